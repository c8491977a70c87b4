"""Turning logits into tokens: greedy, or temperature / top-k / top-p sampling with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampler:
    """How to pick the next token. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    generator: torch.Generator | None = None
    min_p: float = 0.0  # tokens below this share of the top token's probability are dropped (0 = off)

    MIN_TEMPERATURE = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the sampler draws from, row-wise over ``logits`` ([..., V])."""
        logits = logits.float()
        # shifted so the top logit is 0, and divided by no less than MIN_TEMPERATURE (a float32 can hold its
        # inverse): a tiny temperature is near-greedy instead of turning every logit into +-inf or NaN
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / max(self.temperature, self.MIN_TEMPERATURE)
        if self.top_k > 0 and self.top_k < scaled.shape[-1]:
            kth = scaled.topk(self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token once the mass before it already reaches top_p (the first token always stays)
            drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= self.top_p
            drop_sorted[..., 0] = False  # even where top_p rounds to 0 in float32
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        if self.min_p > 0:  # scaled is 0 at the top token: its share is exp(scaled)
            scaled = scaled.masked_fill(scaled < float(torch.log(torch.tensor(self.min_p))), float("-inf"))
        return scaled.softmax(dim=-1)

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Next token from one row of logits, and the distribution it was drawn from (None when greedy)."""
        if self.greedy:
            return int(logits.argmax()), None
        probs = self.probs(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs
