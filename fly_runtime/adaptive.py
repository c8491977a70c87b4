"""Adaptive drafting: how many tokens to draft each round, and when not to speculate at all.

Speculation pays only where a round's tokens cost less than as many plain steps, so the policy chooses from
what it measures in the request: the draft length (expected tokens per second, from per-position survival
and a fitted round cost, never below the mode's default), where the drafter stops (its confidence), whether
FLy's window room pays, and when to fall back to plain decoding. The measurements behind each rule are in
docs/design.md, "Adaptive drafting".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from fly_runtime.config import DEFAULT_K, GenerationConfig
from fly_runtime.drafters import DraftShape

K_MAX = 16


class Survival:
    """Fading counts, per draft position, of drafts that reached the position and of those that survived it.

    Acceptance comes in streaks, so one survival rate for every position undervalues long drafts. A position
    seldom reached leans on the pooled rate by ``SHRINK`` drafts' worth instead of a stale count.
    """

    SHRINK = 2.0

    def __init__(self, prior_p: float, memory: float) -> None:
        self.reached = np.zeros(K_MAX)
        self.survived = np.zeros(K_MAX)
        # the pooled prior is one round that kept prior_p / (1 - prior_p) drafts, the mean run at prior_p
        self._prior_reached = 1 / (1 - prior_p)
        self._prior_survived = prior_p / (1 - prior_p)
        self.memory = memory

    def record(self, kept: int, drafted: int) -> None:
        for counts in (self.reached, self.survived):
            counts *= self.memory
        self._prior_reached *= self.memory
        self._prior_survived *= self.memory
        self.reached[: min(kept + 1, drafted)] += 1
        self.survived[:kept] += 1

    @property
    def pooled(self) -> float:
        return (self.survived.sum() + self._prior_survived) / (self.reached.sum() + self._prior_reached)

    def expected_kept(self) -> np.ndarray:
        """Expected drafts kept of a K-token draft for K = 1..K_MAX: sum over i <= K of P(drafts 1..i survive)."""
        p = (self.survived + self.SHRINK * self.pooled) / (self.reached + self.SHRINK)
        return np.cumsum(np.cumprod(p))


class RoundCost:
    """Seconds of a K-draft round (drafting + verification) as a + b*K, fitted to recent rounds (fading).

    Most of a round's cost does not grow with K (one target pass over K+1 tokens, crops, the verdict); each
    draft adds a drafter pass. Rounds seldom vary K much, so the slope leans on a prior (``PRIOR_SLOPE`` plain
    steps per draft) worth ``PRIOR_WEIGHT`` rounds of K spread.
    """

    PRIOR_SLOPE = 0.1
    PRIOR_WEIGHT = 1.0

    def __init__(self, memory: float) -> None:
        self.memory = memory
        self._sums = np.zeros(5)  # weights, K, K^2, seconds, K * seconds

    def record(self, k: int, seconds: float) -> None:
        self._sums = self.memory * self._sums + np.array([1.0, k, k * k, seconds, k * seconds])

    def seconds(self, k: np.ndarray, plain_step_seconds: float) -> np.ndarray:
        n, sk, skk, sv, skv = self._sums
        mean_k, mean_v = sk / n, sv / n
        spread = skk - n * mean_k**2
        slope = (skv - n * mean_k * mean_v + self.PRIOR_WEIGHT * self.PRIOR_SLOPE * plain_step_seconds) / (
            spread + self.PRIOR_WEIGHT)
        return mean_v + max(slope, 0.0) * (k - mean_k)


class ForgivenessRoom:
    """Does FLy's room (drafts long enough for a forgiven mismatch to be checked) pay in this request?

    Each long FLy round is set against what exact matching's shortest draft (``short_k`` tokens) would have
    made of it: greedy drafts do not depend on K, so its tokens are the drafts matched before the first
    mismatch (at most ``short_k``) plus the target's; its time is interpolated from the round's own.
    """

    MIN_ROUNDS = 8  # long rounds judged before the room may be given up
    MARGIN = 1.05  # short drafts must promise this much more throughput: the judgement ends forgiving for good

    def __init__(self, short_k: int, memory: float) -> None:
        self.short_k = short_k
        self.memory = memory
        self.rounds = 0
        self._sums = np.zeros(4)  # tokens and seconds of the rounds as drafted, then as short drafts

    def record(self, drafted: int, matched: int, produced: int, draft_seconds: float, verify_seconds: float,
               plain_step_seconds: float) -> None:
        if drafted <= self.short_k:  # cut short by the drafter's doubt: the same round either way
            return
        share = self.short_k / drafted
        short_seconds = (draft_seconds * share + plain_step_seconds
                         + max(verify_seconds - plain_step_seconds, 0.0) * share)
        short = np.array([produced, draft_seconds + verify_seconds, min(matched, self.short_k) + 1, short_seconds])
        self._sums = self.memory * self._sums + short
        self.rounds += 1

    def loses(self) -> bool:
        tokens, seconds, short_tokens, short_seconds = self._sums
        return self.rounds >= self.MIN_ROUNDS and short_tokens / short_seconds > self.MARGIN * tokens / seconds


@dataclass(frozen=True)
class CostProfile:
    """The engine's measured prices, in seconds: a one-token target step, each further token of a target
    pass (what verifying one more draft adds), and one drafter token (0 for prompt lookup)."""

    step: float
    row: float
    draft: float

    # a drafter agreeing with the target this often is the good case: model drafting must beat plain decoding
    # there by PAY_MARGIN to be tried at all (docs/design.md, "Figures behind the constants")
    OPTIMISTIC_SURVIVAL = 0.8
    PAY_MARGIN = 1.25

    def round_seconds(self, k: np.ndarray, by_model: bool) -> np.ndarray:
        return (k * self.draft if by_model else 0.0) + self.step + k * self.row

    def best_speedup(self, survival: float, by_model: bool) -> float:
        """Tokens per second of the best K-token round over those of plain steps, at a per-token survival."""
        k = np.arange(1, K_MAX + 1)
        kept = np.cumsum(survival ** k)
        return float(np.max((1 + kept) / self.round_seconds(k, by_model)) * self.step)

    def model_drafts_pay(self) -> bool:
        return self.best_speedup(self.OPTIMISTIC_SURVIVAL, by_model=True) >= self.PAY_MARGIN

    def shared(self, requests: int) -> "CostProfile":
        """The prices as a pass shared by ``requests`` requests sees them: a draft's rows slow every request in
        the pass, so a draft pays only where it adds tokens faster than the pass makes them, and the step a
        draft must beat is the pass's time per token it makes (one a request)."""
        if requests <= 1:
            return self
        return CostProfile((self.step + (requests - 1) * self.row) / requests, self.row, self.draft)


