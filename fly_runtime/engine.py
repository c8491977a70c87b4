"""The generate loop: prefill, then rounds of draft -> one target forward -> verify -> commit -> crop.

One engine owns one target and (optionally) one drafter. The target may come in more than one form (the GGUF
under llama.cpp, an ONNX Runtime graph of it): then each request is served on the form predicted to finish it
soonest (fly_runtime/routing.py), a form opened on its first request. Each request runs this loop on a sequence of
the form's cache of its own: where the backend holds several sequences, the requests decoding at once share
every target pass (fly_runtime/batching.py), else they take turns. The drafter serves one request at a time;
the others decode plainly meanwhile. Output is streamed as committed text pieces. A finished request leaves its
cache behind, and later ones reuse it as far as their prompts start the same way: a chat resends its history
each turn, an agent its system prompt and tool schemas, and reading those again is a CPU's dearest work
(docs/design.md, "Prompt cache").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields

import torch

from fly_runtime.adaptive import CostProfile, DeferredRead
from fly_runtime.backends.base import CachedSequence
from fly_runtime.batching import Slots
from fly_runtime.config import CODE_FENCE, GenerationConfig
from fly_runtime.constraint import JsonConstraint, blank_token_mask, grammar_tokenizer
from fly_runtime.drafters import Draft, Drafter, DraftShape, ReplyHistory
from fly_runtime.errors import EngineBusyError, FlyWarning, InvalidPromptError, InvalidSettingsError
from fly_runtime.numbers import digit_token_mask
from fly_runtime.penalties import Penalties
from fly_runtime.proposer import Learned, Proposal, Proposer
from fly_runtime.routing import Router, request_kind
from fly_runtime.sampling import Sampler
from fly_runtime.spans import ExactSpans
from fly_runtime.text import StopTextStream
from fly_runtime.timing import median_seconds, pass_seconds
from fly_runtime.verify import FlyRule, Verdict, verify

logger = logging.getLogger(__name__)


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
    draft_cuts: int = 0  # rounds whose draft the target cut short (with the drafts kept: how often a draft survives)
    rounds: int = 0  # speculative rounds drafted by the model
    mean_k: float = 0.0  # mean draft length per speculative round
    plain_steps: int = 0  # steps decoded without speculation (measuring, falling back, or lookup found nothing)
    lookup_rounds: int = 0  # rounds drafted by prompt lookup alone (before the model drafter read the prompt, or
    # where prompt lookup is the drafter)
    forced_tokens: int = 0  # tokens a grammar forced (keys, punctuation), verified in passes without drafting
    drafter_busy: int = 0  # 1 where another request held the drafter, so this one was decoded plainly (mode ar)
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

    def count_round(self, proposal: Proposal, verdict: Verdict) -> None:
        """One verified round: its target pass, and its drafts (or the grammar's forced tokens) kept."""
        self.target_forwards += 1
        if proposal.forced:
            self.forced_tokens += verdict.accepted
            return
        self.drafter_forwards += proposal.draft.forwards
        self.drafted_tokens += len(proposal.draft.token_ids)
        self.native_accepted += verdict.native
        self.fly_forgiven += verdict.forgiven
        self.draft_cuts += verdict.accepted < len(proposal.draft.token_ids)

    def __add__(self, other: "GenerationStats") -> "GenerationStats":
        """Two generations' stats together (one reply that took two), counts and seconds summed."""
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        rounds = summed["rounds"]
        summed["mean_k"] = (self.mean_k * self.rounds + other.mean_k * other.rounds) / rounds if rounds else 0.0
        return GenerationStats(**summed)

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
    draft_model: str | None = None  # the drafter model that served the request; None: prompt lookup or none
    form: str | None = None  # the form of the target that served it, where the engine holds several


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


@dataclass
class TargetForm:
    """A form of the target the engine serves requests on (the GGUF under llama.cpp, an ONNX Runtime graph): its
    sequences once open, and the prices learned on it. ``opener`` opens it on its first request."""

    name: str
    max_context: int
    slots: Slots | None = None
    opener: Callable[[], CachedSequence] | None = None
    max_batch: int | None = None
    learned: Learned = field(default_factory=Learned)
    opening: threading.Thread | None = None  # its opening beside the requests, while under way
    broken: bool = False  # its opening failed: requests go to the forms open


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
    def __init__(self, target: CachedSequence, tokenizer, drafter: Drafter | None, vocab_size: int,
                 eos_token_ids: Sequence[int], max_context: int, lookup: Drafter | None = None,
                 host_threads: int | None = None, draft_name: str | None = None,
                 max_batch: int | None = None, history: ReplyHistory | None = None, form: str | None = None,
                 alternates: Sequence[TargetForm] = (), router: Router | None = None) -> None:
        # the target as given, and (with a router) other forms of it, opened on their first request
        primary = TargetForm(form or "target", max_context, Slots(target, max_batch))
        self.forms = [primary, *alternates]
        self.router = router if alternates else None
        self._opening = threading.Lock()
        self.slots = primary.slots  # the given form's sequences, one per request served at once
        self.target = self.slots.sequences[0]
        self.tokenizer = tokenizer
        self.drafter = drafter  # a model (n-grams in front where a request asks), or prompt lookup itself
        # prompt lookup alone (free to draft), for adaptive requests until the model drafter has read the
        # prompt; None where the drafter reads nothing (it is prompt lookup itself)
        self.lookup = lookup
        self.draft_name = draft_name  # the drafter model's name; None where prompt lookup drafts alone
        self.history = history  # the replies written so far, which prompt lookup also draws on (suffix drafts)
        self.vocab_size = vocab_size  # logits beyond the shared vocabulary are padding and never chosen
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max(f.max_context for f in self.forms)
        # torch threads while the engine works on logits itself (argmax, verification, the drafter's stop test);
        # None leaves torch's setting alone. Where the models run on ONNX Runtime its thread pool spins on the
        # same cores between runs, and torch's own pool contending with it slows every drafter pass
        self.host_threads = host_threads
        self._drafting = threading.Lock()  # held by the request the drafter serves
        self.learned = primary.learned  # prices measured on this machine, kept across requests (each form its own)
        self._digit_tokens: torch.Tensor | None = None  # built on the first FLy request that protects numbers
        self._grammar_tokenizer = None  # built on the first structured request
        self._blank_tokens: torch.Tensor | None = None  # the whitespace tokens, on the first schema request

    # ----------------------------------------------------------------------------------------------- API
    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig) -> GenerationStream:
        self._check_not_holding(unless_free=True)
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
        """Every sequence of the engine, once the requests before have finished. A thread that holds one (a
        stream it opened and has not finished or closed) gets an error, since it would wait for itself."""
        self._check_not_holding()
        with self._opening, ExitStack() as held:  # no form opens meanwhile
            for f in self.forms:
                if f.slots is not None:
                    held.enter_context(f.slots.every())
            yield

    def _check_not_holding(self, unless_free: bool = False) -> None:
        """Refuse what would wait for a stream this thread has open (``unless_free``: a request that can start
        on a free sequence at once)."""
        opened = [f.slots for f in self.forms if f.slots is not None]
        if any(s.holding() for s in opened) and not (unless_free and any(s.free_now() for s in opened)):
            raise EngineBusyError(
                "this thread has a generation stream open on the same model, and the engine has no free sequence "
                "to serve another: finish or close that stream (stream.close(), or leave its for loop) before "
                "starting another request, or make the second request from another thread")

    def _reset_caches(self) -> None:
        for f in self.forms:
            for sequence in f.slots.sequences if f.slots is not None else ():
                sequence.reset()
        self._reset_drafter()

    def _reset_drafter(self) -> None:
        if self.drafter is not None:
            self.drafter.reset(cache=True)

    def _check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
        prompt = list(prompt_ids)
        if not prompt:
            raise InvalidPromptError("the prompt is empty: pass at least one token")
        window = self.max_context if config.context_window is None else min(config.context_window, self.max_context)
        if len(prompt) + config.max_new_tokens > window:
            if window < self.max_context:
                limit, fix = (f"the context window ({window} tokens, the context_window / num_ctx setting)",
                              f", or raise context_window (up to {self.max_context})")
            else:
                limit, fix = f"the target's context window ({window} tokens)", ""
            raise InvalidPromptError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds {limit}: shorten "
                f"the prompt or lower max_new_tokens{fix}.")
        return prompt

    # ------------------------------------------------------------------------------------------- the loop
    def _run(self, stream: GenerationStream, prompt: list[int], config: GenerationConfig) -> Iterator[str]:
        """Serve one request on a sequence of its own, with the drafter if no other request has it."""
        form, closed, opening = self._route(prompt, config)
        slots = form.slots
        assert slots is not None
        seq = slots.take(prompt, len(prompt) + config.max_new_tokens + Slots.DRAFT_ROOM)
        # the wait for a sequence is not the request's time; opening the form it runs on is
        start = time.perf_counter() - opening
        drafting = config.mode != "ar" and self._drafting.acquire(blocking=False)
        busy = config.mode != "ar" and not drafting
        if busy:
            config = dataclasses.replace(config, mode="ar")
        try:
            with _torch_threads(self.host_threads):
                request = self._start(prompt, config, slots.sequences[seq], start, form)
                request.closed = closed
                request.stats.drafter_busy = int(busy)
                yield from self._serve(stream, request)
        except BaseException:
            # a request that failed inside a forward pass may leave a cache out of step with its ids; one
            # abandoned or failed for any reason leaves nothing for the next request to trust
            slots.sequences[seq].reset()
            if drafting:
                self._reset_drafter()
            raise
        finally:
            if drafting:
                self._drafting.release()
            slots.give(seq)

    def _route(self, prompt: list[int], config: GenerationConfig) -> tuple[TargetForm, dict[str, int], float]:
        """The form to serve the request on: the only one, else the router's choice among those that can hold it
        (each priced with what its own prompt cache spares), opened here where it was not yet; the forms not open
        that could have held it, with the prompt tokens each would read (what the router charges the request
        against); the seconds spent opening the form for it."""
        if self.router is None or config.seed is not None:  # a seeded request repeats itself on the first form
            return self.forms[0], {}, 0.0
        need = len(prompt) + config.max_new_tokens + Slots.DRAFT_ROOM  # what Slots.take reserves
        fits = [f for f in self.forms if f.max_context >= need and not f.broken] or self.forms[:1]
        # an open form whose sequences are all taken (by streams whose readers may sit on them, or by this thread's
        # own, which it would wait on) is passed over where another open form has one free
        if any(f.slots is not None and f.slots.free_now() for f in fits):
            fits = [f for f in fits if f.slots is None or f.slots.free_now()]
        unread = {f.name: len(prompt) - (f.slots.cached(prompt) if f.slots is not None else 0) for f in fits}
        opened = {f.name for f in fits if f.slots is not None}
        name = self.router.choose(request_kind(config, len(prompt)), unread, config.max_new_tokens, opened)
        form = next(f for f in fits if f.name == name)
        began = time.perf_counter()
        if form.slots is None:
            self._open(form)
        closed = {f.name: unread[f.name] for f in fits if f.slots is None and f.opening is None}
        return form, closed, (time.perf_counter() - began if name not in opened else 0.0)

    def _open(self, form: TargetForm) -> None:
        """Open ``form`` here (or wait for its opening under way beside the requests)."""
        opening = form.opening
        if opening is not None and opening is not threading.current_thread():
            opening.join()
        with self._opening:
            if form.slots is None:
                assert form.opener is not None and self.router is not None
                began = time.perf_counter()
                form.slots = Slots(form.opener(), form.max_batch)
                self.router.opened(form.name, time.perf_counter() - began)

    def open_beside(self, names: Sequence[str]) -> None:
        """Open the forms ``names`` on a thread of their own while requests go on where they are (the loader's
        held forms at load, or a form once the requests served elsewhere have lost what opening it costs); a form
        whose opening fails is left out of routing from then on (the reason logged)."""
        for form in self.forms:
            if form.name not in names or form.slots is not None or form.opening is not None or form.broken:
                continue

            def run(form: TargetForm = form) -> None:
                try:
                    self._open(form)
                except Exception:  # e.g. out of memory: the forms open serve on
                    form.broken = True
                    logger.exception("fly: opening the target's %s form failed; requests stay on the forms open",
                                     form.name)
                finally:
                    form.opening = None

            form.opening = threading.Thread(target=run, name=f"fly-open-{form.name}", daemon=True)
            form.opening.start()

    def settle(self) -> None:
        """Wait for the forms being opened beside the requests (``fly bench`` times nothing while one opens)."""
        for form in self.forms:
            opening = form.opening
            if opening is not None:
                opening.join()

    def _serve(self, stream: GenerationStream, request: _Request) -> Iterator[str]:
        new = self._prefill(request)
        while True:
            piece = request.commit(new)
            if piece:
                yield piece
            if request.finish is not None:
                break
            new = self._step(request)
        tail = request.text.finish()
        if tail:
            yield tail
        stream.result = request.result()
        if self.history is not None:
            self.history.remember(stream.result.token_ids, request.prompt)
        if self.router is not None:
            stream.result.form = request.form.name
            stats = stream.result.stats
            due = self.router.record(request.form.name, request.kind, stats.new_tokens,
                                     time.perf_counter() - request.writing_since,
                                     stream.result.finish_reason == "stop", request.read, request.closed,
                                     (stats.native_accepted + stats.fly_forgiven, stats.draft_cuts))
            if due:
                self.open_beside(due)

    def _start(self, prompt: list[int], config: GenerationConfig, target: CachedSequence, start: float,
               form: TargetForm) -> _Request:
        if config.mode != "ar" and form.learned.costs is None:
            form.learned.costs = self._measure_costs(target)  # once per form (a few passes); the timeout counts it
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        sampler = Sampler(config.temperature, config.top_k, config.top_p, torch.Generator().manual_seed(seed),
                          config.min_p)
        request = _Request(prompt, config, sampler, self._verification(config, prompt),
                           StopTextStream(self.tokenizer, config.stop), self.eos_token_ids, start, self.draft_name)
        request.target, request.form, request.kind = target, form, request_kind(config, len(prompt))
        request.penalties = Penalties.of(config, prompt, self.vocab_size)
        if config.json_schema is not None or config.grammar is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            if config.json_schema is not None and self._blank_tokens is None:  # a user's grammar ends by itself
                self._blank_tokens = blank_token_mask(self.tokenizer, self.vocab_size)
            request.constraint = JsonConstraint(self._grammar_tokenizer, config.json_schema, self.vocab_size,
                                                self.eos_token_ids, lark=config.grammar, blank=self._blank_tokens)
        return request

    def _prefill(self, request: _Request) -> list[int]:
        """Read the prompt (past what the previous request left cached) and pick the first token."""
        stats, target = request.stats, request.target
        unread = target.crop_to_prefix(request.prompt)
        stats.cached_tokens = len(request.prompt) - len(unread)
        learned = request.form.learned
        if 0 < request.config.warn_prompt_tokens < len(unread):
            self._warn_long_read(len(unread), learned)
        began = time.perf_counter()
        logits = self._read_prompt(target, unread, request.deadline,
                                   request.form.slots.read_chunk if request.form.slots is not None else None)
        read = len(target) - stats.cached_tokens  # less than unread where the timeout cut it short
        request.writing_since = time.perf_counter()
        request.read = (read, request.writing_since - began)
        if read:
            self._learn_prefill(read, request.read[1], learned)
        stats.target_forwards += 1
        # how often lookup drafts survived in requests of this kind, on whichever form served them
        survival = self.router.survival(request.kind) if self.router is not None else None
        if self.lookup is None:  # the drafter is prompt lookup itself: each proposal priced by the lookup gate
            request.proposer = Proposer(request.config, None, self.drafter, False, learned, request.sampler,
                                        survival)
        else:
            request.proposer = Proposer(request.config, self.drafter, self.lookup if request.config.ngram else None,
                                        True, learned, request.sampler, survival)
        # a prompt read cut short by the timeout yields no token: the first commit ends the request
        return [request.pick(logits[0, : self.vocab_size])] if logits is not None else []

    def _step(self, request: _Request) -> list[int]:
        """One round: the proposer's draft verified by one target pass, or a plain step; the tokens to commit."""
        context = request.prompt + request.committed
        proposal = request.proposer.propose(context, request.remaining, request.checks.strict_leading(len(context)),
                                            request.constraint, request.form.slots.busy())
        if proposal.plain:
            new, verdict = self._plain_step(context[-1], request), None
        else:
            new, verdict = self._verify(proposal, context, request)
        request.proposer.record(proposal, verdict, context, new)
        return new

    def _measure_costs(self, target: CachedSequence, context: int = 32, repeats: int = 3) -> CostProfile:
        """Time a one-token target step, a nine-token target pass and the drafter's tokens on the request's
        sequence (its cache and the drafter's are dropped before and after), for the policy's decision whether
        model drafts can pay at all."""
        filler = [self.tokenizer.encode(" the", add_special_tokens=False)[0]] * context
        target.reset()
        self._reset_drafter()
        try:
            target.extend(filler, keep=1)
            step, nine = (pass_seconds(target.extend, target.crop, context, filler[:n], repeats) for n in (1, 9))
            assert self.drafter is not None
            self.drafter.commit(filler, read=True)
            greedy = Sampler(0.0, 0, 1.0, torch.Generator())
            drafted: list[Draft] = []

            def draft_four() -> None:
                drafted.append(self.drafter.propose(filler, DraftShape(4, 0.0, 0), greedy))
                self.drafter.commit(filler)

            seconds = median_seconds(draft_four, repeats)
            forwards = drafted[-1].forwards  # 0 where the drafter is prompt lookup itself
            draft_token = seconds / forwards if forwards else 0.0
        finally:
            target.reset()
            self._reset_drafter()
        return CostProfile(step=step, row=max(0.0, nine - step) / 8, draft=draft_token)

    PROMPT_CHUNK = 128  # tokens per target pass while reading a prompt: a timeout or Ctrl-C acts within one

    def _warn_long_read(self, tokens: int, learned: Learned) -> None:
        rate = learned.prefill_per_token
        estimate = f", about {tokens * rate:.0f} s at this machine's measured rate" if rate else ""
        warnings.warn(f"fly: reading a {tokens:,}-token prompt{estimate}; a timeout or Ctrl-C stops it within "
                      f"{self.PROMPT_CHUNK} tokens (warn_prompt_tokens sets when this is said)", FlyWarning,
                      stacklevel=2)

    def _read_prompt(self, target: CachedSequence, ids: list[int], deadline: float | None,
                     hint: int | None = None) -> torch.Tensor | None:
        """Feed the prompt in chunks, so that a timeout (and Ctrl-C, which waits for the running pass) takes
        effect within one chunk instead of after the whole read; None where the deadline passed first. Where the
        backend reads best in larger chunks (``hint``: a prompt reader, whose chunk of 1,024 takes about as long as
        llama.cpp's of 128), those."""
        chunk = max(self.PROMPT_CHUNK, hint or 0)
        done = 0
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return None
            if len(ids) - done <= chunk:
                return target.extend(ids[done:], keep=1)
            target.extend(ids[done:done + chunk], keep=1)
            done += chunk

    @staticmethod
    def _learn_prefill(tokens: int, seconds: float, learned: Learned) -> None:
        """Keep the target's per-token prompt-reading cost, which prices the drafter's read. A prompt read
        mostly from the cache measures per-call overhead instead, so only long reads replace a measured cost."""
        if tokens >= DeferredRead.MIN_MEASURED_READ or learned.prefill_per_token is None:
            learned.prefill_per_token = seconds / tokens

    def _verification(self, config: GenerationConfig, prompt: list[int]) -> Verification:
        if config.mode != "fly" or config.json_schema is not None or config.grammar is not None:  # structured: exact
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

    def _plain_step(self, last: int, request: _Request) -> list[int]:
        logits = request.target.extend([last])
        request.stats.target_forwards += 1
        return [request.pick(logits[0, : self.vocab_size])]

    def _verify(self, proposal: Proposal, context: list[int], request: _Request) -> tuple[list[int], Verdict]:
        """One target pass over the draft: the committed tokens and the verdict."""
        checks, sampler, target = request.checks, request.sampler, request.target
        draft_ids = proposal.draft.token_ids
        cached = len(target)  # the target has seen all of context but its last token
        # the leading rows where the grammar allows a single token (a key, a separator) choose nothing: the pass reads
        # them without their logits (the model's head is 15% of a row for the 1.5B), each stood in by a row of zeros
        # that the grammar's mask turns into that one token
        known = _single_choices(proposal.masks, len(draft_ids))
        logits = target.extend([context[-1], *draft_ids], keep=len(draft_ids) + 1 - known)[:, : self.vocab_size]
        if known:
            logits = torch.cat([logits.new_zeros(known, logits.shape[1]), logits])
        if request.penalties is not None:  # each row as a plain step at its position would see it
            logits = request.penalties.apply(logits, request.committed, draft_ids)
        if proposal.masks is not None:
            logits = logits.masked_fill(~proposal.masks, float("-inf"))
        ids = torch.tensor(draft_ids, dtype=torch.long)
        # a draft from another request's reply is verified exactly whole (drafters.ReplyHistory)
        strict = [True] * len(draft_ids) if proposal.draft.exact else checks.strict_positions(len(context), draft_ids)
        verdict = verify(logits, ids, sampler, checks.rule, strict, checks.protected, proposal.draft.probs)
        request.stats.count_round(proposal, verdict)
        # the target keeps context + kept drafts; the new token is fed at the start of the next round
        target.crop(cached + 1 + verdict.accepted)
        return draft_ids[: verdict.accepted] + [verdict.next_token], verdict


