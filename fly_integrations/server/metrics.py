"""What `fly serve` has done, in Prometheus' text format (`GET /metrics`): HTTP responses, the tokens read,
written and drafted, τ, the queue, and embeddings. Counters only grow while the server runs; a scraper takes
rates itself."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# counter name -> (help text, the GenerationStats field it adds up)
_GENERATION_COUNTERS = {
    "fly_prompt_tokens_total": ("Prompt tokens of finished generations.", "prompt_tokens"),
    "fly_cached_prompt_tokens_total": ("Prompt tokens served from the prefix cache, not read again.", "cached_tokens"),
    "fly_generation_tokens_total": ("Tokens generated.", "new_tokens"),
    "fly_target_forwards_total": ("Forward passes of the target model.", "target_forwards"),
    "fly_drafted_tokens_total": ("Draft tokens proposed (drafter model and prompt lookup).", "drafted_tokens"),
    "fly_accepted_draft_tokens_total": ("Draft tokens the target agreed with natively.", "native_accepted"),
    "fly_forgiven_draft_tokens_total": ("Draft tokens FLy kept where the target disagreed.", "fly_forgiven"),
    "fly_forced_tokens_total": ("Tokens a grammar forced, verified without drafting.", "forced_tokens"),
    "fly_generation_seconds_total": ("Seconds spent generating (prompt read and decoding).", "seconds"),
}


@dataclass
class Metrics:
    """Thread-safe running totals; ``render`` writes them out with the queue's current state."""

    http: Counter = field(default_factory=Counter)  # (path, status) -> responses
    finished: Counter = field(default_factory=Counter)  # finish reason -> generations
    totals: Counter = field(default_factory=Counter)  # counter name -> sum
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def response(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path, status)] += 1

    def generation(self, result: Any) -> None:
        """One finished generation (a GenerationResult, or a Reply holding one)."""
        result = getattr(result, "result", result)
        with self._lock:
            self.finished[result.finish_reason] += 1
            for name, (_, attribute) in _GENERATION_COUNTERS.items():
                self.totals[name] += getattr(result.stats, attribute)

    def embedding(self, inputs: int, tokens: int) -> None:
        with self._lock:
            self.totals["fly_embedding_inputs_total"] += inputs
            self.totals["fly_embedding_tokens_total"] += tokens

    def render(self, waiting: int, running: int, slots: int) -> str:
        with self._lock:
            http, finished, totals = dict(self.http), dict(self.finished), dict(self.totals)
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

        metric("fly_http_responses_total", "counter", "HTTP responses, by route and status.",
               [(f'{{path="{path}",status="{status}"}}', n) for (path, status), n in sorted(http.items())])
        metric("fly_generations_total", "counter", "Generations finished, by finish reason.",
               [(f'{{finish_reason="{reason}"}}', n) for reason, n in sorted(finished.items())])
        for name, (help_text, _) in _GENERATION_COUNTERS.items():
            metric(name, "counter", help_text, [("", totals.get(name, 0))])
        forwards = totals.get("fly_target_forwards_total", 0)
        tau = totals.get("fly_generation_tokens_total", 0) / forwards if forwards else 0.0
        metric("fly_mean_accepted", "gauge", "Tau: tokens generated per target forward pass, since start.",
               [("", tau)])
        metric("fly_requests_waiting", "gauge", "Requests queued for the engine.", [("", waiting)])
        metric("fly_requests_running", "gauge", "Requests the engine is decoding now.", [("", running)])
        metric("fly_request_slots", "gauge", "Requests the engine decodes together at most.", [("", slots)])
        metric("fly_embedding_inputs_total", "counter", "Texts embedded by /v1/embeddings.",
               [("", totals.get("fly_embedding_inputs_total", 0))])
        metric("fly_embedding_tokens_total", "counter", "Tokens read by the embedding model.",
               [("", totals.get("fly_embedding_tokens_total", 0))])
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class CountResponses:
    """ASGI middleware: counts every HTTP response by route (``paths``; any other path as "other") and status."""

    def __init__(self, app, metrics: Metrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        path = path if path in self.paths else "other"

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted_send)
