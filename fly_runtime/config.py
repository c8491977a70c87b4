"""Per-request generation settings, validated at the boundary with errors that say what to change."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from fly_runtime.errors import InvalidSettingsError
from fly_runtime.verify import FlyRule

Mode = Literal["ar", "exact", "fly"]
MODES: tuple[str, ...] = ("ar", "exact", "fly")
CODE_FENCE = ("```", "```")  # opens and closes a Markdown code block

# Draft length per mode when the user fixes none. FLy needs K > window so a forgivable mismatch can be
# followed by a full window of checked drafts.
DEFAULT_K: dict[str, int] = {"ar": 0, "exact": 5, "fly": 8}

# The settings a user may set per request, each a GenerationConfig field of the same name, with its help: the
# CLI's flags, the adapters' fields and per-call keywords and the bench's recorded settings all come from here.
REQUEST_SETTINGS: dict[str, str] = {
    "mode": "ar (plain decoding), exact (speculative, the same output as ar) or fly (loosely speculative)",
    "k": "drafts per round (default: 5 exact, 8 fly); fixing it turns adaptive drafting off",
    "window": "FLy's deferred window W: a forgiven mismatch needs W natively accepted drafts after it",
    "entropy_threshold": "FLy's entropy gate θ: mismatches where the target is more certain are never forgiven",
    "entropy_top_k": "FLy's entropy is taken over the target's top-k probabilities",
    "min_prob_ratio": "FLy forgives a drafted token only if the target gives it this fraction of its top token's "
                      "probability (0: the paper's rule)",
    "exact_numbers": "FLy never forgives a drafted token where it or the target's token holds a digit",
    "exact_code": "FLy verifies fenced code blocks (```) exactly",
    "exact_opening": "FLy verifies the reply's first N tokens exactly (0: off)",
    "ngram": "check prompt-lookup n-grams with the drafter before it drafts alone",
    "suffix_drafts": "greedy requests: prompt lookup also drafts from this process's earlier replies (verified "
                     "exactly)",
    "adaptive": "adapt the draft length, stop unsure drafts, fall back to plain decoding where speculation "
                "does not pay",
    "max_new_tokens": "most tokens to generate",
    "temperature": "sampling temperature (0: greedy)",
    "top_k": "sample from the k most likely tokens (0: off)",
    "top_p": "sample from the smallest set of tokens holding this probability (1: off)",
    "min_p": "sample only tokens at least this share of the most likely one's probability (0: off)",
    "repetition_penalty": "divide the logit of every token already in the prompt or reply by this (a negative "
                          "one multiplied; 1: off; llama.cpp's repeat_penalty)",
    "frequency_penalty": "lower a token's logit by this for each time the reply has it (OpenAI's; 0: off)",
    "presence_penalty": "lower a token's logit by this once the reply has it (OpenAI's; 0: off)",
    "seed": "seed for sampling (a seeded request repeats exactly)",
    "warn_prompt_tokens": "warn before reading a prompt longer than this many tokens (0: never)",
    "context_window": "most tokens one request may hold, prompt and reply together (default: the target's "
                      "maximum)",
}


@dataclass(frozen=True)
class GenerationConfig:
    mode: Mode = "fly"
    k: int | None = None  # drafts per round; None = DEFAULT_K[mode]
    # FLy's rule, its defaults written once, in FlyRule
    window: int = FlyRule.window
    entropy_threshold: float = FlyRule.entropy_threshold
    entropy_top_k: int = FlyRule.entropy_top_k
    # FLy forgives a drafted token only if the target gives it at least this fraction of its own top token's
    # probability (0 = the paper's rule, entropy gate and window only)
    min_prob_ratio: float = FlyRule.min_prob_ratio
    ngram: bool = True  # prompt-lookup n-grams checked by the drafter before it drafts on its own
    # greedy requests: prompt lookup also draws on this process's earlier replies (suffix drafts), each such draft
    # verified exactly, so a reply never holds a token only another request's reply put there
    suffix_drafts: bool = True
    adaptive: bool = True  # adapt K, stop unsure drafts, fall back to plain decoding (off when k is fixed)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # penalties on repeating tokens (fly_runtime/penalties.py): they apply to every row the target decides, greedy
    # or sampled, so verification checks drafts against the penalised target
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    timeout: float | None = None  # seconds a request may run; it then ends with finish_reason "timeout"
    # a prompt longer than this (tokens the target must read, past its cache) is announced with a warning:
    # a CPU reads a long prompt (200 bound tools' schemas, say) for minutes; 0 = never warn
    warn_prompt_tokens: int = 4096
    # most tokens a request may hold, prompt and reply; None = the target's maximum. The adapters default to
    # 8192: frameworks pack prompts up to the stated window, and a CPU reads a long prompt slowly
    context_window: int | None = None
    # a JSON schema (as a JSON string) the reply must follow: every position the target decides is masked to what
    # the schema allows, and drafts are verified exactly. '{"type": "object"}' asks for any JSON object
    json_schema: str | None = None
    # or a grammar in llguidance's Lark dialect (its %json embeds a schema): a forced tool call, whose arguments follow
    # the tool's schema between the family's fixed call text
    grammar: str | None = None
    # (opening, closing) text markers of output spans that FLy verifies exactly, e.g. a tool call's JSON
    exact_spans: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    # FLy never forgives a drafted token when it or the target's token holds a digit: a different number is a
    # different answer, not a different wording
    exact_numbers: bool = True
    # FLy verifies fenced code blocks (```) exactly: one forgiven token there changes what the program does
    exact_code: bool = True
    # FLy verifies the reply's first N tokens exactly: its opening sets the answer's course, not just its wording
    exact_opening: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "exact_spans", tuple(
            tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in self.exact_spans or ()))
        self.validate()

    @property
    def draft_length(self) -> int:
        return DEFAULT_K[self.mode] if self.k is None else self.k

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InvalidSettingsError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode != "ar" and self.draft_length < 1:
            raise InvalidSettingsError(f"k (drafts per round) must be >= 1, got {self.draft_length}")
        if self.window < 0:
            raise InvalidSettingsError(f"window must be >= 0, got {self.window}")
        if self.mode == "fly" and self.window >= self.draft_length:
            raise InvalidSettingsError(
                f"window ({self.window}) must be smaller than k ({self.draft_length}): a forgiven mismatch needs "
                f"{self.window} checked drafts after it. Raise k to at least {self.window + 1} or lower the window."
            )
        if self.exact_opening < 0:
            raise InvalidSettingsError(f"exact_opening must be >= 0 tokens (0 = off), got {self.exact_opening}")
        if not self.entropy_threshold >= 0:
            raise InvalidSettingsError(f"entropy_threshold must be >= 0, got {self.entropy_threshold}")
        if not 0 <= self.min_prob_ratio <= 1:
            raise InvalidSettingsError(f"min_prob_ratio must be in [0, 1] (0 = off), got {self.min_prob_ratio}")
        if self.entropy_top_k < 1:
            raise InvalidSettingsError(f"entropy_top_k must be >= 1, got {self.entropy_top_k}")
        if not 0 <= self.temperature < float("inf"):
            raise InvalidSettingsError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidSettingsError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidSettingsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise InvalidSettingsError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not 0.01 <= self.repetition_penalty <= 100:  # beyond, a logit divided by it overflows to inf
            raise InvalidSettingsError(f"repetition_penalty must be in [0.01, 100] (1 = off), got "
                                       f"{self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidSettingsError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise InvalidSettingsError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidSettingsError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.warn_prompt_tokens < 0:
            raise InvalidSettingsError(f"warn_prompt_tokens must be >= 0 (0 = never warn), got {self.warn_prompt_tokens}")
        if self.context_window is not None and self.context_window < 2:
            raise InvalidSettingsError(f"context_window must be at least 2 tokens (or None: the target's maximum), "
                                       f"got {self.context_window}")
        if self.timeout is not None and not self.timeout > 0:
            raise InvalidSettingsError(f"timeout must be > 0 seconds (or None), got {self.timeout}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, json.JSONDecodeError) as exc:
                raise InvalidSettingsError(f"json_schema must be a JSON schema as a JSON string: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidSettingsError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.json_schema is not None):
            raise InvalidSettingsError("grammar must be a Lark grammar as a string, and not set with json_schema")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSettingsError(f"stop sequences must be non-empty strings, got {s!r}")
        for pair in self.exact_spans:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(m, str) and m for m in pair)):
                raise InvalidSettingsError(
                    f"exact_spans must be (opening, closing) pairs of non-empty strings, got {pair!r}: "
                    f"e.g. exact_spans=[('<tool_call>', '</tool_call>')]")
