"""Where fly keeps what it fetches and converts, and how it writes there without leaving half files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from fly_runtime.errors import CacheError


def cache_dir() -> Path:
    """The cache root: ``$FLY_CACHE_DIR`` if set, else ``~/.cache/fly``; a clear error where it cannot be used."""
    root = os.environ.get("FLY_CACHE_DIR") or Path.home() / ".cache" / "fly"
    path = Path(root).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CacheError(f"the fly cache {path} is a file, not a folder: point FLY_CACHE_DIR at a folder") from None
    except OSError as exc:
        raise CacheError(f"cannot create the fly cache {path} ({exc.strerror}): point FLY_CACHE_DIR at a folder "
                         "you can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"the fly cache {path} is not writable: fix its permissions or point FLY_CACHE_DIR at a "
                         "folder you can write")
    return path


def fingerprint(*parts: object) -> str:
    """A short stable key for cache entries derived from a source's identity."""
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


def file_identity(path: Path) -> str:
    """Identity of a local file or directory that changes when its content is replaced."""
    path = path.resolve()
    if path.is_file():
        st = path.stat()
        return f"{path}:{st.st_size}:{st.st_mtime_ns}"
    entries = []
    for child in sorted(path.iterdir()):
        if child.is_file():
            st = child.stat()
            entries.append(f"{child.name}:{st.st_size}:{st.st_mtime_ns}")
    return f"{path}|" + "|".join(entries)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block completes.

    A crash or Ctrl-C half-way through a conversion leaves no directory that a later run would trust.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = final.with_name(final.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    scratch.rename(final)


@contextlib.contextmanager
def model_lock(name: str) -> Iterator[None]:
    """Hold a per-entry lock file while fetching or converting ``name``: a second process (or thread) doing the
    same waits for the first, then finds the work done, instead of repeating it (a conversion peaks at
    gigabytes of memory). Locks must not nest on one name. Where the platform has no ``fcntl``, no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    locks = cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
