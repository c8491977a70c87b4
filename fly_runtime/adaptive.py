"""Adaptive drafting: how many tokens to draft each round, and when not to speculate at all.

Speculation only pays when a round's tokens cost less than as many plain steps, so the policy chooses from
what it measures in the request:
- the draft length K maximises expected tokens per second. Each drafted token survives verification with
  probability p (estimated as kept / (kept + rejections), the maximum-likelihood estimate for a run that
  ends at its first rejection, with older rounds fading), so a K-token draft yields 1 + p(1 - p^K)/(1 - p)
  tokens and costs K * (draft time per token) + (verification time), both measured. FLy-forgiven tokens
  count as kept, but only a draft of at least W+1 tokens leaves a forgivable mismatch its window: shorter
  drafts are judged by the native survival probability (first native mismatch), longer ones by FLy's, and
  the better expected rate wins. So FLy drafts short only where forgiving would not pay for the window;
- where the drafter stops: below the top-1 probability where one more draft token stops paying (draft time
  / verification time, at most 0.3) its token is likely wrong. In exact mode the draft ends there. In FLy
  mode a doubtful token is exactly where the target is likely uncertain too and a mismatch may be
  forgiven, but only if ``window`` more drafts follow; so the draft runs on for the window, and ends at the
  next doubtful token;
- whether to speculate: when the last rounds produced tokens slower than plain decoding does, and the best
  K under the current estimates promises no better, decode plainly for a stretch (re-measuring the plain
  step), then probe speculation again; each failed probe doubles the stretch.
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


def round_rate(k: int, p: float, draft_seconds: float, verify_seconds: float) -> float:
    """Expected tokens per second of a K-token round whose drafts each survive with probability p."""
    kept = k if p >= 1.0 else p * (1 - p**k) / (1 - p)
    return (1 + kept) / (k * draft_seconds + verify_seconds)


def best_draft_length(p: float, draft_seconds: float, verify_seconds: float, k_min: int, k_max: int) -> int:
    """K in [k_min, k_max] with the most expected tokens per second of round time."""
    return max(range(k_min, k_max + 1), key=lambda k: round_rate(k, p, draft_seconds, verify_seconds))


class Survival:
    """Fading counts of kept drafts and rejections; ``p`` is the survival probability of a drafted token."""

    def __init__(self, prior_p: float, memory: float) -> None:
        # the prior is one round that kept p/(1-p) drafts, the mean run length at prior_p
        self.kept = prior_p / (1 - prior_p)
        self.rejections = 1.0
        self.memory = memory

    def record(self, kept: int, drafted: int) -> None:
        self.kept = self.memory * self.kept + kept
        self.rejections = self.memory * self.rejections + (kept < drafted)

    @property
    def p(self) -> float:
        return self.kept / (self.kept + self.rejections)


class DraftPolicy:
    MAX_CONFIDENCE_FLOOR = 0.3
    ROUNDS_MEASURED = 4  # rounds of speculation judged together against plain decoding
    PLAIN_STRETCH = 24  # plain steps before speculation is probed again (doubles after each failed probe)
    PRIOR_P = 0.75  # starting guess for the survival probability, worth one round of evidence
    MEMORY = 0.9  # per round, older evidence fades by this factor: a request turns from code to prose

    def __init__(self, config: GenerationConfig, plain_step_seconds: float | None) -> None:
        # the choices below follow measured times, so they differ run to run; a seeded sampling request
        # must repeat exactly, so it keeps the fixed schedule (greedy output does not depend on it)
        seeded_sampling = config.temperature > 0 and config.seed is not None
        self.adaptive = config.adaptive and config.k is None and not seeded_sampling
        self.window = config.window if config.mode == "fly" else 0
        self.k = config.draft_length
        self.plain_step_seconds = plain_step_seconds
        self._rounds: deque[tuple[int, float]] = deque(maxlen=self.ROUNDS_MEASURED)
        self._plain_left = 0
        self._stretch = self.PLAIN_STRETCH
        # survival with FLy's forgiveness, and native only (what a draft too short for the window keeps)
        self._survival = Survival(self.PRIOR_P, self.MEMORY)
        self._native_survival = Survival(self.PRIOR_P, self.MEMORY)
        self._draft_seconds_per_token: float | None = None
        self._verify_seconds: float | None = None
        self.plain_steps = 0
        self.rounds = 0
        self.drafted_k_total = 0

    def next_is_plain(self) -> bool:
        """Decode this step plainly? Also used once per engine to measure a plain step when none is known."""
        if not self.adaptive:
            return False
        return self.plain_step_seconds is None or self._plain_left > 0

    def shape(self, remaining: int) -> DraftShape:
        k = min(self.k, remaining)
        if not self.adaptive:
            return DraftShape(k, 0.0, 0)
        return DraftShape(k, self.confidence_floor(), self.window, gate_ngrams=True)

    def confidence_floor(self) -> float:
        """Drafter top-1 probability below which drafting on does not pay.

        One more draft token costs d seconds and, if it survives (probability ~ the drafter's confidence c),
        saves about one round's share of verification v; so drafting on pays while c > d / v. Cheap drafts
        (an int4 drafter: d/v ~ 0.08 here) run on through doubt; dear ones stop sooner.
        """
        if self._draft_seconds_per_token is None or not self._verify_seconds:
            return self.MAX_CONFIDENCE_FLOOR
        return min(self.MAX_CONFIDENCE_FLOOR, self._draft_seconds_per_token / self._verify_seconds)

    def record_plain(self, seconds: float) -> None:
        self.plain_steps += 1
        self.plain_step_seconds = _ema(self.plain_step_seconds, seconds)
        self._plain_left = max(0, self._plain_left - 1)

    def record_round(self, drafted: int, accepted: int, native_run: int, produced: int, draft_seconds: float,
                     verify_seconds: float) -> None:
        self.rounds += 1
        self.drafted_k_total += drafted
        if not self.adaptive:
            return
        self._survival.record(accepted, drafted)
        self._native_survival.record(native_run, drafted)
        if drafted:
            self._draft_seconds_per_token = _ema(self._draft_seconds_per_token, draft_seconds / drafted)
        self._verify_seconds = _ema(self._verify_seconds, verify_seconds)
        self.k = self._best_k()

        self._rounds.append((produced, draft_seconds + verify_seconds))
        if len(self._rounds) == self._rounds.maxlen and self.plain_step_seconds:
            tokens = sum(n for n, _ in self._rounds)
            spent = sum(s for _, s in self._rounds)
            plain_rate = 1.0 / self.plain_step_seconds
            # both the rounds just measured and the best K the estimates promise must lose to plain decoding:
            # a few unlucky rounds alone do not stop speculation that should pay
            if tokens / spent < plain_rate and self._best_rate() < plain_rate:
                self._plain_left = self._stretch
                self._stretch *= 2
                self._rounds.clear()

    def _rate(self, k: int) -> float:
        """Expected tokens per second of a K-token round; FLy forgives only in drafts longer than its window."""
        survival = self._survival if k > self.window else self._native_survival
        assert self._verify_seconds is not None
        return round_rate(k, survival.p, self._draft_seconds_per_token or 0.0, self._verify_seconds)

    def _best_rate(self) -> float:
        return self._rate(self.k)

    def _best_k(self) -> int:
        return max(range(1, K_MAX + 1), key=self._rate)

    @property
    def mean_k(self) -> float:
        return self.drafted_k_total / self.rounds if self.rounds else 0.0


def _ema(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample
