"""Batched decoding: the requests decoding at once share each target pass, and each other's prompt prefixes.

A CPU decoding step is bound by reading the weights, so the rows of several requests in one pass cost little
more than one row (docs/design.md, "Batched decoding"). Each request keeps the engine's one-request loop and
its own sequence in the backend's cache; ``SharedPasses`` gathers the passes those loops ask for into one
backend call, and ``Slots`` hands out the sequences, each starting from the longest prompt prefix any sequence
already holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fly_runtime.backends.base import CachedSequence, MultiSequenceBackend, common_prefix


@dataclass
class _Part:
    seq: int
    ids: list[int]
    keep: int | None
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class SharedPasses:
    """Runs the passes of several sequences' callers together: a caller's pass waits until every running
    request has asked for its own (or ``window`` seconds passed since the first asked), then one of them runs
    them all as one backend pass. A lone request never waits."""

    backend: MultiSequenceBackend
    window: float = 0.02  # seconds a pass waits for the other requests' rows: a fraction of a step
    running: int = 0  # requests currently holding a sequence
    passes: int = 0  # backend passes run
    rows: int = 0  # parts those passes carried
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _pending: list[_Part] = field(default_factory=list)
    _first_at: float = 0.0
    _busy: bool = False

    def forward(self, seq: int, ids: Sequence[int], keep: int | None) -> torch.Tensor:
        part = _Part(seq, list(ids), keep)
        with self._cond:
            if not self._pending:
                self._first_at = time.perf_counter()
            self._pending.append(part)
            self._cond.notify_all()
            while not part.done:
                wait = self._wait()
                if wait <= 0:
                    self._run_pending()
                else:
                    self._cond.wait(wait)
        if part.error is not None:
            raise part.error
        assert part.logits is not None
        return part.logits

    def _wait(self) -> float:
        """Seconds until the pending parts should run (0: now); a long wait while a pass runs elsewhere."""
        if self._busy or not self._pending:
            return 1.0
        if len(self._pending) >= self.running:
            return 0.0
        return self._first_at + self.window - time.perf_counter()

    def _run_pending(self) -> None:
        """Run every pending part as one pass, outside the lock (other callers queue for the next one)."""
        batch, self._pending, self._busy = self._pending, [], True
        self._cond.release()
        try:
            self._run(batch)
        finally:
            self._cond.acquire()
            self._busy = False
            self.passes += 1
            self.rows += len(batch)
            if self._pending:
                self._first_at = time.perf_counter()
            self._cond.notify_all()

    def _run(self, batch: list[_Part]) -> None:
        try:
            results = self.backend.forward_rows([(p.seq, p.ids, p.keep) for p in batch])
        except Exception as exc:
            if len(batch) == 1:
                results = [exc]
            else:  # one part may not fit (the cache is full): the others still get their pass, alone
                results = [self._alone(p) for p in batch]
        for part, result in zip(batch, results):
            if isinstance(result, BaseException):
                part.error = result
            else:
                part.logits = result
            part.done = True

    def _alone(self, part: _Part) -> torch.Tensor | BaseException:
        try:
            return self.backend.forward_rows([(part.seq, part.ids, part.keep)])[0]
        except Exception as exc:
            return exc

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Hold the backend between passes (to crop or share cells)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            yield

    def join(self) -> None:
        with self._cond:
            self.running += 1

    def leave(self) -> None:
        with self._cond:
            self.running -= 1
            self._cond.notify_all()  # the pending passes may no longer wait for this request


class SequenceView:
    """One sequence of a multi-sequence backend, as the single-sequence ``Backend`` the engine drives."""

    def __init__(self, passes: SharedPasses, seq: int) -> None:
        self.passes, self.seq = passes, seq
        self.max_context = passes.backend.max_context
        self.name = getattr(passes.backend, "name", "shared")

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        return self.passes.forward(self.seq, input_ids, keep)

    def crop(self, length: int) -> None:
        with self.passes.idle():
            self.passes.backend.crop_sequence(self.seq, length)


class Slots:
    """The engine's sequences, one per request it serves at once, taken in arrival order.

    A request takes a free sequence whose whole cache its prompt continues (its own conversation's last turn),
    else an empty one, else the one used longest ago; then, if any sequence (busy or free) holds a longer start
    of its prompt, those cells are shared into its own: an agent's system prompt and tools, or a chat's history,
    are read once for every request that starts with them, and interleaved conversations keep their caches. A request is admitted while
    the cells reserved by the running ones plus its own (prompt + max_new_tokens) fit the cache; free
    sequences' leftovers are dropped, largest first, to make room.
    """

    DRAFT_ROOM = 16  # cells a request may hold beyond its reply for one round's draft

    @property
    def read_chunk(self) -> int | None:
        """Prompt tokens the backend reads best in one pass, where it says (a prompt reader's: its passes are
        cheaper by the token the more they hold); None: no preference."""
        return getattr(self._backend, "read_chunk", None)

    def __init__(self, target: CachedSequence, limit: int | None = None) -> None:
        """``limit``: sequences used of those the backend holds (None: all)."""
        backend = target.backend if target is not None else None
        several = isinstance(backend, MultiSequenceBackend)
        count = min(backend.sequences, limit or 64) if several else 1
        self.passes = SharedPasses(backend) if count > 1 else None
        self.sequences = ([target] if self.passes is None else
                          [CachedSequence(SequenceView(self.passes, s)) for s in range(count)])
        self.capacity = backend.max_context if backend is not None else 0
        self._backend = backend
        self._cond = threading.Condition()
        self._free = list(range(len(self.sequences)))
        self._reserved: dict[int, int] = {}  # busy sequence -> the cells its request may fill
        self._queue: deque[object] = deque()
        self._holders: dict[int, int] = {}  # thread ident -> sequences it holds
        self._used_at = [0.0] * len(self.sequences)  # when each sequence's last request ended

    @property
    def count(self) -> int:
        return len(self.sequences)

    def holding(self) -> bool:
        return self._holders.get(threading.get_ident(), 0) > 0

    def busy(self) -> int:
        """Requests holding a sequence now: how many share the coming passes."""
        return len(self._reserved)

    def free_now(self) -> bool:
        with self._cond:
            return bool(self._free) and not self._queue

    def cached(self, prompt: Sequence[int]) -> int:
        """The most of ``prompt[:-1]``'s start any sequence holds: what a request need not read here."""
        with self._cond:
            return max(common_prefix(s.ids, prompt) for s in self.sequences)

    def take(self, prompt: Sequence[int], reserve: int) -> int:
        """Wait for a free sequence and room for ``reserve`` cells; return the sequence, holding the longest
        start of ``prompt[:-1]`` that any sequence had cached."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._free and self._fits(reserve)):
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            seq = max(self._free, key=lambda s: (self._kept(s, prompt), -self._used_at[s]))
            self._free.remove(seq)
            self._make_room(reserve)
            self._start_from_best_prefix(seq, prompt)
            self._reserved[seq] = reserve
            self._hold(+1)
        if self.passes is not None:
            self.passes.join()
        return seq

    def give(self, seq: int) -> None:
        if self.passes is not None:
            self.passes.leave()
        with self._cond:
            del self._reserved[seq]
            self._used_at[seq] = time.monotonic()
            self._free.append(seq)
            self._hold(-1)
            self._cond.notify_all()

    @contextmanager
    def every(self) -> Iterator[None]:
        """Hold every sequence (nothing else runs meanwhile)."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and len(self._free) == self.count):
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
            taken, self._free = self._free, []
            self._hold(+1)
        try:
            yield
        finally:
            with self._cond:
                self._free = taken
                self._hold(-1)
                self._cond.notify_all()

    def _hold(self, change: int) -> None:
        me = threading.get_ident()
        self._holders[me] = self._holders.get(me, 0) + change
        if not self._holders[me]:
            del self._holders[me]

    def _kept(self, seq: int, prompt: Sequence[int]) -> int:
        """How much of a free sequence's cache a request with ``prompt`` keeps: all of it (its length) where the
        prompt continues it, else -1 (taking it loses something)."""
        cached = len(self.sequences[seq])
        return cached if self.sequences[seq].reusable(prompt) == cached else -1

    def _fits(self, reserve: int) -> bool:
        return sum(self._reserved.values()) + reserve <= self.capacity or not self._reserved

    def _make_room(self, reserve: int) -> None:
        """Drop free sequences' cached cells, largest first, until the reservations and leftovers fit."""
        others = sorted(self._free, key=lambda s: -len(self.sequences[s]))
        used = sum(self._reserved.values()) + reserve + sum(len(self.sequences[s]) for s in others)
        for s in others:
            if used <= self.capacity:
                break
            used -= len(self.sequences[s])
            self.sequences[s].reset()

    def _start_from_best_prefix(self, seq: int, prompt: Sequence[int]) -> None:
        own = self.sequences[seq]
        own.crop(own.reusable(prompt))
        if self.passes is None:
            return
        # between passes every sequence's ids are a prefix of its cells (CachedSequence grows cells first and
        # shrinks ids first), busy ones included
        with self.passes.idle():
            best, length = seq, len(own)
            for other in range(self.count):
                # a snapshot: a busy sequence's request may shrink its ids meanwhile
                common = common_prefix(list(self.sequences[other].ids), prompt)
                if other != seq and common > length:
                    best, length = other, common
            if best != seq:
                self.passes.backend.share(best, seq, length)
                own.ids = list(prompt[:length])

