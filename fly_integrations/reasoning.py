"""A thinking model's reasoning, read apart from its answer.

Models such as Qwen3, QwQ and the DeepSeek-R1 distills open their reply with ``<think>`` ... ``</think>`` (or
their chat template opens the block in the prompt, and the reply starts inside it). The reasoning streams as
``Reasoning`` deltas, which the adapters file where users look for it: ``reasoning_content`` on the server and in
LangChain's ``additional_kwargs`` (its reasoning content blocks), a ``ThinkingBlock`` in LlamaIndex. Only a block
that opens the reply is reasoning: a ``<think>`` later in an answer is text. Models without these tokens stream
as before.
"""

from __future__ import annotations

from fly_integrations.tool_calls import partial_marker_length

OPEN, CLOSE = "<think>", "</think>"


class Reasoning(str):
    """A delta of the model's reasoning, not of its answer."""


def answer_text(item: object) -> str:
    """What a streamed item adds to the answer's text: a plain text delta, not reasoning or the closing Reply."""
    return item if isinstance(item, str) and not isinstance(item, Reasoning) else ""


def thinks(tokenizer) -> bool:
    """The model has reasoning tokens (its vocabulary holds both tags as tokens of their own)."""
    added = tokenizer.get_added_vocab()
    return OPEN in added and CLOSE in added


def opens_inside(tokenizer, prompt_ids: list[int]) -> bool:
    """The chat template opened the reasoning block in the prompt: the reply starts inside it."""
    return tokenizer.decode(prompt_ids[-4:]).rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Splits streamed reply text into reasoning and answer, holding back only what may still be a tag."""

    def __init__(self, inside: bool = False) -> None:
        self._state = "inside" if inside else "start"  # start -> inside -> after -> answer, or start -> answer
        self._held = ""
        self.reasoning = ""

    def push(self, piece: str) -> list[str]:
        """The deltas that are final now: ``Reasoning`` for reasoning, plain ``str`` for the answer."""
        self._held += piece
        out: list[str] = []
        while self._held:
            before = (self._state, len(self._held))
            if self._state == "start":
                head = self._held.lstrip()
                if head.startswith(OPEN):
                    self._held, self._state = head[len(OPEN):], "inside"
                elif OPEN.startswith(head):
                    break  # white space, or the opening tag still arriving
                else:
                    self._state = "answer"
            elif self._state == "inside":
                if not self.reasoning:  # the line break after the opening tag
                    self._held = self._held.lstrip("\n")
                at = self._held.find(CLOSE)
                end = at if at >= 0 else len(self._held) - partial_marker_length(self._held, (CLOSE,))
                if end:
                    out.append(self._thought(self._held[:end]))
                self._held = self._held[end:]
                if at < 0:
                    break
                self._held, self._state = self._held[len(CLOSE):], "after"
            elif self._state == "after":  # the blank lines between the reasoning and the answer
                self._held = self._held.lstrip()
                if self._held:
                    self._state = "answer"
            else:
                out.append(self._held)
                self._held = ""
            if (self._state, len(self._held)) == before:
                break
        return out

    def finish(self) -> list[str]:
        """What is still held: reasoning cut off by the budget, or an answer that was only white space."""
        held, self._held = self._held, ""
        if self._state == "inside" and held:
            return [self._thought(held)]
        return [held] if held and self._state in ("start", "answer") else []

    def _thought(self, text: str) -> Reasoning:
        self.reasoning += text
        return Reasoning(text)
