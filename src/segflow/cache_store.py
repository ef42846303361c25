"""The disk cache's trust rules: only what segflow built, kept where only its user writes.

What segflow keeps on disk between processes is code it will run: the native
kernels' shared library (``kernels/native/build.py``) and AOTInductor packages
(``runtime/aot_inductor.py``). Whoever can write such a file can run code in
every process that loads it, so an :class:`ArtifactStore` (one subdirectory of
:func:`segflow.settings.cache_dir`, one per kind of artifact) loads a file only when:

- the cache root, the store's subdirectory and the file are each what they
  claim to be, not a symbolic link (``lstat``; the file is opened with
  ``O_NOFOLLOW``), owned by this process's user (or root) and not writable by
  group or others;
- the file's SHA-256 equals the digest segflow recorded when it built it,
  ``<name>.sha256`` beside it (``sha256sum`` format), written after the artifact.

Anything else is not loaded, and the reason is kept for ``explain()`` and the
compile report ("not loaded: owned by uid 65534", "not loaded: hash mismatch").
A file at the artifact's name that fails a check is rebuilt into a fresh file
that replaces it, so a truncated or corrupt build costs one rebuild, never the
artifact for good.

The cache root and its subdirectories are created with mode 0700. A root or
subdirectory that fails the checks (owned by someone else, group- or
world-writable, a link) is left as it is: segflow neither trusts it nor changes
its owner or mode. Such a process builds into a private temporary directory of
its own (``segflow-<kind>-*``, removed at exit) and says so; so does one whose
cache cannot be created or written (a read-only file system). Directories above
the cache root are not checked: whoever may rename them can replace the whole
cache, so keep the cache under a directory only you can write (the default,
``~/.cache/segflow``, is).

Beside an artifact the store may keep its description, ``<name>.json``: what it was
built from, for ``segflow cache --list`` (:mod:`segflow.cache_descriptions`). It is
written with the artifact, removed with it, and read as untrusted data under the same
checks as the artifact (not a link, owned by this user, not writable by group or
others) and no more than ``DESCRIPTION_MAX_BYTES`` of it; one that fails them, or is
not JSON, reads as none.

Each artifact is built under a lock (``<name>.lock``, ``fcntl.flock``): of several
processes that start together one builds it, in a ``.build-*`` directory it holds
a lock on, and installs it by a rename; the others wait for the lock and load
the artifact it left, after checking it like any other.

Clearing and eviction never follow a link: a link in the store, or a store
that is a link, is left alone with its target. They also remove partial builds
left by killed processes (``.build-*`` directories that no process holds a lock
on and that were not touched for ``STALE_BUILD_S`` seconds). A lock file goes
with its artifact when no process holds it; at worst two processes then build
that artifact once each.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from segflow import progress
from segflow.settings import cache_dir

DIGEST_SUFFIX = ".sha256"
DESCRIPTION_SUFFIX = ".json"
DESCRIPTION_MAX_BYTES = 64 << 10
LOCK_SUFFIX = ".lock"
BUILD_PREFIX = ".build-"
STALE_BUILD_S = 60.0  # a build directory untouched this long, and unlocked, is a killed build's
MISSING = "missing"   # what :meth:`ArtifactStore.check` says of an artifact that is not there
_DIGEST_MAX_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Obtained:
    """What :meth:`ArtifactStore.obtain` found or built."""

    path: Path | None   # the verified artifact; None: its build failed
    built: bool         # built by this call (False: found there and verified)
    refused: str = ""   # why the file that was at its name was not loaded ('' if none was)
    failure: str = ""   # why the build failed


@dataclass(frozen=True, slots=True)
class Cleared:
    """What :meth:`ArtifactStore.clear` and :meth:`ArtifactStore.evict` removed."""

    files: int = 0                  # artifacts (their digests and locks not counted)
    bytes: int = 0
    partial_builds: int = 0         # stale ``.build-*`` directories
    skipped: tuple[str, ...] = ()   # links (not followed) and what could not be removed


class ArtifactStore:
    """One kind of artifact (``native``, ``aoti``) kept under the cache root.

    >>> store = ArtifactStore.open("native")                              # doctest: +SKIP
    >>> got = store.obtain("lib.so", build=compile_into, wait_s=150)     # doctest: +SKIP
    >>> got.path, got.refused                                             # doctest: +SKIP
    """

    def __init__(self, kind: str, root: Path, directory: Path, distrust: str) -> None:
        self.kind = kind
        self.root = root
        self.shared = root / kind   # the store's directory in the cache
        self.directory = directory  # where this store reads and writes artifacts now
        # Why the cache's directory is not used ('' when it is): this process then
        # builds into a private temporary directory.
        self.distrust = distrust

    @classmethod
    def open(cls, kind: str, env: Mapping[str, str] | None = None) -> ArtifactStore:
        """The store for loading and building: the cache's subdirectory ``kind``
        (created with mode 0700, as is the cache root), or, where that cannot be
        trusted or created, a private temporary directory (``distrust`` says why)."""
        root = Path(os.path.abspath(cache_dir(env)))
        for directory in (root, root / kind):
            problem = _make_private_directory(directory) or _untrusted_directory(directory)
            if problem:
                return cls(kind, root, _private_directory(kind), problem)
        return cls(kind, root, root / kind, "")

    @classmethod
    def inspect(cls, kind: str, env: Mapping[str, str] | None = None) -> ArtifactStore:
        """The cache's subdirectory ``kind`` as it is, for listing and clearing
        (``segflow cache``): nothing is created, and ``distrust`` says whether
        :meth:`open` would use it."""
        root = Path(os.path.abspath(cache_dir(env)))
        problem = ""
        for directory in (root, root / kind):
            problem = _untrusted_directory(directory)
            if problem:
                break
        return cls(kind, root, root / kind, "" if problem == MISSING else problem)

    def path(self, name: str) -> Path:
        return self.directory / name

    # -- loading --------------------------------------------------------------------
    def check(self, name: str) -> str:
        """'' when the artifact ``name`` may be loaded; :data:`MISSING` when there is
        none; otherwise why not ("owned by uid 65534", "hash mismatch", ...)."""
        chain = (self.directory,) if self.distrust else (self.root, self.directory)
        for directory in chain:
            problem = _untrusted_directory(directory)
            if problem:
                return problem
        path = self.path(name)
        actual, problem = _trusted_digest_of(path)
        if problem:
            return problem
        recorded, problem = _recorded_digest(path.with_name(name + DIGEST_SUFFIX))
        if problem:
            return problem
        return "" if actual == recorded else "hash mismatch"

    def description(self, name: str) -> object:
        """The decoded JSON kept beside the artifact ``name``, or None where there is
        none or it fails the cache's checks (a link, another user's, writable by others,
        over ``DESCRIPTION_MAX_BYTES``, not JSON). Data only: the caller validates it."""
        chain = (self.root, self.directory) if self.directory == self.shared \
            else (self.directory,)
        if any(_untrusted_directory(directory) for directory in chain):
            return None
        fd, problem = _open_trusted(self.path(name + DESCRIPTION_SUFFIX))
        if problem:
            return None
        with open(fd, "rb") as f:
            text = f.read(DESCRIPTION_MAX_BYTES + 1)
        if len(text) > DESCRIPTION_MAX_BYTES:
            return None
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return None

    def obtain(self, name: str, build: Callable[[Path], str], wait_s: float,
               rebuild: bool = False,
               description: Mapping[str, object] | None = None) -> Obtained:
        """The artifact ``name``, verified (:meth:`check`), or built when there is none
        to trust: ``build(out)`` writes it to ``out`` and returns '' (else why not), or
        raises. One process builds it while others wait up to ``wait_s`` for its lock
        and then load what it built; past that they build a private copy.
        ``rebuild``: the file there verified but did not load; build it again.
        ``description``: a JSON object kept beside what this call builds (with
        ``created``, the time it was installed, added)."""
        refused = "" if rebuild else self.check(name)
        if not rebuild and not refused:
            return Obtained(self.path(name), built=False)
        refused = "" if refused == MISSING else refused
        try:
            lock = self._open_lock(name)
        except OSError as exc:   # a read-only cache: build for this process only
            self._go_private(f"directory {self.directory} is not writable ({exc.strerror})")
            return self._build(name, build, refused, description)
        try:
            if not _flock(lock, wait_s, f"waiting for another process to build {name}"):
                self._go_private(f"another process held {name}'s lock over {wait_s:.0f} s")
            elif not rebuild and not self.check(name):
                return Obtained(self.path(name), built=False)   # the process we waited for built it
            return self._build(name, build, refused, description)
        finally:
            os.close(lock)   # releases the lock

    def _build(self, name: str, build: Callable[[Path], str], refused: str,
               description: Mapping[str, object] | None = None) -> Obtained:
        with self._build_directory() as work:
            out = work / name
            failure = build(out)
            if failure:
                return Obtained(None, built=False, refused=refused, failure=failure)
            self._install(name, out, description)
        return Obtained(self.path(name), built=True, refused=refused)

    def _install(self, name: str, built: Path,
                 description: Mapping[str, object] | None = None) -> None:
        """Move a finished build into place, its description first and its digest last:
        a reader that sees the new file with the old digest (or none) refuses it, takes
        the lock and waits."""
        mode = stat.S_IMODE(os.lstat(built).st_mode)
        os.chmod(built, mode & ~0o022)   # a umask of 002 must not make our own build untrusted
        digest = built.with_name(name + DIGEST_SUFFIX)
        with open(built, "rb") as f:
            digest.write_text(f"{_sha256(f)}  {name}\n")
        os.chmod(digest, 0o644)
        if description is not None:
            described = built.with_name(name + DESCRIPTION_SUFFIX)
            described.write_text(json.dumps({**description, "created": time.time()}))
            os.chmod(described, 0o644)
            os.replace(described, self.path(name + DESCRIPTION_SUFFIX))
        os.replace(built, self.path(name))
        os.replace(digest, self.path(name + DIGEST_SUFFIX))

    @contextlib.contextmanager
    def _build_directory(self) -> Iterator[Path]:
        """A fresh ``.build-*`` directory, locked while the build runs (a sweep leaves
        a locked one alone) and removed afterwards."""
        work = Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=self.directory))
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)
            os.close(fd)

    def _open_lock(self, name: str) -> int:
        return os.open(self.path(name + LOCK_SUFFIX),
                       os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)

    def _go_private(self, why: str) -> None:
        self.directory = _private_directory(self.kind)
        self.distrust = why

    # -- listing, eviction, clearing ---------------------------------------------------
    def artifacts(self, suffix: str) -> list[Path]:
        """The artifacts named ``*suffix`` (regular files; links are not followed),
        least recently used first (by mtime, which :func:`mark_used` refreshes)."""
        return [path for _, _, path in self._entries(suffix)]

    def evict(self, suffix: str, max_bytes: int, keep: Path | None = None) -> Cleared:
        """Delete the least recently used artifacts until those left take at most
        ``max_bytes`` (``keep``, the one just built, stays even alone over it), and any
        stale partial builds."""
        entries = self._entries(suffix)
        total = sum(size for _, size, _ in entries)
        files = freed = 0
        skipped: list[str] = []
        for _, size, path in entries:   # oldest first
            if total <= max_bytes:
                break
            if keep is not None and path == keep:
                continue
            problem = self._remove(path)
            if problem:
                skipped.append(problem)
                continue
            files, freed, total = files + 1, freed + size, total - size
        partial, more = self._sweep_partial_builds()
        return Cleared(files, freed, partial, (*skipped, *more))

    def clear(self, suffix: str) -> Cleared:
        """Delete every artifact named ``*suffix`` (with its digest, description and free
        lock), descriptions left without theirs, and stale partial builds; a link is
        skipped, never followed."""
        for directory in (self.root, self.directory):
            try:
                if stat.S_ISLNK(os.lstat(directory).st_mode):
                    return Cleared(skipped=(f"{directory} (a symbolic link, not followed)",))
            except FileNotFoundError:
                return Cleared()
        files = freed = 0
        skipped: list[str] = []
        for _, size, path in self._entries(suffix):
            problem = self._remove(path)
            if problem:
                skipped.append(problem)
            else:
                files, freed = files + 1, freed + size
        for _, _, orphan in self._entries(suffix + DESCRIPTION_SUFFIX):   # artifact gone
            with contextlib.suppress(OSError):
                orphan.unlink()
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            skipped += [f"{e.path} (a symbolic link, not followed)" for e in entries
                        if e.is_symlink()]
        partial, more = self._sweep_partial_builds()
        return Cleared(files, freed, partial, (*skipped, *more))

    def _entries(self, suffix: str) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of each artifact, oldest first."""
        found = []
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(self.directory).st_mode):
                return []
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            found.append((st.st_mtime, st.st_size, Path(entry.path)))
        return sorted(found)

    def _remove(self, path: Path) -> str:
        """Delete an artifact, its digest, its description and (if no process holds it)
        its lock; '' or why it stayed."""
        try:
            path.unlink()
        except FileNotFoundError:   # another process removed it first
            pass
        except OSError as exc:
            return f"{path} ({exc.strerror})"
        for suffix in (DIGEST_SUFFIX, DESCRIPTION_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.name + suffix).unlink()
        lock = path.with_name(path.name + LOCK_SUFFIX)
        with contextlib.suppress(OSError):
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink()
            finally:
                os.close(fd)
        return ""

    def _sweep_partial_builds(self) -> tuple[int, list[str]]:
        """Remove ``.build-*`` directories left by killed builds: (count, skipped)."""
        removed, skipped = 0, []
        now = time.time()
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.startswith(BUILD_PREFIX):
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    if entry.is_symlink():
                        skipped.append(f"{entry.path} (a symbolic link, not followed)")
                    continue
                if _is_stale_build(entry.path, now):
                    shutil.rmtree(entry.path, ignore_errors=True)   # never follows links
                    removed += 1
        return removed, skipped


