"""llama.cpp backend: the GGUF itself, run by llama.cpp's own kernels (llama-cpp-python), as its users run it.

Where llama.cpp decodes one token faster than any ONNX Runtime graph of the model (`fly models list` shows the
measurement), the target runs here: plain steps then cost what llama.cpp's do, and fly's speculation comes on
top of the fastest plain decoding instead of beside it. A pass computes logits only for the positions asked for
(the last ``keep``), and a crop removes cached positions from llama.cpp's KV cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fly_runtime.errors import InvalidSettingsError


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppBackend:
    BATCH = 512  # tokens per llama_decode call

    def __init__(self, gguf: Path, context: int = 0, threads: int | None = None) -> None:
        """``context``: positions the KV cache holds (0: the model's trained context, as a request may use it)."""
        if not available():
            raise InvalidSettingsError("backend 'llama-cpp' needs llama-cpp-python: pip install "
                                       "'fly-integrations[llama-cpp]' (it builds llama.cpp, about 10 minutes once)")
        from llama_cpp import Llama

        threads = threads or os.cpu_count()
        self.llm = Llama(model_path=str(gguf), n_ctx=context, n_batch=self.BATCH, n_ubatch=self.BATCH,
                         n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
        self._ctx, self._batch = self.llm._ctx, self.llm._batch
        self._vocab = self.llm.n_vocab()
        self.max_context = self.llm.n_ctx()
        self.name = f"llama.cpp-{gguf.stem}"
        self._length = 0

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        ids = list(input_ids)
        n = len(ids)
        keep = min(keep or n, n)
        rows = []
        for start in range(0, n, self.BATCH):
            chunk = ids[start:start + self.BATCH]
            self._batch.set_batch(chunk, n_past=self._length, logits_all=False)
            wanted = 0
            for i in range(len(chunk)):  # logits only for the last `keep` positions of the whole pass
                flag = start + i >= n - keep
                self._batch.batch.logits[i] = flag
                wanted += flag
            self._ctx.decode(self._batch)
            self._length += len(chunk)
            if wanted:
                logits = np.ctypeslib.as_array(self._ctx.get_logits(), shape=(wanted, self._vocab))
                rows.append(logits.copy())
        return torch.from_numpy(np.concatenate(rows))

    def crop(self, length: int) -> None:
        if length < self._length:
            self._ctx.kv_cache_seq_rm(0, length, -1)
            self._length = length
