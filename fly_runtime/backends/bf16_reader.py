"""A prompt reader: the decoder's layers in bfloat16 products on PyTorch, computing a long prompt's keys and values for
llama.cpp's cache (or a graph's written from the same GGUF: ort_backend.py), so that the form writes the reply from
them as if it had read the prompt itself.

Why: on a CPU a prompt read is llama.cpp's slowest part (a RAG answer or a tool turn reads hundreds of tokens and
writes tens; llama.cpp reads a token for a quarter of a step), and on a CPU that computes bfloat16 PyTorch's
oneDNN products read prompts faster (AMX-BF16 on an Intel Xeon: five to six times; AVX512-BF16 on a Zen 4 EPYC:
1.6-1.7x), with no activation rounding to speak of (int8 activations cost a 1.5B model three points of agreement:
docs/design.md).
A step of a bfloat16 model reads twice an 8-bit model's bytes, so the writing stays on llama.cpp. Both compute
the GGUF's weights, and the reader hands over keys after rotary and values in llama.cpp's own rows
(llama_cpp_state.py). It keeps no weights of its own: each read widens each layer's blocks in the mapped GGUF to
bfloat16 once (native_widen.py, in C: the pages llama.cpp's file already holds, 0.79 GB for the 1.5B's layers), so
it computes the GGUF's exact weights (docs/design.md, "The prompt reader"). Where that C does not build, it keeps
int8 rows with a scale a row instead (a byte a weight: 1.3 GB), or bfloat16 weights (``FLY_PROMPT_READER=bf16``,
no widening). It holds no LM head: the last prompt token, whose logits are wanted, is llama.cpp's; and no
embedding table beyond the GGUF's quantised rows, decoded per prompt.

``ReaderSlot`` decides where it runs: opened once the reads it would have sped up add up to its opening, used
while it reads at least ``GAIN`` times faster than llama.cpp does on this machine.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from fly_runtime.backends import native_widen
from fly_runtime.backends.native_widen import BLOCK_BYTES, Q4_K, Q6_K  # the two types a Q4_K_M file holds
from fly_runtime.sources.gguf_graph import Unsupported, read_layout
from fly_runtime.sources.gguf_index import read_index

CHUNK = 512  # prompt positions read at a time through a layer: bounds the activations' memory on long prompts
# the prompt tokens a form's pass should hand the reader where it reads: each read widens every matrix once (0.2 s
# for the 1.5B), so fewer, longer reads; 1,024 tokens take about as long as llama.cpp's own 128-token pass
READ_CHUNK = 1024
BF16 = torch.bfloat16


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [n, 144] (d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles) to float32
    [n, 256]: each 32 weights ``d * scale * q - dmin * minimum``."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16].int()
    scale = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1).float()
    minimum = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1).float()
    qs = blocks[:, 16:144].view(-1, 4, 32)  # four chunks of 64 weights: low nibbles first, then high
    q = torch.stack([qs & 0xF, qs >> 4], 2).reshape(-1, 8, 32).float()
    return (q * (d * scale)[:, :, None] - (dmin * minimum)[:, :, None]).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [n, 210] (128 bytes of low bits, 64 of high bits, 16 int8 scales, d) to float32 [n, 256]:
    each 16 weights ``d * scale * (q - 32)``."""
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    halves = []
    for h in range(2):  # 128 weights each: 64 bytes of low bits, 32 of high bits
        lo, hi = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32]
        halves += [(lo[:, 0:32] & 0xF) | ((hi & 3) << 4), (lo[:, 32:64] & 0xF) | (((hi >> 2) & 3) << 4),
                   (lo[:, 0:32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:64] >> 4) | ((hi >> 6) << 4)]
    q = torch.stack(halves, 1).reshape(-1, 16, 16).float() - 32
    return (q * (d * scale)[:, :, None]).reshape(-1, 256)


_DECODERS = {Q4_K: _q4_k, Q6_K: _q6_k}


