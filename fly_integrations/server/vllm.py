"""fly's settings as a `vllm serve` command: vLLM runs FLy natively (``rejection_sample_method: "fly"``) with
tensor / pipeline parallelism and batching, behind the same OpenAI API that `fly serve` speaks.

What vLLM has no counterpart for: the number, code and opening guards (``exact_numbers``, ``exact_code``,
``exact_opening``), ``min_prob_ratio``, exactly verified tool-call spans, and adaptive drafting (K is fixed):
vLLM runs FLy as published. `fly serve --engine vllm` says so when it starts.
"""

from __future__ import annotations

import json

from fly_runtime.config import GenerationConfig

NOT_IN_VLLM = ("fly's guards (exact_numbers, exact_code, exact_opening, min_prob_ratio), exactly verified tool-call "
               "spans and adaptive drafting have no counterpart in vLLM: it runs FLy as published, with a fixed K")


def speculative_config(config: GenerationConfig, draft: str | None) -> dict | None:
    """vLLM's ``speculative_config`` for fly's mode: none for ``ar``, draft-model speculation for ``exact``,
    and FLy's rejection method with its window, entropy gate and top-k for ``fly``."""
    if config.mode == "ar":
        return None
    if draft is None:
        # without a drafter model fly drafts by prompt lookup alone: vLLM's n-gram proposer does the same
        return {"method": "ngram", "num_speculative_tokens": config.draft_length, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    spec: dict = {"method": "draft_model", "model": draft, "num_speculative_tokens": config.draft_length}
    if config.mode == "fly":
        spec |= {"rejection_sample_method": "fly", "fly_window_size": config.window,
                 "fly_entropy_threshold": config.entropy_threshold, "fly_entropy_top_k": config.entropy_top_k}
    return spec


def generation_overrides(config: GenerationConfig) -> dict:
    """fly's sampling defaults for requests that set none (vLLM's own follow the model's generation config)."""
    return {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k or -1}


def vllm_command(target: str, draft: str | None, config: GenerationConfig, host: str, port: int,
                 api_key: str | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 max_model_len: int | None = None) -> list[str]:
    command = ["vllm", "serve", target, "--host", host, "--port", str(port),
               "--tensor-parallel-size", str(tensor_parallel_size),
               "--pipeline-parallel-size", str(pipeline_parallel_size),
               "--override-generation-config", json.dumps(generation_overrides(config))]
    spec = speculative_config(config, draft)
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    if api_key:
        command += ["--api-key", api_key]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    return command
