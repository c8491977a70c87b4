"""llama.cpp backend: the GGUF itself, run by llama.cpp's own kernels (llama-cpp-python), as its users run it.

Where llama.cpp decodes one token faster than any ONNX Runtime graph of the model (`fly models list` shows the
measurement), the target runs here: plain steps then cost what llama.cpp's do, and fly's speculation comes on
top of the fastest plain decoding instead of beside it. A pass computes logits only for the positions asked for
(the last ``keep``), and a crop removes cached positions from llama.cpp's KV cache.

The model is read into memory rather than mapped: llama.cpp repacks most matrices into a layout of its own, and a
mapped file would keep their original pages resident beside the copies (0.6 GB more for the 1.5B). The cache's
cells are allocated as they are needed, up to ``context``: a pool of ``START_CELLS`` that grows (doubling, the
sequences' cells copied over) when a pass finds no room, so a short conversation does not hold a 32k-token cache.

The cache holds several sequences (``sequences``) in one pool of cells, as llama-server's parallel slots do:
``forward_rows`` runs new tokens of several sequences in one pass (batched decoding, fly_runtime/batching.py),
and ``share`` lets a sequence start from another's cached prefix without reading it again (the cells are
shared, not copied).

Every pass runs on the process's one OpenMP thread (openmp_thread.py), whoever asks for it, as llama-server
decodes on its one main loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fly_runtime.backends.bf16_reader import READ_CHUNK
from fly_runtime.backends.llama_cpp_state import SeqCells, UnknownLayout, pack, parse
from fly_runtime.backends.openmp_thread import on_openmp_thread
from fly_runtime.errors import FlyError, InvalidSettingsError


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class KvCacheFull(FlyError):
    """llama.cpp found no room in the KV cache for a pass."""


class LlamaCppBackend:
    BATCH = 512  # tokens per llama_decode call
    START_CELLS = 4096  # the KV cache's first allocation (112 MiB for the 1.5B); it grows as passes need

    def __init__(self, gguf: Path, context: int = 0, threads: int | None = None, sequences: int = 1) -> None:
        """``context``: the most cells the KV cache may grow to, for all sequences together (0: the model's trained
        context, as one request may use it); ``sequences``: how many sequences it can hold at once."""
        if not available():
            raise InvalidSettingsError("backend 'llama-cpp' needs llama-cpp-python: pip install "
                                       "'fly-integrations[llama-cpp]' (it builds llama.cpp, about 10 minutes once)")
        import llama_cpp
        from llama_cpp import _internals, _logger

        _logger.set_verbose(False)  # llama.cpp's load log would otherwise reach stderr (`fly generate` keeps it clean)
        self._llama_decode = llama_cpp.llama_decode
        threads = threads or os.cpu_count()
        model_params = llama_cpp.llama_model_default_params()
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # read, not mapped (above)
        # loaded on the OpenMP thread: llama.cpp repacks the weights under OpenMP
        self._model = on_openmp_thread(lambda: _internals.LlamaModel(path_model=str(gguf), params=model_params,
                                                                    verbose=False))
        self.max_context = context or self._model.n_ctx_train()
        self._params = params = llama_cpp.llama_context_default_params()
        params.n_batch = params.n_ubatch = self.BATCH
        params.n_threads = params.n_threads_batch = threads
        params.n_seq_max = sequences
        params.kv_unified = True  # one pool of cells: any sequence may grow to the whole context
        self._ctx = self._context(min(self.START_CELLS, self.max_context))
        self._batch = _internals.LlamaBatch(n_tokens=self.BATCH, embd=0, n_seq_max=1, verbose=False)
        self._vocab = self._model.n_vocab()
        self.sequences = sequences
        self.name = f"llama.cpp-{gguf.stem}"
        self._lengths = [0] * sequences
        self.reader = None  # a bf16_reader.ReaderSlot where a prompt reader may pay here (the loader attaches it)

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        return self.forward_rows([(0, input_ids, keep)])[0]

    @property
    def read_chunk(self) -> int | None:
        """Where the prompt reader reads (or is about to), the prompt tokens a pass should hold: each read widens its
        matrices once, its products are cheaper by the token the more rows they have, and each pass costs one
        handover and one llama.cpp step."""
        return READ_CHUNK if self.reader is not None and self.reader.ready() else None

    def crop(self, length: int) -> None:
        self.crop_sequence(0, length)

    def forward_rows(self, parts: Sequence[tuple[int, Sequence[int], int | None]]) -> list[torch.Tensor]:
        """Append each part's ids to its sequence, all in one pass (split every ``BATCH`` tokens); the float32
        logits of the last ``keep`` ids of each part (default all), in the parts' order. Where a prompt reader is
        attached (``reader``), a part's leading ids whose logits are not wanted are read by it first."""
        if self.reader is None:
            return self._pass(parts)
        parts = [self._read_ahead(seq, ids, keep) for seq, ids, keep in parts]
        began = time.perf_counter()
        out = self._pass(parts)
        if len(parts) == 1:  # one part alone: its time prices llama.cpp's own reads
            self.reader.learn(len(parts[0][1]), time.perf_counter() - began, by_reader=False)
        return out

    def _read_ahead(self, seq: int, ids: Sequence[int], keep: int | None) -> tuple[int, Sequence[int], int | None]:
        """Read the ids of a part whose logits are not wanted with the prompt reader, where it pays, and hand their
        keys and values to llama.cpp's cache; the part left for llama.cpp's own pass."""
        unread = len(ids) - min(keep or len(ids), len(ids))
        reader = self.reader.for_read(unread) if self.reader is not None else None
        if reader is None or self._lengths[seq] + unread > self.max_context:
            return seq, ids, keep
        began = time.perf_counter()
        try:
            cells = self._cells(seq)
        except UnknownLayout:  # another llama.cpp's layout: read the usual way from now on
            self.reader = None
            return seq, ids, keep
        keys, values = on_openmp_thread(reader.read, ids[:unread], cells.keys, cells.values)
        self._put_cells(seq, cells, pack(cells, seq, keys, values), cells.count + unread)
        self.reader.learn(unread, time.perf_counter() - began, by_reader=True)
        return seq, ids[unread:], keep

    def _state(self, seq: int) -> np.ndarray:
        """A copy of llama.cpp's state of sequence ``seq`` (its cells: llama_cpp_state.py reads them)."""
        import ctypes

        import llama_cpp

        size = llama_cpp.llama_state_seq_get_size(self._ctx.ctx, seq)
        buffer = np.empty(size, np.uint8)
        llama_cpp.llama_state_seq_get_data(self._ctx.ctx, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                           size, seq)
        return buffer

    def _set_state(self, seq: int, state: np.ndarray) -> bool:
        """Replace sequence ``seq``'s cells with ``state``; False where llama.cpp found no room (the sequence is
        then empty)."""
        import ctypes

        import llama_cpp

        pointer = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return bool(llama_cpp.llama_state_seq_set_data(self._ctx.ctx, pointer, len(state), seq))

    def _cells(self, seq: int) -> SeqCells:
        """Sequence ``seq``'s cells, viewed in a copy of llama.cpp's state of it."""
        import llama_cpp

        return parse(self._state(seq), llama_cpp.llama_model_n_layer(self._model.model))

    def _put_cells(self, seq: int, old: SeqCells, new: np.ndarray, count: int) -> None:
        """Make sequence ``seq`` hold the state ``new`` of ``count`` cells (its cells ``old``, extended); where
        llama.cpp finds no room, the old cells are put back and KvCacheFull raised."""
        need = sum(self._lengths) - self._lengths[seq] + count
        if need > self.cells:
            self._grow(min(max(2 * self.cells, need), self.max_context))
        if self._set_state(seq, new):
            self._lengths[seq] = count
            return
        self._lengths[seq] = old.count if self._set_state(seq, pack(old, seq)) else 0
        raise KvCacheFull(f"llama.cpp found no room for {count} cells of sequence {seq} in its KV cache "
                          f"({self.cells} cells): fewer requests or shorter prompts at once, or a larger context")

    def _pass(self, parts: Sequence[tuple[int, Sequence[int], int | None]]) -> list[torch.Tensor]:
        rows = [(seq, self._lengths[seq] + i, token, i >= len(ids) - min(keep or len(ids), len(ids)), p)
                for p, (seq, ids, keep) in enumerate(parts) for i, token in enumerate(ids)]
        logits: list[list[np.ndarray]] = [[] for _ in parts]
        batch = self._batch.batch
        for start in range(0, len(rows), self.BATCH):
            chunk = rows[start:start + self.BATCH]
            for i, (seq, pos, token, wanted, _) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.logits[i] = token, pos, wanted
                batch.seq_id[i][0], batch.n_seq_id[i] = seq, 1
            batch.n_tokens = len(chunk)
            # the sequences' lengths bound the cells in use (shared prefixes count once per sequence): grow before a
            # pass that might not fit, and once more if llama.cpp finds no room all the same
            need = sum(self._lengths) + len(chunk)
            if need > self.cells < self.max_context:
                self._grow(min(max(2 * self.cells, need), self.max_context))
            status = self._decode()
            if status == 1 and self.cells < self.max_context:
                self._grow(min(2 * self.cells, self.max_context))
                status = self._decode()
            if status:
                self._undo(rows[:start])
                raise KvCacheFull(f"llama.cpp could not place {len(chunk)} tokens in its KV cache "
                                  f"({self.cells} cells, status {status}): fewer requests or shorter "
                                  f"prompts at once, or a larger context")
            for i, (_, _, _, wanted, p) in enumerate(chunk):
                if wanted:
                    row = np.ctypeslib.as_array(self._ctx.get_logits_ith(i), shape=(self._vocab,))
                    logits[p].append(row.copy())
            for seq, *_ in chunk:
                self._lengths[seq] += 1
        return [torch.from_numpy(np.stack(rows_of)) if rows_of else torch.empty(0, self._vocab)
                for rows_of in logits]

    @property
    def cells(self) -> int:
        """Cells the KV cache holds now (it grows up to ``max_context``)."""
        return self._ctx.n_ctx()

    def _context(self, cells: int):
        from llama_cpp import _internals

        self._params.n_ctx = cells
        return on_openmp_thread(lambda: _internals.LlamaContext(model=self._model, params=self._params, verbose=False))

    def _grow(self, cells: int) -> None:
        """Reallocate the cache with ``cells`` cells, each sequence's cached positions copied over (the old pool is
        freed before the new one is allocated: the copies, not two pools, are what the move holds)."""
        saved = {seq: self._state(seq) for seq, length in enumerate(self._lengths) if length}
        self._ctx.close()
        self._ctx = self._context(cells)
        for seq, state in saved.items():
            if not self._set_state(seq, state):
                raise FlyError(f"llama.cpp could not restore sequence {seq} into a cache of {cells} cells")

    def _decode(self) -> int:
        return on_openmp_thread(self._llama_decode, self._ctx.ctx, self._batch.batch)

    def _undo(self, done: list) -> None:
        """A pass failed part way: drop what its earlier chunks wrote, so no sequence holds half a part."""
        for seq in {row[0] for row in done}:
            first = min(row[1] for row in done if row[0] == seq)
            self.crop_sequence(seq, first)

    def crop_sequence(self, seq: int, length: int) -> None:
        if length < self._lengths[seq]:
            self._ctx.kv_cache_seq_rm(seq, length, -1)
            self._lengths[seq] = length

    def close(self) -> None:
        """Free llama.cpp's model, cache and buffers now: its objects hold each other in reference cycles, so
        dropping the backend frees gigabytes only at the garbage collector's next cycle (tuning opens the target
        to time it just before the engine opens it for good)."""
        # on the OpenMP thread, after any pass still running there
        on_openmp_thread(lambda: [part.close() for part in (self._batch, self._ctx, self._model)])

    def share(self, source: int, target: int, length: int) -> None:
        """Make ``target`` hold the first ``length`` positions of ``source`` (shared cells, nothing computed)."""
        self._ctx.kv_cache_seq_rm(target, 0, -1)
        self._ctx.kv_cache_seq_cp(source, target, 0, length)
        self._lengths[target] = length
