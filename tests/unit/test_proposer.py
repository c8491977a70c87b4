"""The proposer's choice each round (plain step, prompt lookup, model draft), with a real prompt-lookup drafter."""

import torch

from fly_runtime.adaptive import CostProfile
from fly_runtime.config import GenerationConfig
from fly_runtime.drafters import NgramDrafter
from fly_runtime.proposer import Learned, Proposer
from fly_runtime.sampling import Sampler
from fly_runtime.verify import Verdict

GREEDY = Sampler(0.0, 0, 1.0, torch.Generator())
FAST_TARGET = CostProfile(step=0.059, row=0.023, draft=0.027)  # model drafts cannot pay beside it
CONTEXT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]  # "5 6 7" was followed by "8 9 10 11" before


def proposer(mode: str, learned: Learned, lookup: NgramDrafter | None) -> Proposer:
    return Proposer(GenerationConfig(mode=mode), None, lookup, defer=False, learned=learned, sampler=GREEDY)


def test_plain_decoding_proposes_nothing():
    proposal = proposer("ar", Learned(plain_step=0.05), NgramDrafter()).propose(CONTEXT, 20, 0)
    assert proposal.plain and not proposal.draft.token_ids


def test_an_unmeasured_plain_step_is_measured_first():
    propose = proposer("exact", Learned(costs=FAST_TARGET), NgramDrafter())
    first = propose.propose(CONTEXT, 20, 0)
    assert first.plain
    propose.record(first, None, CONTEXT, [3])
    assert propose.learned.plain_step is not None  # kept for the engine's later requests


def test_beside_a_fast_target_only_prompt_lookup_drafts_and_without_probabilities():
    lookup = NgramDrafter()
    propose = proposer("exact", Learned(plain_step=0.059, costs=FAST_TARGET), lookup)
    proposal = propose.propose(CONTEXT, 20, 0)
    assert proposal.source is lookup and not proposal.by_model
    assert proposal.draft.token_ids == [8, 9, 10, 11, 1, 2][: len(proposal.draft.token_ids)]
    assert proposal.draft.probs is None
    propose.record(proposal, Verdict(accepted=len(proposal.draft.token_ids), next_token=3, native=1, forgiven=0,
                                     matched=1), CONTEXT, [*proposal.draft.token_ids, 3])
    assert propose.lookup_rounds == 1
    nothing_to_copy = propose.propose([1, 2, 3, 4], 20, 0)  # lookup finds nothing: a plain step
    assert nothing_to_copy.plain


def test_where_prompt_lookup_is_the_drafter_each_proposal_is_priced_and_a_missing_one_stops():
    """No drafter model (the engine's drafter is prompt lookup itself), beside a target whose rows are cheap
    enough for model drafts: lookup proposals still go through the lookup gate, so a request whose lookups miss
    decodes plainly instead of verifying misses until the draft policy's fallback."""
    cheap_rows = CostProfile(step=0.060, row=0.025, draft=0.0)
    assert cheap_rows.model_drafts_pay()
    propose = proposer("fly", Learned(plain_step=0.060, costs=cheap_rows), NgramDrafter())
    kinds = []
    for _ in range(8):
        proposal = propose.propose(CONTEXT, 20, 0)
        kinds.append(proposal.plain)
        if not proposal.plain:
            assert proposal.source is propose.lookup and not proposal.by_model
            propose.record(proposal, Verdict(accepted=0, next_token=3, native=0, forgiven=0, matched=0), CONTEXT,
                           [3])
    assert kinds[0] is False and kinds[-1] is True  # tried at first, given up after misses
    assert propose.policy.rounds == 0 and propose.lookup_rounds == kinds.count(False)


def test_earlier_replies_that_miss_do_not_close_the_lookup_on_the_requests_own_prompt():
    """Drafts from earlier replies (another schema's values, another task's calls) are priced by a gate of their
    own: where they keep missing, the request still verifies what its own prompt proposes."""
    from fly_runtime.drafters import ReplyHistory

    history = ReplyHistory()
    history.remember([1, 2, 5, 6, 7, 50, 51, 52, 53])  # matches the context's end longer than the context does
    propose = proposer("exact", Learned(plain_step=0.060, costs=CostProfile(step=0.060, row=0.025, draft=0.0)),
                       NgramDrafter(history=history))
    seen = []
    for _ in range(8):
        proposal = propose.propose(CONTEXT, 20, 0)
        if proposal.plain:
            seen.append("plain")
            continue
        borrowed = proposal.draft.exact
        seen.append("earlier" if borrowed else "own")
        kept = 0 if borrowed else len(proposal.draft.token_ids)  # the earlier reply misses, the prompt's copy holds
        assert borrowed or proposal.draft.token_ids[:2] == [8, 9]
        propose.record(proposal, Verdict(accepted=kept, next_token=3, native=kept, forgiven=0, matched=kept), CONTEXT,
                       [*proposal.draft.token_ids[:kept], 3])
    assert seen[0] == "earlier" and seen[-1] == "own" and "plain" not in seen[seen.index("own"):]


