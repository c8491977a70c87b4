"""One sequence's cells of llama.cpp's KV cache as arrays, and back: what ``llama_state_seq_get_data`` writes and
``llama_state_seq_set_data`` reads (llama-cpp-python 0.3.36's llama.cpp, one stream, keys and values in rows).

Why: a prompt read elsewhere (fly_runtime/backends/bf16_reader.py) hands llama.cpp the keys and values it
computed, and llama.cpp writes the reply from them as if it had read the prompt itself. The layout, as written:
8 bytes llama.cpp keeps ahead of the cells (carried over as read), the stream count (1), the cell count, each cell's
position and sequence (position, 1, sequence id), whether values are stored transposed (0 here: llama.cpp's flash
attention, its CPU default), the layer count, then per layer the keys (type, row bytes, one row a cell), then per
layer the values alike. A layout other than that raises ``UnknownLayout`` and the caller reads the usual way.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

F16 = 1  # ggml's type id of float16


class UnknownLayout(Exception):
    """The state is not laid out as this module writes it (another llama.cpp, transposed values, quantised cells)."""


@dataclass
class SeqCells:
    """A sequence's cells: ``keys[layer]`` and ``values[layer]`` float16 [cells, kv_heads * head_dim], positions
    0..cells-1."""

    head: bytes  # the 8 bytes ahead of the cells, carried over
    keys: list[np.ndarray]
    values: list[np.ndarray]
    layers: int

    @property
    def count(self) -> int:
        return len(self.keys[0]) if self.keys else 0


def parse(raw, layers: int) -> SeqCells:
    """The cells of ``raw`` (one sequence's state: bytes or a uint8 array, whose rows are viewed, not copied),
    checked against the layout above."""
    if len(raw) < 16:
        raise UnknownLayout(f"{len(raw)} bytes")
    head = bytes(raw[:8])
    streams, count = struct.unpack_from("<II", raw, 8)
    if streams != 1:
        raise UnknownLayout(f"{streams} streams")
    if count == 0:
        return SeqCells(head, [], [], layers)
    at = 16
    meta = np.frombuffer(raw, np.int32, 3 * count, at).reshape(count, 3)
    if not (meta[:, 1] == 1).all() or not (meta[:, 0] == np.arange(count)).all():
        raise UnknownLayout("cells are not positions 0.. of one sequence")
    at += 12 * count
    transposed, n_layer = struct.unpack_from("<II", raw, at)
    at += 8
    if transposed or n_layer != layers:
        raise UnknownLayout(f"transposed values {transposed}, {n_layer} layers (expected {layers})")
    parts: list[list[np.ndarray]] = [[], []]
    for part in parts:
        for _ in range(n_layer):
            kind, row = struct.unpack_from("<iQ", raw, at)
            at += 12
            if kind != F16:
                raise UnknownLayout(f"cells of ggml type {kind}")
            part.append(np.frombuffer(raw, np.float16, count * row // 2, at).reshape(count, row // 2))
            at += count * row
    if at != len(raw):
        raise UnknownLayout(f"{len(raw) - at} bytes past the values")
    return SeqCells(head, parts[0], parts[1], layers)


def pack(cells: SeqCells, seq: int, new_keys: list[np.ndarray] | None = None,
         new_values: list[np.ndarray] | None = None) -> np.ndarray:
    """``cells``, followed by new rows where given (per layer [new cells, kv_heads * head_dim], any float type), as
    ``llama_state_seq_set_data`` reads them into sequence ``seq``: one uint8 array, each row copied once."""
    old, new = cells.count, len(new_keys[0]) if new_keys else 0
    count = old + new
    if count == 0:
        return np.frombuffer(cells.head + struct.pack("<II", 1, 0), np.uint8).copy()
    width = (cells.keys[0] if old else new_keys[0]).shape[1]  # type: ignore[index]
    part_bytes = 12 + count * width * 2
    out = np.empty(16 + 12 * count + 8 + 2 * cells.layers * part_bytes, np.uint8)
    out[:8] = np.frombuffer(cells.head, np.uint8)
    out[8:16] = np.frombuffer(struct.pack("<II", 1, count), np.uint8)
    meta = out[16:16 + 12 * count].view(np.int32).reshape(count, 3)
    meta[:, 0], meta[:, 1], meta[:, 2] = np.arange(count), 1, seq
    at = 16 + 12 * count
    out[at:at + 8] = np.frombuffer(struct.pack("<II", 0, cells.layers), np.uint8)
    at += 8
    for olds, news in ((cells.keys, new_keys), (cells.values, new_values)):
        for layer in range(cells.layers):
            out[at:at + 12] = np.frombuffer(struct.pack("<iQ", F16, width * 2), np.uint8)
            rows = out[at + 12:at + part_bytes].view(np.float16).reshape(count, width)
            if old:
                rows[:old] = olds[layer]
            if new:
                rows[old:] = news[layer]  # type: ignore[index]
            at += part_bytes
    return out
