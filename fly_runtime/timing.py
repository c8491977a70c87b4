"""Timing a model pass: the one helper behind the engine's prices, the precision choice and the bench."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def pass_seconds(forward: Callable[[Sequence[int]], object], crop: Callable[[int], None], context: int,
                 tokens: Sequence[int], repeats: int, warmup: int = 0) -> float:
    """Median seconds of one pass over ``tokens`` on a cache holding ``context`` positions, cropped back to
    them after every pass (so each pass sees the same cache)."""

    def one_pass() -> None:
        forward(tokens)
        crop(context)

    return median_seconds(one_pass, repeats, warmup)