def test_a_fixed_draft_length_caps_a_lookup_proposal():
    propose = Proposer(GenerationConfig(mode="exact", k=2), None, NgramDrafter(), defer=False,
                       learned=Learned(plain_step=0.059, costs=FAST_TARGET), sampler=GREEDY)
    assert propose.propose(CONTEXT, 20, 0).draft.token_ids == [8, 9]


class Grammar:
    """A grammar that forces ``forced`` from here and allows drafts while they stay below ``stop``."""

    def __init__(self, forced: list[int], stop: int = 10**9, vocab: int = 64) -> None:
        self._forced, self.stop, self.vocab = forced, stop, vocab

    def forced(self) -> list[int]:
        return self._forced

    def masks_along(self, draft_ids):
        allowed = next((i for i, t in enumerate(draft_ids) if t >= self.stop), len(draft_ids))
        return torch.ones(allowed + 1, self.vocab, dtype=torch.bool), allowed


def test_forced_tokens_are_proposed_as_they_are_and_teach_the_policy_nothing():
    propose = proposer("exact", Learned(plain_step=0.059, costs=FAST_TARGET), NgramDrafter())
    forced = propose.propose(CONTEXT, 20, 0, Grammar([40, 41, 42]))
    assert forced.forced and forced.draft.token_ids == [40, 41, 42] and not forced.plain
    assert forced.masks is not None and forced.masks.shape[0] == 4  # one mask a verified position
    propose.record(forced, Verdict(accepted=3, next_token=3, native=3, forgiven=0, matched=3), CONTEXT, [40, 41, 42, 3])
    assert propose.lookup_rounds == 0 and propose.policy.rounds == 0
    assert propose.propose(CONTEXT, 3, 0, Grammar([40, 41, 42])).draft.token_ids == [40, 41]  # the budget holds
    # plain decoding stays plain: `ar` is the baseline, so a grammar's forced tokens are decoded one by one
    assert proposer("ar", Learned(plain_step=0.05), NgramDrafter()).propose(CONTEXT, 20, 0, Grammar([40])).plain


def test_a_draft_ends_where_the_grammar_forbids_it():
    propose = proposer("exact", Learned(plain_step=0.059, costs=FAST_TARGET), NgramDrafter())
    free = propose.propose(CONTEXT, 20, 0)
    assert free.draft.token_ids[:2] == [8, 9] and free.masks is None  # lookup copies "8 9 ..."
    cut = proposer("exact", Learned(plain_step=0.059, costs=FAST_TARGET), NgramDrafter()).propose(
        CONTEXT, 20, 0, Grammar([], stop=9))
    assert cut.draft.token_ids == [8] and cut.masks.shape[0] == 2


def test_a_shared_pass_prices_lookup_drafts_as_the_pass_sees_them_and_learns_no_times_from_it():
    costs = CostProfile(step=0.028, row=0.020, draft=0.016)  # llama.cpp here: a row costs 0.7 of a step
    alone = proposer("exact", Learned(plain_step=0.028, costs=costs), NgramDrafter()).propose(CONTEXT, 20, 0)
    assert alone.draft.token_ids == [8]  # alone, one copied token is worth its row
    learned = Learned(plain_step=0.028, costs=costs)
    propose = proposer("exact", learned, NgramDrafter())
    shared = propose.propose(CONTEXT, 20, 0, sharing=4)
    # beside three other requests the row slows them all by more than the copied token gains
    assert shared.plain and shared.shared
    shared.ready -= 0.1  # a pass of four requests takes far longer than this request's own step
    propose.record(shared, None, CONTEXT, [3])
    assert learned.plain_step == propose.policy.plain_step_seconds == 0.028 and propose.policy.plain_steps == 1
    assert propose.propose(CONTEXT, 20, 0, sharing=1).draft.token_ids == [8]  # alone again: drafts again


def test_the_proposer_begins_its_drafter_and_tells_it_what_the_target_kept():
    from fly_runtime.drafters import Draft, Drafter

    class Recording(Drafter):  # a drafter keeps the base class's defaults for what it does not need
        def __init__(self) -> None:
            self.begun, self.kept, self.read = 0, [], []

        def reset(self, cache: bool = False) -> None:
            self.begun += 1

        def propose(self, context, shape, sampler):
            return Draft([8, 9, 10][: shape.k], forwards=3)

        def commit(self, context, read: bool = False) -> int:
            (self.read if read else self.kept).append(list(context))
            return 0

    drafter = Recording()
    propose = Proposer(GenerationConfig(mode="exact"), drafter, None, defer=False,
                       learned=Learned(plain_step=0.05), sampler=GREEDY)
    assert drafter.begun == 1
    proposal = propose.propose(CONTEXT, 20, 0)
    assert proposal.source is drafter and proposal.by_model and proposal.draft.token_ids == [8, 9, 10]
    assert drafter.read == [CONTEXT]  # it read the prompt before its first proposal
    propose.record(proposal, Verdict(accepted=1, next_token=4, native=1, forgiven=0, matched=1), CONTEXT, [8, 4])
    assert drafter.kept == [CONTEXT + [8, 4]]
    propose.record(propose.propose(CONTEXT, 1, 0), None, CONTEXT, [5])  # a plain step: nothing to commit
    assert drafter.kept == [CONTEXT + [8, 4]]
