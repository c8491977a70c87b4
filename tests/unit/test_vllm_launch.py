"""fly's settings as a `vllm serve` command, against the option names of vLLM's docs (FLy:
docs/features/speculative_decoding/fly.md; engine arguments: --speculative-config, --tensor-parallel-size,
--pipeline-parallel-size, --override-generation-config, --api-key)."""

import json
import subprocess
import sys

from fly_integrations.server.cli import is_loopback
from fly_integrations.server.vllm import speculative_config, vllm_command
from fly_runtime.config import GenerationConfig


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_fly_becomes_draft_model_speculation_with_flys_rejection_method():
    config = GenerationConfig(mode="fly", k=10, window=4, entropy_threshold=0.5, entropy_top_k=5)
    assert speculative_config(config, "Qwen/Qwen2.5-0.5B-Instruct") == {
        "method": "draft_model", "model": "Qwen/Qwen2.5-0.5B-Instruct", "num_speculative_tokens": 10,
        "rejection_sample_method": "fly", "fly_window_size": 4, "fly_entropy_threshold": 0.5, "fly_entropy_top_k": 5}


def test_exact_is_standard_speculation_ar_none_and_no_drafter_prompt_lookup():
    assert speculative_config(GenerationConfig(mode="exact"), "d") == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 5}
    assert speculative_config(GenerationConfig(mode="ar"), "d") is None
    assert speculative_config(GenerationConfig(mode="exact", k=4), None)["method"] == "ngram"


def test_the_command_carries_parallelism_sampling_defaults_and_the_key():
    command = vllm_command("Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                           GenerationConfig(mode="fly", temperature=0.0, top_k=0), "0.0.0.0", 9000, "secret", 4, 2)
    assert command[:3] == ["vllm", "serve", "Qwen/Qwen2.5-72B-Instruct"]
    assert option(command, "--tensor-parallel-size") == "4" and option(command, "--pipeline-parallel-size") == "2"
    assert option(command, "--api-key") == "secret" and option(command, "--port") == "9000"
    assert json.loads(option(command, "--override-generation-config")) == {"temperature": 0.0, "top_p": 1.0,
                                                                           "top_k": -1}
    assert json.loads(option(command, "--speculative-config"))["rejection_sample_method"] == "fly"
    assert "--speculative-config" not in vllm_command("t", None, GenerationConfig(mode="ar"), "h", 1)


def test_fly_serve_engine_vllm_prints_the_command_and_demands_a_key_off_loopback():
    run = [sys.executable, "-m", "fly_runtime.cli", "serve", "--engine", "vllm", "--target", "Qwen/Qwen2.5-7B-Instruct",
           "--draft", "Qwen/Qwen2.5-0.5B-Instruct", "--k", "9", "--dry-run"]
    printed = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert '"num_speculative_tokens": 9' in printed.stdout and printed.stdout.startswith("vllm serve")
    exposed = subprocess.run(run + ["--host", "0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert exposed.returncode == 2 and "--api-key" in exposed.stderr
    no_draft = [part for part in run if part not in ("--draft", "Qwen/Qwen2.5-0.5B-Instruct")]
    auto = subprocess.run(no_draft, capture_output=True, text=True, timeout=120)
    assert auto.returncode == 2 and "--draft HUB_ID" in auto.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
