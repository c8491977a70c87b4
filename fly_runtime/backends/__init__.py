"""Model backends: forward new tokens through a causal LM with a KV cache, and crop that cache."""

from fly_runtime.backends.base import Backend, CachedSequence

__all__ = ["Backend", "CachedSequence"]
