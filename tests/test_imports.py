"""The import structure of ``src/segflow``: no cycles, dependencies down the pipeline, and
``settings.py`` the only reader of the environment.

Imports are read with :mod:`ast`, at module level and inside functions alike (a lazy import
is still a dependency); imports under ``if TYPE_CHECKING:`` are left out (they never run).
``from package import name`` counts as an import of ``package.name`` when that is a module.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "segflow"


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's edge: ``importer`` imports ``imported`` at ``line``."""

    importer: str
    imported: str
    line: int


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _statements(stmt.orelse)
            continue
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.stmt):
                yield from _statements([child])
            elif isinstance(child, ast.ExceptHandler | ast.match_case):
                yield from _statements(child.body)


def _known(name: str) -> str:
    """The module ``name`` is, or the nearest package above it that is a module here."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for stmt in _statements(tree.body):
        targets: list[str] = []
        if isinstance(stmt, ast.Import):
            targets = [_known(alias.name) for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                anchor = package.rsplit(".", stmt.level - 1)[0] if stmt.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in stmt.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in MODULES else _known(base))
        edges += [Import(module, target, stmt.lineno) for target in targets
                  if target and target != module]
    return list(dict.fromkeys(edges))   # one edge per statement and module imported


IMPORTS = {module: _imports(module) for module in MODULES}


def _cycles() -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph = {m: sorted({e.imported for e in edges}) for m, edges in IMPORTS.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_lazy_imports_and_skips_type_checking_ones():
    lazy = ast.parse("def f():\n    import segflow.errors\n"
                     "if TYPE_CHECKING:\n    import segflow.settings\n")
    names = [s.names[0].name for s in _statements(lazy.body) if isinstance(s, ast.Import)]
    assert names == ["segflow.errors"]
    assert "segflow.ops.registry" in {e.imported for e in IMPORTS["segflow.ops"]}


def test_no_import_cycles():
    cycles = _cycles()
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("cycle: " + ", ".join(component))
        lines += [f"    {e.importer} -> {e.imported} (line {e.line})"
                  for m in component for e in IMPORTS[m] if e.imported in members]
    assert not cycles, "import cycles between modules:\n" + "\n".join(lines)


# -- layering ---------------------------------------------------------------------------
# Each rule: (importer package, imported packages it must not import, allowed exceptions).
# The exceptions are today's known ones, each pair named exactly and removed by the work
# the comment names; an exception that no longer occurs fails the test, so the list only
# shrinks.

OPS_EXCEPTIONS: set[tuple[str, str]] = set()

PASSES_EXCEPTIONS = {
    # Folding binds kernels to run them once at plan time, so it hands them a Workspace.
    ("segflow.passes.fold_constants", "segflow.kernels.workspace"),
}

KERNELS_EXCEPTIONS: set[tuple[str, str]] = set()

ALLOWED_KERNEL_MODULES = ("segflow.kernels.choice", "segflow.kernels.target")


def _ir_forbidden(imported: str) -> bool:
    return _within(imported, PACKAGE) and not _within(imported, "segflow.ir")


def _violations(importer_package: str, forbidden: Callable[[str], bool]
                ) -> set[tuple[str, str]]:
    return {(e.importer, e.imported) for m, edges in IMPORTS.items()
            if _within(m, importer_package) for e in edges if forbidden(e.imported)}


RULES = {
    "ops imports neither passes, runtime nor kernels": (
        "segflow.ops",
        lambda t: any(_within(t, p) for p in
                      ("segflow.passes", "segflow.runtime", "segflow.kernels")),
        OPS_EXCEPTIONS),
    "passes see kernels only through kernels.choice and kernels.target": (
        "segflow.passes",
        lambda t: _within(t, "segflow.kernels") and t not in ALLOWED_KERNEL_MODULES
        and t != "segflow.kernels",
        PASSES_EXCEPTIONS),
    "kernels import neither passes nor runtime": (
        "segflow.kernels",
        lambda t: _within(t, "segflow.passes") or _within(t, "segflow.runtime"),
        KERNELS_EXCEPTIONS),
    "ir imports nothing of segflow above it": ("segflow.ir", _ir_forbidden, set()),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layering(rule):
    package, forbidden, allowed = RULES[rule]
    found = _violations(package, forbidden)
    new = sorted(found - allowed)
    stale = sorted(allowed - found)
    assert not new, f"{rule}; these imports break it:\n" + "\n".join(
        f"    {a} -> {b}" for a, b in new)
    assert not stale, f"{rule}; these allowed exceptions no longer occur, remove them:\n" + \
        "\n".join(f"    {a} -> {b}" for a, b in stale)


# -- the environment --------------------------------------------------------------------
ENV_READERS = {"segflow.settings"}


def _reads_environment(module: str) -> list[int]:
    tree = ast.parse(MODULES[module].read_text())
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "os" and node.attr in ("environ", "environb", "getenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "environb", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_settings_reads_the_environment():
    readers = {m: sorted(lines) for m in MODULES if (lines := _reads_environment(m))}
    new = sorted(set(readers) - ENV_READERS)
    stale = sorted(ENV_READERS - set(readers) - {"segflow.settings"})
    assert not new, "modules reading os.environ / os.getenv outside settings.py:\n" + \
        "\n".join(f"    {m} (lines {readers[m]})" for m in new)
    assert not stale, f"no longer reading the environment, remove from ENV_READERS: {stale}"
