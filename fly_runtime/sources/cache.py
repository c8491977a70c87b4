"""Where fly keeps what it fetches and converts, and how it writes there without leaving half files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$FLY_CACHE_DIR`` if set, else ``~/.cache/fly``."""
    root = os.environ.get("FLY_CACHE_DIR") or Path.home() / ".cache" / "fly"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
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
