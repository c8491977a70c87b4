"""Turn a model reference (built-in name, local dir, .gguf file, Hub id) into a local Hugging Face directory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fly_runtime.errors import ModelNotFoundError
from fly_runtime.sources.builtin import BUILTIN_MODELS, fetch_builtin
from fly_runtime.sources.cache import cache_dir, file_identity, fingerprint
from fly_runtime.sources.convert import GRAPH_VERSION, gguf_to_hf, hf_to_onnx

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    """A model available locally as a Hugging Face directory, with a key that changes when its weights do."""

    reference: str
    name: str
    hf_dir: Path
    key: str

    def onnx_dir(self, int4: bool) -> Path:
        """The ONNX graph of this model, built once and cached (keyed by source and weights)."""
        kind = "int4" if int4 else "fp32"
        folder = f"{self.name}-{self.key}-{kind}-g{GRAPH_VERSION}"
        return hf_to_onnx(self.hf_dir, cache_dir() / "onnx" / folder, int4=int4)


def resolve_model(reference: str) -> ResolvedModel:
    """Find, fetch and convert as needed; raise ModelNotFoundError with the fix when nothing matches."""
    if not reference or not reference.strip():
        raise ModelNotFoundError("empty model reference: pass a built-in name, a directory, a .gguf file or a Hub id")
    if reference in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[reference]
        gguf = fetch_builtin(spec)
        key = spec.sha256[:16]
        return ResolvedModel(reference, spec.name, gguf_to_hf(gguf, cache_dir() / "hf" / f"{spec.name}-{key}"), key)

    path = Path(reference).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = fingerprint(file_identity(path))
        return ResolvedModel(reference, path.stem, gguf_to_hf(path, cache_dir() / "hf" / f"{path.stem}-{key}"), key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a directory but not a Hugging Face model (no config.json); "
                "pass the folder that save_pretrained wrote."
            )
        return ResolvedModel(reference, path.name, path, fingerprint(file_identity(path)))
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    if _HUB_ID.match(reference) and not reference.startswith((".", "/", "~")):
        return _resolve_hub(reference)
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelNotFoundError(
        f"model {reference!r} not found: no such file or directory, and not a built-in model ({known}) "
        "or a Hugging Face Hub id (owner/name)."
    )


def _resolve_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        folder = Path(snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"],
            local_files_only=offline,
        ))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face Hub"
        raise ModelNotFoundError(
            f"could not get {repo_id!r} from {where}: {exc.__class__.__name__}. Check the id and your network, "
            "or pass a local directory or a built-in model name."
        ) from exc
    # snapshot folders are named after the commit, so the key follows the weights' revision
    return ResolvedModel(repo_id, repo_id.split("/")[-1], folder, fingerprint(repo_id, folder.name))