class LookupGate:
    """How much of a prompt-lookup proposal to verify: the length whose expected tokens per second beat a
    plain step most, from the request's own lookup survival, or none (decode plainly). Verification is not
    free on a CPU target (each drafted token adds a row to the target pass), so a lookup that usually misses
    loses to plain decoding. After ``PROBE_EVERY`` proposals skipped it verifies one token again, since a
    reply can turn to copying its prompt later."""

    PROBE_EVERY = 16

    def __init__(self, costs: CostProfile | None, prior_p: float, memory: float) -> None:
        self.costs = costs
        self.survival = Survival(prior_p, memory)
        self._skipped = 0

    def length(self, proposed: int, sharing: int = 1) -> int:
        """How many of ``proposed`` lookup tokens to verify in a pass shared by ``sharing`` requests."""
        if self.costs is None or proposed == 0:
            return proposed
        costs = self.costs.shared(sharing)
        k = np.arange(1, proposed + 1)
        rates = (1 + self.survival.expected_kept()[:proposed]) / costs.round_seconds(k, by_model=False)
        best = int(np.argmax(rates))
        if rates[best] * costs.step > 1.0:
            return best + 1
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            return 1
        return 0

    def record(self, kept: int, drafted: int) -> None:
        if drafted:
            self.survival.record(kept, drafted)


