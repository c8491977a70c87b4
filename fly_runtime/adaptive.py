"""Adaptive drafting: how many tokens to draft each round, and when not to speculate at all.

Speculation only pays when a round's tokens cost less than as many plain steps. The policy here adapts
three things per request, from what it measures:
- the draft length K: +2 after a fully accepted draft, -1 otherwise (as transformers does), within bounds;
- where the drafter stops: when its own top-1 probability drops below ``confidence_floor`` it is likely to
  be wrong. In exact mode the draft ends there. In FLy mode a doubtful token is exactly where the target is
  likely uncertain too and a mismatch may be forgiven, but only if ``window`` more drafts follow; so the
  draft runs on for the window, and ends at the next doubtful token;
- whether to speculate: when the last rounds produced tokens slower than plain decoding does, decode
  plainly for a stretch (re-measuring the plain step), then probe speculation again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fly_runtime.config import GenerationConfig

K_MAX = 16


@dataclass(frozen=True)
class DraftShape:
    k: int  # most tokens to draft this round
    confidence_floor: float  # drafter stops (or starts its extension) below this top-1 probability
    extension: int  # tokens drafted past the first doubtful one (FLy's window), 0 = stop at once
    gate_ngrams: bool = False  # stop offering n-gram proposals in a request where the drafter rejects them


class DraftPolicy:
    CONFIDENCE_FLOOR = 0.3
    ROUNDS_MEASURED = 6  # rounds of speculation judged together against plain decoding
    PLAIN_STRETCH = 24  # plain steps before speculation is probed again

    def __init__(self, config: GenerationConfig, plain_step_seconds: float | None) -> None:
        self.adaptive = config.adaptive and config.k is None
        self.mode = config.mode
        self.window = config.window if config.mode == "fly" else 0
        self.k_min = max(2, self.window + 1)
        self.k = config.draft_length
        self.plain_step_seconds = plain_step_seconds
        self._rounds: deque[tuple[int, float]] = deque(maxlen=self.ROUNDS_MEASURED)
        self._plain_left = 0
        self.plain_steps = 0
        self.rounds = 0
        self.drafted_k_total = 0

    def next_is_plain(self) -> bool:
        """Decode this step plainly? Also used once per request to measure a plain step when none is known."""
        if not self.adaptive:
            return False
        return self.plain_step_seconds is None or self._plain_left > 0

    def shape(self, remaining: int) -> DraftShape:
        k = min(self.k, remaining)
        if not self.adaptive:
            return DraftShape(k, 0.0, 0)
        return DraftShape(k, self.CONFIDENCE_FLOOR, self.window, gate_ngrams=True)

    def record_plain(self, seconds: float) -> None:
        self.plain_steps += 1
        known = self.plain_step_seconds
        self.plain_step_seconds = seconds if known is None else 0.8 * known + 0.2 * seconds
        self._plain_left = max(0, self._plain_left - 1)

    def record_round(self, drafted: int, accepted: int, produced: int, seconds: float) -> None:
        self.rounds += 1
        self.drafted_k_total += drafted
        if not self.adaptive:
            return
        self.k = min(self.k + 2, K_MAX) if drafted and accepted == drafted else max(self.k - 1, self.k_min)
        self._rounds.append((produced, seconds))
        if len(self._rounds) == self._rounds.maxlen and self.plain_step_seconds:
            tokens = sum(p for p, _ in self._rounds)
            spent = sum(s for _, s in self._rounds)
            if tokens / spent < 1.0 / self.plain_step_seconds:
                self._plain_left = self.PLAIN_STRETCH
                self._rounds.clear()

    @property
    def mean_k(self) -> float:
        return self.drafted_k_total / self.rounds if self.rounds else 0.0
