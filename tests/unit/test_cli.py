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
