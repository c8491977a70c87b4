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
