"""The int4 graph on the GGUF's own grid: Q4_K / Q6_K blocks read as gguf-py reads them, MatMulNBits weights
that compute the GGUF's matrix (not a second rounding of it), and a builder graph rewritten end to end on a
tiny random Qwen2 written as a real GGUF here (no model needed)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fly_runtime.sources.gguf_grid import Q4_K, Q6_K, q4k_grid, q6k_grid, regrid_graph

rng = np.random.default_rng(0)


def random_blocks(kind: int, rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a ``rows x cols`` matrix of valid K-quant blocks: random codes, with scales and minimums
    that give weights of a trained model's size and about zero mean (a random net stays well-conditioned)."""
    count = rows * cols // 256
    if kind == Q4_K:
        blocks = rng.integers(0, 256, (count, 144), dtype=np.uint8)
        d = rng.uniform(1e-4, 2e-4, count).astype(np.float16)
        blocks[:, 0:2] = d[:, None].view(np.uint8)
        blocks[:, 2:4] = (d * 8).astype(np.float16)[:, None].view(np.uint8)  # dmin
        sc = rng.integers(1, 64, (count, 8))
        mn = np.clip(np.rint(sc * 7.5 / 8), 0, 63).astype(np.int64)  # minimum ~ the middle of the codes
        packed = np.zeros((count, 12), np.int64)
        packed[:, 0:4], packed[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
        blocks[:, 4:16] = packed.astype(np.uint8)
    else:
        blocks = rng.integers(0, 256, (count, 210), dtype=np.uint8)
        blocks[:, 192:208] = rng.integers(-8, 9, (count, 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = rng.uniform(1e-4, 2e-4, (count, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_dequantize(raw: np.ndarray, kind: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType(kind)).astype(np.float32)


@pytest.mark.parametrize("kind,read", [(Q4_K, q4k_grid), (Q6_K, q6k_grid)])
def test_grids_are_the_gguf_weights(kind, read):
    raw = random_blocks(kind, 6, 512)
    grid = read(raw, 6)
    want = gguf_dequantize(raw, kind)
    assert grid.q.shape == (6, 512) and grid.q.max() < (16 if kind == Q4_K else 64)
    np.testing.assert_allclose(grid.dequantize(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    if kind == Q4_K:  # the integer zero point alone is the second rounding the residual undoes
        rounded = grid.dequantize() - np.repeat(grid.residual, 32, axis=1)
        assert np.sqrt(np.mean((rounded - want) ** 2)) > 0.02 * np.sqrt(np.mean(want ** 2))


def write_gguf(path: Path, tensors: dict[str, tuple[int, np.ndarray]]) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def one_matmul_graph(path: Path, name: str, k: int, n: int, accuracy_level: int) -> None:
    """A graph of one MatMulNBits node as the model builder names it, with placeholder 4-bit weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    blocks = k // 32
    inits = [numpy_helper.from_array(np.zeros((n, blocks, 16), np.uint8), "w.B"),
             numpy_helper.from_array(np.ones(n * blocks, np.float32), "w.scales")]
    node = helper.make_node("MatMulNBits", ["x", "w.B", "w.scales"], ["y"], name=name, domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=32, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "s", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_rewritten_node_computes_the_gguf_matrix(tmp_path, kind):
    import onnxruntime as ort

    k, n = 512, 48
    raw = random_blocks(kind, n, k)
    write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_gate.weight": (kind, raw)})
    graph = tmp_path / "model.onnx"
    one_matmul_graph(graph, "/model/layers.0/mlp/gate_proj/MatMul", k, n, accuracy_level=0)
    counts = regrid_graph(graph, tmp_path / "m.gguf")
    assert counts == {"4-bit": int(kind == Q4_K), "8-bit": int(kind == Q6_K), "as built": 0}
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    got = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ gguf_dequantize(raw, kind).T
    # float activations: the GGUF's product up to float rounding and the residual's 8-bit blocks
    assert np.abs(got - want).max() < 2e-3 * np.abs(want).max()


def test_a_builder_int4_graph_takes_the_gguf_grid(tmp_path):
    """A tiny Qwen2 whose weights are a GGUF's (Q4_K projections, Q6_K tied embedding), built by the model
    builder at int4 and rewritten: its logits follow the fp32 model far closer than the builder's own
    re-quantisation does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fly_runtime.backends.base import CachedSequence
    from fly_runtime.backends.ort_backend import OrtBackend
    from fly_runtime.backends.torch_backend import TorchBackend
    from fly_runtime.sources.convert import hf_to_onnx
    from tests.unit.test_onnx_build import run_script, tiny_tokenizer

    torch.manual_seed(0)
    # an intermediate size equal to the vocabulary confuses the model builder: keep them apart
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    tensors = {"token_embd.weight": (Q6_K, random_blocks(Q6_K, 512, 256))}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(gguf_dequantize(tensors["token_embd.weight"][1], Q6_K)))
        for i, layer in enumerate(model.model.layers):
            for hf, gg in names.items():
                linear = getattr(layer.self_attn if hf.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp, hf)
                kind = Q6_K if hf == "v_proj" and i == 0 else Q4_K  # as Q4_K_M mixes them
                raw = random_blocks(kind, *linear.weight.shape)
                tensors[f"blk.{i}.{gg}.weight"] = (kind, raw)
                linear.weight.copy_(torch.from_numpy(gguf_dequantize(raw, kind)))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    tiny_tokenizer().save_pretrained(hf_dir)
    write_gguf(tmp_path / "tiny.gguf", tensors)

    regridded = hf_to_onnx(hf_dir, tmp_path / "int4-grid", int4=True, gguf=tmp_path / "tiny.gguf")
    plain = hf_to_onnx(hf_dir, tmp_path / "int4", int4=True)
    want = run_script(CachedSequence(TorchBackend(hf_dir, device="cpu", dtype=torch.float32)))
    errors = {}
    for name, folder in (("grid", regridded), ("requantised", plain)):
        got = run_script(CachedSequence(OrtBackend(folder)))
        errors[name] = max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))
    assert errors["grid"] < errors["requantised"] / 3, errors
