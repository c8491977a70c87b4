"""ONNX Runtime backend: a decoder graph with its KV cache as inputs/outputs (as fly builds them, or any
export with the same names: input_ids, attention_mask, past_key_values.N.key/value -> logits, present.N.*).

Why ONNX Runtime on CPU: a pass over a few tokens costs little more than one decoding step, where PyTorch's
skinny GEMMs for a few rows are slow (docs/design.md). Speculative decoding lives on that ratio. Its prompt reads
are slower (13-15 ms a token for the 1.5B int4 graph on an AMX Xeon): where a prompt reader is attached
(bf16_reader.py), it reads a pass's leading ids into the cache arrays instead (~3 ms a token there).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fly_runtime.backends.bf16_reader import READ_CHUNK
from fly_runtime.backends.openmp_thread import on_openmp_thread
from fly_runtime.sources.convert import LOGITS_TO_KEEP, onnx_model_file
from fly_runtime.sources.gguf_graph import LAYOUT_METADATA


FIRST_CAPACITY = 1024  # cache positions allocated at first where past and present share buffers


def _attention_shares_buffers(onnx_dir: Path, session) -> bool:
    """Whether the graph's attention is GroupQueryAttention, which can write into the past it reads: graphs fly
    writes from a GGUF (their layout metadata) and the genai builder's (its ``past_present_share_buffer``)."""
    if LAYOUT_METADATA in session.get_modelmeta().custom_metadata_map:
        return True
    config = onnx_dir / "genai_config.json"
    try:
        return bool(json.loads(config.read_text())["search"]["past_present_share_buffer"])
    except (OSError, ValueError, KeyError):
        return False


