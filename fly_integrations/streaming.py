"""Bridges from the engine's blocking stream to asyncio, without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from fly_runtime import GenerationResult, GenerationStream

_DONE = object()


async def aiter_stream(open_stream: Callable[[], GenerationStream]) -> AsyncIterator[str | GenerationResult]:
    """Run a generation in a worker thread; yield its text pieces, then its result.

    Cancelling the consuming task (or closing this iterator) stops the generation at its next committed
    piece, which releases the engine for the next request.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def produce() -> None:
        try:
            stream = open_stream()
            with stream:
                for piece in stream:
                    if cancelled.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
            loop.call_soon_threadsafe(queue.put_nowait, stream.result)
        except BaseException as exc:  # hand every failure to the awaiting side
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    loop.run_in_executor(None, produce)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # the worker notices at its next piece, closes the stream and frees the engine; nobody waits for it
        cancelled.set()
