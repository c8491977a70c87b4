"""The settings both adapters expose, and how they become a model pair and a per-request config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field

from fly_integrations.replies import ReplyRequest
from fly_runtime import FlyEngine, GenerationConfig, ModelSettings, get_engine
from fly_runtime.loader import DEFAULT_DRAFT, DEFAULT_TARGET

# per-call keyword arguments that override a field for one request
OVERRIDABLE = ("mode", "k", "window", "entropy_threshold", "min_prob_ratio", "exact_numbers", "exact_code",
               "exact_opening", "ngram", "adaptive", "temperature", "top_k", "top_p", "seed", "warn_prompt_tokens",
               "max_tokens")


class FlyParams(BaseModel):
    # `model` (and LlamaIndex's `model_name`) as every chat model names it; `draft_model` likewise
    target: str = Field(default=DEFAULT_TARGET, validation_alias=AliasChoices("target", "model", "model_name"),
                        description="target model: built-in name, dir, .gguf or Hub id")
    draft: str | None = Field(default=DEFAULT_DRAFT, validation_alias=AliasChoices("draft", "draft_model"),
                              description="drafter (same tokenizer); None = n-grams only")
    backend: Literal["auto", "torch", "onnx"] = "auto"
    device: str | None = None
    precision: Literal["auto", "fp32", "int8", "int4"] = Field(
        default="auto", description="the target's weights on ONNX Runtime (auto: measured fastest on this machine)")
    # request settings default as GenerationConfig's do (the adapters' own default is max_tokens)
    mode: Literal["ar", "exact", "fly"] = GenerationConfig.mode
    k: int | None = GenerationConfig.k
    window: int = GenerationConfig.window
    entropy_threshold: float = GenerationConfig.entropy_threshold
    min_prob_ratio: float = Field(
        default=GenerationConfig.min_prob_ratio,
        description="fly forgives a drafted token only if the target gives it this fraction of its top token's "
                    "probability (0: the paper's rule)")
    exact_numbers: bool = Field(default=GenerationConfig.exact_numbers,
                                description="fly never forgives a drafted token holding a digit")
    exact_code: bool = Field(default=GenerationConfig.exact_code,
                             description="fly verifies fenced code blocks exactly")
    exact_opening: int = Field(default=GenerationConfig.exact_opening,
                               description="fly verifies the reply's first N tokens exactly (0: off)")
    ngram: bool = GenerationConfig.ngram
    adaptive: bool = GenerationConfig.adaptive
    temperature: float = GenerationConfig.temperature
    top_k: int = GenerationConfig.top_k
    top_p: float = GenerationConfig.top_p
    max_tokens: int = 512
    warn_prompt_tokens: int = Field(default=GenerationConfig.warn_prompt_tokens,
                                    description="warn before reading a prompt longer than this (0: never)")
    seed: int | None = GenerationConfig.seed
    timeout: float | None = Field(
        default=GenerationConfig.timeout,
        description="seconds one generation may run; it then ends with finish_reason 'timeout'")
    stop: list[str] | None = Field(default=None, description="stop strings for every request")

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        # bad settings fail at construction, not at the first call, and as fly's own error type (a pydantic
        # validator would wrap it in a ValidationError)
        self.generation_config()

    def model_settings(self, target: str | None = None) -> ModelSettings:
        return ModelSettings(target=target or self.target, draft=self.draft, backend=self.backend,
                             device=self.device, precision=self.precision)

    def engine(self, target: str | None = None) -> FlyEngine:
        """The process-wide engine for these model settings (loaded on first use, shared by all instances).

        ``target`` overrides the target for one call (LangChain's per-call ``model=``).
        """
        return get_engine(self.model_settings(target))

    def generation_config(self, stop: list[str] | tuple[str, ...] | None = None, **overrides: Any) -> GenerationConfig:
        values = {name: overrides.get(name, getattr(self, name)) for name in OVERRIDABLE}
        # every overridable field is a GenerationConfig field of the same name, but for the frameworks' max_tokens
        values["max_new_tokens"] = values.pop("max_tokens")
        return GenerationConfig(**values, stop=tuple(stop or ()), timeout=self.timeout)

    def reply_request(
        self,
        messages: list[dict[str, Any]],
        stop: list[str] | None,
        call_kwargs: dict[str, Any],
        *,
        model: str | None = None,
        tools: list[Any] | None = None,
        tool_choice: Any = None,
        json_schema: dict[str, Any] | None = None,
    ) -> ReplyRequest:
        """One call's request: its stops (else the instance's) and per-call setting overrides, checked before
        the model loads, so a bad setting never costs a model load."""
        stops = list(stop if stop is not None else self.stop or [])
        overrides = {k: call_kwargs[k] for k in OVERRIDABLE if k in call_kwargs}
        self.generation_config(stops, **overrides)
        return ReplyRequest(
            engine=self.engine(model),
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            json_schema=json_schema,
            config=lambda extra: self.generation_config([*stops, *extra], **overrides),
        )

    def fly_metadata(self, stats) -> dict[str, Any]:
        return {
            "model_name": self.target,
            "fly_mode": self.mode,
            "mean_accepted": stats.mean_accepted,
            "acceptance_rate": stats.acceptance_rate,
            "fly_forgiven": stats.fly_forgiven,
            "tokens_per_second": stats.tokens_per_second,
            "target_forwards": stats.target_forwards,
            "k": stats.k,
        }
