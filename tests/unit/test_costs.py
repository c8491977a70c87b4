"""The policy's price model: model drafts only where they can pay, prompt lookup only as far as it pays."""

from fly_runtime.adaptive import CostProfile, DraftPolicy, LookupGate
from fly_runtime.config import GenerationConfig

# measured on a 2-core AVX2 EPYC (fly models list): 1.5B target step / each further row, 0.5B int4 drafter token
INT4_TARGET = CostProfile(step=0.059, row=0.023, draft=0.027)
FP32_TARGET = CostProfile(step=0.261, row=0.021, draft=0.027)
# the int4 graph on the GGUF's grid, measured in a Spec-Bench run (2026-12-02): drafting at these prices lost
# to plain steps in 9 of 13 categories, although code and math kept 71-91% of their drafts
GRID_TARGET = CostProfile(step=0.113, row=0.025, draft=0.035)


def test_model_drafts_pay_beside_a_slow_target_but_not_a_fast_one():
    assert FP32_TARGET.model_drafts_pay() and FP32_TARGET.best_speedup(0.9, by_model=True) > 2
    assert not INT4_TARGET.model_drafts_pay()
    assert not GRID_TARGET.model_drafts_pay()
    # prompt lookup costs only the verification rows, so it can still pay beside the fast target
    assert INT4_TARGET.best_speedup(0.9, by_model=False) > 1.5


def test_the_policy_turns_model_drafts_off_only_at_losing_prices():
    config = GenerationConfig(mode="exact")
    assert not DraftPolicy(config, 0.059, INT4_TARGET).model_drafts
    assert DraftPolicy(config, 0.261, FP32_TARGET).model_drafts
    assert DraftPolicy(config, 0.059, None).model_drafts  # unmeasured: as before
    assert DraftPolicy(GenerationConfig(mode="exact", k=5), 0.059, INT4_TARGET).model_drafts  # a fixed K is obeyed


def test_lookup_gate_verifies_what_pays_and_stops_where_lookup_misses():
    gate = LookupGate(INT4_TARGET, prior_p=0.75, memory=0.9)
    assert gate.length(6) >= 1
    for _ in range(12):  # the proposals keep missing at their first token
        gate.record(0, gate.length(6) or 1)
    lengths = [gate.length(6) for _ in range(LookupGate.PROBE_EVERY)]
    assert sorted(lengths) == [0] * (LookupGate.PROBE_EVERY - 1) + [1]  # skipped, but for one probe


def test_lookup_gate_keeps_long_proposals_that_survive():
    gate = LookupGate(INT4_TARGET, prior_p=0.75, memory=0.9)
    for _ in range(12):
        gate.record(6, 6)
    assert gate.length(6) == 6


def test_lookup_gate_without_prices_takes_the_whole_proposal():
    assert LookupGate(None, 0.75, 0.9).length(5) == 5


def test_a_round_whose_draft_the_target_cut_short_is_counted():
    """Drafts kept over drafts kept plus rounds cut short: how often a draft survives a position (the router learns
    it per kind); a draft kept whole, or a grammar's forced tokens, cut nothing."""
    from fly_runtime.drafters import Draft
    from fly_runtime.engine import GenerationStats
    from fly_runtime.proposer import Kind, Proposal
    from fly_runtime.verify import Verdict

    stats = GenerationStats()
    for drafted, verdict, forced in [(4, Verdict(2, 7, 2, 0, 2), False), (3, Verdict(3, 7, 2, 1, 1), False),
                                     (2, Verdict(0, 7, 0, 0, 0), False), (2, Verdict(1, 7, 1, 0, 2), True)]:
        kind = Kind.FORCED if forced else Kind.LOOKUP
        stats.count_round(Proposal(Draft(list(range(drafted))), kind, 0.0, 0.0), verdict)
    assert (stats.native_accepted + stats.fly_forgiven, stats.draft_cuts, stats.target_forwards) == (5, 2, 4)


def test_the_lookup_gate_starts_from_the_survival_the_engine_learned_for_requests_like_this_one():
    """On llama.cpp a verified row costs 0.38 of a step: at the usual prior a lookup is verified on sight; where the
    engine learned that chat replies keep one lookup draft in ten, the request does not pay rows to learn it again
    (it still probes one token after ``PROBE_EVERY`` skips)."""
    llama_cpp = CostProfile(step=0.065, row=0.0245, draft=0.0)
    config = GenerationConfig(mode="fly")
    assert DraftPolicy(config, 0.065, llama_cpp).lookup.length(6) > 0
    learned = DraftPolicy(config, 0.065, llama_cpp, lookup_prior=0.1)
    assert [learned.lookup.length(6) for _ in range(LookupGate.PROBE_EVERY)][-2:] == [0, 1]
    assert DraftPolicy(config, 0.065, llama_cpp, lookup_prior=0.9).lookup.length(6) > 0
