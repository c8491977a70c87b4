"""The default target precision on the real pair: the graph ``auto`` runs is the model (it agrees with the
GGUF's full-precision weights), it came from a measured record, and the reference it was judged by is the
model's own choices."""

import numpy as np
import pytest
import torch

from fly_runtime.chat import encode_chat
from fly_runtime.loader import DEFAULT_TARGET, ModelSettings, target_precision
from fly_runtime.sources import resolve_model
from fly_runtime.sources.convert import GRAPH_VERSIONS
from fly_runtime.tuning import (AGREEMENT_FLOOR, READ_TOKENS, SHIPPED_REFERENCES, fidelity, machine_candidates,
                                recorded_precision, reference, turn_seconds)


def test_the_shipped_reference_is_the_full_precision_models_choices():
    import psutil

    from fly_runtime.backends.torch_backend import TorchBackend
    from fly_runtime.loader import ModelSettings, load_tokenizer, loaded
    from tests.integration.conftest import drop_engines

    # the 1.5B at fp32 in PyTorch (6.2 GB) needs no engine: the suite's kept default pair (both forms, 3.1 GB and
    # more) is dropped first, its memory handed back to the system (glibc kept a third of it), as the suite's peak
    kept = loaded(ModelSettings()) is not None
    before = psutil.Process().memory_info().rss
    drop_engines(keep_default=False)
    if kept:
        assert before - psutil.Process().memory_info().rss > 2.6e9  # without handing it back: 2.1 GB
    model = resolve_model(DEFAULT_TARGET)
    ref = reference(model, load_tokenizer(model))
    assert (SHIPPED_REFERENCES / f"{model.name}-{model.key}.npz").is_file()
    # the first chunk again, from the dequantised GGUF in PyTorch at fp32
    logits = TorchBackend(model.weights(), device="cpu", dtype=torch.float32).forward(ref["ids"][:128].tolist())
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    assert (logprobs.argmax(-1).numpy() == ref["top_ids"][:128, 0]).all()
    np.testing.assert_allclose(torch.gather(logprobs, 1, torch.from_numpy(ref["top_ids"][:128]).long()).numpy(),
                               ref["top_logprobs"][:128], atol=1e-3)


def test_auto_runs_the_fastest_recorded_graph_that_is_the_model(engine):
    model = resolve_model(DEFAULT_TARGET)
    choice = target_precision(ModelSettings(), model, engine.tokenizer)
    record = recorded_precision(model.key)
    assert record is not None and record["precision"] == choice
    measured = record["ms"]
    assert sorted(measured) == sorted(record["candidates"]) == sorted(machine_candidates(model))
    qualified = [p for p, m in measured.items() if m.get("agreement", 1.0) >= AGREEMENT_FLOOR]
    assert choice == min(qualified, key=lambda p: (turn_seconds(measured[p]), measured[p]["1"]))
    assert all(str(READ_TOKENS) in measured[p] for p in measured)  # each form's prompt read was timed
    runs = engine.target.backend.name
    assert runs == f"llama.cpp-{model.gguf.stem}" if choice == "gguf" else runs.endswith(f"-{choice}-g{GRAPH_VERSIONS[choice]}")
    if choice not in ("fp32", "gguf"):  # a graph, measured again now: what the engine runs agrees with the model
        with engine.exclusive():  # the engine's own target, borrowed between requests
            again = fidelity(engine.target.backend, reference(model, engine.tokenizer))
        assert again["agreement"] >= AGREEMENT_FLOOR
        if "agreement" in measured[choice]:  # a graph with rounded matrices, checked when chosen
            assert abs(again["agreement"] - measured[choice]["agreement"]) < 0.005
        else:  # a graph on the GGUF's own grid is the file's model: it agrees as llama.cpp does (98-99%)
            assert model.on_own_grid(choice) and again["agreement"] >= 0.98


def test_the_gguf_under_llama_cpp_reads_crops_and_keeps_logits_like_a_graph(engine):
    pytest.importorskip("llama_cpp", reason="the [llama-cpp] extra (CI installs it)")
    from fly_runtime.backends.base import CachedSequence
    from fly_runtime.loader import open_target

    model = resolve_model(DEFAULT_TARGET)
    sequence = CachedSequence(open_target(model, "gguf"))
    ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "Write a haiku about rivers."}])
    first = sequence.extend(ids, keep=1)
    assert first.shape == (1, engine.vocab_size) or first.shape[1] >= engine.vocab_size
    step = int(first[0].argmax())
    passed = sequence.extend([step, 11, 12], keep=3)  # a verification pass: logits of all three
    assert passed.shape[0] == 3
    sequence.crop(len(ids))
    again = sequence.extend([step, 11, 12], keep=3)
    torch.testing.assert_close(again, passed)  # the crop removed exactly what the pass added
    sequence.crop(len(ids) - 5)
    assert torch.equal(sequence.extend(ids[-5:], keep=1)[0].argmax(), first[0].argmax())


def test_dropped_weights_are_converted_again_from_the_gguf(tmp_path):
    """`fly models fetch` drops a GGUF model's float32 weights once its graph is built; whatever needs them later
    (the torch backend, a new graph) gets them converted again, the same as before."""
    import shutil

    from safetensors import safe_open

    from fly_runtime.loader import DEFAULT_DRAFT
    from fly_runtime.sources.convert import drop_weights, gguf_to_hf, has_weights

    drafter = resolve_model(DEFAULT_DRAFT)
    folder = tmp_path / drafter.hf_dir.name
    shutil.copytree(drafter.hf_dir, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert not has_weights(folder) and (folder / "tokenizer.json").is_file()
    assert gguf_to_hf(drafter.gguf, folder, weights=False) == folder and not has_weights(folder)  # tokenizer use
    assert gguf_to_hf(drafter.gguf, folder) == folder and has_weights(folder)
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as fresh, \
            safe_open(str(next(drafter.weights().glob("*.safetensors"))), "pt") as cached:
        assert torch.equal(fresh.get_tensor("model.norm.weight"), cached.get_tensor("model.norm.weight"))
    assert drop_weights(folder) > 1e9 and not has_weights(folder) and (folder / "config.json").is_file()


def test_the_tokenizer_folder_from_the_gguf_metadata_is_the_one_written_beside_the_weights(tmp_path):
    """A llama.cpp target needs no float32 copy: its tokenizer, chat template, config and end-of-turn ids come from
    the GGUF's metadata alone, the same as a full conversion writes them."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from fly_runtime.loader import DEFAULT_DRAFT
    from fly_runtime.sources.convert import gguf_to_hf, has_weights

    drafter = resolve_model(DEFAULT_DRAFT)
    full = drafter.weights()  # converted with its weights (CI keeps them)
    light = gguf_to_hf(drafter.gguf, tmp_path / "light", weights=False)
    assert not has_weights(light)
    a, b = AutoTokenizer.from_pretrained(full), AutoTokenizer.from_pretrained(light)
    assert a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template
    assert a.all_special_tokens == b.all_special_tokens
    ca, cb = AutoConfig.from_pretrained(full).to_dict(), AutoConfig.from_pretrained(light).to_dict()
    for key in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "rope_theta", "eos_token_id"):
        assert ca.get(key) == cb.get(key), key
    assert GenerationConfig.from_pretrained(full).eos_token_id == GenerationConfig.from_pretrained(light).eos_token_id
