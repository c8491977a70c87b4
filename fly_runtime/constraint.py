"""Constrained decoding: a JSON schema as a mask over the target's vocabulary at every position it decides.

The mask comes from llguidance's grammar matcher, advanced over the committed tokens. A draft is checked along
its own path: the masks for the positions before each draft token and after the last, as far as the grammar
allows the drafts (a draft token it forbids ends the draft there). Verification then sees only what the
grammar allows, so whatever it commits, forgiven or not, parses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import torch

from fly_runtime.errors import InvalidSettingsError


def blank_token_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """A bool mask over the vocabulary: True where a token's text is whitespace alone (what may trail a JSON value)."""
    from fly_runtime.numbers import token_texts

    return torch.tensor([bool(text) and text.isspace() for text in token_texts(tokenizer, vocab_size)],
                        dtype=torch.bool)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's view of ``tokenizer`` (under a second to build: an engine keeps one). A byte-level BPE vocabulary
    (Qwen's, Llama 3's) is handed over as each token's bytes, encoding through ``tokenizer`` itself: 0.03 GB, where
    llguidance's own route parses a second copy of the whole tokenizer from its JSON (0.13 GB for Qwen's)."""
    import llguidance
    import llguidance.hf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteLevelVocabulary(tokenizer, vocab_size)),
                                  n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


class _ByteLevelVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads of a byte-level BPE tokenizer: each token's bytes (a special token's
    text behind llguidance's 0xFF mark), and an encoder of bytes."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

        self._backend = tokenizer.backend_tokenizer
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = tokenizer.added_tokens_decoder
        self.special_token_ids = sorted(set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special})
        special = set(self.special_token_ids)
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            piece = self._backend.id_to_token(i)
            if piece is None:  # rows past the vocabulary (the model's padded embedding)
                self.tokens.append(b"")
            elif i in added:  # added tokens are kept as their text, not in the byte alphabet
                self.tokens.append(b"\xff" + piece.encode() if i in special else piece.encode())
            else:
                self.tokens.append(bytes(byte_of[char] for char in piece))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        return self._backend.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids


# what may follow a value: up to two whitespace characters. A model closes a JSON value with tokens such as "}}\n"
# (its object closed, then a new line), which a grammar ending at the brace forbids, and a model denied them keeps
# writing what is still allowed (more digits of a number, say) until its budget runs out
TRAILING = "/[ \\t\\n]{0,2}/"

# the layout JSON values are written in: json.dumps's (", " between items, ": " after keys, no other whitespace).
# Every brace, key and separator is then the only token the grammar allows, so the target reads it in a pass
# instead of choosing it in a step; an extraction's reply is 10-15% fewer tokens than the model's own indented
# layout and a third faster here (docs/benchmarks.md, twelfth session). A schema's own "x-guidance" wins.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def laid_out(schema: dict) -> dict:
    """``schema`` with fly's JSON layout (``LAYOUT``) where it does not set llguidance's options itself."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": LAYOUT}


class JsonConstraint:
    def __init__(self, grammar_tokenizer, schema: str | None, vocab_size: int, eos_token_ids: Sequence[int],
                 lark: str | None = None, blank: torch.Tensor | None = None) -> None:
        """A JSON ``schema`` (a JSON string), or a ``lark`` grammar in llguidance's dialect. ``blank``: the
        whitespace tokens (``blank_token_mask``), with which a schema's reply ends as soon as its value is whole."""
        import llguidance

        # a JSON value once whole may be followed by whitespace alone (TRAILING), which nobody reads: the reply ends
        # there instead of after a step that picks the end-of-sequence token (a user's grammar may mean its
        # whitespace, so it decides its own end)
        self._blank = blank if lark is None else None
        if lark is None:  # GenerationConfig has checked that the schema is a JSON object
            lark = f"start: value {TRAILING}\nvalue: %json {json.dumps(laid_out(json.loads(schema)))}"
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except ValueError as exc:
            raise InvalidSettingsError(f"the reply's grammar cannot be read: {exc}") from None
        self.matcher = llguidance.LLMatcher(grammar_tokenizer, grammar, log_level=0)
        self.tokenizer = grammar_tokenizer
        if self.matcher.is_error():
            raise InvalidSettingsError(f"the reply's grammar cannot be decoded to: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)

    def allowed(self) -> torch.Tensor:
        """Bool mask [V] of the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def masks_along(self, draft_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """(masks [n + 1, V], n): the masks before each of the first n drafts and after them, where n drafts
        are what the grammar allows of ``draft_ids``. The matcher is left where it was."""
        masks = [self.allowed()]
        n = 0
        for token in draft_ids:
            # a token the mask forbids would put the matcher in its error state for good: test it first. A
            # draft ends before an end-of-sequence token, which stops the matcher where a rollback would not
            # count it; the target picks that token itself where the value may end
            if token in self.eos or not masks[-1][token] or not self.matcher.consume_token(token):
                break
            n += 1
            masks.append(self.allowed())
        if n:
            self.matcher.rollback(n)
        return torch.stack(masks), n

    def forced(self) -> list[int]:
        """The tokens of the text the grammar allows no alternative to from here (keys, punctuation, closing
        brackets, a string's opening quote): llguidance's fast-forward tokens, then the text they leave as the
        tokenizer writes it. That rest (the ``' "'`` before a string value, the ``' '`` before a number) is no
        forced token, since the model may write it merged with the value's first characters, but it is the
        likely one; drafted with the rest, the pass that reads a key also writes its value's first token. All are
        verified like any draft, so exact decoding stays exact where the target would tokenize the text otherwise."""
        tokens = list(self.matcher.compute_ff_tokens())
        text = self.matcher.compute_ff_bytes()
        written = self.tokenizer.decode_bytes(tokens)
        if len(text) > len(written) and text.startswith(written):
            tokens += self.tokenizer.tokenize_bytes(text[len(written):])
        return tokens

    def commit(self, token_ids: Sequence[int]) -> int:
        """Advance over ``token_ids``; how many of them were taken: all, or (with ``blank``) those up to the one
        that made the value whole, so that a pass committing the value's end and whitespace after it ends where a
        step at a time would."""
        if self._blank is None:
            if token_ids and not self.matcher.consume_tokens(list(token_ids)):
                raise AssertionError(f"a committed token broke the grammar: {self.matcher.get_error()}")
            return len(token_ids)
        for taken, token in enumerate(token_ids, 1):
            if not self.matcher.consume_token(token):
                raise AssertionError(f"a committed token broke the grammar: {self.matcher.get_error()}")
            if self.finished:
                return taken
        return len(token_ids)

    @property
    def finished(self) -> bool:
        """The value is complete and nothing may follow it (with ``blank``: nothing but whitespace)."""
        if self.matcher.is_stopped():
            return True
        if self._blank is None or not self.matcher.is_accepting():
            return False
        more = self.allowed() & ~self._blank
        more[sorted(self.eos)] = False
        return not bool(more.any())
