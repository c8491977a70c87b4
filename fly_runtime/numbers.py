"""Tokens that write numbers: FLy never forgives a drafted number (see ``verify``)."""

from __future__ import annotations

import torch


def digit_token_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """A bool mask over the vocabulary: True where a token's text holds a digit (any script: 7, ７, ²). The first
    FLy request of every process pays for it."""
    return torch.tensor([any(c.isdigit() for c in text) for text in token_texts(tokenizer, vocab_size)],
                        dtype=torch.bool)


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """Each token's text alone (special tokens empty). A fast tokenizer decodes the vocabulary in its own batch,
    several times faster than ``batch_decode``."""
    ids = [[i] for i in range(vocab_size)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(ids, skip_special_tokens=True)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)
