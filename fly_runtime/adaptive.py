"""Adaptive drafting: how many tokens to draft each round, and when not to speculate at all.

Speculation only pays when a round's tokens cost less than as many plain steps, so the policy chooses from
what it measures in the request:
- the draft length K maximises expected tokens per second, but never drops below the mode's fixed default
  (5 exact; 8 FLy while its room pays, see below and ``DraftPolicy.__init__``). A K-token draft yields
  1 + sum over i <= K of P(the first i drafts survive) tokens, from per-position survival estimates (see
  ``Survival``; FLy-forgiven drafts count as survivors), and costs a + b*K seconds, fitted to the measured
  rounds (see ``RoundCost``). Verifying K drafts is one target pass over K+1 tokens, which on a
  memory-bound target costs little more than a plain step, so long drafts cost only b each;
- where the drafter stops: below the top-1 probability where one more draft token stops paying (draft time
  / verification time, at most 0.05) its token is likely wrong. In exact mode the draft ends there. In FLy
  mode a doubtful token is exactly where the target is likely uncertain too and a mismatch may be
  forgiven, but only if ``window`` more drafts follow; so the draft runs on for the window, and ends at the
  next doubtful token;
- whether FLy's room pays: FLy drafts at least its default K (8) so that a mismatch can be followed by a
  window of checked drafts; where its rounds made fewer tokens per second than exact matching's shortest
  drafts would have made of the same rounds (see ``ForgivenessRoom``), it gives that room up for the rest
  of the request;
- whether to speculate: when the last rounds produced tokens clearly slower than plain decoding does (by
  ``FALLBACK_MARGIN``), and the best K under the current estimates promises no better, FLy first gives up
  its room; after that, or in exact mode, decode plainly for a stretch (re-measuring the plain step), then
  probe speculation again; each failed probe doubles the stretch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from fly_runtime.config import DEFAULT_K, GenerationConfig

K_MAX = 16


@dataclass(frozen=True)
class DraftShape:
    k: int  # most tokens to draft this round
    confidence_floor: float  # drafter stops (or starts its extension) below this top-1 probability
    extension: int  # tokens drafted past the first doubtful one (FLy's window), 0 = stop at once
    gate_ngrams: bool = False  # stop offering n-gram proposals in a request where the drafter rejects them


class Survival:
    """Fading counts, per draft position, of drafts that reached the position and of those that survived it.

    Acceptance comes in streaks: a draft is often wrong at its first token and, once right, right for a
    while. One survival probability for every position (the geometric model) then undervalues long drafts:
    on a Spec-Bench writing prompt it settled on K = 1-2 and fell back to plain decoding (0.85x), where a
    fixed K = 5 ran 1.18x faster than plain. Each position's estimate leans on
    the pooled one (all positions together, the geometric estimate) by ``SHRINK`` drafts' worth, so a
    position seldom reached follows the pooled rate instead of a stale count.
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

    Much of a round's cost does not grow with K: the target pass over K+1 tokens costs little more than a
    plain step on a memory-bound target, and cache crops and the verdict come once per round; each draft
    token adds one drafter pass (~15% of a target step for the int4 0.5B drafter here) and a little
    verification. The intercept and slope are fitted rather than assumed, since both depend on the pair, the
    machine and the context length. Rounds seldom vary K much, so the slope leans on a prior
    (``PRIOR_SLOPE`` plain steps per draft) worth ``PRIOR_WEIGHT`` rounds of K spread.
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
    made of the same round. Its tokens are known exactly: greedy drafts do not depend on K (sampled ones
    only in distribution), so the short draft would have kept the drafts matched before the first
    mismatch, at most ``short_k``, plus the target's token. Its cost comes from the round's own
    measurements: ``short_k`` drafts at the round's time per draft, and a verification that grows linearly
    from one plain step to the round's. On Spec-Bench roleplay, where the drafter and target disagree early
    and a mismatch with ``window`` agreeing drafts after it is rare, FLy's 8-token rounds made 6.2-6.9
    tokens/s where 5-token drafts of the same rounds would have made 7.8-8.4 (the request ran at 0.93x of
    plain decoding against exact matching's 1.24x). Where forgiving pays, a forgiven round keeps far more
    than its matched prefix and the room stays. On 10 held-out Spec-Bench prompts (the 3rd and 4th of
    writing, roleplay, reasoning, stem, humanities) FLy ran at 1.36x of plain decoding with this test and
    1.33x without it (exact matching: 1.33x); it lost most on one writing prompt (1.22x against 1.31x: 2
    forgiven tokens against 3).
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

    # a drafter agreeing with the target this often is the best case: model drafting must beat plain decoding
    # there by PAY_MARGIN to be tried at all
    OPTIMISTIC_SURVIVAL = 0.9
    PAY_MARGIN = 1.1

    def round_seconds(self, k: np.ndarray, by_model: bool) -> np.ndarray:
        return (k * self.draft if by_model else 0.0) + self.step + k * self.row

    def best_speedup(self, survival: float, by_model: bool) -> float:
        """Tokens per second of the best K-token round over those of plain steps, at a per-token survival."""
        k = np.arange(1, K_MAX + 1)
        kept = np.cumsum(survival ** k)
        return float(np.max((1 + kept) / self.round_seconds(k, by_model)) * self.step)

    def model_drafts_pay(self) -> bool:
        return self.best_speedup(self.OPTIMISTIC_SURVIVAL, by_model=True) >= self.PAY_MARGIN


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

    def length(self, proposed: int) -> int:
        if self.costs is None or proposed == 0:
            return proposed
        k = np.arange(1, proposed + 1)
        rates = (1 + self.survival.expected_kept()[:proposed]) / self.costs.round_seconds(k, by_model=False)
        best = int(np.argmax(rates))
        if rates[best] * self.costs.step > 1.0:
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
    # rounds of speculation judged together against plain decoding, and by how much they must lose. Kept tokens
    # per round vary 1-6 from round to round, so 8 rounds judged against plain alone were noise: on a writing
    # prompt where fixed K = 5 ran 1.13x faster than plain, the worst 8-round stretches ran at 0.56x and 0.82x,
    # and falling back cost 54 plain steps (exact 20.2 s against 17.9 s)
    ROUNDS_MEASURED = 16
    FALLBACK_MARGIN = 0.85
    PLAIN_STRETCH = 24  # plain steps before speculation is probed again (doubles after each failed probe)
    PRIOR_P = 0.75  # starting guess for the survival probability, worth one round of evidence
    MEMORY = 0.9  # per round, older evidence fades by this factor: a request turns from code to prose

    def __init__(self, config: GenerationConfig, plain_step_seconds: float | None,
                 costs: CostProfile | None = None) -> None:
        # the choices below follow measured times, so they differ run to run; a seeded sampling request
        # must repeat exactly, so it keeps the fixed schedule (greedy output does not depend on it)
        seeded_sampling = config.temperature > 0 and config.seed is not None
        self.adaptive = config.adaptive and config.k is None and not seeded_sampling
        self.window = config.window if config.mode == "fly" else 0
        self.k = config.draft_length
        # adaptive drafts are at least the mode's fixed default long. The rate model prefers shorter drafts
        # wherever acceptance is middling, and measured, those lose: on Spec-Bench prose (writing, roleplay,
        # translation) exact drafts of K = 4 kept 0.1-0.4 fewer tokens per round than K = 5 (tau 2.61 / 2.67
        # against 2.72 / 3.12) for ~0.14 plain steps saved per draft token, and K = 2-3 drafts were slow enough to
        # trip the fallback (24-72 plain steps) where a fixed K = 5 ran 1.2-1.3x faster than plain. FLy forgives
        # a mismatch only with ``window`` checked drafts after it, so below K = 8 it forgives at most at draft
        # 1 and drafts like exact matching: FLy with K = 5-7 ran at 5.3 / 4.8 / 3.8 tokens/s on three prose
        # prompts where K = 8 ran at 8.2 / 4.9 / 4.7 (measured before the engine kept torch to one thread).
        # Letting the rate model take FLy down to K = 5 wherever its forgiving survival (counted only where a
        # draft left the window room) did not beat the native one ran no faster since (8 Spec-Bench prompts:
        # 1.41x against 1.42x): forgiveness is rare per round (0-4 per 128 tokens) but rescues a whole draft
        # when it comes, so a request that gave up K >= 8 early lost it where it paid (writing 1.53x / 1.24x
        # against 1.64x / 1.40x, code 2.66x against 3.07x). So FLy gives up its room only where the fallback
        # test says speculation is losing, or where the request's own rounds show that exact's shortest drafts
        # would have done better (``ForgivenessRoom``); where even exact's default does not pay, the fallback
        # decides.
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
        self.lookup = LookupGate(costs if self.adaptive else None, self.PRIOR_P, self.MEMORY)

    def next_is_plain(self) -> bool:
        """Decode this step plainly? Also used once per engine to measure a plain step when none is known."""
        if not self.adaptive:
            return False
        return self.plain_step_seconds is None or self._plain_left > 0

    def shape(self, remaining: int, strict: int = 0) -> DraftShape:
        """This round's draft; its first ``strict`` drafts will be verified exactly whatever the mode (the
        reply's opening)."""
        if not self.adaptive:
            return DraftShape(min(self.k, remaining), 0.0, 0)
        k = self.k
        if self.window and k - self.window <= strict:
            # every draft a mismatch could be forgiven at (those with a window of drafts after them) is verified
            # exactly: the room buys nothing this round, so draft as exact matching would. In the opening of a
            # short answer (Spec-Bench extraction: 13-15 tokens) that is the whole reply
            k = self._best_k(self._rates(), DEFAULT_K["exact"]) if self._verify_seconds else DEFAULT_K["exact"]
        k = min(k, remaining)
        # a draft that leaves no forgivable mismatch a window of checked drafts drafts like exact matching
        extension = self.window if self.window and k - self.window > strict else 0
        return DraftShape(k, self.confidence_floor(), extension, gate_ngrams=True)

    def confidence_floor(self) -> float:
        """Drafter top-1 probability below which drafting on does not pay.

        One more draft token costs d seconds and, if it survives, saves about one round's share of
        verification v; so drafting on pays while P(survive) > d / v. The drafter's confidence c understates
        P(survive) well below 1: on Spec-Bench (6 categories, K=5) the target kept reached draft tokens at
        c in 0.1-0.2 about half the time (0.49, n=39), at 0.3-0.5 0.52, and only below 0.1 none (0/4). So the
        floor is d / v but at most ``MAX_CONFIDENCE_FLOOR``: at 0.3 it cut drafts the target would have kept
        (8 prose prompts: 141 s with it, 135 s without, 130 s at a fixed K=5).
        """
        if self._draft_seconds_per_token is None or not self._verify_seconds:
            return self.MAX_CONFIDENCE_FLOOR
        return min(self.MAX_CONFIDENCE_FLOOR, self._draft_seconds_per_token / self._verify_seconds)

    def record_plain(self, seconds: float) -> None:
        self.plain_steps += 1
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

    Before it drafts a single token the drafter must read the whole prompt, which costs about a quarter of
    the target's prefill for the 0.5B / 1.5B pair here, and many requests end before drafting repays that:
    on Spec-Bench the short answer to a 741-token RAG prompt ran at 0.88x of plain decoding with the read and
    1.09x with prompt lookup alone. So until the drafter reads, a request decodes from prompt lookup alone
    (free to draft, strong where the answer copies the prompt) or plainly where lookup finds nothing, and adds
    up the time the drafter would have saved: each step's seconds beyond its tokens at ``DRAFTER_SPEEDUP``
    times the plain rate. Once that regret reaches the price of the read, the drafter reads (ski rental: in
    hindsight never worse than twice the better choice). Where lookup alone keeps up, nothing is forgone and
    the drafter never reads. The speedup is a deliberately optimistic guess: it makes the read come early,
    which costs little where drafting turns out poor (the policy then falls back) and forgoes little where
    it turns out good. A read priced at a few plain steps is bought at once (``READ_AT_ONCE_STEPS``): the
    worst case ski rental guards against, an answer too short to repay it, is the rare one.
    """

    DRAFTER_SPEEDUP = 2.0
    PRIOR_READ_SHARE = 0.25  # drafter read seconds / target prefill seconds, until a read is measured
    MIN_MEASURED_READ = 64  # tokens; shorter reads are dominated by per-call overhead
    # a read priced at up to this many plain steps is bought at once. Most answers run long enough to repay a
    # few steps, and renting first costs short answers most: with the read of a 65-200 token prompt (1-3.6
    # steps here) deferred, Spec-Bench reasoning and extraction answers of 11-15 tokens spent 2-3 plain steps
    # and lookup rounds first and ran at 0.88-0.99x of plain decoding, against 1.14-1.33x reading at once.
    # Summaries and RAG prompts (660-740 tokens, 11 steps) still rent.
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
