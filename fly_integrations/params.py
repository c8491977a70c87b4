"""The settings both adapters expose, and how they become a model pair and a per-request config."""

from __future__ import annotations

import functools
from typing import Any, Literal, get_type_hints

from pydantic import AliasChoices, Field, create_model

from fly_integrations.messages import format_schema
from fly_integrations.replies import ReplyRequest
from fly_runtime import FlyEngine, GenerationConfig, ModelSettings, get_engine
from fly_runtime.config import REQUEST_SETTINGS
from fly_runtime.loader import AUTO_DRAFT, DEFAULT_TARGET

# request settings the OpenAI API has fields of its own for; fly's others ride to a server as extra body fields
OPENAI_FIELDS = ("max_tokens", "temperature", "top_p", "seed")
# the generation statistics each reply's metadata carries
METADATA_STATS = ("mean_accepted", "acceptance_rate", "fly_forgiven", "tokens_per_second", "target_forwards",
                  "mean_k", "cached_tokens", "drafter_busy")


# the adapters' own defaults where they differ from GenerationConfig's: frameworks size replies by max_tokens, and
# pack prompts up to the stated window, which a CPU reads slowly
ADAPTER_DEFAULTS = {"max_new_tokens": 512, "context_window": 8192}
# the names users bring from Ollama (ChatOllama) and llama.cpp for the same settings: LlamaIndex's context_window
# is Ollama's num_ctx, max_tokens its num_predict, repetition_penalty llama.cpp's repeat_penalty
ALIASES = {"context_window": AliasChoices("context_window", "num_ctx"),
           "max_new_tokens": AliasChoices("max_tokens", "num_predict"),
           "repetition_penalty": AliasChoices("repetition_penalty", "repeat_penalty")}
# per call, the same
CALL_ALIASES = {"num_ctx": "context_window", "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}


def adapter_name(setting: str) -> str:
    return "max_tokens" if setting == "max_new_tokens" else setting


# per-call keyword arguments that override a field for one request: the request settings, max_new_tokens under
# the name the frameworks give it
OVERRIDABLE = tuple(adapter_name(name) for name in REQUEST_SETTINGS)

# one field per request setting, typed as GenerationConfig types it
_HINTS = get_type_hints(GenerationConfig)
RequestSettings = create_model("RequestSettings", **{
    adapter_name(name): (_HINTS[name], Field(default=ADAPTER_DEFAULTS.get(name, getattr(GenerationConfig, name)),
                                              description=help_text, validation_alias=ALIASES.get(name)))
    for name, help_text in REQUEST_SETTINGS.items()})


class FlyParams(RequestSettings):
    # `model` (and LlamaIndex's `model_name`) as every chat model names it; `draft_model` likewise
    target: str = Field(default=DEFAULT_TARGET, validation_alias=AliasChoices("target", "model", "model_name"),
                        description="target model: built-in name, dir, .gguf or Hub id")
    draft: str | None = Field(default=AUTO_DRAFT, validation_alias=AliasChoices("draft", "draft_model"),
                              description="drafter (same tokenizer); 'auto': the one fly knows for the target; "
                                          "None: prompt lookup only")
    backend: Literal["auto", "torch", "onnx"] = "auto"
    device: str | None = None
    max_batch: int | None = Field(default=None, ge=1, le=64,
                                  description="requests from this process decoded together in one target pass (a "
                                              "llama.cpp target; ONNX Runtime and PyTorch targets serve them in "
                                              "turn); None: as many as pay on this machine, measured once")
    precision: Literal["auto", "fp32", "int8", "int4", "gguf"] = Field(
        default="auto", description="the target's weights: an ONNX Runtime graph (fp32, int8, int4) or the GGUF under "
                                    "llama.cpp (gguf); auto: the fastest that agrees with the model on this machine")
    timeout: float | None = Field(
        default=GenerationConfig.timeout,
        description="seconds one generation may run; it then ends with finish_reason 'timeout'")
    stop: list[str] | None = Field(default=None, description="stop strings for every request")
    format: str | dict | None = Field(
        default=None, description="as Ollama's: 'json' (any JSON object) or a JSON schema every reply is decoded "
                                  "under, where a call asks for no response_format")

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        # bad settings fail at construction, not at the first call, and as fly's own error type (a pydantic
        # validator would wrap it in a ValidationError)
        self.generation_config()

    def model_settings(self, target: str | None = None) -> ModelSettings:
        return ModelSettings(target=target or self.target, draft=self.draft, backend=self.backend,
                             device=self.device, precision=self.precision, max_batch=self.max_batch)

    def engine(self, target: str | None = None) -> FlyEngine:
        """The process-wide engine for these model settings (loaded on first use, shared by all instances).

        ``target`` overrides the target for one call (LangChain's per-call ``model=``).
        """
        return get_engine(self.model_settings(target))

    def tokenizer(self):
        """The target's own tokenizer and chat template, loaded without the models (counting tokens needs no
        weights): the same for a local model and for one a server runs under that name."""
        return _tokenizer(self.target)

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
        stops, overrides, json_schema = self.call_settings(stop, call_kwargs, json_schema)
        return ReplyRequest(
            engine=self.engine(model),
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            json_schema=json_schema,
            config=lambda extra: self.generation_config([*stops, *extra], **overrides),
        )

    def call_settings(self, stop: list[str] | None, call_kwargs: dict[str, Any],
                      json_schema: dict[str, Any] | None = None) -> tuple[list[str], dict[str, Any], dict | None]:
        """One call's stops (else the instance's), setting overrides under fly's names (Ollama's taken too) and
        reply schema (else the ``format`` setting's), checked here: before a model loads or a server is asked."""
        stops = list(stop if stop is not None else self.stop or [])
        call_kwargs = {CALL_ALIASES.get(k, k): v for k, v in call_kwargs.items()}
        overrides = {k: call_kwargs[k] for k in OVERRIDABLE if k in call_kwargs}
        self.generation_config(stops, **overrides)
        if json_schema is None:
            json_schema = format_schema(call_kwargs.get("format", self.format))
        return stops, overrides, json_schema

    def fly_metadata(self, result, model: str | None = None) -> dict[str, Any]:
        """A reply's metadata: the models that served it (a per-call ``model=`` included; the drafter, None
        where prompt lookup drafted alone), the mode, the finish reason and the stats."""
        values = result.stats.as_dict()
        return {"model_name": model or self.target, "draft_model": result.draft_model, "target_form": result.form,
                "fly_mode": self.mode,
                "finish_reason": result.finish_reason, **{name: values[name] for name in METADATA_STATS}}


@functools.lru_cache(maxsize=8)
def _tokenizer(target: str):
    from fly_runtime.loader import load_tokenizer
    from fly_runtime.sources import resolve_model

    return load_tokenizer(resolve_model(target))
