"""An ONNX Runtime graph written straight from a GGUF, one tensor at a time, at 4 or 8 bits.

Why not the model builder: it starts from float32 weights (four bytes a parameter, peak memory several times
the model) and rounds them again. Here each matrix keeps the GGUF's own grid where MatMulNBits holds it
(gguf_grid.py), is written to the weights file as soon as it is read, and the memory a build needs is the
largest tensor's, not the model's. The graph is the one the builder makes for a Llama-like decoder (fused
GroupQueryAttention with rotary inside, skip RMS norms, MatMulNBits projections, a block-quantised embedding
gather) with fly's ``logits_to_keep``; families the GGUF layout here does not cover raise ``Unsupported`` and
take the builder's way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fly_runtime.sources.gguf_grid import Grid, matrix_grid, pack_weights, pack_zero_points, residual_grid, stack

# the graph's metadata key for its layout: also how a reader knows the graph is fly's (GroupQueryAttention)
LAYOUT_METADATA = "fly.layout"

# how each family's GGUF lays out rotary pairs: llama.cpp's converter permutes a Llama's q/k rows so that pairs
# are adjacent (interleaved); Qwen2 keeps the halves apart (NeoX style)
_INTERLEAVED = {"llama": True, "qwen2": False}
DATA_FILE = "model.onnx.data"
_ALIGN = 4096  # page-aligned weights, so ONNX Runtime can map them


class Unsupported(Exception):
    """This GGUF's family or a feature of it (partial or scaled rotary, per-head norms) is not built here."""


@dataclass(frozen=True)
class Layout:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_base: float
    eps: float

    @property
    def interleaved(self) -> bool:
        return _INTERLEAVED[self.arch]


def read_layout(fields: dict, tensors: dict) -> Layout:
    """The decoder's shape from the GGUF's metadata; ``Unsupported`` for what this writer does not build."""
    arch = fields["general.architecture"].contents()
    if arch not in _INTERLEAVED:
        raise Unsupported(f"architecture {arch!r}")

    def get(key: str, default=None):
        field = fields.get(f"{arch}.{key}")
        if field is None and default is None:
            raise Unsupported(f"no {arch}.{key} in the metadata")
        return default if field is None else field.contents()

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim or get("rope.scaling.type", "none") != "none":
        raise Unsupported("partial or scaled rotary embeddings")
    if "rope_freqs.weight" in tensors or any(n.endswith(("attn_q_norm.weight", "attn_k_norm.weight")) for n in tensors):
        raise Unsupported("per-head norms or rotary frequency factors")
    return Layout(arch, int(get("block_count")), hidden, heads, int(get("attention.head_count_kv", heads)), head_dim,
                  int(get("context_length")), float(get("rope.freq_base", 10000.0)),
                  float(get("attention.layer_norm_rms_epsilon")))


