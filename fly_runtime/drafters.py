"""Drafters propose the next tokens; they know nothing of how the target verifies them.

- ``NgramDrafter``: prompt lookup. Finds the longest match of the context's end earlier in the context (its
  latest occurrence among the longest where that is a few ids long) and proposes what followed it. Free to run,
  and strong where the answer copies the prompt (RAG, edits) or its conversation's last turn (an agent's calls).
  Given a ``ReplyHistory``, a greedy request also draws on the replies this process wrote before where they match
  longer (suffix drafts: an agent's tool calls and a template's answers repeat across requests).
- ``ModelDrafter``: a small causal LM drafting greedily (or sampling), one token per forward pass. Given an
  ``NgramDrafter``, a round that asks for n-grams runs the multi-level cascade: n-gram proposals are checked by
  one drafter forward pass, the agreeing prefix is kept plus the drafter's own next token, and that repeats
  until K tokens exist.

Both meet the proposer at one seam, ``Drafter``: propose tokens, then learn which the target kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fly_runtime.backends.base import CachedSequence
from fly_runtime.sampling import Sampler


@dataclass(frozen=True)
class DraftShape:
    """What the policy asks of one round's draft."""

    k: int  # most tokens to draft this round
    confidence_floor: float  # drafter stops (or starts its extension) below this top-1 probability
    extension: int  # tokens drafted past the first doubtful one (FLy's window), 0 = stop at once
    ngrams: bool = False  # a model drafter checks prompt-lookup n-grams first (the cascade)
    gate_ngrams: bool = False  # stop offering n-gram proposals in a request where the drafter rejects them
    history: bool = True  # prompt lookup may draw on earlier replies (ReplyHistory), where the request is greedy


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    # [len(token_ids), V]: the distribution each token was drawn from; None for a deterministic proposal
    # (greedy drafting, prompt lookup), which verification treats as probability 1 on the drafted token
    probs: torch.Tensor | None = None
    forwards: int = 0  # drafter forward passes spent on this draft
    # drawn from another request's reply: every token must match the target exactly (FLy forgives none of
    # them), so that no reply holds a token only another request put there
    exact: bool = False

    def head(self, n: int) -> "Draft":
        """The first ``n`` tokens of this draft."""
        probs = self.probs[:n] if self.probs is not None else None
        return Draft(self.token_ids[:n], probs, self.forwards, self.exact)


class Drafter:
    """The seam between the proposer and a drafter, as transformers' ``CandidateGenerator``: ``propose`` a
    draft, ``commit`` what the target kept (each drafter keeping its own state in step with it), ``reset`` at a
    request's start. A drafter that reads the context into a cache of its own (a model) says in ``commit`` what
    it has not read yet and reads it where asked; one that reads nothing (prompt lookup) keeps the defaults."""

    def propose(self, context: Sequence[int], shape: DraftShape, sampler: Sampler) -> Draft:
        """Up to ``shape.k`` tokens to follow ``context`` (prompt + committed ids)."""
        raise NotImplementedError

    def commit(self, context: Sequence[int], read: bool = False) -> int:
        """The target kept ``context``: drop any state beyond it; with ``read``, also read all of it but its
        last id (which the next proposal feeds): the prompt before a request's first round, the tokens committed
        while decoding plainly before a later one. Returns how many ids are left unread before that last one."""
        return 0

    def reset(self, cache: bool = False) -> None:
        """A request starts: forget what the last one taught; with ``cache``, the KV cache too (otherwise kept:
        its prefix may be reused)."""


