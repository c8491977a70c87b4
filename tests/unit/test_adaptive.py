"""Adaptive drafting policy on synthetic measurements (no model)."""

import random

import numpy as np

from fly_runtime.adaptive import K_MAX, DeferredRead, DraftPolicy, ForgivenessRoom, RoundCost
from fly_runtime.drafters import DraftShape
from fly_runtime.config import DEFAULT_K, GenerationConfig


def _k_after(p: float, draft_seconds: float, verify_per_draft: float = 0.01, rounds: int = 200) -> float:
    """Mean K the policy drafts when each drafted token survives with probability ``p`` (seeded)."""
    rng = random.Random(0)
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    for _ in range(rounds):
        k = policy.k
        kept = next((i for i in range(k) if rng.random() >= p), k)
        policy.record_round(k, kept, kept + 1, k * draft_seconds, 0.2 + k * verify_per_draft)
    return policy.mean_k


def test_draft_length_follows_acceptance_and_cost():
    assert _k_after(0.25, 0.02) < DEFAULT_K["exact"] + 0.1  # poor acceptance: the shortest draft allowed
    assert _k_after(0.7, 0.02) < _k_after(0.8, 0.02) < _k_after(0.9, 0.02)
    assert _k_after(0.8, 0.005) > _k_after(0.8, 0.05)  # cheaper drafts justify longer ones
    assert _k_after(0.8, 0.02, verify_per_draft=0.001) > _k_after(0.8, 0.02, verify_per_draft=0.05)
    assert _k_after(1.0, 0.005) > K_MAX - 0.5  # all but the first rounds draft the most allowed


def test_streaky_acceptance_earns_longer_drafts_than_its_mean_suggests():
    # both requests keep 8 drafts per 2 rejections (pooled survival 0.8) from 8-token drafts that cost the
    # same; one loses two in three drafts at their first token and keeps the third whole, the other keeps 4
    # of every draft. One survival rate for every position cannot tell them apart; the first deserves more K
    streaky = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    steady = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    for i in range(60):
        kept = 8 if i % 3 == 0 else 0
        streaky.record_round(8, kept, kept + 1, 8 * 0.02, 0.2 + 8 * 0.01)
        if i % 3 == 0:  # two rounds of 4 kept for every three of the streaky: the same counts in all
            for _ in range(2):
                steady.record_round(8, 4, 5, 8 * 0.02, 0.2 + 8 * 0.01)
    assert streaky.k > steady.k


def test_drafts_stay_at_least_the_default_k_and_fall_back_where_that_does_not_pay():
    # a memory-bound target: verifying K drafts costs 1 + 0.05 K plain steps, a draft token 10% of one; one
    # draft in three keeps its first token, none keeps a second. A 1-token draft would beat plain decoding
    # (5 tokens/s) by a little on this model; measured, such drafts lose, so the policy drafts the default K and,
    # that being clearly slower than plain, falls back
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    for i in range(2 * DraftPolicy.ROUNDS_MEASURED):
        if policy.next_is_plain():
            break
        k = policy.k
        assert k >= DEFAULT_K["exact"]
        kept = min(int(i % 3 == 0), k)
        policy.record_round(k, kept, kept + 1, k * 0.02, 0.2 + k * 0.01)
    assert policy.next_is_plain() and i >= DraftPolicy.ROUNDS_MEASURED


def test_policy_shrinks_k_to_the_mode_default_when_drafts_die_early():
    exact = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.17)
    fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
    ks = []
    for _ in range(10):
        for policy in (exact, fly):
            policy.record_round(policy.k + 4, 1, 2, (policy.k + 4) * 0.05, 0.23)
        ks.append(fly.k)
    assert exact.k == DEFAULT_K["exact"]
    # FLy keeps the room its window needs (8 > window 6) until it has seen enough rounds to judge it; nothing
    # was forgiven, and 5-token drafts of the same rounds would have kept as much at less cost: it gives it up
    judged = ForgivenessRoom.MIN_ROUNDS
    assert ks[: judged - 1] == [DEFAULT_K["fly"]] * (judged - 1)
    assert ks[judged - 1 :] == [DEFAULT_K["exact"]] * (10 - judged + 1)
    assert fly.shape(100).extension == 0


def test_fly_drafts_longer_while_forgiveness_pays():
    fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
    for _ in range(10):
        # natively the drafts die after one token, but FLy keeps all of them
        fly.record_round(fly.k, fly.k, fly.k + 1, fly.k * 0.02, 0.23, matched=1)
    assert fly.k > DEFAULT_K["fly"]


