"""Up to ``turns`` requests on the engine at once (decoded together), the rest waiting in arrival order up to a
bounded depth."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__("timed out waiting for the model")
        self.retry_after = retry_after


class Admission:
    """A FIFO turn on the engine, ``turns`` held at once: asyncio's semaphore wakes its waiters in order. A
    request arriving with ``depth`` already waiting is refused at once, with a retry time estimated from recent
    requests' durations."""

    def __init__(self, depth: int, turns: int = 1) -> None:
        self.depth, self.turns = depth, turns
        self._lock = asyncio.Semaphore(turns)
        self._waiting = 0
        self._running = 0
        self._durations: deque[float] = deque(maxlen=16)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def retry_after(self) -> int:
        typical = sum(self._durations) / len(self._durations) if self._durations else 5.0
        return max(1, math.ceil(typical * (self._waiting + 1) / self.turns))

    @asynccontextmanager
    async def turn(self, timeout: float | None) -> AsyncIterator[None]:
        if self._lock.locked() and self._waiting >= self.depth:
            raise QueueFull(self.retry_after())
        self._waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except TimeoutError:
            raise QueueTimeout(self.retry_after()) from None
        finally:
            self._waiting -= 1
        start = time.perf_counter()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._durations.append(time.perf_counter() - start)
            self._lock.release()
