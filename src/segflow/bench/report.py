"""Text tables and the optional plot for benchmark results."""

from __future__ import annotations

from collections.abc import Sequence

from segflow.bench.runner import ModelResult, VariantResult
from segflow.errors import SegflowError
from segflow.profiler.tables import format_table

_COUNTERS = ("segments", "pushes", "syncs", "kernels")


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _counter_cells(v: VariantResult) -> list[str]:
    if v.counters is None:
        return ["-"] * len(_COUNTERS)
    return [str(v.counters.get(c, "-")) for c in _COUNTERS]


def _label(v: VariantResult) -> str:
    """A peer's row names its precision, and says when its outputs failed the check."""
    if v.kind.value == "segflow":
        return v.name
    facts = ["peer"] + ([v.precision] if v.precision else [])
    differs = " DIFFERS" if v.check is not None and not v.check.ok else ""
    return f"{v.name} ({', '.join(facts)}){differs}"


def format_results(results: Sequence[ModelResult], *, counters_only: bool = False) -> str:
    """The table ``segflow bench`` prints, followed by ratios and notes."""
    notes: list[str] = []
    rows: list[list[str]] = []
    for r in results:
        for v in r.variants:
            label = _label(v)
            if not v.ok:
                notes.append(f"{r.model} [{v.name}]: {v.status}: {v.detail}")
            if v.check is not None and not v.check.ok:
                notes.append(f"{r.model} [{v.name}]: DIFFERS: outputs differ from "
                             f"{v.check.against}'s by up to {v.check.max_abs_diff:.3g} "
                             f"({v.check.relative_diff:.2g} of the largest output, tolerance "
                             f"{v.check.tolerance:g}); timed, but it computes something else")
            if counters_only:
                rows.append([r.model, label, *_counter_cells(v), v.status])
                continue
            lat = v.latency
            timing = ([_ms(lat.p50_ms), _ms(lat.p90_ms), _ms(lat.p99_ms),
                       f"{lat.throughput:.1f}"] if lat is not None else [v.status, "", "", ""])
            rel = f"{v.relative:.2f}x" if v.relative is not None else "-"
            mem = f"{v.peak_memory_mib:.1f}" if v.peak_memory_mib is not None else "-"
            rows.append([r.model, label, *timing, rel, *_counter_cells(v), mem])
            if v.max_abs_diff is not None and v.max_abs_diff > 1e-2 and v.check is None:
                notes.append(f"{r.model} [{v.name}]: outputs differ from {r.reference} by "
                             f"up to {v.max_abs_diff:.3g}")
    if counters_only:
        text = format_table(["Model", "Mode", *_COUNTERS, "status"], rows,
                            [False, False, True, True, True, True, False])
        return text + _notes(notes)
    headers = ["Model", "Variant", "p50 ms", "p90 ms", "p99 ms", "items/s", "rel",
               *_COUNTERS, "peak MiB"]
    text = format_table(headers, rows, [False, False] + [True] * (len(headers) - 2))
    ref = results[0].reference if results else "bulk"
    text += (f"\nrel: latency / segflow {ref or 'reference'} (median of per-round ratios); "
             "counters are per run; peak MiB: memory growth during one run")
    ratio_lines = [f"  {r.model}: " + "  ".join(f"{k} {v:.2f}" for k, v in r.ratios.items())
                   for r in results if r.ratios]
    if ratio_lines:
        text += ("\nratios (segflow mode / other, median of per-round ratios; > 1: segflow "
                 "slower):\n" + "\n".join(ratio_lines))
    rounds = ", ".join(f"{r.model} {r.rounds}" for r in results)
    text += f"\ntimed rounds: {rounds}"
    return text + _notes(notes)


def _notes(notes: list[str]) -> str:
    return ("\nnotes:\n" + "\n".join(f"  {n}" for n in notes)) if notes else ""


def require_matplotlib() -> None:
    """Fail early, before benchmarking, when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SegflowError("--plot needs matplotlib: pip install matplotlib "
                           "(or pip install 'segflow[bench]')") from None


def plot_results(results: Sequence[ModelResult], path: str) -> None:
    """Bar chart of p50 latency (whisker to p90) per variant, one panel per model."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if any(v.latency for v in r.variants)]
    if not timed:
        raise SegflowError("--plot: no timings to plot (was --counters-only given?)")
    fig, axes = plt.subplots(1, len(timed), figsize=(3.2 * len(timed) + 1, 3.6), squeeze=False)
    for ax, r in zip(axes[0], timed):
        variants = [v for v in r.variants if v.latency is not None]
        names = [v.name for v in variants]
        p50 = [v.latency.p50_ms for v in variants if v.latency]
        p90 = [v.latency.p90_ms for v in variants if v.latency]
        colors = ["tab:blue" if v.kind.value == "segflow" else "tab:gray" for v in variants]
        ax.bar(names, p50, color=colors,
               yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90)]], capsize=3)
        ax.set_title(f"{r.model} (batch {r.batch_size}, {r.device})", fontsize=9)
        ax.set_ylabel("latency p50 (ms), whisker p90")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle("segflow bench: segflow modes (blue) and peers (gray)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