def test_fly_drafts_like_exact_where_its_room_lies_in_the_exactly_verified_opening():
    fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
    window, k = fly.window, DEFAULT_K["fly"]
    # with K = 8 and W = 6 only drafts 1-2 can be forgiven; while both lie in the opening nothing can
    assert fly.shape(100, strict=k - window) == fly.shape(100, strict=k) == DraftShape(
        DEFAULT_K["exact"], fly.confidence_floor(), 0, ngrams=True, gate_ngrams=True)
    # once the second of them lies past the opening, the room is back
    assert fly.shape(100, strict=k - window - 1) == fly.shape(100) == DraftShape(
        k, fly.confidence_floor(), window, ngrams=True, gate_ngrams=True)
    # the short draft follows the measured rates like exact's: long where drafts survive
    for _ in range(10):
        fly.record_round(fly.k, fly.k, fly.k + 1, fly.k * 0.02, 0.23)
    assert fly.shape(100, strict=k).k > DEFAULT_K["exact"]
    assert DraftPolicy(GenerationConfig(mode="exact"), 0.17).shape(100, strict=16).k == DEFAULT_K["exact"]


def test_fly_keeps_its_room_where_occasional_forgiveness_outweighs_its_cost():
    # one round in four forgives a mismatch at the first draft and keeps all its drafts; the other rounds keep
    # 2 natively. Short drafts would save ~25% of each round's time but lose what the forgiving rounds make
    def run(forgiving: bool) -> DraftPolicy:
        fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
        for i in range(40):
            k = fly.k
            forgiven = forgiving and i % 4 == 0
            kept, matched = (k, 0) if forgiven else (2, 2)
            fly.record_round(k, kept, kept + 1, k * 0.02, 0.17 + k * 0.01, matched=matched)
        return fly

    assert run(forgiving=True).min_k == DEFAULT_K["fly"]
    assert run(forgiving=False).min_k == DEFAULT_K["exact"]


def test_policy_falls_back_to_plain_decoding_and_backs_off():
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.1)
    assert not policy.next_is_plain()
    for _ in range(DraftPolicy.ROUNDS_MEASURED):  # 1 token per 0.5 s round: slower than 10 plain tokens/s
        policy.record_round(5, 0, 1, 0.25, 0.25)
    plain = 0
    while policy.next_is_plain():
        policy.record_plain(0.1)
        plain += 1
    assert plain == DraftPolicy.PLAIN_STRETCH
    for _ in range(DraftPolicy.ROUNDS_MEASURED):
        policy.record_round(5, 0, 1, 0.25, 0.25)
    plain = 0
    while policy.next_is_plain():
        policy.record_plain(0.1)
        plain += 1
    assert plain == 2 * DraftPolicy.PLAIN_STRETCH


def test_fly_gives_up_its_window_before_falling_back_to_plain_decoding():
    policy = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.1)
    assert policy.shape(100).extension == policy.window
    for _ in range(DraftPolicy.ROUNDS_MEASURED):
        # 2 tokens per 0.5 s round, one of them forgiven: slower than 10 plain tokens/s, but faster than
        # 5-token drafts of the same rounds (1 token in 0.35 s), so the room itself pays
        policy.record_round(policy.k, 1, 2, 0.25, 0.25, matched=0)
    # first, drafts as long as exact matching's, which leave no room to forgive
    assert not policy.next_is_plain() and policy.k == DEFAULT_K["exact"]
    assert policy.shape(100).extension == 0
    for _ in range(DraftPolicy.ROUNDS_MEASURED):
        policy.record_round(policy.k, 0, 1, 0.25, 0.25)
    assert policy.next_is_plain()


def test_fixed_k_turns_adaptation_off():
    policy = DraftPolicy(GenerationConfig(mode="fly", k=10), plain_step_seconds=None)
    assert not policy.next_is_plain()
    for _ in range(10):
        policy.record_round(10, 0, 1, 1.0, 1.0)
    assert policy.shape(100).k == 10 and not policy.next_is_plain()


def test_seeded_sampling_keeps_the_fixed_schedule():
    assert not DraftPolicy(GenerationConfig(mode="fly", temperature=0.8, seed=1), None).adaptive
    assert DraftPolicy(GenerationConfig(mode="fly", temperature=0.8), None).adaptive
    assert DraftPolicy(GenerationConfig(mode="fly", seed=1), None).adaptive  # greedy output never depends on it


def test_drafter_stop_floor_follows_draft_and_verify_cost():
    cheap = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    dear = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    assert cheap.shape(100).confidence_floor == DraftPolicy.MAX_CONFIDENCE_FLOOR  # nothing measured yet
    for _ in range(3):
        cheap.record_round(5, 3, 4, 5 * 0.005, 0.25)
        dear.record_round(5, 3, 4, 5 * 0.2, 0.25)
    assert abs(cheap.shape(100).confidence_floor - 0.005 / 0.25) < 1e-9
    assert dear.shape(100).confidence_floor == DraftPolicy.MAX_CONFIDENCE_FLOOR