class DraftPolicy:
    MAX_CONFIDENCE_FLOOR = 0.05
    # rounds judged together against plain decoding, and by how much they must lose: kept tokens vary a lot
    # from round to round, so fewer rounds or a tighter margin fall back on noise
    ROUNDS_MEASURED = 16
    FALLBACK_MARGIN = 0.85
    PLAIN_STRETCH = 24  # plain steps before speculation is probed again (doubles after each failed probe)
    PRIOR_P = 0.75  # starting guess for the survival probability, worth one round of evidence
    MEMORY = 0.9  # per round, older evidence fades by this factor: a request turns from code to prose

    def __init__(self, config: GenerationConfig, plain_step_seconds: float | None,
                 costs: CostProfile | None = None, lookup_prior: float | None = None) -> None:
        """``lookup_prior``: how often a lookup draft survives a position in requests like this one, as the engine
        learned it (``PRIOR_P`` where None): where it is low, a request whose target verifies a row for most of a
        step (llama.cpp) does not spend rows finding out again that its lookups miss."""
        # the choices below follow measured times, so they differ run to run; a seeded sampling request
        # must repeat exactly, so it keeps the fixed schedule (greedy output does not depend on it)
        seeded_sampling = config.temperature > 0 and config.seed is not None
        self.adaptive = config.adaptive and config.k is None and not seeded_sampling
        self.window = config.window if config.mode == "fly" else 0
        self.ngrams = config.ngram  # a model drafter checks prompt-lookup n-grams first
        self.suffix = config.suffix_drafts  # prompt lookup may draw on earlier replies
        self.k = config.draft_length
        # adaptive drafts are at least the mode's fixed default long: shorter ones lost to it where acceptance was
        # middling, and below K = W + 2 FLy cannot forgive at all. FLy gives that room up only where the fallback
        # test or its own rounds (ForgivenessRoom) say it loses
        self.min_k = self.k
        self._room = ForgivenessRoom(DEFAULT_K["exact"], self.MEMORY) if self.min_k > DEFAULT_K["exact"] else None
        self.plain_step_seconds = plain_step_seconds
        self._rounds: deque[tuple[int, float]] = deque(maxlen=self.ROUNDS_MEASURED)
        self._plain_left = 0
        self._stretch = self.PLAIN_STRETCH
        self._survival = Survival(self.PRIOR_P, self.MEMORY)  # FLy-forgiven drafts count as survivors
        self._draft_seconds_per_token: float | None = None
        self._verify_seconds: float | None = None
        self._round_cost = RoundCost(self.MEMORY)
        self.plain_steps = 0
        self.rounds = 0
        self.drafted_k_total = 0
        # where even a drafter that nearly always agrees could not beat plain steps at the engine's measured
        # prices (a fast quantised target beside a drafter a third of its cost), the request never drafts with
        # the model: it verifies prompt-lookup proposals where they pay and decodes plainly elsewhere
        self.model_drafts = not (self.adaptive and costs is not None and not costs.model_drafts_pay())
        self.lookup = LookupGate(costs if self.adaptive else None,
                                 self.PRIOR_P if lookup_prior is None else lookup_prior, self.MEMORY)
        # earlier replies' drafts (suffix drafts) are priced apart: where they miss (another schema's values, another
        # task's calls) they must not close the gate on the request's own prompt, which its reply copies
        self.history_lookup = LookupGate(costs if self.adaptive else None, self.PRIOR_P, self.MEMORY)

    def lookup_gate(self, borrowed: bool) -> "LookupGate":
        """The gate pricing a lookup proposal: from an earlier reply (``borrowed``) or from the request itself."""
        return self.history_lookup if borrowed else self.lookup

    def next_is_plain(self) -> bool:
        """Decode this step plainly? Also used once per engine to measure a plain step when none is known."""
        if not self.adaptive:
            return False
        return self.plain_step_seconds is None or self._plain_left > 0

    def shape(self, remaining: int, strict: int = 0) -> DraftShape:
        """This round's draft; its first ``strict`` drafts will be verified exactly whatever the mode (the
        reply's opening)."""
        if not self.adaptive:
            return DraftShape(min(self.k, remaining), 0.0, 0, self.ngrams, history=self.suffix)
        k = self.k
        if self.window and k - self.window <= strict:
            # every draft a mismatch could be forgiven at lies in the exactly verified opening: the room buys
            # nothing this round, so draft as exact matching would
            k = self._best_k(self._rates(), DEFAULT_K["exact"]) if self._verify_seconds else DEFAULT_K["exact"]
        k = min(k, remaining)
        # a draft that leaves no forgivable mismatch a window of checked drafts drafts like exact matching
        extension = self.window if self.window and k - self.window > strict else 0
        return DraftShape(k, self.confidence_floor(), extension, self.ngrams, gate_ngrams=True, history=self.suffix)

    def confidence_floor(self) -> float:
        """Drafter top-1 probability below which drafting on does not pay: one more draft costs d seconds and,
        kept, saves about v (a round's verification), so the floor is d / v; capped at
        ``MAX_CONFIDENCE_FLOOR``, since the drafter's confidence understates its tokens' survival."""
        if self._draft_seconds_per_token is None or not self._verify_seconds:
            return self.MAX_CONFIDENCE_FLOOR
        return min(self.MAX_CONFIDENCE_FLOOR, self._draft_seconds_per_token / self._verify_seconds)

    def record_plain(self, seconds: float | None) -> None:
        """A plain step took ``seconds``; None: its time was not this request's own (a pass shared with other
        requests), so only the step is counted."""
        self.plain_steps += 1
        if seconds is None:
            return
        self.plain_step_seconds = _ema(self.plain_step_seconds, seconds)
        self._plain_left = max(0, self._plain_left - 1)

    def record_round(self, drafted: int, accepted: int, produced: int, draft_seconds: float,
                     verify_seconds: float, matched: int | None = None) -> None:
        """One speculative round: drafts made and kept, tokens produced, and its times. ``matched``: drafts
        before the first mismatch (default ``accepted``: nothing was forgiven)."""
        self.rounds += 1
        self.drafted_k_total += drafted
        if not self.adaptive:
            return
        if drafted:  # a round whose draft was dropped whole cost a plain step: no evidence on drafts or their cost
            self._survival.record(accepted, drafted)
            self._draft_seconds_per_token = _ema(self._draft_seconds_per_token, draft_seconds / drafted)
            self._verify_seconds = _ema(self._verify_seconds, verify_seconds)
            self._round_cost.record(drafted, draft_seconds + verify_seconds)
        if self._verify_seconds is None:
            return
        if self._room is not None and self.plain_step_seconds:  # rounds of no long draft it skips itself
            self._room.record(drafted, accepted if matched is None else matched, produced, draft_seconds,
                              verify_seconds, self.plain_step_seconds)
            if self._room.loses():
                self._give_up_room()
        rates = self._rates()
        self.k = self._best_k(rates)

        self._rounds.append((produced, draft_seconds + verify_seconds))
        if len(self._rounds) == self._rounds.maxlen and self.plain_step_seconds:
            tokens = sum(n for n, _ in self._rounds)
            spent = sum(s for _, s in self._rounds)
            plain_rate = 1.0 / self.plain_step_seconds
            # both the rounds just measured and the best K the estimates promise must lose to plain decoding:
            # a few unlucky rounds alone do not stop speculation that should pay
            if tokens / spent < self.FALLBACK_MARGIN * plain_rate and rates[self.k - 1] < plain_rate:
                if self._room is not None:
                    # FLy gives up its window's room before speculation itself: drafts as long as exact
                    # matching's, which lose less where forgiving does not pay
                    self._give_up_room()
                    self.k = self._best_k(rates)
                else:
                    self._plain_left = self._stretch
                    self._stretch *= 2
                self._rounds.clear()

    def _give_up_room(self) -> None:
        self.min_k = DEFAULT_K["exact"]
        self._room = None

    def _best_k(self, rates: np.ndarray, floor: int | None = None) -> int:
        """The draft length of highest expected rate, at least ``floor`` (default ``min_k``)."""
        floor = self.min_k if floor is None else floor
        return int(np.argmax(rates[floor - 1 :])) + floor

    def _rates(self) -> np.ndarray:
        """Expected tokens per second of a K-token round for K = 1..K_MAX."""
        assert self._verify_seconds is not None
        k = np.arange(1, K_MAX + 1)
        kept = self._survival.expected_kept()
        return (1 + kept) / self._round_cost.seconds(k, self.plain_step_seconds or self._verify_seconds)

    @property
    def mean_k(self) -> float:
        return self.drafted_k_total / self.rounds if self.rounds else 0.0


