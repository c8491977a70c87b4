"""Adaptive drafting policy on synthetic measurements (no model)."""

from fly_runtime.adaptive import K_MAX, DraftPolicy, best_draft_length
from fly_runtime.config import GenerationConfig


def test_draft_length_follows_acceptance_and_cost():
    assert best_draft_length(0.5, 0.05, 0.23, 2, K_MAX) < best_draft_length(0.85, 0.05, 0.23, 2, K_MAX) \
        < best_draft_length(0.95, 0.05, 0.23, 2, K_MAX)
    # cheaper drafts justify longer ones
    assert best_draft_length(0.85, 0.01, 0.23, 2, K_MAX) > best_draft_length(0.85, 0.1, 0.23, 2, K_MAX)
    assert best_draft_length(1.0, 0.01, 0.23, 2, K_MAX) == K_MAX
    assert best_draft_length(0.1, 0.05, 0.23, 7, K_MAX) == 7  # the floor holds


def test_policy_shrinks_k_when_drafts_die_early():
    exact = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.17)
    fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
    for _ in range(10):
        exact.record_round(exact.k, 1, 1, 2, exact.k * 0.05, 0.23)
        fly.record_round(fly.k, 1, 1, 2, fly.k * 0.05, 0.23)
    # forgiving never helped, so FLy drafts as short as exact matching does instead of paying for a window
    assert exact.k == fly.k <= 2


def test_fly_keeps_room_for_its_window_while_forgiveness_pays():
    fly = DraftPolicy(GenerationConfig(mode="fly"), plain_step_seconds=0.17)
    for _ in range(10):
        # natively the drafts die after one token, but FLy keeps all of them
        fly.record_round(fly.k, fly.k, 1, fly.k + 1, fly.k * 0.02, 0.23)
    assert fly.k > GenerationConfig().window


def test_policy_falls_back_to_plain_decoding_and_backs_off():
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.1)
    assert not policy.next_is_plain()
    for _ in range(DraftPolicy.ROUNDS_MEASURED):  # 2 tokens per 0.5 s round: slower than 10 plain tokens/s
        policy.record_round(5, 1, 1, 2, 0.25, 0.25)
    plain = 0
    while policy.next_is_plain():
        policy.record_plain(0.1)
        plain += 1
    assert plain == DraftPolicy.PLAIN_STRETCH
    for _ in range(DraftPolicy.ROUNDS_MEASURED):
        policy.record_round(5, 1, 1, 2, 0.25, 0.25)
    plain = 0
    while policy.next_is_plain():
        policy.record_plain(0.1)
        plain += 1
    assert plain == 2 * DraftPolicy.PLAIN_STRETCH


def test_fixed_k_turns_adaptation_off():
    policy = DraftPolicy(GenerationConfig(mode="fly", k=10), plain_step_seconds=None)
    assert not policy.next_is_plain()
    for _ in range(10):
        policy.record_round(10, 0, 0, 1, 1.0, 1.0)
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
        cheap.record_round(5, 3, 3, 4, 5 * 0.02, 0.25)
        dear.record_round(5, 3, 3, 4, 5 * 0.2, 0.25)
    assert abs(cheap.shape(100).confidence_floor - 0.02 / 0.25) < 1e-9
    assert dear.shape(100).confidence_floor == DraftPolicy.MAX_CONFIDENCE_FLOOR


def test_unlucky_rounds_alone_do_not_stop_speculation_that_should_pay():
    policy = DraftPolicy(GenerationConfig(mode="exact"), plain_step_seconds=0.2)
    for _ in range(20):  # drafts mostly survive, so the estimates promise a gain
        policy.record_round(5, 5, 5, 6, 0.1, 0.25)
    for _ in range(DraftPolicy.ROUNDS_MEASURED):  # then a slow stretch
        policy.record_round(5, 0, 0, 1, 0.1, 0.25)
    assert not policy.next_is_plain()
