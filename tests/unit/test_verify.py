"""Verification rules on hand-built logits: no model involved."""

import math

import pytest
import torch

from fly_runtime.sampling import Sampler
from fly_runtime.verify import FlyRule, kept_prefix, topk_entropy, verify, verify_greedy, verify_sampling

V = 16


def row(token: int, confident: bool) -> torch.Tensor:
    """Logits whose argmax is ``token``: one dominant token (entropy ~0), or three near-equal ones (~ln 3)."""
    logits = torch.zeros(V)
    if confident:
        logits[token] = 30.0
    else:
        logits[token] = 10.2
        logits[(token + 1) % V] = 10.0
        logits[(token + 2) % V] = 10.0
    return logits


def target(tokens: list[int], uncertain_at: set[int] = frozenset()) -> torch.Tensor:
    """K+1 rows of target logits predicting ``tokens`` (the last one is the bonus)."""
    return torch.stack([row(t, confident=i not in uncertain_at) for i, t in enumerate(tokens)])


def drafts(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


TARGET8 = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # K = 8 predictions + bonus


def with_mismatches(positions: list[int], base: list[int] = TARGET8) -> list[int]:
    out = list(base[:-1])
    for p in positions:
        out[p] = (base[p] + 1) % V  # the target's runner-up where it is uncertain, improbable where it is sure
    return out


def test_topk_entropy_matches_hand_computation():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    expected = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 0.125 * math.log(0.125))
    assert topk_entropy(probs.log(), 3).item() == pytest.approx(expected)
    # top-k only: the fourth token's mass is ignored, and nothing is renormalised
    assert topk_entropy(probs.log(), 1).item() == pytest.approx(-0.5 * math.log(0.5))


def test_row_helper_entropies_straddle_the_default_threshold():
    logs = torch.log_softmax(torch.stack([row(3, True), row(3, False)]), dim=-1)
    confident, uncertain = topk_entropy(logs, 3).tolist()
    assert confident < 0.3 < uncertain


def test_exact_accepts_all_and_adds_bonus():
    v = verify_greedy(target(TARGET8), drafts(TARGET8[:-1]))
    assert (v.accepted, v.next_token, v.native, v.forgiven, v.matched) == (8, 9, 8, 0, 8)


def test_exact_stops_at_first_mismatch_with_target_token():
    v = verify_greedy(target(TARGET8, uncertain_at={3}), drafts(with_mismatches([3])))
    assert (v.accepted, v.next_token, v.forgiven, v.matched) == (3, 4, 0, 3)


def test_exact_rejects_at_position_zero():
    v = verify_greedy(target(TARGET8), drafts(with_mismatches([0])))
    assert (v.accepted, v.next_token) == (0, 1)


def test_fly_forgives_uncertain_mismatch_followed_by_native_window():
    d = drafts(with_mismatches([1]))
    v = verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6))
    assert (v.accepted, v.next_token, v.native, v.forgiven) == (8, 9, 7, 1)
    assert v.matched == 1  # exact matching would have kept the draft before the forgiven mismatch only


def test_fly_never_forgives_a_strict_position():
    d = drafts(with_mismatches([1]))
    strict = [False, True] + [False] * 6  # e.g. the mismatch is inside a tool call's arguments
    v = verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), strict)
    assert (v.accepted, v.next_token, v.forgiven) == (1, 2, 0)
    loose = [True] + [False] * 7  # strictness elsewhere does not change the forgiven position
    assert verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), loose).forgiven == 1
    with pytest.raises(ValueError, match="strict marks 3 positions"):
        verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), [False] * 3)


@pytest.mark.parametrize("side", ["draft", "target"])
def test_fly_never_forgives_a_protected_token_on_either_side(side):
    """A number drafted for a word, or a word drafted for a number: both are other answers, not other wordings."""
    d = drafts(with_mismatches([1]))
    protected = torch.zeros(V, dtype=torch.bool)
    protected[int(d[1]) if side == "draft" else TARGET8[1]] = True
    v = verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), protected=protected)
    assert (v.accepted, v.next_token, v.forgiven) == (1, 2, 0)
    elsewhere = torch.zeros(V, dtype=torch.bool)
    elsewhere[TARGET8[3]] = True  # a protected token that matches natively is kept like any other
    assert verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), protected=elsewhere).forgiven == 1


