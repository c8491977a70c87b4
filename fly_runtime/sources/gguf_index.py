"""A GGUF's metadata and tensor table, read in a fraction of a second: gguf-py's reader builds a numpy view for
every element of every array field (a Qwen2 vocabulary and its merges: 300,000 strings, 10-20 s on 2 cores), where
the prompt reader needs the model's shape and where each tensor lies. Scalars and strings are decoded; arrays are
skipped (their element count is kept). Tensors are ``memmap`` views shaped as gguf-py shapes them (quantised
types: one row of blocks per matrix row)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
F32, F16 = 0, 1


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass
class Field:
    value: object  # a scalar, a string, or for an array its element count

    def contents(self) -> object:
        return self.value


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml's order: the row length first
    tensor_type: int
    data: np.ndarray


def read_index(path: Path) -> tuple[dict[str, Field], dict[str, Tensor]]:
    """The fields and tensors of the GGUF at ``path``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFFormatError(f"{path} is not a GGUF file")
    version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise GGUFFormatError(f"{path}: GGUF version {version} is not read here")
    at = 24

    def string() -> str:
        nonlocal at
        (length,) = struct.unpack_from("<Q", buf, at)
        text = bytes(buf[at + 8:at + 8 + length]).decode("utf-8", "replace")
        at += 8 + length
        return text

    def skip(kind: int, count: int) -> None:
        nonlocal at
        if kind == STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buf, at)
                at += 8 + length
        elif kind == ARRAY:
            for _ in range(count):
                inner, inner_count = struct.unpack_from("<IQ", buf, at)
                at += 12
                skip(inner, inner_count)
        else:
            at += struct.calcsize(_SCALARS[kind]) * count

    fields: dict[str, Field] = {}
    for _ in range(n_fields):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if kind == STRING:
            fields[key] = Field(string())
        elif kind == ARRAY:
            inner, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            skip(inner, count)
            fields[key] = Field(count)
        elif kind in _SCALARS:
            (value,) = struct.unpack_from(_SCALARS[kind], buf, at)
            at += struct.calcsize(_SCALARS[kind])
            fields[key] = Field(value)
        else:
            raise GGUFFormatError(f"{path}: field {key} has unknown type {kind}")
    infos = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, at)
        shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, tuple(int(d) for d in shape), int(kind), int(offset)))
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    start = (at + alignment - 1) // alignment * alignment
    tensors: dict[str, Tensor] = {}
    for name, shape, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * size
        view = raw[start + offset:start + offset + rows * row_bytes]
        if kind == F32:
            data = view.view(np.float32).reshape(*reversed(shape))
        elif kind == F16:
            data = view.view(np.float16).reshape(*reversed(shape))
        else:
            data = view.reshape(rows, row_bytes)
        tensors[name] = Tensor(name, shape, kind, data)
    return fields, tensors
