"""Which form of the target serves a request, where the engine holds more than one (docs/design.md, "Each
request on its form").

On a CPU no single form of a model is fastest for every request: llama.cpp on the GGUF steps fastest but
verifies a drafted token for about a step (so drafts never pay there), while an ONNX Runtime graph of the same
weights reads prompts faster and verifies a row for a fifth of a step (so prompt lookup, grammar tokens and suffix
drafts pay there). A request's cost on a form is predicted as

    tokens it must read there (past that form's prompt cache) x the form's read price
    + the reply's expected length x the form's price per written token for this kind of request

and the request goes to the cheapest. The price per written token starts from the timed passes (a step, over the
speed-up free drafts reach) and is then learned per form and kind from the requests the form served; the read
price from the form's own prompt reads (a long read costs less a token than the 64-token pass timed: llama.cpp
read 250-token tool prompts at 14 ms a token against 22 timed); the reply's expected length is learned per kind.
What was learned is kept with tuning's record when the engine is dropped or the process ends, and the next
process on this machine starts from it.
A served engine opens its held forms beside the requests at load where the memory free holds them (the loader);
where it does not, a form not open yet is opened once the time it would have saved the requests served elsewhere
adds up to what opening it costs (the ski-rental rule: a one-off request never pays for a second form, a steady
stream of requests it suits does): each request served elsewhere counts the share of its time that form was
predicted to save it, and the form is then opened beside the requests (no request waits for it); one request that
alone would save the opening goes there at once. Opening is priced as tuning timed it here, then as it last took. Pure
bookkeeping: no backend is touched here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fly_runtime.adaptive import CostProfile
from fly_runtime.config import GenerationConfig

if TYPE_CHECKING:
    from fly_runtime.backends.bf16_reader import ReaderSlot

# what a request is, for the prices learned: replies under a grammar (JSON schema, a forced call), replies that may
# call tools (their calls copy names and arguments from the prompt), free text from a prompt with material to copy
# (retrieved passages, a document, earlier turns), free text from a short prompt (a question, an instruction), and
# plain decoding (mode ar)
KINDS = ("structured", "tools", "text", "chat", "plain")
# how often a free draft (prompt lookup, grammar) survives in each kind before anything is learned: a call or a
# JSON object copies its prompt's names and values; free text copies its prompt less, and a short prompt holds
# little to copy (docs/design.md, "Each request on its form"); plain decoding drafts nothing
PRIOR_SURVIVAL = {"structured": 0.6, "tools": 0.6, "text": 0.3, "chat": 0.1, "plain": 0.0}
CHAT_PROMPT = 256  # prompt tokens under which free text is "chat": a question or an instruction, little to copy
PRIOR_REPLY = 100  # tokens a reply is expected to hold before any was seen (an agent turn, a RAG answer)
LEARN_RATE = 0.3  # weight of the latest request in the learned averages
MIN_READ = 64  # prompt tokens a read must hold to price reading (a short one measures a call's overhead)
MIN_DRAFT_EVENTS = 8  # drafts kept and cut a request must hold to teach its kind's survival
# what opening a form is priced at before one was opened here: about what llama.cpp takes to open a 1.1 GB GGUF
# from the page cache (a price set too high keeps long replies on the slower writer: docs/design.md)
OPEN_SECONDS = 2.0


def request_kind(config: GenerationConfig, prompt_tokens: int) -> str:
    """What a request is, for the prices learned (``KINDS``): tool calls are the replies verified inside the tool
    format's exact spans."""
    if config.mode == "ar":
        return "plain"
    if config.json_schema is not None or config.grammar is not None:
        return "structured"
    if config.exact_spans:
        return "tools"
    return "text" if prompt_tokens >= CHAT_PROMPT else "chat"


@dataclass
class FormPrices:
    """A form's timed prices in seconds: a prompt token read, a one-token step, a verified row past the first."""

    read: float
    step: float
    row: float

    @classmethod
    def of(cls, ms: dict) -> "FormPrices":
        """From tuning's pass milliseconds ("1", "9", and the timed prompt read), priced as tuning prices them."""
        from fly_runtime.tuning import pass_prices, read_ms

        prices = pass_prices(ms)
        return cls(read=read_ms(ms) / 1000, step=prices.step, row=prices.row)

    def written(self, kind: str, survival: float | None = None) -> float:
        """Seconds per written token as the timed passes price it: a step over what free drafts gain here, each
        surviving at ``survival`` (the kind's prior where None)."""
        profile = CostProfile(self.step, self.row, 0.0)
        survival = PRIOR_SURVIVAL[kind] if survival is None else survival
        return self.step / max(1.0, profile.best_speedup(survival, by_model=False))