class DeferredRead:
    """When the model drafter should read the prompt: a rent-or-buy choice made per request.

    The read is a share of the target's prefill (``PRIOR_READ_SHARE`` until measured), paid before a single
    draft, which a short answer to a long prompt never repays. Until it reads, the request decodes from prompt
    lookup alone (or plainly) and adds up what the drafter would have saved (each step's time beyond its
    tokens at ``DRAFTER_SPEEDUP`` times the plain rate, an optimistic guess that buys early); once that regret
    reaches the read's price, it reads (ski rental: never worse than twice the better choice). A read priced at
    a few plain steps is bought at once (``READ_AT_ONCE_STEPS``).
    """

    DRAFTER_SPEEDUP = 2.0
    PRIOR_READ_SHARE = 0.25  # drafter read seconds / target prefill seconds, until a read is measured
    MIN_MEASURED_READ = 64  # tokens; shorter reads are dominated by per-call overhead
    # a read priced at up to this many plain steps is bought at once: most answers repay it, and renting
    # first costs short answers most
    READ_AT_ONCE_STEPS = 6.0

    def __init__(self, read_share: float | None, target_seconds_per_token: float) -> None:
        self._measured = read_share is not None
        self.read_share = self.PRIOR_READ_SHARE if read_share is None else read_share
        self.target_seconds_per_token = target_seconds_per_token
        self.regret = 0.0

    def price(self, unread: int) -> float:
        """Estimated seconds for the drafter to read ``unread`` tokens."""
        return self.read_share * self.target_seconds_per_token * unread

    def record(self, tokens: int, seconds: float, plain_step_seconds: float) -> None:
        self.regret += max(0.0, seconds - tokens * plain_step_seconds / self.DRAFTER_SPEEDUP)

    def due(self, unread: int, plain_step_seconds: float | None, budget: int) -> bool:
        """Read now? At once where the read is cheap and the token budget could repay it, else once the
        savings forgone match its price."""
        price = self.price(unread)
        if plain_step_seconds is not None:
            repayable = budget * (1 - 1 / self.DRAFTER_SPEEDUP)  # plain steps drafting could save at best
            if price <= min(self.READ_AT_ONCE_STEPS, repayable) * plain_step_seconds:
                return True
        return self.regret >= price

    def learn(self, unread: int, seconds: float) -> float:
        """The read share measured on a read of ``unread`` tokens (kept where the read was too short to tell)."""
        if unread >= self.MIN_MEASURED_READ and self.target_seconds_per_token > 0:
            share = seconds / unread / self.target_seconds_per_token
            self.read_share = _ema(self.read_share if self._measured else None, share, 0.5)
            self._measured = True
        return self.read_share


def _ema(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample
