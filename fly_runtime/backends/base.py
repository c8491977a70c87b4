"""What every backend offers the engine: run new tokens through the model, and crop its KV cache; and what a
backend whose cache holds several sequences offers besides (batched decoding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


class Backend(Protocol):
    """One causal LM with a KV cache for a single sequence (batch size 1)."""

    name: str
    max_context: int  # positions the model supports

    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` to the cache; return float32 logits of the last ``keep`` of them (default
        all), shape [keep, V]."""
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        ...


@runtime_checkable
class MultiSequenceBackend(Protocol):
    """A backend whose cache holds ``sequences`` sequences in one pool of ``max_context`` cells (llama.cpp): the
    engine decodes several requests together on it, in passes whose parts are (sequence, new ids, keep)."""

    sequences: int
    max_context: int

    def forward_rows(self, parts: Sequence[tuple[int, Sequence[int], int | None]]) -> list[torch.Tensor]: ...

    def crop_sequence(self, seq: int, length: int) -> None: ...

    def share(self, source: int, target: int, length: int) -> None: ...


class CachedSequence:
    """A backend plus the token ids its cache holds, so callers can sync it to a context by id.

    Keeping the ids here (not in the backend) lets the engine and drafters find out what to feed and what
    to drop without either knowing the cache layout.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        logits = self.backend.forward(input_ids, keep)
        self.ids.extend(input_ids)
        return logits

    def crop(self, length: int) -> None:
        if length < len(self.ids):
            # ids first: at every moment they are a prefix of what the cache holds (batching.Slots relies on it)
            del self.ids[length:]
            self.backend.crop(length)

    def reset(self) -> None:
        """Empty the cache, also where a failed pass left cells the ids do not know of."""
        self.ids.clear()
        self.backend.crop(0)

    def reusable(self, context: Sequence[int]) -> int:
        """How many cached positions hold the start of ``context[:-1]`` (its last id is always fed anew)."""
        return common_prefix(self.ids, context)

    def crop_to_prefix(self, context: Sequence[int]) -> list[int]:
        """Crop the cache to its longest common prefix with ``context[:-1]``; return the ids still to feed.

        At least the last id of ``context`` is always returned, so feeding the result yields the logits
        that predict the token after ``context``.
        """
        common = self.reusable(context)
        self.crop(common)
        return list(context[common:])


def common_prefix(cached: Sequence[int], context: Sequence[int]) -> int:
    """How many of ``cached`` hold the start of ``context[:-1]`` (its last id is always fed anew)."""
    limit = min(len(cached), len(context) - 1)
    common = 0
    while common < limit and cached[common] == context[common]:
        common += 1
    return common
