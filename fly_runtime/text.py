"""Incremental detokenisation with multi-token stop strings.

Text is released only when it is final: never half of a multi-byte character, and never characters that
could still turn out to be the start of a stop string. A stop string may span several tokens and several
rounds; nothing after it is ever released.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``: text that may
    still turn out to be the start of a marker, so is held back until the next piece tells."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class StopTextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.released = ""  # text handed out so far
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add committed tokens; return the newly final text. Sets ``stopped`` when a stop string appears."""
        self.token_ids.extend(token_ids)
        text = self._decode(self.token_ids)
        if self.stop:
            # a stop string can only start where the released text cannot have reached it yet
            search_from = max(0, len(self.released) - max(map(len, self.stop)) + 1)
            found = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
            if found:
                end = min(found)
                self.stopped = True
                self._trim_tokens(end)
                return self._release(text[:end])
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait for its other bytes
            end -= 1
        end -= partial_marker_length(text[:end], self.stop)
        return self._release(text[:end])

    def finish(self) -> str:
        """Release whatever was held back (generation ended without completing a stop string)."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.token_ids))

    def _release(self, text: str) -> str:
        if len(text) <= len(self.released):
            return ""
        delta = text[len(self.released) :]
        self.released = text
        return delta

    def _trim_tokens(self, text_end: int) -> None:
        """Drop the tokens that only produced the stop string and what followed it."""
        while len(self.token_ids) > 1 and len(self._decode(self.token_ids[:-1])) >= text_end:
            self.token_ids.pop()