def test_only_a_clear_loss_to_plain_decoding_stops_speculation():
    # plain decoding: 5 tokens/s. Rounds of 0.35 s alternately producing 1 and 2 tokens run at 4.3 tokens/s,
    # within the noise of a stretch that speeds up over a whole request; 1 token per round (2.9/s) does not
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    assert 1.5 / 0.35 > DraftPolicy.FALLBACK_MARGIN * 5 > 1 / 0.35
    for i in range(3 * DraftPolicy.ROUNDS_MEASURED):
        policy.record_round(5, i % 2, 1 + i % 2, 0.1, 0.25)
    assert not policy.next_is_plain()
    for _ in range(DraftPolicy.ROUNDS_MEASURED):
        policy.record_round(5, 0, 1, 0.1, 0.25)
    assert policy.next_is_plain()


def test_round_cost_is_fitted_as_intercept_plus_slope():
    cost = RoundCost(memory=0.9)
    for k in [1, 3, 5, 8, 2, 6] * 3:
        cost.record(k, 0.25 + 0.03 * k)
    one, ten = cost.seconds(np.array([1, 10]), 0.2)
    assert abs(one - 0.28) < 2e-3 and abs(ten - 0.55) < 5e-3
    single = RoundCost(memory=0.9)
    single.record(4, 0.4)  # one K seen: the slope is the prior's
    assert abs(single.seconds(np.array([5]), 0.2)[0] - (0.4 + RoundCost.PRIOR_SLOPE * 0.2)) < 1e-9


def test_drafter_reads_the_prompt_once_the_savings_forgone_match_the_read():
    # a 1024-token prompt the target read in 2 s: the drafter's read is priced at a quarter of that
    read = DeferredRead(None, target_seconds_per_token=2**-9)
    assert read.price(1024) == DeferredRead.PRIOR_READ_SHARE * 2.0 == 0.5
    plain_steps = 0
    while not read.due(1024, plain_step_seconds=None, budget=128):
        read.record(1, 0.25, plain_step_seconds=0.25)  # a plain step forgoes half a step at 2x the plain rate
        plain_steps += 1
    assert plain_steps == 4  # 4 x 0.125 s forgone = 0.5 s of reading
    # a short prompt is read almost at once; a longer one later: the price grows with what there is to read
    assert _plain_steps_before_read(100) < _plain_steps_before_read(1000) < _plain_steps_before_read(4000)


def test_a_read_worth_a_few_plain_steps_is_bought_at_once_if_the_budget_can_repay_it():
    read = DeferredRead(None, target_seconds_per_token=2**-9)  # the drafter reads 2048 tokens a second
    assert read.due(256, plain_step_seconds=0.25, budget=128)  # 0.125 s: half a plain step
    assert read.price(3072) == DeferredRead.READ_AT_ONCE_STEPS * 0.25 == 1.5
    assert read.due(3072, plain_step_seconds=0.25, budget=128)
    assert not read.due(3073, plain_step_seconds=0.25, budget=128)  # dearer: rented first
    # one step's read, but 2 tokens to go: drafting them could save one step at most
    assert not read.due(513, plain_step_seconds=0.25, budget=2)
    assert not read.due(256, plain_step_seconds=None, budget=128)  # no plain step measured: no basis yet


def _plain_steps_before_read(prompt_tokens: int) -> int:
    read = DeferredRead(None, target_seconds_per_token=0.002)
    steps = 0
    while not read.due(prompt_tokens + steps, plain_step_seconds=None, budget=128):
        read.record(1, 0.2, plain_step_seconds=0.2)
        steps += 1
    return steps


def test_drafter_never_reads_while_prompt_lookup_keeps_up():
    read = DeferredRead(None, target_seconds_per_token=0.002)
    for _ in range(500):  # lookup rounds of 3 tokens for 1.3 plain steps beat the drafter's assumed 2x
        read.record(3, 0.26, plain_step_seconds=0.2)
    assert not read.due(4000, plain_step_seconds=0.2, budget=128) and read.regret == 0  # 10 steps to read
    read.record(1, 0.26, plain_step_seconds=0.2)  # a failed lookup round forgoes more than a plain step
    assert read.regret > 0.2 - 0.2 / DeferredRead.DRAFTER_SPEEDUP


def test_measured_read_share_replaces_the_prior_and_short_reads_are_ignored():
    read = DeferredRead(None, target_seconds_per_token=0.002)
    assert read.learn(20, 1.0) == DeferredRead.PRIOR_READ_SHARE  # 20 tokens: overhead, not a rate
    assert read.learn(500, 0.5) == 0.5  # 1 ms per token against the target's 2 ms
    later = DeferredRead(0.5, target_seconds_per_token=0.002)
    assert later.price(1000) == 1.0
    assert 0.3 < later.learn(1000, 0.6) < 0.5  # later reads move the estimate, not replace it
