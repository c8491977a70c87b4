"""fly_runtime: the FLy speculative-decoding engine, free of any LLM-framework dependency."""

from fly_runtime.config import GenerationConfig
from fly_runtime.engine import FlyEngine, GenerationResult, GenerationStats, GenerationStream
from fly_runtime.errors import (
    CacheError,
    EngineBusyError,
    FlyError,
    FlyWarning,
    IncompatibleModelsError,
    InvalidPromptError,
    InvalidSettingsError,
    ModelIntegrityError,
    ModelNotFoundError,
)
from fly_runtime.loader import ModelSettings, get_engine, load_engine

__all__ = [
    "CacheError",
    "EngineBusyError",
    "FlyEngine",
    "FlyError",
    "FlyWarning",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "IncompatibleModelsError",
    "InvalidPromptError",
    "InvalidSettingsError",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ModelSettings",
    "get_engine",
    "load_engine",
]