@dataclass(eq=False)
class Router:
    """Predicts each form's cost for a request and learns from the requests served."""

    prices: dict[str, FormPrices]
    open_seconds: float = OPEN_SECONDS
    _written: dict[tuple[str, str], float] = field(default_factory=dict)  # (form, kind) -> seconds per token
    _read: dict[str, float] = field(default_factory=dict)  # form -> seconds per prompt token
    _reply: dict[str, float] = field(default_factory=dict)  # kind -> tokens
    _survival: dict[str, float] = field(default_factory=dict)  # kind -> how often a free draft survives a position
    _missed: dict[str, float] = field(default_factory=dict)  # form not open -> seconds it would have saved so far
    _opens: dict[str, float] = field(default_factory=dict)  # form -> seconds opening it took (timed by tuning here)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # the prompt reader's slot on each form it reads for (bf16_reader.ReaderSlot: llama.cpp's, a graph's; one reader
    # shared): reads there cost the reader's price while it is open or expected to pay (it opens within long reads
    # there; the reads served on a form it does not read for count toward it)
    readers: dict[str, ReaderSlot] = field(default_factory=dict)

    @classmethod
    def timed(cls, ms: dict[str, dict], forms: list[str], learned: dict | None = None) -> "Router":
        """A router over ``forms`` priced from tuning's pass milliseconds of each, and from what an earlier
        process learned here (``learned()``'s record), as far as it concerns these forms."""
        router = cls({p: FormPrices.of(ms[p]) for p in forms})
        router._opens = {p: ms[p]["open"] / 1000 for p in forms if "open" in ms[p]}
        if learned:
            router._read = {f: v for f, v in learned.get("read", {}).items() if f in forms}
            router._written = {(f, k): v for f, k, v in learned.get("written", ()) if f in forms and k in KINDS}
            router._reply = {k: v for k, v in learned.get("reply", {}).items() if k in KINDS}
            router._survival = {k: v for k, v in learned.get("survival", {}).items() if k in KINDS}
        return router

    def learned(self) -> dict:
        """What the requests served taught, as JSON: kept with tuning's record so that the next process here
        starts from it (``timed``), and a one-shot process picks its form by it. Not what opening a form cost:
        that depends on what the operating system still holds of its files."""
        with self._lock:
            return {"read": dict(self._read), "written": [[f, k, v] for (f, k), v in self._written.items()],
                    "reply": dict(self._reply), "survival": dict(self._survival)}

    def predict(self, form: str, kind: str, unread: int, max_new_tokens: int, reply: int | None = None) -> float:
        """Seconds ``form`` would take for a request of ``kind`` with ``unread`` prompt tokens to read there and a
        reply of the length expected (or of ``reply`` tokens)."""
        if reply is None:
            reply = min(max_new_tokens, self._reply.get(kind, PRIOR_REPLY))
        written = self._written.get((form, kind))
        return unread * self._read_price(form) + reply * (written or self._unlearned(form, kind))

    def _modeled(self, form: str, kind: str) -> float:
        return self.prices[form].written(kind, self._survival.get(kind))

    def _unlearned(self, form: str, kind: str) -> float:
        """Seconds per token ``form`` is expected to write for a kind it has not served: its timed passes priced at
        the kind's learned survival, raised as far as another form's learned price for the kind stood above its own
        such price (the engine's work beside the passes). Without this a form that served a kind first kept it: the
        int4 graph's summaries, priced at the prior's survival, looked no faster than llama.cpp's measured ones,
        though they ran 1.2x faster there. A learned price below its model is not carried over: what made it
        cheaper (drafts surviving more than counted) need not pay on a form whose rows cost more."""
        modeled = self._modeled(form, kind)
        for (other, k), learned in self._written.items():
            if k == kind and other != form and other in self.prices:
                return modeled * max(1.0, learned / self._modeled(other, kind))
        return modeled

    def survival(self, kind: str) -> float | None:
        """How often a free draft survived a position in the requests of ``kind`` served so far; None before any
        taught it."""
        with self._lock:
            return self._survival.get(kind)

    def open_price(self, form: str) -> float:
        """Seconds opening ``form`` is expected to take."""
        return self._opens.get(form, self.open_seconds)

    def _read_price(self, form: str) -> float:
        slot = self.readers.get(form)
        if slot is not None and slot.expected():
            return slot.reader_ms / 1000
        return self._read.get(form, self.prices[form].read)

    def choose(self, kind: str, unread: dict[str, int], max_new_tokens: int, open_forms: set[str]) -> str:
        """The form that serves the request soonest; ``unread``: the prompt tokens each form must still read
        (only the forms that can hold the request). A form not open yet is chosen (opened for it) where this
        request alone would save what opening it costs; the requests served elsewhere meanwhile count toward its
        opening (``record``)."""
        with self._lock:
            cost = {f: self.predict(f, kind, unread[f], max_new_tokens) for f in unread}
            best = min(cost, key=cost.__getitem__)
            held = [f for f in cost if f in open_forms]
            if best in open_forms or not held:
                return best
            fallback = min(held, key=cost.__getitem__)
            return best if cost[fallback] - cost[best] >= self.open_price(best) else fallback

    def record(self, form: str, kind: str, new_tokens: int, write_seconds: float, stopped: bool,
               read: tuple[int, float] = (0, 0.0), closed: dict[str, int] | None = None,
               drafts: tuple[int, int] = (0, 0)) -> list[str]:
        """A request ``form`` served read ``read`` = (tokens, seconds) of its prompt, then wrote ``new_tokens`` in
        ``write_seconds``. A reply that ended by itself (``stopped``) teaches how long one runs; one cut by
        max_new_tokens only that it runs at least that long: it may raise the expected length, never lower it
        (learning only from stopped replies learns the short ones, and long free replies then look too short to
        move to the faster stepper). ``closed``: the forms not open that could have held the request, with the
        prompt tokens each would have read; what the request took beyond their prediction for it counts toward
        opening them. ``drafts``: the free drafts the request kept, and the rounds whose draft was cut short: how
        often a draft survives a position in this kind, whatever form served it (``MIN_DRAFT_EVENTS`` at least).
        Returns those whose count has reached their opening's price: to open now."""
        tokens, seconds = read
        due = []
        with self._lock:
            # the request's time, scaled by how much sooner the other form was predicted to serve it (a ratio of
            # predictions: what neither prediction holds, the engine's own work, is not counted as lost)
            served = self.predict(form, kind, tokens, new_tokens, reply=new_tokens)
            for other, unread in (closed or {}).items():
                ratio = self.predict(other, kind, unread, new_tokens, reply=new_tokens) / served if served > 0 else 1.0
                self._missed[other] = self._missed.get(other, 0.0) + max(0.0, (seconds + write_seconds) * (1 - ratio))
                if self._missed[other] >= self.open_price(other):
                    due.append(other)
            if tokens >= MIN_READ:
                slot = self.readers.get(form)
                if slot is None and self.readers:
                    next(iter(self.readers.values())).offer(tokens, seconds)
                if not (slot is not None and slot.ready()):  # the reader's reads price the reader, not the form
                    _learn(self._read, form, seconds / tokens)
            kept, cuts = drafts
            if kept + cuts >= MIN_DRAFT_EVENTS:
                _learn(self._survival, kind, kept / (kept + cuts), PRIOR_SURVIVAL[kind])
            if new_tokens > 1:  # a one-token reply is all prompt read and overhead
                _learn(self._written, (form, kind), write_seconds / new_tokens)
                if stopped or new_tokens > self._reply.get(kind, PRIOR_REPLY):
                    _learn(self._reply, kind, new_tokens, PRIOR_REPLY)
        return due

    def opened(self, form: str, seconds: float) -> None:
        """``form`` took ``seconds`` to open: what opening it (and a form tuning did not time) is priced at now."""
        with self._lock:
            self._opens[form] = self.open_seconds = seconds
            self._missed.pop(form, None)


def _learn(averages: dict, key, value: float, prior: float | None = None) -> None:
    """Move ``averages[key]`` toward ``value`` by ``LEARN_RATE`` (the first value, or from ``prior``, where none)."""
    old = averages.get(key, prior)
    averages[key] = value if old is None else (1 - LEARN_RATE) * old + LEARN_RATE * value