class _Weights:
    """The external weights file, written as tensors arrive; small tensors stay inside the graph."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")
        self.initializers: list = []

    def put(self, name: str, array: np.ndarray) -> str:
        from onnx import TensorProto, helper, numpy_helper

        array = np.ascontiguousarray(array)
        if array.nbytes < 1024:
            self.initializers.append(numpy_helper.from_array(array, name))
            return name
        offset = -(-self._file.tell() // _ALIGN) * _ALIGN
        self._file.seek(offset)
        array.tofile(self._file)  # no copy of a large matrix
        tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                             data_location=TensorProto.EXTERNAL)
        for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def close(self) -> None:
        self._file.close()


class _Graph:
    """Nodes in topological order, named as the model builder names them."""

    def __init__(self, weights: _Weights) -> None:
        self.nodes: list = []
        self.weights = weights
        self._block_sums: dict[tuple[str, int], str] = {}

    def op(self, kind: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str | None = None,
           **attrs) -> list[str]:
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, name=name, domain=domain, **attrs))
        return names

    def matmul(self, x: str, grid: Grid, name: str) -> str:
        """``x @ W.T`` for a matrix on ``grid``; a grid with a residual adds its block sums' product."""
        n, k = grid.q.shape
        w = self.weights
        inputs = [x, w.put(f"{name}.B", pack_weights(grid)), w.put(f"{name}.scales", grid.scale.reshape(-1)),
                  w.put(f"{name}.zero_points", pack_zero_points(grid))]
        (main,) = self.op("MatMulNBits", inputs, name, domain="com.microsoft", K=k, N=n, bits=grid.bits,
                          block_size=grid.block, accuracy_level=4)
        if grid.residual is None:
            return main
        residual = residual_grid(grid.residual)
        inputs = [self.block_sums(x, k, grid.block), w.put(f"{name}.residual.B", pack_weights(residual)),
                  w.put(f"{name}.residual.scales", residual.scale.reshape(-1)),
                  w.put(f"{name}.residual.zero_points", pack_zero_points(residual))]
        (extra,) = self.op("MatMulNBits", inputs, f"{name}/Residual", domain="com.microsoft", K=k // grid.block, N=n,
                           bits=8, block_size=residual.block, accuracy_level=4)
        return self.op("Add", [main, extra], f"{name}/AddResidual")[0]

    def block_sums(self, x: str, k: int, block: int) -> str:
        """The sums of ``x`` over each block of ``block`` columns (shared by the products that read ``x``)."""
        if (x, block) not in self._block_sums:
            name = f"{x}/block_sums_{block}"
            shape = self.weights.put(f"{name}.shape", np.array([0, 0, k // block, block], np.int64))
            axis = self.weights.put(f"{name}.axis", np.array([-1], np.int64))
            (blocks,) = self.op("Reshape", [x, shape], f"{name}/Reshape")
            self._block_sums[(x, block)] = self.op("ReduceSum", [blocks, axis], f"{name}/ReduceSum", keepdims=0)[0]
        return self._block_sums[(x, block)]

    def embedding(self, ids: str, grid: Grid) -> str:
        """Rows of the embedding, dequantised as they are gathered (the table stays at its grid's bits)."""
        w = self.weights
        vocab, hidden = grid.q.shape
        inputs = [w.put("embed.data", pack_weights(grid).reshape(vocab, -1)), ids, w.put("embed.scales", grid.scale),
                  w.put("embed.zero_points", pack_zero_points(grid).reshape(vocab, -1))]
        (rows,) = self.op("GatherBlockQuantized", inputs, "/model/embed_tokens/GatherBlockQuantized",
                          domain="com.microsoft", bits=grid.bits, block_size=grid.block, gather_axis=0,
                          quantize_axis=1)
        if grid.residual is None:
            return rows
        (extra,) = self.op("Gather", [w.put("embed.residual", grid.residual), ids], "/model/embed_tokens/Residual")
        blocks = w.put("embed.blocks", np.array([0, 0, hidden // grid.block, grid.block], np.int64))
        last = w.put("embed.last", np.array([-1], np.int64))
        flat = w.put("embed.flat", np.array([0, 0, hidden], np.int64))
        (shaped,) = self.op("Reshape", [rows, blocks], "/model/embed_tokens/Blocks")
        (column,) = self.op("Unsqueeze", [extra, last], "/model/embed_tokens/ResidualColumn")
        (added,) = self.op("Add", [shaped, column], "/model/embed_tokens/AddResidual")
        return self.op("Reshape", [added, flat], "/model/embed_tokens/Rows")[0]


def build_from_gguf(gguf, out_dir: Path, bits: int, config_file: Path, say=None) -> dict[str, int]:
    """Write ``model.onnx`` and its weights into ``out_dir`` (which must exist) for ``gguf`` (a path, or a gguf-py
    reader of one) at ``bits`` (4 or 8), with ``config_file`` beside it. Returns how many matrices kept the GGUF's
    grid and how many were rounded. ``Unsupported`` before anything is written where the family is not built
    here."""
    from gguf import GGUFReader

    reader = gguf if isinstance(gguf, GGUFReader) else GGUFReader(str(gguf))
    tensors = {t.name: t for t in reader.tensors}
    layout = read_layout(reader.fields, tensors)
    start = time.perf_counter()
    weights = _Weights(out_dir / DATA_FILE)
    graph = _Graph(weights)
    counts = {"own grid": 0, "rounded": 0}

    def grid(*names: str) -> Grid:
        """The matrices ``names`` at ``bits``, stacked along N, each counted as kept on its grid or rounded."""
        grids = [matrix_grid(tensors[n], bits) for n in names]
        counts["own grid"] += sum(g.own for g in grids)
        counts["rounded"] += sum(not g.own for g in grids)
        if len(grids) == 1:
            return grids[0]
        stacked = stack(grids)
        if stacked is None:
            raise Unsupported(f"{names} do not share a width")
        return stacked

    try:
        _decoder(graph, layout, tensors, grid, say)
        _save(graph, weights, layout, out_dir, int(tensors["token_embd.weight"].shape[-1]))
    finally:
        weights.close()
    (out_dir / "config.json").write_text(config_file.read_text())
    if say:
        say(f"wrote the {bits}-bit graph in {time.perf_counter() - start:.0f} s: {counts['own grid']} matrices on "
            f"the file's own grid, {counts['rounded']} rounded to {bits} bits")
    return counts


def _decoder(graph: _Graph, layout: Layout, tensors: dict, grid, say) -> None:
    w = graph.weights
    one = w.put("one", np.array([1], np.int64))
    (lengths,) = graph.op("ReduceSum", ["attention_mask", one], "/model/attn_mask/ReduceSum", keepdims=0)
    (lengths,) = graph.op("Sub", [lengths, one], "/model/attn_mask/Sub")
    (seqlens,) = graph.op("Cast", [lengths], "/model/attn_mask/SeqLens", to=6)
    (shape,) = graph.op("Shape", ["attention_mask"], "/model/attn_mask/Shape")
    (total,) = graph.op("Gather", [shape, w.put("axis_one", np.array(1, np.int64))], "/model/attn_mask/Gather", axis=0)
    (total,) = graph.op("Cast", [total], "/model/attn_mask/Total", to=6)
    inv_freq = layout.rope_base ** (-np.arange(0, layout.head_dim, 2, dtype=np.float64) / layout.head_dim)
    angles = np.outer(np.arange(layout.context, dtype=np.float64), inv_freq)
    cos, sin = w.put("cos_cache", np.cos(angles).astype(np.float32)), w.put("sin_cache", np.sin(angles).astype(np.float32))

    hidden = graph.embedding("input_ids", grid("token_embd.weight"))
    residual = None
    for i in range(layout.layers):
        blk = lambda name: f"blk.{i}.{name}"  # noqa: E731
        prefix = f"/model/layers.{i}"
        norm = w.put(f"{prefix}.attn_norm", np.asarray(tensors[blk("attn_norm.weight")].data, np.float32))
        if residual is None:
            (x,) = graph.op("SimplifiedLayerNormalization", [hidden, norm], f"{prefix}/input_layernorm",
                            epsilon=layout.eps, axis=-1, stash_type=1)
            residual = hidden
        else:
            x, _, _, residual = graph.op("SkipSimplifiedLayerNormalization", [residual, hidden, norm],
                                         f"{prefix}/input_layernorm", outputs=4, epsilon=layout.eps,
                                         domain="com.microsoft")
        qkv = graph.matmul(x, grid(blk("attn_q.weight"), blk("attn_k.weight"), blk("attn_v.weight")),
                           f"{prefix}/attn/qkv_proj")
        biases = [tensors.get(blk(f"attn_{p}.bias")) for p in "qkv"]
        if all(b is not None for b in biases):
            bias = w.put(f"{prefix}.qkv_bias", np.concatenate([np.asarray(b.data, np.float32) for b in biases]))
            (qkv,) = graph.op("Add", [qkv, bias], f"{prefix}/attn/qkv_proj/Add")
        name = f"{prefix}/attn/GroupQueryAttention"
        attn, _, _ = graph.op(
            "GroupQueryAttention", [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens,
                                    total, cos, sin], name, outputs=[f"{name}/output_0", f"present.{i}.key",
                                                                     f"present.{i}.value"],
            domain="com.microsoft", num_heads=layout.heads, kv_num_heads=layout.kv_heads,
            scale=float(layout.head_dim ** -0.5), do_rotary=1, rotary_interleaved=int(layout.interleaved))
        out = graph.matmul(attn, grid(blk("attn_output.weight")), f"{prefix}/attn/o_proj")
        norm = w.put(f"{prefix}.ffn_norm", np.asarray(tensors[blk("ffn_norm.weight")].data, np.float32))
        x, _, _, residual = graph.op("SkipSimplifiedLayerNormalization", [residual, out, norm],
                                     f"{prefix}/post_attention_layernorm", outputs=4, epsilon=layout.eps,
                                     domain="com.microsoft")
        gate = graph.matmul(x, grid(blk("ffn_gate.weight")), f"{prefix}/mlp/gate_proj")
        up = graph.matmul(x, grid(blk("ffn_up.weight")), f"{prefix}/mlp/up_proj")
        (sig,) = graph.op("Sigmoid", [gate], f"{prefix}/mlp/act_fn/Sigmoid")
        (act,) = graph.op("Mul", [gate, sig], f"{prefix}/mlp/act_fn/Mul")
        (act,) = graph.op("Mul", [act, up], f"{prefix}/mlp/Mul")
        hidden = graph.matmul(act, grid(blk("ffn_down.weight")), f"{prefix}/mlp/down_proj")
        if say and (i + 1) % 8 == 0:
            say(f"  layer {i + 1} of {layout.layers}")
    norm = w.put("/model/final_norm", np.asarray(tensors["output_norm.weight"].data, np.float32))
    final, _, _, _ = graph.op("SkipSimplifiedLayerNormalization", [residual, hidden, norm], "/model/final_norm",
                              outputs=4, epsilon=layout.eps, domain="com.microsoft")
    # the LM head runs on the last ``logits_to_keep`` positions only (a prefill needs one)
    (starts,) = graph.op("Neg", ["logits_to_keep"], "/fly/KeepStarts")
    kept = graph.op("Slice", [final, starts, w.put("keep_ends", np.array([2**62], np.int64)), one],
                    "/fly/KeepLastPositions")[0]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    graph.matmul(kept, grid(head), "/lm_head")
    graph.nodes[-1].output[0] = "logits"  # the head's last node (its product, or the residual's sum)


def _save(graph: _Graph, weights: _Weights, layout: Layout, out_dir: Path, vocab: int) -> None:
    import onnx
    from onnx import TensorProto, helper

    def value(name: str, kind: int, dims: list) -> object:
        return helper.make_tensor_value_info(name, kind, dims)

    cache = ["batch_size", layout.kv_heads, "past_sequence_length", layout.head_dim]
    present = ["batch_size", layout.kv_heads, "total_sequence_length", layout.head_dim]
    inputs = [value("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              value("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
              value("logits_to_keep", TensorProto.INT64, [1])]
    outputs = [value("logits", TensorProto.FLOAT, ["batch_size", "logits_to_keep", vocab])]
    for i in range(layout.layers):
        inputs += [value(f"past_key_values.{i}.{kv}", TensorProto.FLOAT, cache) for kv in ("key", "value")]
        outputs += [value(f"present.{i}.{kv}", TensorProto.FLOAT, present) for kv in ("key", "value")]
    model = helper.make_model(helper.make_graph(graph.nodes, "fly-gguf", inputs, outputs, weights.initializers),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              producer_name="fly", ir_version=10)
    model.metadata_props.append(onnx.StringStringEntryProto(key=LAYOUT_METADATA, value=json.dumps(layout.__dict__)))
    onnx.save(model, str(out_dir / "model.onnx"))