def test_fly_rejects_confident_mismatch():
    v = verify_greedy(target(TARGET8), drafts(with_mismatches([1])), FlyRule(window=6))
    assert (v.accepted, v.next_token, v.forgiven) == (1, 2, 0)


@pytest.mark.parametrize(("position", "forgiven"), [(8 - 6 - 1, True), (8 - 6, False)])
def test_fly_window_edge(position, forgiven):
    """K=8, W=6: a mismatch at K-W-1 has a full window after it; at K-W it does not."""
    v = verify_greedy(target(TARGET8, uncertain_at={position}), drafts(with_mismatches([position])), FlyRule(window=6))
    if forgiven:
        assert (v.accepted, v.forgiven, v.next_token) == (8, 1, 9)
    else:
        assert (v.accepted, v.forgiven, v.next_token) == (position, 0, TARGET8[position])


def test_fly_forgives_several_mismatches_in_one_round():
    tokens = list(range(1, 14))  # K = 12
    d = drafts(with_mismatches([2, 7], tokens))
    v = verify_greedy(target(tokens, uncertain_at={2, 7}), d, FlyRule(window=3))
    assert (v.accepted, v.forgiven, v.native, v.next_token, v.matched) == (12, 2, 10, 13, 2)


def test_fly_second_mismatch_inside_window_breaks_the_first():
    d = drafts(with_mismatches([1, 4]))
    v = verify_greedy(target(TARGET8, uncertain_at={1, 4}), d, FlyRule(window=6))
    assert (v.accepted, v.forgiven, v.next_token) == (1, 0, 2)


def test_fly_later_mismatch_ends_the_prefix_after_a_forgiven_one():
    tokens = list(range(1, 14))  # K = 12
    d = drafts(with_mismatches([1, 9], tokens))
    v = verify_greedy(target(tokens, uncertain_at={1}), d, FlyRule(window=3))
    # 1 is forgiven (2..4 native); 9 is confident -> the prefix ends there with the target's token
    assert (v.accepted, v.forgiven, v.next_token) == (9, 1, 10)


def test_ablation_window_zero_forgives_any_uncertain_mismatch():
    d = drafts(with_mismatches([7]))
    assert verify_greedy(target(TARGET8, uncertain_at={7}), d, FlyRule(window=6)).accepted == 7
    v = verify_greedy(target(TARGET8, uncertain_at={7}), d, FlyRule(window=0))
    assert (v.accepted, v.forgiven) == (8, 1)


def test_ablation_threshold_zero_disables_the_gate():
    d = drafts(with_mismatches([1]))
    assert verify_greedy(target(TARGET8), d, FlyRule(window=6, entropy_threshold=0.3)).accepted == 1
    v = verify_greedy(target(TARGET8), d, FlyRule(window=6, entropy_threshold=0.0, min_prob_ratio=0.0))
    assert (v.accepted, v.forgiven) == (8, 1)


def uncertain_between(top: int, runner_up: int, ratio: float) -> torch.Tensor:
    """Logits where ``top`` leads, ``runner_up`` has ``ratio`` of its probability, and a third token keeps the
    top-3 entropy above the default gate."""
    logits = torch.full((V,), -30.0)
    logits[top] = 0.0
    logits[runner_up] = math.log(ratio)
    logits[(top + 7) % V] = math.log(0.5)
    return logits


@pytest.mark.parametrize("ratio, forgiven", [(0.06, False), (0.15, True)])
def test_fly_forgives_only_a_draft_the_target_rates_near_its_own(ratio, forgiven):
    # a swapped name the target gives 6% of its top token's probability is an error, not a rewording
    logits = target(TARGET8)
    logits[1] = uncertain_between(top=2, runner_up=12, ratio=ratio)
    assert topk_entropy(torch.log_softmax(logits[1:2], dim=-1), 3).item() > 0.3
    d = TARGET8[:-1]
    d[1] = 12
    v = verify_greedy(logits, drafts(d), FlyRule(window=6))
    assert (v.accepted, v.forgiven) == ((8, 1) if forgiven else (1, 0))
    # the paper's rule (no ratio test) forgives both
    assert verify_greedy(logits, drafts(d), FlyRule(window=6, min_prob_ratio=0.0)).forgiven == 1


