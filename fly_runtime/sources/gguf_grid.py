"""A GGUF matrix's own grid as ONNX Runtime's MatMulNBits holds it, so that a graph is the model the user
downloaded, not a second rounding of it (gguf_graph.py writes the graphs).

A Q4_K_M GGUF stores most matrices as Q4_K: rows in blocks of 32 columns whose weights are ``a * q - b`` (q in
0..15, one scale ``a`` and one minimum ``b`` per block). MatMulNBits computes ``s * (q - z)`` with an integer zero
point z, and its fast CPU kernels take only integer zero points, so quantising the dequantised weights again
rounds ``b / a`` to an integer: well off the GGUF's weights. Here each block keeps the GGUF's own q and a, the
zero point is ``round(b / a)``, and the residual ``a * z - b`` of each block is added back by a small product:
the block sums of the activations times a [blocks x N] matrix (8-bit, in blocks of 16), about a fifth of the main
product's bytes. Q6_K (``a * (q - 32)``, blocks of 16), Q8_0 and Q5_0 fit MatMulNBits' 8-bit blocks exactly,
Q4_0 its 4-bit ones; other types are dequantised and rounded. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Q4_K, Q6_K = 12, 14  # ggml type ids
_BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}


@dataclass
class Grid:
    """One matrix as MatMulNBits wants it: ``w[n, k] = scale[n, k // block] * (q[n, k] - zero[n, k // block])
    + residual[n, k // block]`` (residual None where the grid is exact without it)."""

    q: np.ndarray  # uint8 [N, K]
    scale: np.ndarray  # float32 [N, K // block]
    zero: np.ndarray  # uint8 [N, K // block]
    bits: int
    block: int
    residual: np.ndarray | None = None  # float32 [N, K // block]
    own: bool = True  # the file's own grid, not a rounding of its dequantised weights

    def dequantize(self) -> np.ndarray:
        expand = lambda x: np.repeat(x, self.block, axis=1)  # noqa: E731
        w = expand(self.scale) * (self.q.astype(np.float32) - expand(self.zero).astype(np.float32))
        return w + expand(self.residual) if self.residual is not None else w


def _blocks(raw: np.ndarray, kind: int, rows: int) -> np.ndarray:
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])


def q4k_grid(raw: np.ndarray, rows: int) -> Grid:
    """A Q4_K matrix's own grid (blocks of 32): q, scale a = d * sc, zero round(b / a), residual a * zero - b."""
    blk = _blocks(raw, Q4_K, rows)
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, S, 1]
    dmin = blk[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = blk[..., 4:16].astype(np.uint8)  # 12 bytes: eight 6-bit scales and eight 6-bit minimums
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blk[..., 16:144].reshape(rows, -1, 4, 32)  # four chunks of 64 weights: low nibbles, then high
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1)  # [N, K]: chunk, half, 32 weights
    a = (d * sc).reshape(rows, -1)
    b = (dmin * mn).reshape(rows, -1)
    zero = np.clip(np.rint(np.divide(b, a, out=np.zeros_like(b), where=a > 0)), 0, 15).astype(np.uint8)
    return Grid(q.astype(np.uint8), a, zero, bits=4, block=32, residual=a * zero - b)


