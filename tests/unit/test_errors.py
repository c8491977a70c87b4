"""Bad input gets fly's own error, naming the problem and the fix; the CLI prints one line, no traceback."""

import pytest

from fly_integrations.prompting import check_messages
from fly_runtime import CacheError, GenerationConfig, InvalidPromptError, InvalidSettingsError
from fly_runtime.cli import main
from fly_runtime.sources.cache import cache_dir


@pytest.mark.parametrize("settings, message", [
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"seed": 2**70}, r"seed must be an integer in \[0, 2\*\*63\)"),
    ({"seed": -1}, "seed must be an integer"),
])
def test_out_of_range_settings_are_refused(settings, message):
    with pytest.raises(InvalidSettingsError, match=message):
        GenerationConfig(**settings)


def test_whitespace_only_messages_are_refused_like_empty_ones():
    with pytest.raises(InvalidPromptError, match="empty or whitespace"):
        check_messages([{"role": "user", "content": " \n\t "}])


def test_a_cache_path_that_is_a_file_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("FLY_CACHE_DIR", str(blocker))
    with pytest.raises(CacheError, match="is a file, not a folder: point FLY_CACHE_DIR at a folder"):
        cache_dir()


def test_a_cache_that_cannot_be_created_is_named(monkeypatch):
    monkeypatch.setenv("FLY_CACHE_DIR", "/proc/fly-cache")  # no folder can be made there, not even by root
    with pytest.raises(CacheError, match="cannot create the fly cache /proc/fly-cache"):
        cache_dir()


def test_cli_prints_one_error_line_for_a_bad_cache(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FLY_CACHE_DIR", str(blocker))
    assert main(["models", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fly: error: the fly cache") and "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(CacheError):  # --debug shows the traceback instead
        main(["--debug", "models", "list"])



def test_a_model_folder_without_a_loadable_model_is_named(tmp_path):
    from fly_runtime import ModelIntegrityError, ModelSettings, load_engine

    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ModelIntegrityError, match="could not be loaded .*complete Hugging Face model"):
        load_engine(ModelSettings(target=str(folder), draft=None, backend="torch"))


def test_junk_weights_are_named_not_a_safetensors_traceback(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fly_runtime import ModelIntegrityError, ModelSettings, load_engine
    from tests.unit.test_onnx_build import tiny_tokenizer

    folder = tmp_path / "junk"
    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00junk" * 100)
    with pytest.raises(ModelIntegrityError, match="could not be loaded"):
        load_engine(ModelSettings(target=str(folder), draft=None, backend="torch", device="cpu"))


def test_context_window_is_checked_and_named_before_any_model_reads(tmp_path):
    from fly_runtime import GenerationConfig, InvalidPromptError, InvalidSettingsError
    from fly_runtime.engine import FlyEngine

    engine = FlyEngine(target=None, tokenizer=None, drafter=None, vocab_size=10, eos_token_ids=[0], max_context=100)
    with pytest.raises(InvalidPromptError, match=r"context window \(20 tokens, the context_window / num_ctx"):
        engine.stream(list(range(15)), GenerationConfig(mode="ar", max_new_tokens=8, context_window=20))
    with pytest.raises(InvalidPromptError, match=r"target's context window \(100 tokens\)"):
        engine.stream(list(range(95)), GenerationConfig(mode="ar", max_new_tokens=8))
    with pytest.raises(InvalidSettingsError, match="context_window must be at least 2"):
        GenerationConfig(context_window=1)