def _one_hot_rows(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    rows = torch.zeros(len(token_ids), vocab_size)
    rows[torch.arange(len(token_ids)), torch.tensor(list(token_ids), dtype=torch.long)] = 1.0
    return rows


def _longest_match(tokens: np.ndarray, tail: np.ndarray, ends: np.ndarray, latest_from: int = 1) -> tuple[int, int]:
    """Of the candidate ``ends`` (positions of ``tokens`` that hold ``tail``'s last id), the one where the
    longest suffix of ``tail`` ends: (length, end), or (0, -1) where none is given. Among the longest, the latest
    where they are at least ``latest_from`` ids long, else the earliest. Only the candidates are extended
    backwards, so a lookup costs one comparison over ``tokens``."""
    if not ends.size:
        return 0, -1
    lengths = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for back in range(1, len(tail)):
        at = ends - back
        alive &= at >= 0
        alive[alive] &= tokens[at[alive]] == tail[-1 - back]
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    longest = ends[lengths == best]
    return best, int(longest[-1] if best >= latest_from else longest[0])


class ReplyHistory:
    """The replies this process wrote, for suffix drafts (SuffixDecoding, arXiv 2411.04975): an agent's tool
    calls, a template's answers and extraction JSON repeat across requests, not only within one prompt. Each
    reply is kept after the last ``LEAD`` ids of its prompt (the chat template's turn opening), so that a reply's
    first tokens match where a new reply begins the same way; bounded to ``capacity`` tokens, the oldest dropped
    first; each entry ends with a -1, so no draft runs across two."""

    MIN_MATCH = 2  # a single shared token says little about what follows it in another reply
    LEAD = 8  # prompt ids kept before a reply: the end of the turn it answers, the template's reply opening

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._tokens = np.empty(0, np.int64)
        self._lock = threading.Lock()

    def remember(self, reply: Sequence[int], prompt: Sequence[int] = ()) -> None:
        if len(reply) < self.MIN_MATCH + 1:
            return
        lead = list(prompt[-self.LEAD:]) if self.LEAD else []
        with self._lock:  # requests finish on several threads; readers take the array as it was
            self._tokens = np.concatenate([self._tokens, np.asarray(lead + list(reply), np.int64), [-1]])[
                -self.capacity:]

    def clear(self) -> None:
        """Forget every reply (a benchmark's warm-up, whose replies its measured runs must not copy)."""
        with self._lock:
            self._tokens = np.empty(0, np.int64)

    def match(self, tail: np.ndarray) -> tuple[int, int]:
        """The longest (then latest) match of ``tail``'s end in an earlier entry that goes on in it: (length,
        end), length 0 where none holds ``MIN_MATCH`` ids."""
        tokens = self._tokens
        ends = np.flatnonzero((tokens[:-1] == tail[-1]) & (tokens[1:] >= 0))
        length, end = _longest_match(tokens, tail, ends)
        return (length, end) if length >= self.MIN_MATCH else (0, -1)

    def after(self, end: int, limit: int) -> list[int]:
        """Up to ``limit`` ids that follow position ``end``, cut at its entry's end."""
        after = self._tokens[end + 1:][:limit]
        stop = np.flatnonzero(after < 0)
        return after[: stop[0] if stop.size else limit].tolist()


class QuotedLookup:
    """Prompt lookup by text for a quoted value's first tokens, where ids do not match: the value's opening token
    follows a quote (``"St``, ``"Rot``), where its prompt text follows a space (`` St``, `` Rotterdam``), so no id
    of it occurs in the prompt, and each extracted string would open with plain steps until its tokens fall in
    line with the prompt's. Here the value's text so far is found in the context at the start of a word, and what
    follows it there is encoded as the proposal."""

    LONGEST = 24  # characters of a value's text so far that are looked up
    AHEAD = 48  # characters after a match that are encoded (the last id dropped: the window may cut its word)

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def propose(self, context: Sequence[int], limit: int) -> list[int]:
        tail = self._tokenizer.decode(list(context[-4:]))  # the value's opening tokens, at most a few ids
        quote = tail.rfind('"')
        value = tail[quote + 1:] if quote >= 0 else ""
        if not value or len(value) > self.LONGEST or not value[0].isalnum() or '"' in value:
            return []
        text = self._tokenizer.decode(list(context[:-4]))
        at = text.find(value)
        while at > 0 and text[at - 1].isalnum():  # at the start of a word only
            at = text.find(value, at + 1)
        if at < 0:
            return []
        ahead = text[at + len(value): at + len(value) + self.AHEAD]
        ids = self._tokenizer.encode(ahead, add_special_tokens=False)
        return ids[: min(limit, len(ids) - 1 if len(ahead) == self.AHEAD else len(ids))]


class NgramDrafter(Drafter):
    """Prompt-lookup proposals: what followed the longest match of the context's end (up to ``max_ngram`` ids)
    earlier in the context, its latest occurrence among the longest where that is ``LATEST_FROM`` ids or more (in a
    conversation the latest turn is the pattern the next one follows: an agent's last tool call, not the format
    example of its system prompt), else its first, or
    (``history``, greedy requests only) in an earlier reply where that matches longer."""

    # a match this long is a repeated structure (a conversation's turns, a template), whose latest instance the
    # next follows; a shorter one is a common phrase, whose first occurrence (a retrieved text read in order) is the
    # better guess: model-free over the rag suite's replies, 3.69 ids a pass against 3.37 always latest
    LATEST_FROM = 4

    def __init__(self, max_ngram: int = 12, max_tokens: int = 6, history: ReplyHistory | None = None,
                 quoted: QuotedLookup | None = None) -> None:
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens
        self.history = history
        self.quoted = quoted  # where no id of the context's end occurs before: a quoted value looked up by text

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """What followed the context's longest match earlier in the context (the drafter model's cascade)."""
        return self._find(context, k, history=False)[0]

    def _find(self, context: Sequence[int], k: int, history: bool) -> tuple[list[int], bool]:
        """The proposal, and whether it came from an earlier reply."""
        limit = min(k, self.max_tokens)
        if limit < 1 or len(context) < 2:
            return [], False
        ids = np.asarray(context, dtype=np.int64)
        tail = ids[-min(self.max_ngram, len(ids) - 1):]
        # matches end before the last id, so every one has at least one id after it
        length, end = _longest_match(ids, tail, np.flatnonzero(ids[:-1] == tail[-1]), self.LATEST_FROM)
        if history and self.history is not None and length < len(tail):  # a whole-tail match here cannot lose
            earlier, at = self.history.match(tail)
            if earlier > length:  # as long a match in the context wins
                return self.history.after(at, limit), True
        if not length:
            return (self.quoted.propose(context, limit) if self.quoted is not None else []), False
        return ids[end + 1 : end + 1 + limit].tolist(), False

    def propose(self, context: Sequence[int], shape: DraftShape, sampler: Sampler) -> Draft:
        # earlier replies only where the request is greedy: a sampled request's draws depend on its drafts, and a
        # seeded one must repeat itself whatever ran before it
        ids, borrowed = self._find(context, shape.k, history=shape.history and sampler.greedy)
        return Draft(ids, exact=borrowed)  # deterministic: no distribution to carry


class ModelDrafter(Drafter):
    """A small LM as drafter; given ``ngram``, rounds that ask for n-grams are fed its proposals first (the
    multi-level cascade)."""

    # with gating on, n-grams stay in use while the drafter keeps at least this share of what they propose
    NGRAM_MIN_KEPT = 0.25
    NGRAM_TRIAL = 16  # proposed tokens before the share is judged

    def __init__(self, sequence: CachedSequence, vocab_size: int, ngram: NgramDrafter | None = None) -> None:
        self.sequence = sequence
        self.vocab_size = vocab_size
        self.ngram = ngram
        self._ngram_proposed = 0
        self._ngram_kept = 0


    def _ngrams_useful(self, shape: DraftShape) -> bool:
        if self.ngram is None or not shape.ngrams:
            return False
        if not shape.gate_ngrams or self._ngram_proposed < self.NGRAM_TRIAL:
            return True
        return self._ngram_kept >= self.NGRAM_MIN_KEPT * self._ngram_proposed

    def propose(self, context: Sequence[int], shape: DraftShape, sampler: Sampler) -> Draft:
        draft = Draft()
        rows: list[torch.Tensor] = []
        feed = self.sequence.crop_to_prefix(context)  # ids the drafter has not seen yet (at least the last one)
        limit = shape.k
        doubted = False
        while len(draft.token_ids) < limit:
            room = limit - len(draft.token_ids)
            use_ngrams = self._ngrams_useful(shape)
            proposal = self.ngram.lookup(list(context) + draft.token_ids, room - 1) if use_ngrams else []
            cached_before = len(self.sequence)
            logits = self.sequence.extend(feed + proposal, keep=len(proposal) + 1)  # predictions after each proposal
            draft.forwards += 1
            agree = 0
            while agree < len(proposal) and int(logits[agree].argmax()) == proposal[agree]:
                agree += 1
            self._ngram_proposed += len(proposal)
            self._ngram_kept += agree
            # proposals the drafter disagrees with must not stay in its cache
            self.sequence.crop(cached_before + len(feed) + agree)
            row = logits[agree][: self.vocab_size]
            token, probs = sampler.pick(row)
            draft.token_ids.extend(proposal[:agree] + [token])
            if probs is not None:
                rows.extend([_one_hot_rows(proposal[:agree], self.vocab_size), probs[None]])
            feed = [token]
            if shape.confidence_floor > 0:
                confidence = float((probs if probs is not None else row.float().softmax(-1)).max())
                if confidence < shape.confidence_floor:
                    if len(draft.token_ids) == 1 and shape.extension == 0:
                        # a lone doubtful token is not worth verifying: a target pass over two tokens costs
                        # more than a plain step and such tokens are seldom kept
                        draft.token_ids, rows = [], []
                        break
                    if doubted or shape.extension == 0:
                        break
                    doubted = True  # FLy: keep drafting a window's worth so a mismatch here can be forgiven
                    limit = min(limit, len(draft.token_ids) + shape.extension)
        if rows:
            draft.probs = torch.cat(rows)
        return draft

    def commit(self, context: Sequence[int], read: bool = False) -> int:
        # keep what the target kept; the first id not in the cache is fed with the next proposal
        unread = self.sequence.crop_to_prefix(context)
        if read and len(unread) > 1:
            self.sequence.extend(unread[:-1], keep=1)
            return 0
        return max(0, len(unread) - 1)

    def reset(self, cache: bool = False) -> None:
        if cache:
            self.sequence.reset()
        self._ngram_proposed = self._ngram_kept = 0