def q6k_grid(raw: np.ndarray, rows: int) -> Grid:
    """A Q6_K matrix's own grid: 6-bit q, scale d * sc per 16 weights, zero point 32: exact at 8 bits."""
    blk = _blocks(raw, Q6_K, rows)
    ql, qh = blk[..., 0:128], blk[..., 128:192]
    sc = blk[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[..., 208:210].copy().view(np.float16).astype(np.float32)
    halves = []
    for h in range(2):  # each half of a super-block: 64 bytes of low bits, 32 of high bits, 128 weights
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        halves += [(lo[..., 0:32] & 0xF) | ((hi & 3) << 4), (lo[..., 32:64] & 0xF) | (((hi >> 2) & 3) << 4),
                   (lo[..., 0:32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:64] >> 4) | ((hi >> 6) << 4)]
    q = np.stack(halves, axis=2).reshape(rows, -1)
    a = (d * sc).reshape(rows, -1)
    return Grid(q.astype(np.uint8), a, np.full(a.shape, 32, np.uint8), bits=8, block=16)


Q4_0, Q5_0, Q8_0 = 2, 6, 8
_SIMPLE = {Q4_0: (18, 4, 8), Q5_0: (22, 8, 16), Q8_0: (34, 8, 128)}  # block bytes, bits stored at, zero point


def simple_grid(raw: np.ndarray, kind: int, rows: int) -> Grid:
    """A Q4_0 / Q5_0 / Q8_0 matrix's own grid: blocks of 32 weights ``d * (q - zero)``, exact at 4 or 8 bits."""
    size, bits, zero = _SIMPLE[kind]
    blk = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size)
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if kind == Q8_0:
        q = (blk[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        low = blk[..., size - 16:]
        q = np.concatenate([low & 0xF, low >> 4], axis=-1)  # weights 0-15 in low nibbles, 16-31 in high
        if kind == Q5_0:
            high = blk[..., 2:6].copy().view(np.uint32)  # the fifth bits, one a weight
            q = q | (((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    return Grid(q.reshape(rows, -1).astype(np.uint8), d, np.full(d.shape, zero, np.uint8), bits=bits, block=32)


def grid_of(tensor) -> Grid | None:
    """The grid of a gguf-py ReaderTensor, or None where its type has no exact MatMulNBits form here."""
    kind = int(tensor.tensor_type)
    rows = int(np.prod(tensor.shape[1:]))
    if kind in _SIMPLE:
        return simple_grid(tensor.data, kind, rows)
    if kind not in (Q4_K, Q6_K):
        return None
    return (q4k_grid if kind == Q4_K else q6k_grid)(tensor.data, rows)


def quantize(w: np.ndarray, bits: int, block: int = 32) -> Grid:
    """Round a float matrix [N, K] (K a multiple of ``block``) to an asymmetric grid: per block, the span from its
    minimum to its maximum (each taken to include zero) in 2**bits - 1 steps."""
    n, k = w.shape
    b = w.reshape(n, k // block, block)
    top = 2 ** bits - 1
    lo, hi = np.minimum(b.min(axis=2), 0), np.maximum(b.max(axis=2), 0)
    scale = ((hi - lo) / top).astype(np.float32)
    scale[scale == 0] = 1.0
    zero = np.clip(np.rint(-lo / scale), 0, top)
    q = np.clip(np.rint(b / scale[..., None]) + zero[..., None], 0, top)
    return Grid(q.astype(np.uint8).reshape(n, k), scale, zero.astype(np.uint8), bits=bits, block=block, own=False)


def matrix_grid(tensor, bits: int) -> Grid:
    """What a graph of ``bits``-bit weights stores for one GGUF matrix: its own grid where MatMulNBits holds it
    exactly (a 4-bit grid at 4 bits, the 5- to 8-bit ones at 8: Q4_K_M's Q6_K matrices are the sensitive ones),
    otherwise the dequantised matrix rounded to ``bits`` (an int4 drafter from a Q5_0 / Q8_0 file)."""
    kind = int(tensor.tensor_type)
    own_bits = 8 if kind in (Q6_K, Q5_0, Q8_0) else 4 if kind in (Q4_K, Q4_0) else None
    if own_bits is not None and (own_bits <= bits or kind == Q6_K):  # decoded only where it is kept
        grid = grid_of(tensor)
        return _widened(grid) if grid.bits < bits else grid
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind, raw = GGMLQuantizationType(int(tensor.tensor_type)), tensor.data
    raw = raw.reshape(int(np.prod(tensor.shape[1:])), -1)
    # a few thousand rows at a time: a float32 copy of a whole embedding would be most of a build's memory
    parts = [quantize(dequantize(raw[i:i + 8192], kind).astype(np.float32), bits) for i in range(0, len(raw), 8192)]
    return Grid(*(np.concatenate([getattr(g, f) for g in parts]) for f in ("q", "scale", "zero")), bits=bits,
                block=parts[0].block, own=False)


def _widened(grid: Grid) -> Grid:
    """A 4-bit grid stored at 8 bits: the same codes, scales, zero points and residual."""
    return Grid(grid.q, grid.scale, grid.zero, 8, grid.block, grid.residual, grid.own)


# ------------------------------------------------------------------------------------ MatMulNBits tensors
def pack_weights(grid: Grid) -> np.ndarray:
    """MatMulNBits' B: uint8 [N, K / block, block * bits / 8], two 4-bit values a byte low nibble first."""
    n, k = grid.q.shape
    q = grid.q.reshape(n, k // grid.block, grid.block)
    if grid.bits == 8:
        return np.ascontiguousarray(q)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_zero_points(grid: Grid) -> np.ndarray:
    """MatMulNBits' zero points, flat: one byte each at 8 bits, two a byte (low nibble first) at 4 bits, each
    row padded to whole bytes."""
    z = grid.zero
    if grid.bits == 8:
        return z.reshape(-1)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def residual_grid(residual: np.ndarray, block: int = 16) -> Grid:
    """The residual matrix [N, B] as an 8-bit symmetric grid over blocks of ``block`` (padded with zeros)."""
    n, width = residual.shape
    padded = -(-width // block) * block
    r = np.zeros((n, padded), np.float32)
    r[:, :width] = residual
    blocks = r.reshape(n, -1, block)
    scale = np.abs(blocks).max(axis=2) / 127.0
    q = np.rint(np.divide(blocks, scale[..., None], out=np.zeros_like(blocks), where=scale[..., None] > 0))
    return Grid((q + 128).astype(np.uint8).reshape(n, padded), scale.astype(np.float32),
                np.full(scale.shape, 128, np.uint8), bits=8, block=block)


# ------------------------------------------------------------------------------------- stacking grids
def _as_8bit_16(grid: Grid) -> Grid:
    """The same weights at 8 bits in blocks of 16 (a 4-bit block of 32 is two blocks of 16 that share its
    scale, zero point and residual)."""
    if (grid.bits, grid.block) == (8, 16):
        return grid
    twice = lambda x: None if x is None else np.repeat(x, grid.block // 16, axis=1)  # noqa: E731
    return Grid(grid.q, twice(grid.scale), twice(grid.zero), 8, 16, twice(grid.residual), grid.own)


def stack(grids: list[Grid]) -> Grid | None:
    """Grids stacked along N (a packed q/k/v node). Where their types differ (Q4_K_M keeps v at Q6_K in some
    layers) all go to 8 bits in blocks of 16, which holds both exactly: a few percent more bytes there."""
    first = grids[0]
    if any(g.q.shape[1] != first.q.shape[1] for g in grids):
        return None
    if any((g.bits, g.block) != (first.bits, first.block) for g in grids):
        grids = [_as_8bit_16(g) for g in grids]
        first = grids[0]
    residuals = [g.residual for g in grids]
    residual = None if all(r is None for r in residuals) else np.concatenate(
        [r if r is not None else np.zeros_like(g.scale) for r, g in zip(residuals, grids)])
    return Grid(np.concatenate([g.q for g in grids]), np.concatenate([g.scale for g in grids]),
                np.concatenate([g.zero for g in grids]), first.bits, first.block, residual)