def mark_used(path: Path) -> None:
    """Set an artifact's mtime to now: eviction goes by last use (atime is often off)."""
    with contextlib.suppress(OSError):
        os.utime(path, follow_symlinks=False)


# -- the checks --------------------------------------------------------------------------
def _untrusted_stat(st: os.stat_result) -> str:
    """'' for a file or directory this process may trust, else what is wrong with it."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable == stat.S_IWGRP:
        return "group-writable"
    if writable:
        return "world-writable"
    return ""


def _untrusted_directory(path: Path) -> str:
    """'' for a directory this process may trust, MISSING, else why not (a phrase
    naming the directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"directory {path} cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"directory {path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    problem = _untrusted_stat(st)
    return f"directory {path} is {problem}" if problem else ""


def _open_trusted(path: Path) -> tuple[int, str]:
    """``(fd, '')`` for a regular file this process may trust, else ``(-1, why not)``.
    O_NOFOLLOW: a link at the name is refused, not followed; O_NONBLOCK: a FIFO
    planted there cannot stall the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1, MISSING
    except OSError as exc:
        return -1, "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    st = os.fstat(fd)
    problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else _untrusted_stat(st)
    if problem:
        os.close(fd)
        return -1, problem
    return fd, ""


def _trusted_digest_of(path: Path) -> tuple[str, str]:
    """``(sha256 hex, '')`` of a trusted file, else ``('', why not)``."""
    fd, problem = _open_trusted(path)
    if problem:
        return "", problem
    with open(fd, "rb") as f:
        return _sha256(f), ""


def _sha256(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _recorded_digest(path: Path) -> tuple[str, str]:
    """The digest recorded at ``path`` (``<hex>  <name>``), else ``('', why not)``."""
    fd, problem = _open_trusted(path)
    if problem == MISSING:
        return "", "no recorded digest"
    if problem:
        return "", f"its digest file is {problem}"
    with open(fd, "rb") as f:
        words = f.read(_DIGEST_MAX_BYTES).split()
    digest = words[0].decode("ascii", "replace").lower() if words else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return "", "its recorded digest is malformed"
    return digest, ""


def _make_private_directory(path: Path) -> str:
    """Create ``path`` with mode 0700 if it is missing; '' or why it could not be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"directory {path} cannot be created ({exc.strerror})"
    return ""


def _private_directory(kind: str) -> Path:
    """A directory of this process's own (mode 0700), removed when it exits."""
    directory = Path(tempfile.mkdtemp(prefix=f"segflow-{kind}-"))
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _flock(fd: int, wait_s: float, waiting: str = "") -> bool:
    """Take an exclusive lock on ``fd``, waiting up to ``wait_s``; whether it was taken.
    A wait is announced as the step ``waiting`` (:mod:`segflow.progress`): another
    process's build can take minutes."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    deadline = time.monotonic() + wait_s
    pause = 0.005
    with progress.step(waiting or "waiting for another process's build"):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, 0.1)


def _is_stale_build(path: str, now: float) -> bool:
    """Whether a build directory is a killed build's: untouched for ``STALE_BUILD_S``
    and not locked by a live one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if now - os.fstat(fd).st_mtime < STALE_BUILD_S:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(fd)