class _Request:
    """One request's state while the engine serves it."""

    def __init__(self, prompt: list[int], config: GenerationConfig, sampler: Sampler, checks: Verification,
                 text: StopTextStream, eos: frozenset[int], start: float, draft_name: str | None) -> None:
        self.prompt, self.config, self.sampler, self.checks, self.text = prompt, config, sampler, checks, text
        self.draft_name = draft_name
        self.eos = eos
        self.start = start
        self.deadline = None if config.timeout is None else start + config.timeout
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.committed: list[int] = []
        self.finish: str | None = None  # set once the request has ended: "stop", "length" or "timeout"
        self.proposer: Proposer  # made once the prompt is read
        self.target: CachedSequence  # the request's sequence of the target's cache
        self.form: TargetForm  # the form of the target serving it
        self.kind = "text"  # what the request is, for the router's prices (routing.KINDS)
        self.writing_since = start  # when the prompt was read and the reply began
        self.read = (0, 0.0)  # prompt tokens read (past the cache) and the seconds that took
        self.closed: dict[str, int] = {}  # forms not open that could have served it, and what each would read
        self.constraint: JsonConstraint | None = None  # the grammar a structured reply follows
        self.penalties: Penalties | None = None  # repetition, frequency and presence penalties, where asked for

    def pick(self, logits: torch.Tensor) -> int:
        """The target's token from one row of logits, penalised as asked, among those the grammar allows."""
        if self.penalties is not None:
            logits = self.penalties.apply(logits[None], self.committed)[0]
        if self.constraint is not None:
            logits = logits.masked_fill(~self.constraint.allowed(), float("-inf"))
        return self.sampler.pick(logits)[0]

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.committed)

    def commit(self, new: list[int]) -> str:
        """Take the step's tokens (up to the first EOS and the token budget); the text now final."""
        ended = False
        for i, token in enumerate(new[: self.remaining]):
            if token in self.eos:
                new, ended = new[:i], True
                break
        new = new[: self.remaining]
        if self.constraint is not None:
            whole = self.constraint.commit(new)  # a value whole before the last token: what trails it is dropped
            new = new[:whole]
            ended = ended or self.constraint.finished
        self.committed.extend(new)
        if self.checks.spans is not None:
            self.checks.spans.commit(new)
        piece = self.text.push(new)
        if ended or self.text.stopped:
            self.finish = "stop"
        elif self.remaining <= 0:
            self.finish = "length"
        elif self.deadline is not None and time.perf_counter() > self.deadline:
            self.finish = "timeout"
        return piece

    def result(self) -> GenerationResult:
        stats = self.stats
        stats.new_tokens = len(self.text.token_ids)
        stats.seconds = time.perf_counter() - self.start
        policy = self.proposer.policy
        if policy is not None:
            stats.rounds, stats.mean_k = policy.rounds, policy.mean_k
            stats.plain_steps = policy.plain_steps
        stats.lookup_rounds = self.proposer.lookup_rounds
        assert self.finish is not None
        drafter = self.draft_name if self.config.mode != "ar" else None
        return GenerationResult(self.text.released, list(self.text.token_ids), self.finish, stats, drafter)


def _single_choices(masks: torch.Tensor | None, drafted: int) -> int:
    """How many of a pass's leading rows, before its last, the grammar's ``masks`` allow a single token at."""
    if masks is None or drafted == 0:
        return 0
    single = masks[:drafted].sum(dim=1) == 1
    return drafted if bool(single.all()) else int(single.int().argmin())


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