def test_sampling_fly_forgives_only_a_draft_the_target_rates_near_its_own():
    sure = torch.eye(V)[5]
    q = torch.stack([torch.eye(V)[12], sure, sure])  # the drafter is sure of token 12 at position 0
    d = drafts([12, 5, 5])
    for ratio, expect_forgiven in ((0.06, False), (0.15, True)):
        p = torch.stack([torch.softmax(uncertain_between(2, 12, ratio), dim=-1), sure, sure, sure])
        verdicts = [verify_sampling(p, q, d, torch.Generator().manual_seed(s), FlyRule(window=2)) for s in range(40)]
        assert any(v.forgiven == 1 for v in verdicts) == expect_forgiven
        assert any(v.accepted == 0 for v in verdicts) != expect_forgiven


def test_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[K\+1, V\]"):
        verify_greedy(torch.zeros(3, V), drafts([1, 2, 3]))


def test_kept_prefix_counts():
    assert kept_prefix([True, True, False], [False] * 3, 0) == (2, 0)
    assert kept_prefix([True, False, True, True], [False, True, False, False], 2) == (4, 1)
    assert kept_prefix([], [], 6) == (0, 0)


# ------------------------------------------------------------------------------------------- sampling
def test_sampling_is_lossless_for_exact():
    """The first emitted token is distributed as the target's p, whatever the drafter's q."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    trials = 20000
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        v = verify_sampling(torch.stack([p, p]), q[None], drafts([d]), gen)
        counts[d if v.accepted else v.next_token] += 1
    assert torch.allclose(counts / trials, p, atol=0.015)


def test_sampling_identical_distributions_always_accept():
    p = torch.softmax(torch.randn(4, V), dim=-1)
    gen = torch.Generator().manual_seed(1)
    v = verify_sampling(p, p[:3], drafts([0, 5, 7]), gen)
    assert v.accepted == 3 and v.native == 3


def test_sampling_fly_forgives_only_tokens_the_target_allows():
    uncertain = torch.tensor([0.4, 0.3, 0.3] + [0.0] * (V - 3))
    sure = torch.zeros(V)
    sure[5] = 1.0
    p = torch.stack([uncertain, sure, sure, sure])  # K = 3
    q = torch.stack([torch.eye(V)[2], sure, sure])  # draft 2 at position 0: p=0.3 < q=1 -> may be rejected
    d = drafts([2, 5, 5])
    rule = FlyRule(window=2)
    forgiven = [verify_sampling(p, q, d, torch.Generator().manual_seed(s), rule) for s in range(40)]
    assert all(v.accepted == 3 for v in forgiven)
    assert any(v.forgiven == 1 for v in forgiven)
    q_zero = torch.stack([torch.eye(V)[9], sure, sure])  # token 9 has p = 0: never forgiven
    v = verify_sampling(p, q_zero, drafts([9, 5, 5]), torch.Generator().manual_seed(0), rule)
    assert v.accepted == 0 and v.next_token in (0, 1, 2)
    digits = torch.zeros(V, dtype=torch.bool)
    digits[2] = True  # the drafted token is a number: rejected draws stay rejected
    guarded = [verify_sampling(p, q, d, torch.Generator().manual_seed(s), rule, protected=digits) for s in range(40)]
    assert all(v.forgiven == 0 for v in guarded)
    assert any(v.accepted == 0 for v in guarded)


def test_sampling_is_reproducible_with_a_seed():
    p = torch.softmax(torch.randn(6, V), dim=-1)
    q = torch.softmax(torch.randn(5, V), dim=-1)
    d = drafts([1, 2, 3, 4, 5])
    a = verify_sampling(p, q, d, torch.Generator().manual_seed(7), FlyRule(window=2))
    b = verify_sampling(p, q, d, torch.Generator().manual_seed(7), FlyRule(window=2))
    assert a == b


def test_the_replys_opening_is_verified_exactly():
    from fly_runtime.engine import Verification

    checks = Verification(FlyRule(), opening_end=10)  # prompt of 4 tokens, exact_opening=6
    assert checks.strict_positions(8, [5, 6, 7, 8]) == [True, True, False, False]
    assert checks.strict_positions(10, [5, 6]) is None  # past the opening nothing is strict
    # a forgivable mismatch in the opening is rejected like exact matching would
    d = drafts(with_mismatches([1]))
    loose = verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6))
    strict = verify_greedy(target(TARGET8, uncertain_at={1}), d, FlyRule(window=6), checks.strict_positions(8, list(d)))
    assert (loose.accepted, strict.accepted) == (8, 1)


def test_a_deterministic_draft_needs_no_distribution():
    """draft_probs None (prompt lookup) decides every round as a one-hot distribution would, and stays lossless."""
    for seed in range(30):
        torch.manual_seed(seed)
        p = torch.softmax(torch.randn(5, V) * 2, dim=-1)
        d = drafts([int(i) for i in torch.randint(0, V, (4,))])
        for rule in (None, FlyRule(window=2)):
            one_hot = verify_sampling(p, torch.eye(V)[d], d, torch.Generator().manual_seed(seed), rule)
            assert verify_sampling(p, None, d, torch.Generator().manual_seed(seed), rule) == one_hot
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20000):  # a fixed guess of token 3: the emitted token is still distributed as p
        v = verify_sampling(torch.stack([p, p]), None, drafts([3]), gen)
        counts[3 if v.accepted else v.next_token] += 1
    assert torch.allclose(counts / 20000, p, atol=0.015)


@pytest.mark.parametrize("temperature, top_p", [(1e-300, 1.0), (2.0, 5e-324), (1e-30, 1e-30)])
def test_extreme_sampling_settings_give_a_distribution_not_nan(temperature, top_p):
    """Settings at the edge of their ranges (a fuzzer's favourites): a tiny temperature is near-greedy and a tiny
    top_p keeps the top token, instead of NaN probabilities that crash the draw."""
    logits = torch.randn(2, 1000) * 5
    probs = Sampler(temperature, 0, top_p, torch.Generator().manual_seed(0)).probs(logits)
    assert not torch.isnan(probs).any()
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert (probs.argmax(-1) == logits.argmax(-1)).all() and (probs.max(-1).values > 0.99).all()


def test_the_one_entry_verifies_greedily_or_by_sampling_as_its_sampler_decodes():
    torch.manual_seed(3)
    logits, drafts = torch.randn(5, 12) * 3, torch.tensor([1, 4, 7, 2])
    rule = FlyRule(window=1, entropy_threshold=0.0, min_prob_ratio=0.0)
    greedy = Sampler(0.0, 0, 1.0, torch.Generator())
    assert verify(logits, drafts, greedy, rule) == verify_greedy(logits, drafts, rule)
    assert verify(logits, drafts, greedy) == verify_greedy(logits, drafts)
    hot = Sampler(0.8, 0, 1.0, torch.Generator().manual_seed(11))
    by_entry = verify(logits, drafts, hot, rule)
    by_hand = verify_sampling(Sampler(0.8, 0, 1.0, torch.Generator()).probs(logits), None, drafts,
                              torch.Generator().manual_seed(11), rule)
    assert by_entry == by_hand


def test_a_pass_reads_the_rows_the_grammar_leaves_one_token_without_their_logits():
    """The leading rows of a pass where the grammar's mask allows a single token need no logits (a key's tokens):
    counted up to the first row with a choice, never the last row (the token after the draft)."""
    import torch

    from fly_runtime.engine import _single_choices

    one, two = torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.bool)
    one[3], two[[3, 5]] = True, True
    masks = lambda *rows: torch.stack(rows)  # noqa: E731
    assert _single_choices(None, 4) == 0 and _single_choices(masks(one), 0) == 0
    assert _single_choices(masks(one, one, two, one), 3) == 2
    assert _single_choices(masks(one, one, one, one), 3) == 3
    assert _single_choices(masks(two, one, one, one), 3) == 0
