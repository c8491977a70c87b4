"""The int4 target graph on the GGUF's own grid, so that int4 is the model the user downloaded.

A Q4_K_M GGUF stores most matrices as Q4_K: rows in blocks of 32 columns whose weights are ``a * q - b`` (q in
0..15, one scale ``a`` and one minimum ``b`` per block). ONNX Runtime's MatMulNBits computes ``s * (q - z)``
with an integer zero point z, and its fast CPU kernels take only integer zero points, so quantising the
dequantised weights again rounds ``b / a`` to an integer: a second rounding, well off the GGUF's weights.
Here each block keeps the GGUF's own q and a, the zero point is ``round(b / a)``, and the residual
``a * z - b`` of each block is added back by a small product: the block sums of the activations times a
[blocks x N] matrix (8-bit, in blocks of 16), about a fifth of the main product's bytes. Q6_K matrices
(``a * (q - 32)``, blocks of 16) fit MatMulNBits' 8-bit blocks exactly. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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


def grid_of(tensor) -> Grid | None:
    """The grid of a gguf-py ReaderTensor, or None where its type has no exact MatMulNBits form here."""
    kind = int(tensor.tensor_type)
    if kind not in (Q4_K, Q6_K):
        return None
    rows = int(np.prod(tensor.shape[1:]))
    return (q4k_grid if kind == Q4_K else q6k_grid)(tensor.data, rows)


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


# --------------------------------------------------------------------------------------- graph rewrite
# the model builder's projection names -> the GGUF's tensor names (llama.cpp's naming for Llama-like models)
_PROJECTIONS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_LAYER = re.compile(r"layers\.(\d+)/.*?(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/")


def gguf_names(node_name: str, tied: bool) -> list[str] | None:
    """The GGUF tensors a builder MatMulNBits node computes (several for a packed q/k/v or gate/up node)."""
    if "lm_head" in node_name:
        return ["token_embd.weight" if tied else "output.weight"]
    if "qkv_proj" in node_name:
        layer = re.search(r"layers\.(\d+)/", node_name)
        return [f"blk.{layer.group(1)}.attn_{p}.weight" for p in "qkv"] if layer else None
    match = _LAYER.search(node_name)
    return [f"blk.{match.group(1)}.{_PROJECTIONS[match.group(2)]}.weight"] if match else None


def read_gguf_tensors(gguf_file: Path) -> tuple[dict, bool]:
    """The GGUF's tensors by name, and whether its LM head is tied to the embedding (no ``output.weight``)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_file)).tensors}
    return tensors, "output.weight" not in tensors


def _as_8bit_16(grid: Grid) -> Grid:
    """The same weights at 8 bits in blocks of 16 (a 4-bit block of 32 is two blocks of 16 that share its
    scale, zero point and residual)."""
    if (grid.bits, grid.block) == (8, 16):
        return grid
    twice = lambda x: None if x is None else np.repeat(x, grid.block // 16, axis=1)  # noqa: E731
    return Grid(grid.q, twice(grid.scale), twice(grid.zero), 8, 16, twice(grid.residual))


def _concat(grids: list[Grid]) -> Grid | None:
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


def regrid_graph(model_file: Path, gguf_file: Path) -> dict[str, int]:
    """Rewrite a builder int4 graph's MatMulNBits weights on the GGUF's own grids (in place, weights in the
    external data file beside the graph). Returns counts: matrices on the GGUF's grid at 4 and 8 bits, and
    those left as built (a type with no exact MatMulNBits form, or a packed node of mixed types)."""
    import onnx
    from onnx import helper, numpy_helper

    tensors, tied = read_gguf_tensors(gguf_file)
    model = onnx.load(str(model_file))
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    counts = {"4-bit": 0, "8-bit": 0, "as built": 0}
    # (activation, K, block) -> its block sums, shared by the products that read one activation (gate and up)
    block_sums: dict[tuple[str, int, int], str] = {}
    added: list[tuple[int, list]] = []

    def put(name: str, array: np.ndarray) -> None:
        if name in initializers:
            graph.initializer.remove(initializers[name])
        initializers[name] = numpy_helper.from_array(array, name)
        graph.initializer.append(initializers[name])

    for index, node in enumerate(graph.node):
        if node.op_type != "MatMulNBits":
            continue
        names = gguf_names(node.name, tied)
        attrs = {a.name: a for a in node.attribute}
        k, n = attrs["K"].i, attrs["N"].i
        grid = None
        if names and all(name in tensors for name in names):
            grids = [grid_of(tensors[name]) for name in names]
            grid = _concat(grids) if all(g is not None for g in grids) else None
        if grid is None or grid.q.shape != (n, k):
            counts["as built"] += 1
            continue
        counts[f"{grid.bits}-bit"] += 1
        prefix = node.name.replace("/", "_").strip("_")
        while len(node.input) < 4:
            node.input.append("")
        node.input[3] = node.input[3] or f"{prefix}.zero_points"  # a symmetric build has none
        put(node.input[1], pack_weights(grid))
        put(node.input[2], grid.scale.reshape(-1))
        put(node.input[3], pack_zero_points(grid))
        attrs["bits"].i, attrs["block_size"].i = grid.bits, grid.block
        if grid.residual is None:
            continue
        # the residual: block sums of the activations times the [blocks x N] residual matrix
        activation = node.input[0]
        nodes = []
        key = (activation, k, grid.block)
        if key not in block_sums:
            shape, sums = f"{prefix}/fly_block_shape", f"{prefix}/fly_block_sums"
            put(shape, np.array([0, 0, k // grid.block, grid.block], np.int64))
            put(f"{prefix}/fly_sum_axis", np.array([-1], np.int64))
            nodes += [helper.make_node("Reshape", [activation, shape], [f"{sums}_blocks"], name=f"{prefix}/FlyBlocks"),
                      helper.make_node("ReduceSum", [f"{sums}_blocks", f"{prefix}/fly_sum_axis"], [sums],
                                       keepdims=0, name=f"{prefix}/FlyBlockSums")]
            block_sums[key] = sums
        residual = residual_grid(grid.residual)
        for suffix, array in (("B", pack_weights(residual)), ("scales", residual.scale.reshape(-1)),
                              ("zero_points", pack_zero_points(residual))):
            put(f"{prefix}.residual_{suffix}", array)
        output = node.output[0]
        node.output[0] = f"{output}/fly_main"
        nodes += [
            helper.make_node("MatMulNBits", [block_sums[key], f"{prefix}.residual_B",
                                             f"{prefix}.residual_scales", f"{prefix}.residual_zero_points"],
                             [f"{output}/fly_residual"], name=f"{prefix}/FlyResidual", domain="com.microsoft",
                             K=k // grid.block, N=n, bits=8, block_size=residual.block,
                             accuracy_level=attrs["accuracy_level"].i if "accuracy_level" in attrs else 4),
            helper.make_node("Add", [node.output[0], f"{output}/fly_residual"], [output], name=f"{prefix}/FlyAdd"),
        ]
        added.append((index, nodes))
    for index, nodes in reversed(added):  # after each rewritten node, keeping the graph in topological order
        for offset, new in enumerate(nodes, 1):
            graph.node.insert(index + offset, new)
    used = {name for node in graph.node for name in node.input}
    for name in [name for name in initializers if name not in used]:
        graph.initializer.remove(initializers.pop(name))
    data = model_file.with_name(model_file.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(model, str(model_file), save_as_external_data=True, all_tensors_to_one_file=True,
              location=data.name, size_threshold=1024)
    return counts
