"""Graphs on the GGUF's own grid: Q4_K / Q6_K / Q4_0 / Q5_0 / Q8_0 blocks read as gguf-py reads them, and whole
graphs written from tiny random Qwen2 and Llama decoders saved as real GGUFs here (no model needed)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fly_runtime.sources.gguf_grid import Q4_K, Q6_K, q4k_grid, q6k_grid, quantize, simple_grid

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


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0"])
def test_simple_grids_are_the_gguf_weights(name):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[name]
    raw = quantize(rng.standard_normal((6, 256)).astype(np.float32) * 0.02, kind)
    grid = simple_grid(raw, int(kind), 6)
    np.testing.assert_array_equal(grid.dequantize(), gguf_dequantize(raw, int(kind)))
    assert grid.own and grid.bits == (4 if name == "Q4_0" else 8)


def test_rounding_to_a_grid_stays_within_half_a_step():
    w = rng.standard_normal((8, 128)).astype(np.float32)
    for bits in (4, 8):
        grid = quantize(w, bits)
        step = np.repeat(grid.scale, 32, axis=1)
        assert not grid.own and np.all(np.abs(grid.dequantize() - w) <= step / 2 + 1e-6)
def write_gguf(path: Path, tensors: dict[str, tuple[int, np.ndarray]]) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_decoder_gguf(tmp_path: Path, arch: str):
    """A tiny random decoder written as a real GGUF (Q4_K and Q6_K projections as Q4_K_M mixes them, a Q6_K
    embedding, F32 norms and biases), and the same weights as a Hugging Face folder."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.unit.test_onnx_build import tiny_tokenizer

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=True)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if arch == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**shape, attention_bias=False))).eval()
    heads, kv_heads, head_dim = 4, 2, 64
    writer = GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    for key, value in (("block_count", 2), ("context_length", 512), ("embedding_length", 256),
                       ("feed_forward_length", 768), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)

    def permuted(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's converter's q/k row order for a Llama
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)

    def unpermuted(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    def put(name: str, param: torch.nn.Parameter, kind: int | None, heads_of: int = 0) -> None:
        if kind is None:  # F32
            writer.add_tensor(name, param.detach().numpy().astype(np.float32))
            return
        raw = random_blocks(kind, *param.shape)
        w = gguf_dequantize(raw, kind)
        with torch.no_grad():
            param.copy_(torch.from_numpy(unpermuted(w, heads_of) if heads_of and arch == "llama" else w))
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(kind))

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    put("token_embd.weight", model.model.embed_tokens.weight, Q6_K)
    put("output_norm.weight", model.model.norm.weight, None)
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, None)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, None)
        put(f"blk.{i}.attn_q.weight", a.q_proj.weight, Q4_K, heads)
        put(f"blk.{i}.attn_k.weight", a.k_proj.weight, Q4_K, kv_heads)
        put(f"blk.{i}.attn_v.weight", a.v_proj.weight, Q6_K if i == 0 else Q4_K)
        put(f"blk.{i}.attn_output.weight", a.o_proj.weight, Q4_K)
        for proj, kind in (("gate", Q4_K), ("up", Q4_K), ("down", Q6_K)):
            put(f"blk.{i}.ffn_{proj}.weight", getattr(m, f"{proj}_proj").weight, kind)
        if arch == "qwen2":
            for proj in "qkv":
                with torch.no_grad():
                    getattr(a, f"{proj}_proj").bias.normal_(0, 0.05)
                put(f"blk.{i}.attn_{proj}.bias", getattr(a, f"{proj}_proj").bias, None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    tiny_tokenizer().save_pretrained(hf_dir)
    return tmp_path / f"{arch}.gguf", hf_dir


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_graph_written_from_a_gguf_computes_its_model(tmp_path, arch):
    """The graph written from a GGUF's tensors computes the model the GGUF holds (the same weights in PyTorch at
    float32) through prefill, verification passes, crops and kept logits, at 4 and at 8 bits, with every matrix
    on the file's own grid; a Llama's rotary pairs come out right from llama.cpp's permuted rows."""
    from fly_runtime.backends.base import CachedSequence
    from fly_runtime.backends.ort_backend import OrtBackend
    from fly_runtime.backends.torch_backend import TorchBackend
    from fly_runtime.sources.gguf_graph import build_from_gguf
    from tests.unit.test_onnx_build import run_script

    gguf_file, hf_dir = tiny_decoder_gguf(tmp_path, arch)
    want = run_script(CachedSequence(TorchBackend(hf_dir, device="cpu", dtype=torch.float32)))
    for bits in (4, 8):
        out = tmp_path / f"int{bits}"
        out.mkdir()
        counts = build_from_gguf(gguf_file, out, bits, hf_dir / "config.json")
        assert counts == {"own grid": 2 * 7 + 2, "rounded": 0}  # the projections, the embedding and the (tied) head
        got = run_script(CachedSequence(OrtBackend(out)))
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            # int8 activations and the residual's 8-bit blocks: a few percent of the logits' spread
            assert float((g - w).norm() / w.norm()) < 0.03
            assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.8


def test_a_family_not_written_here_is_refused_before_anything_is_written(tmp_path):
    from gguf import GGUFWriter

    from fly_runtime.sources.convert import gguf_buildable, gguf_graph
    from fly_runtime.sources.gguf_graph import Unsupported, build_from_gguf

    writer = GGUFWriter(str(tmp_path / "m.gguf"), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not gguf_buildable(tmp_path / "m.gguf", tmp_path)
    import json  # the answer is kept beside the tokenizer: the file is not parsed again for it
    assert json.loads((tmp_path / "gguf_layout.json").read_text())["unsupported"] == "architecture 'gemma2'"
    assert not gguf_graph(tmp_path / "m.gguf", tmp_path / "g", "int4", tmp_path / "config.json")
    assert not (tmp_path / "g").exists()
    with pytest.raises(Unsupported, match="gemma2"):
        build_from_gguf(tmp_path / "m.gguf", tmp_path, 4, tmp_path / "config.json")


def test_a_graph_written_from_a_gguf_takes_the_prompt_readers_keys_and_values(tmp_path):
    """The prompt reader reads a graph's prompts too (its keys after rotary and its values into the graph's cache,
    where GroupQueryAttention reads them): the logits after a read by the reader are the graph's own after its own
    read, within the two computations' rounding (bfloat16 against int8 activations), from an empty cache and after a
    cached prefix the graph read itself; a pass whose every logit is wanted reads nothing ahead."""
    from fly_runtime.backends.bf16_reader import ReaderSlot
    from fly_runtime.backends.ort_backend import OrtBackend
    from fly_runtime.sources.gguf_graph import build_from_gguf

    gguf_file, hf_dir = tiny_decoder_gguf(tmp_path, "qwen2")
    out = tmp_path / "int8"
    out.mkdir()
    build_from_gguf(gguf_file, out, 8, hf_dir / "config.json")
    ids = [(7 * i + 3) % 512 for i in range(120)]

    def run(graph: OrtBackend) -> list[torch.Tensor]:
        first = graph.forward(ids[:60], keep=1)
        after = graph.forward(ids[60:64])  # a verification pass on the read prompt
        graph.crop(20)  # back into the prompt, then a read on top of the cached prefix
        return [first, after, graph.forward(ids[20:100], keep=1), graph.forward(ids[100:103])]

    itself = OrtBackend(out)
    own = run(itself)
    graph = OrtBackend(out)
    slot = ReaderSlot(gguf_file, reader_ms=1.0, open_seconds=0.0)
    slot.own_ms = 100.0  # the graph's own reads priced far above the reader's: it opens on the first read
    graph.reader = slot
    read = run(graph)
    assert slot.reader is not None and graph._length == 103
    # the cache holds what the graph's own passes would have put there (keys after rotary, values)
    for k, v in graph._layers:
        for i in (k, v):
            mine, theirs = graph._cache[i][0, :, :99], itself._cache[i][0, :, :99]
            assert np.abs(mine - theirs).mean() / np.abs(theirs).mean() < 0.02
    for got, want in zip(read, own):  # 1-1.5% apart; with the reader's keys left out 3.5-4.5%
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 0.025
        assert bool((got.argmax(-1) == want.argmax(-1)).all())
    before = slot.reader_ms
    graph.forward(ids[103:110])  # every logit wanted: nothing for the reader
    assert graph._length == 110 and slot.reader_ms == before
