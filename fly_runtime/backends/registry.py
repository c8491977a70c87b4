"""Backends by name: how a model is opened in each form (``gguf``: llama.cpp on the GGUF; ``fp32`` / ``int8`` /
``int4``: an ONNX Runtime graph; ``torch``: PyTorch on the weights), and its tokenizer. The loader and the tuning
both open models through here, so neither imports the other for it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fly_runtime.backends.base import Backend
from fly_runtime.errors import FlyError, InvalidSettingsError, ModelIntegrityError

GGUF = "gguf"


@contextmanager
def loading(model) -> Iterator[None]:
    """Turn a library's failure on a broken model folder (TypeError, SafetensorError, ...) into fly's error."""
    try:
        yield
    except FlyError:
        raise
    except Exception as exc:
        raise ModelIntegrityError(
            f"{model.hf_dir} could not be loaded ({type(exc).__name__}: {exc}): check that it holds a complete "
            "Hugging Face model (config.json, the weights, the tokenizer), or pass another model") from exc


def _llama_cpp(model, precision: str, device: str | None, threads: int, sequences: int, context: int) -> Backend:
    if model.gguf is None:
        raise InvalidSettingsError(f"precision 'gguf' runs a model's GGUF file with llama.cpp, and "
                                   f"{model.reference} did not come as one: pick fp32, int8, int4 or auto")
    from fly_runtime.backends.llama_cpp_backend import LlamaCppBackend

    with loading(model):
        return LlamaCppBackend(model.gguf, context=context, threads=threads, sequences=sequences)


def _onnx_graph(model, precision: str, device: str | None, threads: int, sequences: int, context: int) -> Backend:
    from fly_runtime.backends.ort_backend import OrtBackend

    onnx_dir = model.build_onnx(precision)
    with loading(model):
        return OrtBackend(onnx_dir, threads=threads)


def _torch(model, precision: str, device: str | None, threads: int, sequences: int, context: int) -> Backend:
    from fly_runtime.backends.torch_backend import TorchBackend

    if model.exported_onnx:
        raise InvalidSettingsError(f"{model.reference} is an ONNX export, which runs on ONNX Runtime only: use "
                                   "backend='onnx' (the default on CPU), or pass the model's Hugging Face folder")
    with loading(model):
        return TorchBackend(model.weights(), device=device)


# backend name -> factory(model, precision, device, threads, sequences, context)
FACTORIES: dict[str, Callable[..., Backend]] = {GGUF: _llama_cpp, "onnx": _onnx_graph, "torch": _torch}


def open_backend(model, kind: str, precision: str, *, device: str | None = None, threads: int | None = None,
                 sequences: int = 1, context: int = 0) -> Backend:
    """``model`` on backend ``kind`` (``onnx`` runs the GGUF on llama.cpp where ``precision`` is ``gguf``), its
    cache holding ``sequences`` sequences of up to ``context`` tokens (0: the model's own) where the backend
    allocates it up front (llama.cpp)."""
    name = GGUF if kind == "onnx" and precision == GGUF else kind
    if name not in FACTORIES:
        raise InvalidSettingsError(f"backend must be one of {sorted(FACTORIES)}, got {kind!r}")
    return FACTORIES[name](model, precision, device, threads or os.cpu_count(), sequences, context)


def open_target(model, precision: str, threads: int | None = None, sequences: int = 1, context: int = 0) -> Backend:
    """The model on the CPU at ``precision``: an ONNX Runtime graph, or (``gguf``) its GGUF run by llama.cpp."""
    return open_backend(model, "onnx", precision, threads=threads, sequences=sequences, context=context)


def load_tokenizer(model):
    from transformers import AutoTokenizer

    # transformers 4.57.3+ warns about a Mistral regex for every locally saved tokenizer; ours carry the
    # correct pattern, so say explicitly that no patch is wanted.
    with loading(model):
        return AutoTokenizer.from_pretrained(model.hf_dir, fix_mistral_regex=False)
