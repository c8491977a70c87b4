"""Bridge from a blocking iterator (a generation) to asyncio, without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def aiter_in_thread(open_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run ``open_iterator()`` in a worker thread and yield its items here as they come.

    Cancelling the consuming task (or closing this iterator) makes the worker stop at its next item and
    close the iterator, which ends the generation and releases the engine for the next request.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def produce() -> None:
        try:
            iterator = open_iterator()
            try:
                for item in iterator:
                    if cancelled.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # hand every failure to the awaiting side
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    # a thread of its own, not the loop's default executor: that one holds min(32, CPUs + 4) workers (6 on two
    # cores), which would cap the requests decoding together below the engine's max_batch and the queue behind
    threading.Thread(target=produce, name="fly-generation", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # the worker notices at its next item, closes the generation and frees the engine; nobody waits
        cancelled.set()
