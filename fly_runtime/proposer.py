"""What each round gives the target to verify: nothing (a plain step), a prompt-lookup draft, or a model draft.

The proposer owns the request's draft policy and the choice between those three; the engine only verifies
what it is given and reports back. It knows nothing of how drafts are verified.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fly_runtime.adaptive import CostProfile, DeferredRead, DraftPolicy
from fly_runtime.config import GenerationConfig
from fly_runtime.drafters import Draft, Drafter, DraftShape
from fly_runtime.sampling import Sampler
from fly_runtime.verify import Verdict

if TYPE_CHECKING:
    from fly_runtime.constraint import JsonConstraint


class Kind(enum.Enum):
    """Where a round's proposal came from."""

    PLAIN = "plain"  # nothing to verify: a plain step
    LOOKUP = "lookup"  # prompt lookup's n-grams
    MODEL = "model"  # the drafter model (fed n-grams first where they help)
    FORCED = "forced"  # the tokens a grammar allows no alternative to: no drafter's evidence


@dataclass
class Learned:
    """What an engine measures once and keeps for later requests (seconds)."""

    plain_step: float | None = None  # one plain target step
    prefill_per_token: float | None = None  # the target reading a prompt
    read_share: float | None = None  # the drafter's prompt read / the target's, per token
    costs: CostProfile | None = None  # the prices that decide whether model drafts can pay at all


@dataclass
class Proposal:
    draft: Draft
    kind: Kind
    started: float  # when the step began
    ready: float  # when the proposal was made: verification is timed from here
    source: Drafter | None = None  # whose state follows the commit: the drafter model or prompt lookup
    draft_seconds: float = 0.0  # spent drafting (a model draft; its catch-up read is not part of it)
    shared: bool = False  # proposed for a pass other requests share: its times are not this request's own
    masks: torch.Tensor | None = None  # [len(draft) + 1, V]: what the grammar allows at each verified position

    @property
    def plain(self) -> bool:
        return self.kind is Kind.PLAIN

    @property
    def forced(self) -> bool:
        return self.kind is Kind.FORCED

    @property
    def by_model(self) -> bool:
        return self.kind is Kind.MODEL


