"""Building ONNX Runtime graphs from a Hugging Face folder, on a tiny random Qwen2 made here (seconds, no cache).

The built graph must compute what the PyTorch model computes through prefill, multi-token verification,
cache crops and ``logits_to_keep``; a broken folder must fail with a clear error and leave no cache entry.
"""

from pathlib import Path

import pytest
import torch

from fly_runtime.backends.base import CachedSequence
from fly_runtime.backends.ort_backend import OrtBackend
from fly_runtime.backends.torch_backend import TorchBackend
from fly_runtime.errors import ModelIntegrityError
from fly_runtime.sources.convert import hf_to_onnx

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)  # the builder copies the tokenizer beside the graph
    return folder


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<unk>")


@pytest.fixture(scope="module")
def tiny_fp32(tiny_hf_dir, tmp_path_factory) -> Path:
    return hf_to_onnx(tiny_hf_dir, tmp_path_factory.mktemp("onnx") / "tiny-fp32", int4=False)


def run_script(sequence: CachedSequence) -> list[torch.Tensor]:
    """Prefill, a 5-token verification pass, a crop back into it, then single steps."""
    ids = [(7 * i + 3) % VOCAB for i in range(40)]
    out = [sequence.extend(ids[:30], keep=1), sequence.extend(ids[30:35])]
    sequence.crop(32)
    out += [sequence.extend(ids[32:34], keep=2), sequence.extend([ids[34]])]
    sequence.crop(0)
    out.append(sequence.extend(ids[:3]))
    return out


def test_fp32_graph_matches_pytorch_through_crops_and_kept_logits(tiny_hf_dir, tiny_fp32):
    built = run_script(CachedSequence(OrtBackend(tiny_fp32)))
    reference = run_script(CachedSequence(TorchBackend(tiny_hf_dir, device="cpu", dtype=torch.float32)))
    assert [tuple(t.shape) for t in built] == [(1, VOCAB), (5, VOCAB), (2, VOCAB), (1, VOCAB), (3, VOCAB)]
    for got, want in zip(built, reference):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_cache_written_in_place_computes_what_a_copied_one_does(tiny_fp32, monkeypatch):
    """Past and present bound to one buffer (GroupQueryAttention writes into it): the same logits, bit for bit, as
    the graph's copying run, through the buffer's growth (kept contents), crops (free: the next pass writes over
    them) and a fresh start."""
    from fly_runtime.backends import ort_backend

    monkeypatch.setattr(ort_backend, "FIRST_CAPACITY", 8)
    in_place, copied = OrtBackend(tiny_fp32), OrtBackend(tiny_fp32)
    copied._shares_buffers = False
    assert in_place._shares_buffers  # the builder's graph: GroupQueryAttention
    outputs = [run_script(CachedSequence(backend)) for backend in (in_place, copied)]
    assert in_place._capacity == 60  # 30 for the prefill, doubled for the pass to 35 (contents kept)
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


def test_build_is_cached(tiny_hf_dir, tiny_fp32):
    stamp = (tiny_fp32 / "model.onnx").stat().st_mtime_ns
    assert hf_to_onnx(tiny_hf_dir, tiny_fp32, int4=False) == tiny_fp32
    assert (tiny_fp32 / "model.onnx").stat().st_mtime_ns == stamp


def test_int4_graph_runs_and_stays_close(tiny_hf_dir, tmp_path):
    folder = hf_to_onnx(tiny_hf_dir, tmp_path / "tiny-int4", int4=True)
    built = run_script(CachedSequence(OrtBackend(folder)))
    reference = run_script(CachedSequence(TorchBackend(tiny_hf_dir, device="cpu", dtype=torch.float32)))
    for got, want in zip(built, reference):
        assert got.shape == want.shape
        # 4-bit weights perturb the logits, but they must still track the model's
        assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.9


def test_fp32_graph_computes_a_token_alike_in_a_step_and_in_a_pass(tiny_fp32):
    from fly_runtime.tuning import ROW_TOLERANCE, measure_graph

    measured = measure_graph(tiny_fp32, context=20, repeats=2)
    assert measured["1"] > 0 and measured["9"] > 0
    assert measured["row_delta"] <= ROW_TOLERANCE


def test_int8_copy_of_a_graph_tracks_it(tiny_hf_dir, tiny_fp32, tmp_path):
    from fly_runtime.sources.convert import quantize_onnx

    folder = quantize_onnx(tiny_fp32, tmp_path / "tiny-int8", bits=8)
    built = run_script(CachedSequence(OrtBackend(folder)))
    reference = run_script(CachedSequence(OrtBackend(tiny_fp32)))
    for got, want in zip(built, reference):
        assert got.shape == want.shape
        # 8-bit blockwise weights stay much closer to the source than 4-bit ones
        assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99


def test_broken_folder_fails_clearly_and_caches_nothing(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    out = tmp_path / "onnx" / "broken-fp32"
    with pytest.raises(ModelIntegrityError, match="building the ONNX graph"):
        hf_to_onnx(broken, out, int4=False)
    assert not out.exists()


def test_fidelity_compares_a_graph_with_the_full_precision_model(tiny_hf_dir, tiny_fp32, tmp_path):
    from fly_runtime.tuning import fidelity, teacher_forced

    ids = [(11 * i + 5) % VOCAB for i in range(200)]
    torch_model = TorchBackend(tiny_hf_dir, device="cpu", dtype=torch.float32)
    ref = teacher_forced(torch_model.forward, ids, chunk=64)
    assert ref["top_ids"].shape == (199, 16)
    same = fidelity(tiny_fp32, ref)
    assert same["agreement"] == 1.0 and abs(same["kl"]) < 1e-5
    rounded = fidelity(hf_to_onnx(tiny_hf_dir, tmp_path / "tiny-int4", int4=True), ref)
    assert rounded["kl"] > 100 * max(abs(same["kl"]), 1e-9)  # 4-bit weights move the distribution measurably
