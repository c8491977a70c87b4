"""Chat messages -> prompt token ids, with message contents encoded as text, never as control tokens.

A chat template renders contents into one string, and encoding that string parses every special-token
spelling in it, so a user message, a retrieved document or a tool result that contains ``<|im_end|>`` would
close its turn and open a forged one. Here each control-token spelling inside the caller's data is swapped
for a placeholder before rendering; the rendered text is then cut at the template's own control tokens, and
the text between them, placeholders restored, is encoded by the tokenizer's model alone (no added-token
matching). For clean messages the ids equal what ``apply_chat_template(tokenize=True)`` gives.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

from fly_runtime.errors import InvalidPromptError

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters; the caller's own are escaped like control text


class ChatEncoder:
    """Encodes chat prompts for one tokenizer (built once per engine: it compiles the control-token pattern)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.control_ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.content}
        escaped = sorted(self.control_ids, key=len, reverse=True) + [_OPEN, _CLOSE]
        self._in_data = re.compile("|".join(re.escape(s) for s in escaped))
        self._in_render = re.compile(
            f"{re.escape(_OPEN)}(\\d+){re.escape(_CLOSE)}|"
            + "|".join(re.escape(s) for s in sorted(self.control_ids, key=len, reverse=True)))

    def encode(
        self,
        messages: Sequence[dict],
        tools: list[dict] | None = None,
        suffix: str = "",
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered by the chat template, then ``suffix``: fly's own
        text after the generation prompt (a steering prefill), whose control tokens are meant."""
        literals: list[str] = []

        def hide(match: re.Match) -> str:
            literals.append(match.group(0))
            return f"{_OPEN}{len(literals) - 1}{_CLOSE}"

        if not self.tokenizer.chat_template:
            raise InvalidPromptError(
                "this model's tokenizer has no chat template, so chat messages cannot be rendered for it: use a chat "
                "(instruct) model, or send plain text with fly generate --raw")
        safe_messages = _map_strings(list(messages), lambda s: self._in_data.sub(hide, s))
        safe_tools = _map_strings(tools, lambda s: self._in_data.sub(hide, s)) if tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                safe_messages, tools=safe_tools, add_generation_prompt=add_generation_prompt, tokenize=False)
        except UnicodeError as exc:
            raise InvalidPromptError(f"a message is not valid text ({exc}): send UTF-8 text") from exc
        text += suffix
        ids: list[int] = []
        plain: list[str] = []
        position = 0
        for match in self._in_render.finditer(text):
            plain.append(text[position:match.start()])
            position = match.end()
            if match.group(1) is not None:
                plain.append(literals[int(match.group(1))])  # caller's text: stays text
            else:
                ids += self.encode_text("".join(plain))
                plain.clear()
                ids.append(self.control_ids[match.group(0)])
        plain.append(text[position:])
        return ids + self.encode_text("".join(plain))

    def encode_text(self, text: str) -> list[int]:
        """``text`` as ordinary text: a control-token spelling in it becomes the tokens of its characters."""
        if not text:
            return []
        _check_text(text)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: split_special_tokens keeps special spellings as text
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        # the fast tokenizer's pipeline without its added-token pass: normalize, pre-tokenize, model
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_encoder(tokenizer) -> ChatEncoder:
    """The tokenizer's encoder, built on first use."""
    encoder = _encoders.get(tokenizer)
    if encoder is None:
        encoder = _encoders[tokenizer] = ChatEncoder(tokenizer)
    return encoder


def encode_chat(tokenizer, messages: Sequence[dict], tools: list[dict] | None = None, suffix: str = "") -> list[int]:
    """Prompt ids for ``messages`` with the generation prompt: see ``ChatEncoder.encode``."""
    return chat_encoder(tokenizer).encode(messages, tools, suffix)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start:exc.end].encode("unicode_escape").decode()
        raise InvalidPromptError(
            f"the prompt holds {bad!r} at character {exc.start}, which is not valid text (a lone surrogate): "
            "send valid UTF-8 text") from None


def _map_strings(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every string inside it (dict keys left alone)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value