class OrtBackend:
    def __init__(self, onnx_dir: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(onnx_model_file(onnx_dir)), options,
                                            providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self._cache_names = [n for n in inputs if n.startswith("past_key_values.")]
        self._present_names = [n.replace("past_key_values.", "present.") for n in self._cache_names]
        self._uses_positions = "position_ids" in inputs
        self._keeps_logits = LOGITS_TO_KEEP in inputs  # graphs built by fly; other exports return all logits
        self._dtype = np.float16 if "float16" in inputs[self._cache_names[0]].type else np.float32
        shape = inputs[self._cache_names[0]].shape  # [batch, kv_heads, past_len, head_dim]
        self._empty = np.zeros((1, shape[1], 0, shape[3]), dtype=self._dtype)
        config = json.loads((onnx_dir / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings", 32768))
        self.name = f"onnxruntime-cpu-{onnx_dir.name}"
        self._cache: list[np.ndarray] = [self._empty] * len(self._cache_names)
        self._length = 0
        # GroupQueryAttention (fly's graphs, the genai builder's) writes a pass's keys and values into the buffer
        # it reads where past and present are bound to one: no copy of the whole cache per pass, no copy to crop
        self._shares_buffers = _attention_shares_buffers(onnx_dir, self.session)
        self._values: list = []  # the bound OrtValues over self._cache's preallocated arrays
        # each layer's key and value buffers (their places in self._cache), for the keys and values a prompt
        # reader hands over
        self._layers = [(self._cache_names.index(f"past_key_values.{i}.key"),
                         self._cache_names.index(f"past_key_values.{i}.value"))
                        for i in range(len(self._cache_names) // 2)
                        if f"past_key_values.{i}.key" in self._cache_names]
        # a bf16_reader.ReaderSlot where the prompt reader may pay here (the loader attaches it to graphs it wrote
        # from the GGUF the reader computes)
        self.reader = None

    @property
    def read_chunk(self) -> int | None:
        """Where the prompt reader reads (or is about to), the prompt tokens a pass should hold."""
        return READ_CHUNK if self.reader is not None and self.reader.ready() else None

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        if self.reader is None:
            return self._forward(input_ids, keep)
        input_ids = self._read_ahead(input_ids, keep)
        began = time.perf_counter()
        logits = self._forward(input_ids, keep)
        self.reader.learn(len(input_ids), time.perf_counter() - began, by_reader=False)  # the graph's own reads
        return logits

    def _read_ahead(self, ids: Sequence[int], keep: int | None) -> Sequence[int]:
        """Read the ids whose logits are not wanted with the prompt reader, where it pays, into the cache (keys after
        rotary, as GroupQueryAttention keeps them); the ids left for the graph's own pass."""
        unread = len(ids) - min(keep or len(ids), len(ids))
        reader = self.reader.for_read(unread) if self._shares_buffers else None
        if reader is None or self._length + unread > self.max_context or len(self._layers) != reader.layout.layers:
            return ids
        began = time.perf_counter()
        start = self._length
        rows = lambda c: c[0, :, :start].transpose(1, 0, 2).reshape(start, -1)  # noqa: E731 [positions, heads * dim]
        past = ([rows(self._cache[k]) for k, _ in self._layers], [rows(self._cache[v]) for _, v in self._layers]) \
            if start else ((), ())
        keys, values = on_openmp_thread(reader.read, ids[:unread], *past)
        self._reserve(start + unread)
        heads, dim = self._empty.shape[1], self._empty.shape[3]
        for (k, v), new_keys, new_values in zip(self._layers, keys, values):
            self._cache[k][0, :, start:start + unread] = new_keys.reshape(unread, heads, dim).transpose(1, 0, 2)
            self._cache[v][0, :, start:start + unread] = new_values.reshape(unread, heads, dim).transpose(1, 0, 2)
        self._length = start + unread
        self.reader.learn(unread, time.perf_counter() - began, by_reader=True)
        return ids[unread:]

    def _forward(self, input_ids: Sequence[int], keep: int | None) -> torch.Tensor:
        n = len(input_ids)
        keep = min(keep or n, n)
        total = self._length + n
        feed: dict[str, np.ndarray] = {
            "input_ids": np.asarray([input_ids], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
        }
        if self._uses_positions:
            feed["position_ids"] = np.arange(self._length, total, dtype=np.int64)[None]
        if self._keeps_logits:
            feed[LOGITS_TO_KEEP] = np.asarray([keep], dtype=np.int64)
        if self._shares_buffers:
            logits = self._run_in_place(feed, total)
        else:
            feed.update(zip(self._cache_names, self._cache))
            logits, *present = self.session.run(["logits", *self._present_names], feed)
            self._cache = present
        self._length = total
        return torch.from_numpy(logits[0, -keep:]).float()

    def _run_in_place(self, feed: dict[str, np.ndarray], total: int) -> np.ndarray:
        """One pass with each layer's past and present bound to the same preallocated buffer."""
        self._reserve(total)
        binding = self.session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("logits")  # first: get_outputs() lists the outputs in the order they were bound
        for past, present, value in zip(self._cache_names, self._present_names, self._values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    @property
    def _capacity(self) -> int:
        """Positions the cache arrays hold (where they are written in place, more than are cached)."""
        return self._cache[0].shape[2]

    def _reserve(self, total: int) -> None:
        """Buffers of at least ``total`` positions, doubling (up to the model's context) and keeping what is cached."""
        if total <= self._capacity:
            return
        import onnxruntime as ort

        capacity = max(total, min(self.max_context, max(2 * self._capacity, FIRST_CAPACITY)))
        shape = (1, self._empty.shape[1], capacity, self._empty.shape[3])
        grown = []
        for old in self._cache:
            new = np.zeros(shape, dtype=self._dtype)
            new[:, :, :self._length] = old[:, :, :self._length]
            grown.append(new)
        self._cache = grown
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in grown]

    def crop(self, length: int) -> None:
        if length >= self._length:
            return
        if not self._shares_buffers:  # in place, the next pass writes over the positions past ``length``
            self._cache = [np.ascontiguousarray(c[:, :, :length]) if length else self._empty for c in self._cache]
        self._length = length
