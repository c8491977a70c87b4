"""The generate loop: prefill, then rounds of draft -> one target forward -> verify -> commit -> crop.

One engine owns one target and (optionally) one drafter, each with a single KV cache, so requests are
served one at a time under a lock. Output is streamed as committed text pieces. A finished request leaves its
caches behind, and the next one reuses them as far as its prompt starts the same way: a chat resends its
history each turn, an agent its system prompt and tool schemas, and reading those again costs the target
~13 ms a token on the 2-core CPU measured (6 s for a 500-token agent prompt).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from fly_runtime.adaptive import CostProfile, DeferredRead, DraftPolicy, DraftShape
from fly_runtime.backends.base import CachedSequence
from fly_runtime.config import CODE_FENCE, GenerationConfig
from fly_runtime.drafters import Draft, Drafter
from fly_runtime.errors import EngineBusyError, FlyWarning, InvalidPromptError, InvalidSettingsError
from fly_runtime.numbers import digit_token_mask
from fly_runtime.sampling import Sampler
from fly_runtime.spans import ExactSpans
from fly_runtime.text import StopTextStream
from fly_runtime.verify import FlyRule, Verdict, verify_greedy, verify_sampling


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the target did not read again: the previous request left them cached
    new_tokens: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    drafted_tokens: int = 0
    native_accepted: int = 0
    fly_forgiven: int = 0
    k: float = 0.0  # mean draft length per speculative round
    plain_steps: int = 0  # steps decoded without speculation (measuring, falling back, or lookup found nothing)
    lookup_rounds: int = 0  # rounds drafted by prompt lookup alone, before the model drafter read the prompt
    seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """τ: tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target matched natively."""
        return self.native_accepted / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {
            "mean_accepted": self.mean_accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens) or "timeout"
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(frozen=True)
class Verification:
    """How one request's drafts are checked: FLy's rule (None: exact matching) and the guards on it."""

    rule: FlyRule | None = None
    spans: ExactSpans | None = None  # output spans verified exactly (code blocks, tool calls)
    protected: torch.Tensor | None = None  # tokens never forgiven (numbers), a bool mask over the vocabulary
    opening_end: int = 0  # drafts at sequence positions before this one (the reply's opening) match exactly

    def strict_positions(self, position: int, draft_ids: Sequence[int]) -> list[bool] | None:
        """Which drafts must match the target exactly, the first of them at sequence ``position``: those in
        the reply's opening or inside an exact span. None where no draft must."""
        leading = self.strict_leading(position)
        opening = [i < leading for i in range(len(draft_ids))]
        if self.spans is not None:
            return [o or s for o, s in zip(opening, self.spans.strict_positions(draft_ids))]
        return opening if any(opening) else None

    def strict_leading(self, position: int) -> int:
        """How many drafts from sequence ``position`` on are sure to be verified exactly (the reply's opening)."""
        return max(0, self.opening_end - position)


