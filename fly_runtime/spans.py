"""Spans of the output that FLy must verify exactly, such as a tool call's JSON.

FLy keeps a drafted token the target did not pick where the target is uncertain and agrees with what
follows. In prose that is a different wording; inside a tool call it is a different argument (a quoted
number, another digit), and the call the agent makes is no longer the target's. So a request may name
(opening, closing) marker pairs: a draft token that lies inside such a span, or completes its opening marker,
is verified by exact matching. Markers are matched on the decoded text, so one may span several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fly_runtime.text import partial_marker_length


@dataclass(frozen=True)
class SpanState:
    closing: str | None  # the marker that ends the span generation is in; None outside every span
    tail: str  # the last characters seen, where a marker split across tokens may have begun

    @property
    def inside(self) -> bool:
        return self.closing is not None


class ExactSpans:
    def __init__(self, tokenizer, spans: Sequence[tuple[str, str]], prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.spans = tuple(spans)
        # generation may start inside a span the reply already opened (a forced tool call's prompt ends with an
        # opening marker), but not inside one a user's message left open (an inline ``` in a question): only the
        # prompt's text after its last special token, the chat template's turn marker, counts
        self.state = self._advance(SpanState(None, ""), self._decode(_after_last_special(tokenizer, prompt_ids)))

    @property
    def inside(self) -> bool:
        return self.state.inside

    def strict_positions(self, draft_ids: Sequence[int]) -> list[bool]:
        """For each draft token: must it match the target exactly (inside a span, or opening one)?"""
        strict = []
        state = self.state
        for token in draft_ids:
            before = state.inside
            state = self._advance(state, self._decode([token]))
            strict.append(before or state.inside)
        return strict

    def commit(self, token_ids: Sequence[int]) -> None:
        self.state = self._advance(self.state, self._decode(token_ids))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _advance(self, state: SpanState, text: str) -> SpanState:
        closing = state.closing
        buffer = state.tail + text
        position = 0
        while True:
            if closing is None:
                found = [(buffer.find(opening, position), opening, end) for opening, end in self.spans]
                found = [f for f in found if f[0] >= 0]
                if not found:
                    break
                start, opening, closing = min(found)
                position = start + len(opening)
            else:
                start = buffer.find(closing, position)
                if start < 0:
                    break
                position = start + len(closing)
                closing = None
        # keep what could still be the start of the marker looked for next, but nothing a marker consumed
        watched = [opening for opening, _ in self.spans] if closing is None else [closing]
        return SpanState(closing, buffer[len(buffer) - partial_marker_length(buffer[position:], watched):])


def _after_last_special(tokenizer, ids: Sequence[int]) -> list[int]:
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    last = max((n for n, i in enumerate(ids) if i in special), default=-1)
    return list(ids[last + 1:])
