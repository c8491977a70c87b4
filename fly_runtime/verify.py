"""Verification of a draft against the target: pure functions on logits / probabilities and draft ids.

Every function takes the target's output for the K+1 positions of a round (the position before each of the
K drafts, plus the bonus position after the last draft) and returns how many drafts are kept and the
target's token that follows them. Nothing here touches a model, so every rule is unit-tested on hand-built
tensors.

FLy (arXiv 2511.22972) loosens exact matching in two ways. A mismatch at position i is *forgiven* (the
draft token is kept) when
  1. the target is uncertain there: the entropy of its top-k probabilities is at least the threshold
     (a confident target means the draft is really wrong), and
  2. the target natively accepts each of the next ``window`` drafts, which must all exist (i + W < K):
     a continuation the target agrees with shows the draft token was an acceptable alternative.
Several mismatches may be forgiven in one round. ``window=0`` drops the second test and
``entropy_threshold=0`` drops the first (ablations). Beyond the paper, the target must also rate the drafted
token as a real alternative: at least ``min_prob_ratio`` of its own top token's probability (the shape of
Medusa's typical acceptance): the entropy gate alone passes tokens the target rates far below its own,
which can change an answer (docs/design.md, "The FLy guards"). ``min_prob_ratio=0`` gives the paper's rule. Two guards
keep FLy to differences of wording: positions marked ``strict`` (e.g. inside a tool call, whose arguments must
be the target's own, or in the reply's opening, which sets the answer's course) are never forgiven, nor is a
mismatch where the drafted token or the target's pick is ``protected`` (e.g. holds a digit: another number is
another answer, and the target happily continues from a wrong one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fly_runtime.sampling import Sampler


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept, counting from the first
    next_token: int  # the target's token after the kept drafts (a correction, or the bonus if all were kept)
    native: int  # kept drafts that matched the target natively
    forgiven: int  # kept drafts that did not match but were forgiven by FLy
    matched: int  # drafts before the first mismatch: what exact matching would have kept


@dataclass(frozen=True)
class FlyRule:
    window: int = 6
    entropy_threshold: float = 0.3
    entropy_top_k: int = 3
    min_prob_ratio: float = 0.1  # p_target(draft) / p_target(target's top) needed to forgive


def topk_entropy(log_probs: torch.Tensor, k: int) -> torch.Tensor:
    """-sum p*log p over the k most likely tokens of each row (natural log, probabilities not renormalised)."""
    top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1).values
    return -(top.exp() * top).sum(dim=-1)


def kept_prefix(native: Sequence[bool], forgivable: Sequence[bool], window: int) -> tuple[int, int]:
    """Length of the kept prefix and how many of its positions were forgiven.

    ``native[i]``: draft i matched the target. ``forgivable[i]``: a mismatch at i may be forgiven if its
    window holds (the entropy gate and any sampling condition passed).
    """
    size = len(native)
    forgiven = 0
    for i in range(size):
        if native[i]:
            continue
        if forgivable[i] and i + window < size and all(native[i + 1 : i + 1 + window]):
            forgiven += 1
            continue
        return i, forgiven
    return size, forgiven


def _leading(native: Sequence[bool]) -> int:
    """How many drafts match before the first mismatch."""
    return next((i for i, ok in enumerate(native) if not ok), len(native))


def _check_shapes(target: torch.Tensor, draft_ids: torch.Tensor) -> int:
    k = draft_ids.shape[0]
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target scores must be [K+1, V] = [{k + 1}, V], got {tuple(target.shape)}")
    return k


def verify_greedy(target_logits: torch.Tensor, draft_ids: torch.Tensor, rule: FlyRule | None = None,
                  strict: Sequence[bool] | None = None, protected: torch.Tensor | None = None) -> Verdict:
    """Greedy verification: exact match when ``rule`` is None, FLy otherwise (never at ``strict`` positions,
    nor where the draft or the target's token is ``protected``: a bool mask over the vocabulary)."""
    k = _check_shapes(target_logits, draft_ids)
    target_ids = target_logits.argmax(dim=-1)
    native = (target_ids[:k] == draft_ids).tolist()

    def plausible(rule: FlyRule) -> torch.Tensor:
        log_probs = torch.log_softmax(target_logits[:k].float(), dim=-1)
        entropy = topk_entropy(log_probs, rule.entropy_top_k)
        draft_vs_top = (log_probs[torch.arange(k), draft_ids] - log_probs.max(dim=-1).values).exp()
        return (entropy >= rule.entropy_threshold) & (draft_vs_top >= rule.min_prob_ratio)

    accepted, forgiven = _kept(native, rule, plausible, draft_ids, target_ids[:k], strict, protected)
    return Verdict(accepted, int(target_ids[accepted]), accepted - forgiven, forgiven, _leading(native))


def verify_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    generator: torch.Generator,
    rule: FlyRule | None = None,
    strict: Sequence[bool] | None = None,
    protected: torch.Tensor | None = None,
) -> Verdict:
    """Speculative sampling: lossless when ``rule`` is None, FLy's relaxation (as in vLLM) otherwise, except
    at ``strict`` positions and where the draft or the target's most likely token is ``protected``.

    Draft i is accepted natively with probability min(1, p_i(d_i) / q_i(d_i)). Under FLy a rejected draft
    is kept when the target is uncertain there, the next ``window`` drafts are accepted natively by the same
    test, and the target gives the draft token non-zero probability, at least ``rule.min_prob_ratio`` of its
    most likely token's. At the first position kept by neither, the next token is drawn from
    norm(max(p - q, 0)); if all drafts are kept it is drawn from the target's bonus distribution.
    ``draft_probs`` None: a deterministic proposal (prompt lookup), q = 1 on each drafted token.
    """
    k = _check_shapes(target_probs, draft_ids)
    rows = torch.arange(k)
    p_draft = target_probs[rows, draft_ids]
    q_draft = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones(k, dtype=target_probs.dtype)
    uniform = torch.rand(k, generator=generator, dtype=torch.float64)
    native = (uniform * q_draft.double() < p_draft.double()).tolist()

    def plausible(rule: FlyRule) -> torch.Tensor:
        entropy = topk_entropy(torch.log(target_probs[:k].double().clamp_min(1e-300)), rule.entropy_top_k)
        top = target_probs[:k].max(dim=-1).values
        return (entropy >= rule.entropy_threshold) & (p_draft > 0) & (p_draft >= rule.min_prob_ratio * top)

    accepted, forgiven = _kept(native, rule, plausible, draft_ids, target_probs[:k].argmax(dim=-1), strict,
                               protected)
    if accepted == k:
        dist = target_probs[k]
    else:
        if draft_probs is not None:
            residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        else:  # max(p - one_hot(d), 0): p without the rejected token
            residual = target_probs[accepted].clone()
            residual[draft_ids[accepted]] = 0
        dist = residual if residual.sum() > 0 else target_probs[accepted]
    next_token = int(torch.multinomial(dist.double(), 1, generator=generator))
    return Verdict(accepted, next_token, accepted - forgiven, forgiven, _leading(native))