class GenerationStream:
    """Iterate to receive text pieces as they are committed; ``result`` is set once iteration ends.

    Closing the stream early (``close()``, ``break`` out of a ``with`` block, garbage collection) ends the
    request and frees the engine for the next one.
    """

    def __init__(self, run: Callable[["GenerationStream"], Iterator[str]]) -> None:
        self.result: GenerationResult | None = None
        self._pieces = run(self)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FlyEngine:
    def __init__(
        self,
        target: CachedSequence,
        tokenizer,
        drafter: Drafter | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_context: int,
        ngram_drafter: Drafter | None = None,
        lookup_drafter: Drafter | None = None,
        host_threads: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        # the same drafter with prompt-lookup n-grams in front (the cascade), used when a request asks for it
        self.ngram_drafter = ngram_drafter or drafter
        # prompt lookup alone (free to draft), for adaptive requests until the model drafter has read the
        # prompt; None where the drafter reads nothing (it is prompt lookup itself)
        self.lookup_drafter = lookup_drafter
        self.vocab_size = vocab_size  # logits beyond the shared vocabulary are padding and never chosen
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        # torch threads while the engine works on logits itself (argmax, verification, the drafter's stop test);
        # None leaves torch's setting alone. Where the models run on ONNX Runtime its thread pool spins on the
        # same cores between runs, and torch's own pool contending with it made each drafter pass that reads
        # its confidence 40% dearer here (22.5 ms against 16; 15.2 with one torch thread)
        self.host_threads = host_threads
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose request holds the lock (a stream may sit open there)
        self._plain_step_seconds: float | None = None  # measured cost of one plain target step
        self._prefill_seconds_per_token: float | None = None  # measured cost of the target reading a prompt
        self._read_share: float | None = None  # measured drafter prompt read / target prefill, per token
        self._digit_tokens: torch.Tensor | None = None  # built on the first FLy request that protects numbers
        self._costs: CostProfile | None = None  # measured on the first speculative request

    # ----------------------------------------------------------------------------------------------- API
    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig) -> GenerationStream:
        self._check_not_holding()
        prompt = self._check_prompt(prompt_ids, config)
        if config.mode != "ar" and self.drafter is None:
            raise InvalidSettingsError(f"mode {config.mode!r} needs a drafter; load one or use mode='ar'")
        return GenerationStream(lambda stream: self._run(stream, prompt, config))

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig) -> GenerationResult:
        stream = self.stream(prompt_ids, config)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine between requests (to measure or probe its models directly), with empty caches."""
        with self._hold(), _torch_threads(self.host_threads):
            self._reset_caches()
            try:
                yield
            finally:
                self._reset_caches()

    def clear_cache(self) -> None:
        """Drop what finished requests left in the KV caches: the next request reads its whole prompt."""
        with self._hold():
            self._reset_caches()

    @contextmanager
    def _hold(self) -> Iterator[None]:
        """The engine's lock. Other threads wait for it; the thread already holding it (a stream it opened and
        has not finished or closed) gets an error, since it would wait for itself forever."""
        self._check_not_holding()
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def _check_not_holding(self) -> None:
        if self._holder == threading.get_ident():
            raise EngineBusyError(
                "this thread has a generation stream open on the same model, and the engine serves one request "
                "at a time: finish or close that stream (stream.close(), or leave its for loop) before starting "
                "another request, or make the second request from another thread")

    def _reset_caches(self) -> None:
        self.target.reset()
        for view in self._drafter_views():
            view.reset()

    def _drafter_views(self) -> list[Drafter]:
        """The plain and the n-gram cascade drafter: two views of one drafter cache, each with its own state."""
        return [view for view in (self.drafter, self.ngram_drafter) if view is not None]

    def _check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
        prompt = list(prompt_ids)
        if not prompt:
            raise InvalidPromptError("the prompt is empty: pass at least one token")
        if len(prompt) + config.max_new_tokens > self.max_context:
            raise InvalidPromptError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the target's "
                f"context window ({self.max_context} tokens): shorten the prompt or lower max_new_tokens."
            )
        return prompt

    # ------------------------------------------------------------------------------------------- the loop
    def _run(self, stream: GenerationStream, prompt: list[int], config: GenerationConfig) -> Iterator[str]:
        with self._hold(), _torch_threads(self.host_threads):
            start = time.perf_counter()
            if config.mode != "ar" and self._costs is None:
                self._costs = self._measure_costs()  # once per engine (a few passes); the timeout counts it
            generator = torch.Generator().manual_seed(config.seed if config.seed is not None else
                                                       int(torch.randint(0, 2**62, ()).item()))
            sampler = Sampler(config.temperature, config.top_k, config.top_p, generator)
            checks = self._verification(config, prompt)
            stats = GenerationStats(prompt_tokens=len(prompt))
            policy = DraftPolicy(config, self._plain_step_seconds, self._costs) if config.mode != "ar" else None
            text = StopTextStream(self.tokenizer, config.stop)
            committed: list[int] = []
            finish = "length"
            completed = False
            try:
                for view in self._drafter_views():
                    view.begin()
                unread = self.target.pending(prompt)  # what the previous request left cached is kept
                stats.cached_tokens = len(prompt) - len(unread)
                prefill_start = time.perf_counter()
                deadline = None if config.timeout is None else start + config.timeout
                if 0 < config.warn_prompt_tokens < len(unread):
                    self._warn_long_read(len(unread))
                logits = self._read_prompt(unread, deadline)
                read = len(self.target) - stats.cached_tokens  # less than unread where the timeout cut it short
                if read:
                    self._learn_prefill(read, time.perf_counter() - prefill_start)
                stats.target_forwards += 1
                drafter = self.ngram_drafter if config.ngram else self.drafter
                # an adaptive request lets the model drafter read the prompt only once that is likely to pay
                deferral = None
                if policy is not None and policy.adaptive and self.lookup_drafter is not None and \
                        self._prefill_seconds_per_token is not None:  # None only where no token was read
                    deferral = DeferredRead(self._read_share, self._prefill_seconds_per_token)
                lookup = self.lookup_drafter if config.ngram else None
                # a prompt read cut short by the timeout yields no token: the loop's first check ends the request
                new = [sampler.pick(logits[0, : self.vocab_size])[0]] if logits is not None else []
                while True:
                    new, ended = self._clip(new, config.max_new_tokens - len(committed))
                    committed.extend(new)
                    if checks.spans is not None:
                        checks.spans.commit(new)
                    piece = text.push(new)
                    if piece:
                        yield piece
                    if ended or text.stopped:
                        finish = "stop"
                        break
                    if len(committed) >= config.max_new_tokens:
                        break
                    if config.timeout is not None and time.perf_counter() - start > config.timeout:
                        finish = "timeout"
                        break
                    remaining = config.max_new_tokens - len(committed)
                    context = prompt + committed
                    step_start = time.perf_counter()
                    if policy is None or policy.next_is_plain() or remaining <= 1:
                        new = self._plain_step(committed[-1], sampler, stats, policy)
                    elif not policy.model_drafts or (
                            deferral is not None and not deferral.due(drafter.unread(context), policy.plain_step_seconds,
                                                                      remaining)):
                        new = self._lookup_step(lookup, context, remaining, sampler, checks, stats, policy)
                    else:
                        # counted only while the read is still to be priced: a scan of the context, not per round
                        unread_by_drafter = drafter.unread(context) if deferral is not None else 0
                        drafter.catch_up(context)  # the prompt, or what a plain stretch decoded
                        if deferral is not None:
                            self._read_share = deferral.learn(unread_by_drafter, time.perf_counter() - step_start)
                            deferral = None
                        # the round is timed from here: the policy prices drafting by a round's draft time,
                        # which reading is not part of
                        shape = policy.shape(remaining - 1, checks.strict_leading(len(context)))
                        new = self._drafted_step(drafter, context, shape, sampler, checks, stats, policy)
                    if deferral is not None:
                        deferral.record(len(new), time.perf_counter() - step_start, policy.plain_step_seconds)
                completed = True
                tail = text.finish()
                if tail:
                    yield tail
            finally:
                if not completed:
                    # a request that failed inside a forward pass may leave a cache out of step with its ids;
                    # one abandoned or failed for any reason leaves nothing for the next request to trust
                    self._reset_caches()
            stats.new_tokens = len(text.token_ids)
            stats.seconds = time.perf_counter() - start
            if policy is not None:
                stats.k = policy.mean_k
                stats.plain_steps = policy.plain_steps
            stream.result = GenerationResult(text.released, list(text.token_ids), finish, stats)

    def _measure_costs(self, context: int = 32, repeats: int = 3) -> CostProfile:
        """Time a one-token target step, a nine-token target pass and the drafter's tokens (caches are dropped
        before and after), for the policy's decision whether model drafts can pay at all."""
        filler = [self.tokenizer.encode(" the", add_special_tokens=False)[0]] * context

        def median(run) -> float:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            return sorted(samples)[len(samples) // 2]

        self._reset_caches()
        try:
            self.target.extend(filler, keep=1)

            def target_pass(n: int) -> None:
                self.target.extend(filler[:n])
                self.target.crop(context)

            step, nine = median(lambda: target_pass(1)), median(lambda: target_pass(9))
            assert self.drafter is not None
            self.drafter.catch_up(filler)
            greedy = Sampler(0.0, 0, 1.0, torch.Generator())
            drafted: list[Draft] = []

            def draft_four() -> None:
                drafted.append(self.drafter.propose(filler, DraftShape(4, 0.0, 0), greedy))
                self.drafter.commit(filler)

            seconds = median(draft_four)
            forwards = drafted[-1].forwards  # 0 where the drafter is prompt lookup itself
            draft_token = seconds / forwards if forwards else 0.0
        finally:
            self._reset_caches()
        return CostProfile(step=step, row=max(0.0, nine - step) / 8, draft=draft_token)

    PROMPT_CHUNK = 128  # tokens per target pass while reading a prompt (~2 s on 2 cores at fp32)

    def _warn_long_read(self, tokens: int) -> None:
        rate = self._prefill_seconds_per_token
        estimate = f", about {tokens * rate:.0f} s at this machine's measured rate" if rate else ""
        warnings.warn(f"fly: reading a {tokens:,}-token prompt{estimate}; a timeout or Ctrl-C stops it within "
                      f"{self.PROMPT_CHUNK} tokens (warn_prompt_tokens sets when this is said)", FlyWarning,
                      stacklevel=2)

    def _read_prompt(self, ids: list[int], deadline: float | None) -> torch.Tensor | None:
        """Feed the prompt in chunks, so that a timeout (and Ctrl-C, which waits for the running pass) takes
        effect within one chunk instead of after the whole read; None where the deadline passed first."""
        done = 0
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return None
            if len(ids) - done <= self.PROMPT_CHUNK:
                return self.target.extend(ids[done:], keep=1)
            self.target.extend(ids[done:done + self.PROMPT_CHUNK], keep=1)
            done += self.PROMPT_CHUNK

    def _learn_prefill(self, tokens: int, seconds: float) -> None:
        """Keep the target's per-token prompt-reading cost, which prices the drafter's read. A prompt read
        mostly from the cache measures per-call overhead instead, so only long reads replace a measured cost."""
        if tokens >= DeferredRead.MIN_MEASURED_READ or self._prefill_seconds_per_token is None:
            self._prefill_seconds_per_token = seconds / tokens

    def _verification(self, config: GenerationConfig, prompt: list[int]) -> Verification:
        if config.mode != "fly":
            return Verification()
        markers = config.exact_spans + ((CODE_FENCE,) if config.exact_code else ())
        spans = ExactSpans(self.tokenizer, markers, prompt) if markers else None
        protected = None
        if config.exact_numbers:
            if self._digit_tokens is None:
                self._digit_tokens = digit_token_mask(self.tokenizer, self.vocab_size)
            protected = self._digit_tokens
        rule = FlyRule(window=config.window, entropy_threshold=config.entropy_threshold,
                       entropy_top_k=config.entropy_top_k, min_prob_ratio=config.min_prob_ratio)
        return Verification(rule, spans, protected, len(prompt) + config.exact_opening)

    def _clip(self, new: list[int], budget: int) -> tuple[list[int], bool]:
        """Cut ``new`` at the first EOS (dropped) or at the token budget; say whether EOS ended generation."""
        for i, token in enumerate(new[:budget]):
            if token in self.eos_token_ids:
                return new[:i], True
        return new[:budget], False

    def _plain_step(
        self, last: int, sampler: Sampler, stats: GenerationStats, policy: DraftPolicy | None
    ) -> list[int]:
        """One target step; timed for the policy, whose plain-step estimate the engine keeps for later requests."""
        start = time.perf_counter()
        logits = self.target.extend([last])
        stats.target_forwards += 1
        token, _ = sampler.pick(logits[0, : self.vocab_size])
        if policy is not None:
            policy.record_plain(time.perf_counter() - start)
            self._plain_step_seconds = policy.plain_step_seconds
        return [token]

    def _lookup_step(
        self,
        lookup: Drafter | None,
        context: list[int],
        remaining: int,
        sampler: Sampler,
        checks: Verification,
        stats: GenerationStats,
        policy: DraftPolicy,
    ) -> list[int]:
        """A round drafted by prompt lookup alone, or a plain step where lookup finds nothing (or is off)."""
        draft = lookup.propose(context, DraftShape(remaining - 1, 0.0, 0), sampler) if lookup else Draft()
        keep = policy.lookup.length(len(draft.token_ids))  # the part worth a target row each
        if not keep:
            return self._plain_step(context[-1], sampler, stats, policy)
        assert lookup is not None
        if keep < len(draft.token_ids):
            probs = draft.probs[:keep] if draft.probs is not None else None
            draft = Draft(draft.token_ids[:keep], probs, draft.forwards)
        stats.lookup_rounds += 1
        new, verdict = self._verify(lookup, draft, context, sampler, checks, stats)
        policy.lookup.record(verdict.accepted, keep)
        return new

    def _drafted_step(
        self,
        drafter: Drafter,
        context: list[int],
        shape: DraftShape,
        sampler: Sampler,
        checks: Verification,
        stats: GenerationStats,
        policy: DraftPolicy,
    ) -> list[int]:
        """A round drafted by the drafter the request chose, timed for the policy."""
        start = time.perf_counter()
        draft = drafter.propose(context, shape, sampler)
        draft_seconds = time.perf_counter() - start
        new, verdict = self._verify(drafter, draft, context, sampler, checks, stats)
        policy.record_round(len(draft.token_ids), verdict.accepted, len(new), draft_seconds,
                            time.perf_counter() - start - draft_seconds, verdict.matched)
        return new

    def _verify(
        self,
        drafter: Drafter,
        draft: Draft,
        context: list[int],
        sampler: Sampler,
        checks: Verification,
        stats: GenerationStats,
    ) -> tuple[list[int], Verdict]:
        """One target pass over the draft: the committed tokens and the verdict."""
        draft_ids = draft.token_ids
        cached = len(self.target)  # the target has seen all of context but its last token
        logits = self.target.extend([context[-1], *draft_ids])[:, : self.vocab_size]
        stats.target_forwards += 1
        ids = torch.tensor(draft_ids, dtype=torch.long)
        strict = checks.strict_positions(len(context), draft_ids)
        if sampler.greedy:
            verdict = verify_greedy(logits, ids, checks.rule, strict, checks.protected)
        else:
            target_probs = sampler.probs(logits)
            draft_probs = draft.probs if draft.probs is not None else torch.zeros(0, self.vocab_size)
            verdict = verify_sampling(target_probs, draft_probs, ids, sampler.generator, checks.rule, strict,
                                      checks.protected)
        stats.drafter_forwards += draft.forwards
        stats.drafted_tokens += len(draft_ids)
        stats.native_accepted += verdict.native
        stats.fly_forgiven += verdict.forgiven
        kept = draft_ids[: verdict.accepted]
        # the target keeps context + kept drafts; the new token is fed at the start of the next round
        self.target.crop(cached + 1 + verdict.accepted)
        drafter.commit(context + kept + [verdict.next_token])
        return kept + [verdict.next_token], verdict


@contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` torch intra-op threads (None: unchanged), restoring the caller's setting after."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
