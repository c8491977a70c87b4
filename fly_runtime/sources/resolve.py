"""Turn a model reference (built-in name, local dir, .gguf file, Hub id) into a local Hugging Face directory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fly_runtime.errors import InvalidSettingsError, ModelNotFoundError
from fly_runtime.sources.builtin import BUILTIN_MODELS, fetch_builtin
from fly_runtime.sources.cache import cache_dir, file_identity, fingerprint, model_lock
from fly_runtime.sources.convert import (
    PRECISIONS,
    gguf_buildable,
    gguf_graph,
    gguf_to_hf,
    graph_folder_name,
    hf_to_onnx,
    on_own_grid,
    onnx_model_file,
    quantize_onnx,
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    """A model available locally as a Hugging Face directory, with a key that changes when its weights do."""

    reference: str
    name: str
    hf_dir: Path
    key: str
    gguf: Path | None = None  # the GGUF the weights came from, where they came from one
    # an ONNX export that came with the model (an Optimum ``model.onnx`` decoder with past_key_values inputs): it
    # runs as exported, at its own precision, on ONNX Runtime only
    exported_onnx: bool = False

    def weights(self) -> Path:
        """The Hugging Face folder with its float32 weights, converted from the GGUF again if they were dropped
        (the folder alone holds the tokenizer and config)."""
        if self.gguf is None:
            return self.hf_dir
        with model_lock(f"{self.hf_dir.name}-hf"):
            return gguf_to_hf(self.gguf, self.hf_dir)

    def build_onnx(self, precision: str) -> Path:
        """Build this model's ONNX graph at ``precision`` (one of PRECISIONS) and return its folder, then read it
        from the cache (keyed by source and weights). int4 and int8 of a GGUF model are written from the GGUF's own
        grids a tensor at a time (gguf_graph.py: seconds, memory about the largest tensor); other families, and
        fp32, take the model builder's way from float32 weights (a minute or more, several times the model in
        memory), int8 then quantised from fp32."""
        if self.exported_onnx:
            return self.hf_dir
        if precision not in PRECISIONS:
            raise InvalidSettingsError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        folder = self.graph_folder(precision)
        with model_lock(folder.name):
            if onnx_model_file(folder).is_file():  # built before: the weights are not needed
                return folder
            if precision != "fp32" and self.gguf is not None and gguf_graph(self.gguf, folder, precision,
                                                                            self.hf_dir / "config.json"):
                return folder
        if precision == "int8":
            source = self.build_onnx("fp32")
            with model_lock(folder.name):
                return quantize_onnx(source, folder, bits=8)
        with model_lock(folder.name):
            return hf_to_onnx(self.weights(), folder, int4=precision == "int4")

    def on_own_grid(self, precision: str) -> bool:
        """Is this model's graph at ``precision`` written from its GGUF with every matrix on the file's own grid?"""
        return self.has_graph(precision) and not self.exported_onnx and on_own_grid(self.graph_folder(precision))

    def builds_from_gguf(self) -> bool:
        """Are this model's int4 and int8 graphs written straight from its GGUF (seconds, no float32 copy)?"""
        return self.gguf is not None and gguf_buildable(self.gguf, self.hf_dir)

    def graph_folder(self, precision: str) -> Path:
        """Where this model's graph at ``precision`` is (or would be) cached."""
        return cache_dir() / "onnx" / graph_folder_name(self.name, self.key, precision)

    def has_graph(self, precision: str) -> bool:
        """Is the graph at ``precision`` built already (an export always is, at its own precision)?"""
        return self.exported_onnx or onnx_model_file(self.graph_folder(precision)).is_file()


def is_onnx_export(folder: Path) -> bool:
    """Does ``folder`` hold an ONNX decoder with a KV cache (as ``optimum-cli export onnx --task
    text-generation-with-past`` writes it) instead of weights to build one from?"""
    model = onnx_model_file(folder)
    if not model.is_file() or any(folder.glob("*.safetensors")):
        return False
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return any(i.name.startswith("past_key_values.") for i in graph.input)


def resolve_model(reference: str) -> ResolvedModel:
    """Find, fetch and convert as needed; raise ModelNotFoundError with the fix when nothing matches."""
    if not reference or not reference.strip():
        raise ModelNotFoundError("empty model reference: pass a built-in name, a directory, a .gguf file or a Hub id")
    if reference in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[reference]
        gguf = fetch_builtin(spec)
        key = spec.sha256[:16]
        with model_lock(f"{spec.name}-{key}-hf"):
            hf_dir = gguf_to_hf(gguf, cache_dir() / "hf" / f"{spec.name}-{key}", weights=False)
        return ResolvedModel(reference, spec.name, hf_dir, key, gguf)

    path = Path(reference).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = fingerprint(file_identity(path))
        return ResolvedModel(reference, path.stem, gguf_to_hf(path, cache_dir() / "hf" / f"{path.stem}-{key}", weights=False), key,
                             path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a directory but not a Hugging Face model (no config.json); "
                "pass the folder that save_pretrained wrote."
            )
        return ResolvedModel(reference, path.name, path, fingerprint(file_identity(path)),
                             exported_onnx=is_onnx_export(path))
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
