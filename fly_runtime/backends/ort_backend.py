"""ONNX Runtime backend: a decoder graph with its KV cache as inputs/outputs (as fly builds them, or any
export with the same names: input_ids, attention_mask, past_key_values.N.key/value -> logits, present.N.*).

Why ONNX Runtime on CPU: a pass over a few tokens costs little more than one decoding step, where PyTorch's
skinny GEMMs for a few rows are slow (docs/design.md). Speculative decoding lives on that ratio.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fly_runtime.sources.convert import LOGITS_TO_KEEP, onnx_model_file


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

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
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
        feed.update(zip(self._cache_names, self._cache))
        logits, *present = self.session.run(["logits", *self._present_names], feed)
        self._cache = present
        self._length = total
        return torch.from_numpy(logits[0, -keep:]).float()

    def crop(self, length: int) -> None:
        if length >= self._length:
            return
        if length == 0:
            self._cache = [self._empty] * len(self._cache_names)
        else:
            self._cache = [np.ascontiguousarray(c[:, :, :length]) for c in self._cache]
        self._length = length