def _matrix(tensor) -> torch.Tensor:
    """A GGUF matrix dequantised to float32 [N, K]: Q4_K and Q6_K decoded in PyTorch (on all cores; about as fast
    as gguf-py's numpy decoder, and bit-equal to it), other types by gguf-py."""
    rows = int(np.prod(tensor.shape[1:]))
    raw = np.asarray(tensor.data).reshape(rows, -1)
    kind = int(tensor.tensor_type)
    if kind in _DECODERS:
        size, decode = BLOCK_BYTES[kind], _DECODERS[kind]
        blocks = torch.from_numpy(np.array(raw)).view(-1, size)  # a copy: the mapped file is read-only
        return decode(blocks).reshape(rows, -1)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType(kind)), np.float32).reshape(rows, -1))


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float32 as int8 rows and a float32 scale a row (symmetric: the row's largest magnitude at 127). On a
    Q4_K_M 1.5B the rounding moves a weight by 0.9-1.9% of the matrix's RMS (the GGUF's own 4 bits move it ~10%)."""
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).to(torch.int8), scale


WIDEN_ROWS = 1024  # int8 rows widened to bfloat16 at a time: about twice as fast here as the whole matrix at once


def _widen(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] into ``out`` bfloat16 [N, K] (exact: bfloat16 holds every int8); returns ``out``."""
    for at in range(0, rows.shape[0], WIDEN_ROWS):
        out[at:at + WIDEN_ROWS].copy_(rows[at:at + WIDEN_ROWS])
    return out


class _Part(NamedTuple):
    """A GGUF matrix [rows, cols] as the mapped file holds it: ``data`` its blocks (uint8) or floats, row by row."""

    kind: int
    data: np.ndarray
    rows: int
    cols: int


def _mapped(tensor) -> _Part:
    """A GGUF matrix left in the mapped file (no copy), for ``_widen_parts``."""
    kind, cols = int(tensor.tensor_type), int(tensor.shape[0])
    rows = int(np.prod(tensor.shape[1:]))
    if kind not in WIDENED:
        raise _NotWidened(f"a matrix of ggml type {kind}")
    return _Part(kind, np.asarray(tensor.data), rows, cols)


def _widen_parts(parts: list[_Part], out: torch.Tensor) -> torch.Tensor:
    """Matrices stacked by rows into ``out`` bfloat16 [sum of rows, cols]: Q4_K / Q6_K blocks in C, floats by PyTorch
    (float32 rounded to nearest, as the other kinds of kept weights are)."""
    at = 0
    for part in parts:
        rows = out[at:at + part.rows]
        if part.kind in BLOCK_BYTES:
            native_widen.widen(part.kind, part.data, rows, torch.get_num_threads())
        else:  # read-only mapped floats, only read here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                rows.copy_(torch.from_numpy(part.data.reshape(part.rows, part.cols)))
        at += part.rows
    return out


def _vector(tensor) -> torch.Tensor:
    return torch.from_numpy(np.asarray(tensor.data, np.float32).copy())


# how the reader keeps its matrices: the GGUF's own blocks, widened to bfloat16 in C each read (native_widen.py; where
# it builds and the file holds only the types it widens, else int8 rows), int8 rows and a scale a row, or bfloat16
WEIGHTS = ("gguf", "int8", "bf16")
F32, F16 = 0, 1  # ggml type ids widened by PyTorch from the mapped file (Q4_K, Q6_K: in C)
WIDENED = frozenset((*BLOCK_BYTES, F32, F16))  # the matrix types read from the mapped file


class _NotWidened(Exception):
    """The GGUF holds a matrix type the reader does not widen from the file, or no C compiler built the widening."""


