"""PyTorch backend: a Hugging Face causal LM with a croppable DynamicCache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    # bf16 is exact enough for verification on GPUs and halves memory traffic; on CPU fp32 is the fast path.
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


class TorchBackend:
    def __init__(self, model_dir: Path, device: str | None = None, dtype: torch.dtype | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device or default_device()
        self.dtype = dtype or default_dtype(self.device)
        kwargs: dict = {"dtype": self.dtype, "low_cpu_mem_usage": True}
        if self.device == "cuda" and torch.cuda.device_count() > 1:
            kwargs["device_map"] = "auto"  # spread a large target over the GPUs with accelerate
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
        if "device_map" not in kwargs:
            self.model.to(self.device)
        self.input_device = self.model.get_input_embeddings().weight.device
        self.name = f"torch-{self.device}-{str(self.dtype).removeprefix('torch.')}"
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 32768))
        self._new_cache()

    def _new_cache(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int], keep: int | None = None) -> torch.Tensor:
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.input_device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep or 0)
        return out.logits[0].float().cpu()

    def crop(self, length: int) -> None:
        if length == 0:
            self._new_cache()
        else:
            self.cache.crop(length)
