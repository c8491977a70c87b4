"""Penalties on repeated tokens, applied to the target's logits before a token is picked or a draft verified.

``repetition_penalty`` (HF's and vLLM's rule; llama.cpp's ``repeat_penalty``): the logit of every token already in
the prompt or the reply is divided by it where positive, multiplied where negative. ``frequency_penalty`` and
``presence_penalty`` (OpenAI's): a token's logit drops by ``frequency * count + presence * (count > 0)``, counting
the reply's tokens. A verification pass holds one row a drafted position, each seeing the reply so far plus the
drafts before it, so every row is penalised as a plain step at that position would be: exact verification stays
exactly plain decoding under the same penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fly_runtime.config import GenerationConfig


class Penalties:
    def __init__(self, config: GenerationConfig, prompt: Sequence[int], vocab_size: int) -> None:
        self.repetition = config.repetition_penalty
        self.frequency = config.frequency_penalty
        self.presence = config.presence_penalty
        self.vocab_size = vocab_size
        self._in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        if self.repetition != 1.0:
            self._in_prompt[torch.tensor([t for t in prompt if t < vocab_size], dtype=torch.long)] = True

    @classmethod
    def of(cls, config: GenerationConfig, prompt: Sequence[int], vocab_size: int) -> "Penalties | None":
        """The request's penalties, or None where it asks for none (nothing is computed then)."""
        if config.repetition_penalty == 1.0 and config.frequency_penalty == 0.0 and config.presence_penalty == 0.0:
            return None
        return cls(config, prompt, vocab_size)

    def apply(self, logits: torch.Tensor, reply: Sequence[int], drafts: Sequence[int] = ()) -> torch.Tensor:
        """``logits`` [rows, V]: row i follows ``reply`` + ``drafts[:i]``; the penalised rows (a new tensor)."""
        rows = logits.shape[0]
        tokens = torch.tensor([*reply, *drafts[: max(rows - 1, 0)]], dtype=torch.long)
        counts = torch.zeros(rows, self.vocab_size)
        if len(reply):
            counts += torch.bincount(tokens[: len(reply)], minlength=self.vocab_size)[: self.vocab_size].float()
        for i, token in enumerate(tokens[len(reply):].tolist()):  # row i + 1 onwards has seen draft i
            counts[i + 1:, token] += 1
        out = logits[:, : self.vocab_size].float().clone()
        if self.repetition != 1.0:
            seen = (counts > 0) | self._in_prompt
            out = torch.where(seen, torch.where(out > 0, out / self.repetition, out * self.repetition), out)
        out -= self.frequency * counts + self.presence * (counts > 0).float()
        return out
