"""Tokens that write numbers: FLy never forgives a drafted number (see ``verify``)."""

from __future__ import annotations

import torch


def digit_token_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """A bool mask over the vocabulary: True where a token's text holds a digit (any script: 7, ７, ²)."""
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)], skip_special_tokens=True)
    return torch.tensor([any(c.isdigit() for c in text) for text in texts], dtype=torch.bool)