class _Layer:
    """One decoder layer: norms, and each matrix as the mapped GGUF's parts (``_Part``, no scale), int8 rows with a
    float32 scale a row (``_int8_rows``), or in bfloat16 (no scale)."""

    MATRICES = ("qkv", "o", "gate_up", "down")
    FIELDS = ("attn_norm", "ffn_norm", "qkv_bias") + MATRICES + tuple(f"{m}_scale" for m in MATRICES)

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.attn_norm, self.ffn_norm = weights["attn_norm"], weights["ffn_norm"]
        self.qkv_bias = weights.get("qkv_bias")
        self.qkv, self.o, self.gate_up, self.down = (weights[m] for m in self.MATRICES)
        self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale = (weights.get(f"{m}_scale")
                                                                             for m in self.MATRICES)
        # applied to bfloat16 outputs, in place
        self.gate_up_scale_bf16 = self.gate_up_scale.to(BF16) if self.gate_up_scale is not None else None

    @classmethod
    def from_gguf(cls, tensors: dict, i: int, kept_as: str = "int8") -> "_Layer":
        t = lambda name: tensors[f"blk.{i}.{name}"]  # noqa: E731
        joined = lambda names: torch.cat([_matrix(t(n)) for n in names])  # noqa: E731
        weights = {"attn_norm": _vector(t("attn_norm.weight")), "ffn_norm": _vector(t("ffn_norm.weight"))}
        for name, parts in (("qkv", ["attn_q.weight", "attn_k.weight", "attn_v.weight"]), ("o", ["attn_output.weight"]),
                            ("gate_up", ["ffn_gate.weight", "ffn_up.weight"]), ("down", ["ffn_down.weight"])):
            if kept_as == "bf16":
                weights[name] = joined(parts).to(BF16)
            elif kept_as == "gguf":  # the mapped file's blocks, a part each
                weights[name] = [_mapped(t(n)) for n in parts]
            else:
                weights[name], weights[f"{name}_scale"] = _int8_rows(joined(parts))
        biases = [tensors.get(f"blk.{i}.attn_{p}.bias") for p in "qkv"]
        if all(b is not None for b in biases):
            weights["qkv_bias"] = torch.cat([_vector(b) for b in biases])
        return cls(weights)

    def named(self, i: int) -> dict[str, torch.Tensor]:
        return {f"{i}.{f}": getattr(self, f) for f in self.FIELDS if getattr(self, f) is not None}

    def widened(self, scratch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's matrices in bfloat16 (unscaled), the GGUF's blocks or int8 rows widened into ``scratch``'s
        buffers (made on first use)."""
        out = {}
        for m in self.MATRICES:
            rows = getattr(self, m)
            if isinstance(rows, list):  # the GGUF's blocks, part after part
                if m not in scratch:
                    scratch[m] = torch.empty(sum(part.rows for part in rows), rows[0].cols, dtype=BF16)
                out[m] = _widen_parts(rows, scratch[m])
                continue
            if rows.dtype == BF16:
                out[m] = rows
                continue
            if m not in scratch:
                scratch[m] = torch.empty(rows.shape, dtype=BF16)
            out[m] = _widen(rows, scratch[m])
        return out


WEIGHTS_VERSION = 2  # of the kept weights' layout (1: bfloat16 matrices; 2: int8 rows and scales)


def weights_file(gguf_path: Path, folder: Path, kept_as: str = "int8") -> Path:
    """Where the reader's weights of ``gguf_path`` are kept (``kept_as``: one of ``WEIGHTS``): named by the file and
    its size and date, so that another file of the same name is converted anew."""
    stat = gguf_path.stat()
    tag = "" if kept_as == "int8" else f"-{kept_as}"
    return folder / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{WEIGHTS_VERSION}{tag}.safetensors"


def _kept_layers(gguf_path: Path, cache: Path | None, kept_as: str, tensors: dict, layers: int) -> list[_Layer]:
    """The layers as int8 rows or bfloat16, read back from ``cache`` where kept there, else converted from the GGUF
    (and kept)."""
    kept = weights_file(gguf_path, cache, kept_as) if cache is not None else None
    if kept is not None and kept.is_file():
        from safetensors.torch import load_file

        saved = load_file(str(kept))
        return [_Layer({f: saved[f"{i}.{f}"] for f in _Layer.FIELDS if f"{i}.{f}" in saved}) for i in range(layers)]
    converted = [_Layer.from_gguf(tensors, i, kept_as) for i in range(layers)]
    if kept is not None:
        from safetensors.torch import save_file

        kept.parent.mkdir(parents=True, exist_ok=True)
        scratch = kept.with_suffix(f".{os.getpid()}.partial")
        save_file({k: v for i, layer in enumerate(converted) for k, v in layer.named(i).items()}, str(scratch))
        scratch.replace(kept)
        _remove_stale(gguf_path, kept.parent, kept)
    return converted


class PromptReader:
    """Computes the keys and values of prompt tokens (``read``), from a GGUF's weights widened to bfloat16 once a read
    (from the file's own blocks, or from int8 rows), in bfloat16 products."""

    def __init__(self, gguf_path: Path, cache: Path | None = None, kept_as: str = "gguf") -> None:
        """``kept_as``: ``"gguf"``, the mapped file's own blocks widened in C (nothing kept beside the file; where the
        widening does not build or the file holds other types, int8 rows instead: ``kept_as`` says which), ``"int8"``
        rows, or ``"bf16"`` (twice int8's memory; no widening: reads of a few hundred tokens 20-40% faster).
        ``cache``: a folder where int8 or bfloat16 weights, once converted, are kept for the next opening (reading
        them back takes a second or two where converting the GGUF takes 15 s for a 1.5B)."""
        if kept_as not in WEIGHTS:
            raise ValueError(f"the prompt reader keeps its weights as one of {WEIGHTS}, not {kept_as!r}")
        fields, tensors = read_index(gguf_path)
        self.layout = layout = read_layout(fields, tensors)  # Unsupported: a family not written here
        if layout.interleaved:
            raise Unsupported("rotary pairs interleaved (a Llama GGUF's permuted rows)")
        # the embedding's rows as stored (quantised), left in the mapped file: a prompt's rows are decoded from them,
        # and only the pages of rows read stay in memory (a copy held the whole table: 0.13 GB for the 1.5B)
        embedding = tensors["token_embd.weight"]
        self._embedding_kind = int(embedding.tensor_type)
        self._embedding = np.asarray(embedding.data).reshape(int(np.prod(embedding.shape[1:])), -1)
        if kept_as == "gguf":
            try:
                if not native_widen.available():
                    raise _NotWidened("no C compiler built the widening")
                self.layers = [_Layer.from_gguf(tensors, i, kept_as) for i in range(layout.layers)]
            except _NotWidened:
                kept_as = "int8"  # kept as int8 rows instead (a byte a weight)
            else:
                if cache is not None and cache.is_dir():  # weights kept otherwise before: nothing reads them now
                    _remove_stale(gguf_path, cache)
        if kept_as != "gguf":
            self.layers = _kept_layers(gguf_path, cache, kept_as, tensors, layout.layers)
        self.kept_as = kept_as
        self._inv_freq = layout.rope_base ** (-torch.arange(0, layout.head_dim, 2, dtype=torch.float64)
                                              / layout.head_dim)

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt's embedding rows, float32 [n, hidden], dequantised from the GGUF's rows of those ids alone."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self._embedding[np.asarray(ids, np.int64)]
        rows = dequantize(raw, GGMLQuantizationType(self._embedding_kind))
        return torch.from_numpy(np.asarray(rows, np.float32).reshape(len(ids), -1))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions.double(), self._inv_freq).float()  # [n, head_dim / 2]
        return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    @torch.inference_mode()
    def read(self, ids: Sequence[int], past_keys: Sequence[np.ndarray] = (),
             past_values: Sequence[np.ndarray] = ()) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The keys and values of ``ids`` following the cached positions ``past_keys`` / ``past_values`` (per
        layer [positions, kv_heads * head_dim], any float type; empty for a prompt's start), per layer float16
        [len(ids), kv_heads * head_dim], keys after rotary: llama.cpp's rows."""
        L = self.layout
        start = len(past_keys[0]) if len(past_keys) else 0
        # per layer, what attention reads: [kv_heads, positions, head_dim] bfloat16
        as_heads = lambda rows: torch.from_numpy(np.asarray(rows, np.float32)).view(-1, L.kv_heads, L.head_dim).transpose(0, 1).to(BF16)  # noqa: E731
        keys = [as_heads(k) for k in past_keys] if start else [torch.empty(L.kv_heads, 0, L.head_dim, dtype=BF16)] * L.layers
        values = [as_heads(v) for v in past_values] if start else list(keys)
        new_keys: list[list[torch.Tensor]] = [[] for _ in range(L.layers)]
        new_values: list[list[torch.Tensor]] = [[] for _ in range(L.layers)]
        previous = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)  # every core (the engine keeps torch to one while llama.cpp runs)
        try:
            x = self.embed(ids)
            cos, sin = self._rotary(torch.arange(start, start + len(ids)))
            scratch: dict[str, torch.Tensor] = {}
            # layer by layer, each layer's matrices widened once for all of the read's chunks
            for i, layer in enumerate(self.layers):
                w = layer.widened(scratch)
                for at in range(0, len(ids), CHUNK):
                    end = min(len(ids), at + CHUNK)
                    x[at:end] = self._layer_rows(i, layer, w, x[at:end], start + at, cos[at:end], sin[at:end],
                                                 keys, values, new_keys[i], new_values[i])
        finally:
            torch.set_num_threads(previous)
        rows = lambda parts: [torch.cat(p).reshape(len(ids), -1).to(torch.float16).numpy() for p in parts]  # noqa: E731
        return rows(new_keys), rows(new_values)

    def _layer_rows(self, i: int, layer: _Layer, w: dict[str, torch.Tensor], x: torch.Tensor, start: int,
                    cos: torch.Tensor, sin: torch.Tensor, keys: list, values: list, new_keys: list,
                    new_values: list) -> torch.Tensor:
        """Layer ``i`` on rows ``x`` [n, hidden] float32 at positions ``start``..: their keys and values appended
        (to the cache ``keys[i]`` / ``values[i]`` and to ``new_keys`` / ``new_values``); returns the layer's output.
        Each product runs on the widened int8 rows and is scaled after, per output column."""
        L = self.layout
        n = len(x)
        q_width, kv_width = L.heads * L.head_dim, L.kv_heads * L.head_dim
        linear = torch.nn.functional.linear
        h = _rms_norm(x, layer.attn_norm, L.eps).to(BF16)
        qkv = _scaled(linear(h, w["qkv"]).float(), layer.qkv_scale)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        q = _rope(qkv[:, :q_width].view(n, L.heads, L.head_dim), cos, sin)
        k = _rope(qkv[:, q_width:q_width + kv_width].view(n, L.kv_heads, L.head_dim), cos, sin)
        v = qkv[:, q_width + kv_width:].view(n, L.kv_heads, L.head_dim)
        new_keys.append(k)
        new_values.append(v)
        keys[i] = torch.cat([keys[i], k.transpose(0, 1).to(BF16)], dim=1)
        values[i] = torch.cat([values[i], v.transpose(0, 1).to(BF16)], dim=1)
        attn = _attention(q, keys[i], values[i], start, L.head_dim ** -0.5)
        x = x + _scaled(linear(attn.to(BF16), w["o"]).float(), layer.o_scale)
        h = _rms_norm(x, layer.ffn_norm, L.eps).to(BF16)
        gate, up = _scaled(linear(h, w["gate_up"]), layer.gate_up_scale_bf16).chunk(2, dim=-1)
        return x + _scaled(linear(torch.nn.functional.silu(gate) * up, w["down"]).float(), layer.down_scale)


def _scaled(out: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A product's output [n, N] scaled in place per output column (int8 rows' scales; None: bfloat16 weights)."""
    return out if scale is None else out.mul_(scale)


def _remove_stale(gguf_path: Path, folder: Path, kept: Path | None = None) -> None:
    """Removes from ``folder`` the weights kept for ``gguf_path`` but ``kept``: by other versions of the layout or of
    the file (the name's size and date), or kept otherwise (int8 rows, bfloat16; any, where the reader widens the
    GGUF's own blocks): nothing reads them again until the setting changes back."""
    import re

    pattern = re.compile(rf"{re.escape(gguf_path.stem)}-\d+-\d+-v\d+(-[a-z0-9]+)?\.safetensors")
    for other in folder.iterdir():
        if other != kept and pattern.fullmatch(other.name):
            other.unlink(missing_ok=True)


QUERY_BLOCK = 128  # queries scored together: a block sees the keys up to its last position, not the whole chunk's


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of queries [n, heads, head_dim] at positions ``start``.. over ``keys`` / ``values``
    [kv_heads, start + n, head_dim] (bfloat16); the heads sharing a key-value head are scored as one matrix
    product. Returns [n, heads * head_dim] float32."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out = torch.empty(n, heads, dim)
    for a in range(0, n, QUERY_BLOCK):
        b = min(n, a + QUERY_BLOCK)
        seen = start + b
        # [kv_heads, group * rows, dim]: heads h * group .. h * group + group - 1 read key-value head h
        qb = (q[a:b] * scale).to(torch.bfloat16).permute(1, 0, 2).reshape(kv_heads, group * (b - a), dim)
        scores = torch.bmm(qb, keys[:, :seen].transpose(1, 2)).float().view(kv_heads, group, b - a, seen)
        # row i (position start + a + i) sees keys up to and including its own position
        hidden = torch.arange(seen)[None, :] > torch.arange(start + a, start + b)[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, -1).to(torch.bfloat16).view(kv_heads, group * (b - a), seen)
        out[a:b] = torch.bmm(probs, values[:, :seen]).view(heads, b - a, dim).transpose(0, 1)
    return out.view(n, heads * dim)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [n, heads, head_dim] with the halves apart (NeoX style, as Qwen2's GGUF and the graph's
    GroupQueryAttention); ``cos`` / ``sin`` [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# what a read costs a token beyond its matrix products (attention over a few hundred cached positions, norms,
# conversions, the handover; since 2026-12-07 the int8 rows' widening, 0.2 s a read), as measured on the 1.5B on
# two cores: about the same with AMX (products 1.4 ms a token, reads 2.5-3.5; int8 rows 2.9-3.2 over 356-1,000
# tokens) and with AVX512-BF16 alone (products 6.1 ms, reads 7.1-8.0). Not a multiple of the products:
# priced as one (twice them), the Zen 4 EPYC's reads were predicted at 12 ms a token and the reader never opened.
OTHER_MS = 1.5
OTHER_PARAMS = 1.31e9  # the decoder weights of the 1.5B that OTHER_MS was measured on
PRODUCT = (512, 1536, 8960)  # the bfloat16 product timed once per machine (rows, K, N)


# a product slower than this on its first run is bfloat16 emulated in software (AMX makes it in 7-8 ms, fp32 units in
# 50): one more run prices it, instead of seven of a second each, and the reader never opens there anyway
EMULATED_MS = 250.0


def product_ms(repeats: int = 5) -> float:
    """Median milliseconds of one bfloat16 product of ``PRODUCT``'s shape on this machine's CPU."""
    from fly_runtime.timing import median_seconds

    rows, k, n = PRODUCT
    x, w = torch.randn(rows, k, dtype=BF16), torch.randn(n, k, dtype=BF16)

    def product() -> None:
        torch.nn.functional.linear(x, w)

    if median_seconds(product, 1) * 1000 > EMULATED_MS:  # the first run, kernel set-up and all
        return median_seconds(product, 1) * 1000
    return median_seconds(product, repeats, warmup=1) * 1000


def _decoder_matrices(gguf_path: Path) -> tuple[int, bool]:
    """(weights of a GGUF's decoder layers, what a read multiplies every token by; whether every one of their
    matrices is a type widened from the file). ``Unsupported`` where the reader does not compute this model (its
    family, interleaved rotary pairs)."""
    fields, tensors = read_index(gguf_path)
    if read_layout(fields, tensors).interleaved:
        raise Unsupported("rotary pairs interleaved (a Llama GGUF's permuted rows)")
    matrices = [t for t in tensors.values() if t.name.startswith("blk.") and len(t.shape) == 2]
    widened = all(int(t.tensor_type) in WIDENED for t in matrices)
    return sum(int(np.prod(t.shape)) for t in matrices), widened


def predicted_ms_per_token(params: int, product: float) -> float:
    """A read's milliseconds a token for a model of ``params`` decoder weights, from the timed product
    (``product_ms``): the products' share, plus the rest of a read (``OTHER_MS``, scaled by the model's size)."""
    rows, k, n = PRODUCT
    return product / rows * params / (k * n) + OTHER_MS * params / OTHER_PARAMS


class _Shared:
    """What the forms a reader serves share: the reader once open, its price, what opening it costs, what it would
    have saved so far unopened, and the slots (one per form)."""

    def __init__(self, reader_ms: float, open_seconds: float) -> None:
        self.reader: PromptReader | None = None
        self.reader_ms = reader_ms  # predicted, then learned from the reader's own reads
        self.open_seconds = open_seconds
        self.missed = 0.0
        self.slots: list[ReaderSlot] = []
        # the first read after opening pages the mapped weights in (1.3 GB for the 1.5B; seconds where the page cache
        # had dropped them, 75 ms a token over a short prompt): it prices nothing, or the reader is dropped for good
        self.fresh = False


class ReaderSlot:
    """Where a prompt reader may pay for one form of the target (llama.cpp's cache, an ONNX Runtime graph's): opened
    once the reads it would have sped up add up to what opening it costs (the ski-rental rule, as for a second form of
    the target), then used for every read of ``MIN_TOKENS`` or more while it stays faster than the form's own reads.
    The backend tells it what its own reads cost. The slots of one model's forms (``for_form``) share one reader: one
    copy of its weights, opened by the reads of any of them."""

    MIN_TOKENS = 32
    LEARN_RATE = 0.3
    SECONDS_PER_PARAM = 11e-9  # opening: each weight dequantised and rounded to int8 rows (14 s for the 1.5B)
    SECONDS_PER_PARAM_KEPT = 2e-9  # opening from the weights kept by an earlier opening (mapped, read on first use)
    # opening on the GGUF's own blocks: the file mapped and indexed (0.03 s for the 1.5B), its pages, mostly held
    # already for the target's own form, touched by the first read (0.08 s more than the next read)
    SECONDS_PER_PARAM_MAPPED = 1e-10
    # a reader is worth its memory (a byte a weight) where it reads at least this much faster: a read-heavy turn
    # (a RAG answer, a tool call) then comes out about 1.4x faster. At 2.0 it was dropped on the Zen 4 EPYC, whose
    # reads it makes 1.6-1.7x faster (llama.cpp's own 13 ms a token once learned, tuning's 17)
    GAIN = 1.5

    def __init__(self, gguf_path: Path, reader_ms: float, open_seconds: float, cache: Path | None = None,
                 kept_as: str = "gguf") -> None:
        self.gguf_path, self.cache, self.kept_as = gguf_path, cache, kept_as
        self._shared = _Shared(reader_ms, open_seconds)
        self._shared.slots.append(self)
        self.own_ms: float | None = None  # the form's own reads, a token
        self.dropped = False  # not worth its memory for this form: never used here again

    @classmethod
    def for_model(cls, gguf_path: Path, product: float, cache: Path | None = None,
                  kept_as: str = "gguf") -> "ReaderSlot | None":
        """A slot for a GGUF's model priced from this machine's timed product, or None where the reader does not
        compute that model; its weights kept in ``cache`` as ``kept_as`` (then opening costs a read of them, not a
        conversion)."""
        try:
            params, widened = _decoder_matrices(gguf_path)
        except Unsupported:
            return None
        if kept_as == "gguf" and widened and native_widen.buildable():  # the file's own blocks: mapped, nothing made
            opening = params * cls.SECONDS_PER_PARAM_MAPPED
        else:  # int8 rows (where the widening cannot serve this file or machine) or bfloat16: converted once, then kept
            stored = "int8" if kept_as == "gguf" else kept_as
            kept = cache is not None and weights_file(gguf_path, cache, stored).is_file()
            opening = params * (cls.SECONDS_PER_PARAM_KEPT if kept else cls.SECONDS_PER_PARAM)
        return cls(gguf_path, predicted_ms_per_token(params, product), opening, cache, kept_as)

    def for_form(self, own_ms: float | None = None) -> "ReaderSlot":
        """A slot for another form of the same model, whose own reads cost ``own_ms`` a token: the same reader."""
        slot = copy.copy(self)  # the same shared state, a slot of its own
        slot.own_ms, slot.dropped = own_ms, False
        self._shared.slots.append(slot)
        return slot

    @property
    def reader(self) -> PromptReader | None:
        return self._shared.reader if not self.dropped else None

    @reader.setter
    def reader(self, reader: PromptReader | None) -> None:
        self._shared.reader = reader

    @property
    def reader_ms(self) -> float:
        return self._shared.reader_ms

    @reader_ms.setter
    def reader_ms(self, ms: float) -> None:
        self._shared.reader_ms = ms

    @property
    def open_seconds(self) -> float:
        return self._shared.open_seconds if not self.dropped else float("inf")

    @property
    def missed(self) -> float:
        return self._shared.missed

    def learn(self, tokens: int, seconds: float, by_reader: bool) -> None:
        """A read of ``tokens`` took ``seconds``, by the reader or by the form itself."""
        if tokens < self.MIN_TOKENS:
            return
        ms = 1000 * seconds / tokens
        if by_reader and self._shared.fresh:
            self._shared.fresh = False
        elif by_reader:
            self._shared.reader_ms = (1 - self.LEARN_RATE) * self._shared.reader_ms + self.LEARN_RATE * ms
        else:
            self.own_ms = ms if self.own_ms is None else (1 - self.LEARN_RATE) * self.own_ms + self.LEARN_RATE * ms

    def offer(self, tokens: int, seconds: float) -> None:
        """A read of ``tokens`` took ``seconds`` on a form the reader does not serve: what it would have saved
        counts toward opening it."""
        if self._shared.reader is None and tokens >= self.MIN_TOKENS:
            self._shared.missed += max(0.0, seconds - tokens * self.reader_ms / 1000)

    def ready(self) -> bool:
        """Whether reads here go to the reader: it is open, or has paid for its opening and is worth its memory."""
        return self.reader is not None or (not self.dropped and self.missed >= self.open_seconds and self._worth())

    def expected(self) -> bool:
        """Whether long reads here are the reader's or about to be: it is open, or predicted to pay and not dropped.
        The router prices them at its price, so that a long read comes here and pays for the reader's opening
        instead of opening another form of the target (a second copy of the weights) to read it."""
        return self.reader is not None or (self.open_seconds != float("inf") and self.promising())

    def promising(self) -> bool:
        """Predicted (before it opens) to read ``GAIN`` times as fast as the form."""
        return self.own_ms is not None and self.reader_ms * self.GAIN <= self.own_ms

    def _worth(self) -> bool:
        """Before it opens, ``promising``; once open, faster than the form at all."""
        if self._shared.reader is None:
            return self.promising()
        return self.own_ms is not None and self.reader_ms < self.own_ms

    def for_read(self, tokens: int) -> PromptReader | None:
        """The reader, for a read of ``tokens``, where it pays (opened now if the rule says so); else None."""
        if tokens < self.MIN_TOKENS or self.own_ms is None or self.dropped:
            return None
        shared = self._shared
        if not self._worth():  # not worth its memory here (or slower after all): never again for this form
            self.dropped = True
            if all(slot.dropped for slot in shared.slots):  # nor for any other: its memory back
                shared.reader, shared.open_seconds = None, float("inf")
            return None
        if shared.reader is None:
            shared.missed += tokens * (self.own_ms - self.reader_ms) / 1000
            if shared.missed < shared.open_seconds:
                return None
            shared.reader, shared.fresh = PromptReader(self.gguf_path, self.cache, self.kept_as), True
        return shared.reader