class Proposer:
    """One request's proposals, and its drafter's part in the request: begun here, fed what the target kept.
    ``drafter`` is the drafter model (None where prompt lookup drafts alone: then each of its proposals is
    priced by the lookup gate, as a model's are by the draft policy); ``lookup`` is prompt lookup alone (None
    where the request turns n-grams off); ``defer`` lets an adaptive request put off the model drafter's prompt
    read until it is likely to pay; ``lookup_prior``: the survival its lookup gate starts from (DraftPolicy)."""

    def __init__(self, config: GenerationConfig, drafter: Drafter | None, lookup: Drafter | None, defer: bool,
                 learned: Learned, sampler: Sampler, lookup_prior: float | None = None) -> None:
        self.policy = DraftPolicy(config, learned.plain_step, learned.costs, lookup_prior) \
            if config.mode != "ar" else None
        if self.policy is not None and drafter is not None:
            drafter.reset()
        self.drafter = drafter
        self.lookup = lookup
        self.learned = learned
        self.sampler = sampler
        self.lookup_rounds = 0
        self.deferral: DeferredRead | None = None
        if self.policy is not None and self.policy.adaptive and defer and learned.prefill_per_token is not None:
            self.deferral = DeferredRead(learned.read_share, learned.prefill_per_token)

    def propose(self, context: Sequence[int], remaining: int, strict_leading: int,
                constraint: JsonConstraint | None = None, sharing: int = 1) -> Proposal:
        """This round's proposal for ``context`` with ``remaining`` tokens of budget; the first
        ``strict_leading`` drafts will be verified exactly. Under a grammar (``constraint``) the tokens it allows
        no alternative to from here (object keys, punctuation) are proposed as they are, at a row each and no
        drafting, and any draft ends where the grammar forbids it, with the grammar's masks for verification.
        ``sharing``: requests the coming target pass serves (batched decoding), this one included."""
        proposal = self._propose(context, remaining, strict_leading,
                                 constraint.forced() if constraint is not None else (), sharing)
        if constraint is None or proposal.plain:
            return proposal
        masks, allowed = constraint.masks_along(proposal.draft.token_ids)
        return dataclasses.replace(proposal, draft=proposal.draft.head(allowed), masks=masks)

    def _propose(self, context: Sequence[int], remaining: int, strict_leading: int,
                 forced: Sequence[int], sharing: int) -> Proposal:
        start = time.perf_counter()
        policy = self.policy
        if policy is not None and forced and remaining > 1:
            return Proposal(Draft(list(forced[: remaining - 1])), Kind.FORCED, start, start)
        if policy is None or remaining <= 1:
            return Proposal(Draft(), Kind.PLAIN, start, start)
        if sharing > 1 and policy.adaptive:
            # a pass shared with other requests: a draft's rows slow them all, and a model draft makes them
            # wait for the drafter, so only prompt lookup may draft, priced as the shared pass sees it
            return dataclasses.replace(self._lookup(context, remaining, start, sharing), shared=True)
        if policy.next_is_plain():
            return Proposal(Draft(), Kind.PLAIN, start, start)
        if self.drafter is None or not policy.model_drafts or (self.deferral is not None and not self.deferral.due(
                self.drafter.commit(context), policy.plain_step_seconds, remaining)):
            return self._lookup(context, remaining, start)
        self._catch_up(context, start)
        shape = policy.shape(remaining - 1, strict_leading)
        drafted = time.perf_counter()
        draft = self.drafter.propose(context, shape, self.sampler)
        ready = time.perf_counter()
        return Proposal(draft, Kind.MODEL, start, ready, self.drafter, ready - drafted)

    def record(self, proposal: Proposal, verdict: Verdict | None, context: Sequence[int], new: Sequence[int]) -> None:
        """The step is done: ``new`` tokens follow ``context`` (``verdict`` None for a plain step)."""
        now = time.perf_counter()
        produced = len(new)
        if verdict is not None and proposal.source is not None:
            proposal.source.commit([*context, *new])
        policy = self.policy
        if policy is None or proposal.forced:
            return
        if proposal.shared:  # the pass's time was everyone's: only what the lookup kept is evidence
            if verdict is None:
                policy.record_plain(None)
            else:
                policy.lookup_gate(proposal.draft.exact).record(verdict.accepted, len(proposal.draft.token_ids))
            return
        if verdict is None:
            policy.record_plain(now - proposal.ready)
            self.learned.plain_step = policy.plain_step_seconds
        elif proposal.by_model:
            policy.record_round(len(proposal.draft.token_ids), verdict.accepted, produced, proposal.draft_seconds,
                                now - proposal.ready, verdict.matched)
        else:
            policy.lookup_gate(proposal.draft.exact).record(verdict.accepted, len(proposal.draft.token_ids))
        if self.deferral is not None:
            self.deferral.record(produced, now - proposal.started, policy.plain_step_seconds)

    def _lookup(self, context: Sequence[int], remaining: int, start: float, sharing: int = 1) -> Proposal:
        """Prompt lookup's proposal, cut to the part worth a target row each; a plain step where none is."""
        assert self.policy is not None
        # an adaptive request verifies what the gate finds worth it; a fixed K caps the proposal
        k = remaining - 1 if self.policy.adaptive else min(self.policy.k, remaining - 1)
        shape = DraftShape(k, 0.0, 0, history=self.policy.suffix)
        draft = self.lookup.propose(context, shape, self.sampler) if self.lookup else Draft()
        keep = self.policy.lookup_gate(draft.exact).length(len(draft.token_ids), sharing)
        if draft.exact and not keep:  # earlier replies' drafts do not pay in this request: its own prompt's may
            draft = self.lookup.propose(context, dataclasses.replace(shape, history=False), self.sampler)
            keep = self.policy.lookup.length(len(draft.token_ids), sharing)
        now = time.perf_counter()
        if not keep:
            return Proposal(Draft(), Kind.PLAIN, start, now)
        self.lookup_rounds += 1
        return Proposal(draft.head(keep), Kind.LOOKUP, start, now, self.lookup)

    def _catch_up(self, context: Sequence[int], start: float) -> None:
        """Let the model drafter read what it has not (the prompt, or a plain stretch); the first read of a
        deferring request prices the next one."""
        unread = self.drafter.commit(context) if self.deferral is not None else 0
        self.drafter.commit(context, read=True)
        if self.deferral is not None:
            self.learned.read_share = self.deferral.learn(unread, time.perf_counter() - start)
            self.deferral = None
