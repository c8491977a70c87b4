"""The command line's decoding flags, without models."""

from fly_runtime.cli import _config, build_parser
from fly_runtime.config import GenerationConfig


def test_no_flags_give_the_library_defaults():
    assert _config(build_parser().parse_args(["generate", "hi"])) == GenerationConfig()
    bench = build_parser().parse_args(["bench", "--out", "x"])
    assert _config(bench) == GenerationConfig(max_new_tokens=128)  # the benchmark's own default length


def test_every_decoding_flag_reaches_the_generation_config():
    args = build_parser().parse_args([
        "generate", "--mode", "exact", "--k", "7", "--window", "3", "--entropy-threshold", "0.5",
        "--min-prob-ratio", "0.2", "--no-exact-numbers", "--no-exact-code", "--exact-opening", "0", "--no-ngram",
        "--no-adaptive", "--max-new-tokens", "9", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
        "--seed", "3", "--warn-prompt-tokens", "100", "hi"])
    assert _config(args) == GenerationConfig(
        mode="exact", k=7, window=3, entropy_threshold=0.5, min_prob_ratio=0.2, exact_numbers=False,
        exact_code=False, exact_opening=0, ngram=False, adaptive=False, max_new_tokens=9, temperature=0.7, top_k=40,
        top_p=0.9, seed=3, warn_prompt_tokens=100)


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`fly ... | head`: the closed pipe ends the command with the shell's code for it, not an internal error."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "models", "list"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "FLY_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""


def test_models_list_shows_every_kind_of_tuning_record(tmp_path, monkeypatch, capsys):
    """`fly models list` and `prune` on a cache whose tuning record holds this machine's timed bfloat16 product (the
    prompt reader's price, a record without a model) beside a model's choice: each is listed, none is an internal
    error (both were, wherever the reader had been priced)."""
    import json

    from fly_runtime.cli import main
    from fly_runtime.tuning import RECORD_VERSION, machine_id

    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path))
    ms = {"1": 62.0, "9": 292.0, "64": 1158.0, "row_delta": 0.6}
    records = {f"{machine_id()}|abc": {"model": "some-model", "precision": "gguf", "ms": {"gguf": ms},
                                       "version": RECORD_VERSION, "date": "2026-12-07"},
               f"{machine_id()}|bf16-product": {"ms": 6.28, "version": RECORD_VERSION, "date": "2026-12-07"}}
    (tmp_path / "tuning.json").write_text(json.dumps(records))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "some-model: target gguf" in out and "a bfloat16 product 6.3 ms" in out
    assert main(["models", "prune"]) == 0 and "freed 0.00 GB" in capsys.readouterr().out