def verify(target_logits: torch.Tensor, draft_ids: torch.Tensor, sampler: Sampler, rule: FlyRule | None = None,
           strict: Sequence[bool] | None = None, protected: torch.Tensor | None = None,
           draft_probs: torch.Tensor | None = None) -> Verdict:
    """The one entry, as vLLM's ``rejection_sample``: a round's target logits [K+1, V] against its K drafts,
    greedy verification where ``sampler`` is greedy, speculative sampling from its distribution otherwise
    (``draft_probs``: the drafter's, None for a deterministic proposal)."""
    if sampler.greedy:
        return verify_greedy(target_logits, draft_ids, rule, strict, protected)
    return verify_sampling(sampler.probs(target_logits), draft_probs, draft_ids, sampler.generator, rule, strict,
                           protected)


def _kept(native: list[bool], rule: FlyRule | None, plausible, draft_ids: torch.Tensor, target_ids: torch.Tensor,
          strict: Sequence[bool] | None, protected: torch.Tensor | None) -> tuple[int, int]:
    """The kept prefix and how many of it FLy forgave: exact matching where ``rule`` is None, else mismatches
    ``plausible(rule)`` marks and the guards leave forgivable, each with its window of native matches."""
    if rule is None:
        return kept_prefix(native, [False] * len(native), 0)
    forgivable = _guarded(plausible(rule), draft_ids, target_ids, strict, protected)
    return kept_prefix(native, forgivable, rule.window)


def _guarded(plausible: torch.Tensor, draft_ids: torch.Tensor, target_ids: torch.Tensor,
             strict: Sequence[bool] | None, protected: torch.Tensor | None) -> list[bool]:
    """Which mismatches the guards leave forgivable: none at a strict position (inside a span that must match
    the target exactly), none where either the drafted token or the target's token is protected."""
    forgivable = plausible
    if protected is not None:
        forgivable = forgivable & ~(protected[draft_ids] | protected[target_ids])
    if strict is None:
        return forgivable.tolist()
    if len(strict) != len(draft_ids):
        raise ValueError(f"strict marks {len(strict)} positions, the draft has {len(draft_ids)}")
    return [f and not s for f, s in zip(forgivable.tolist(), strict)]
