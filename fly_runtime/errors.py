"""Errors a user can get from the runtime. Each message names the problem and the fix."""


class FlyError(Exception):
    """Base class of every error raised on purpose by fly."""


class InvalidSettingsError(FlyError):
    """A generation setting (K, window, temperature, ...) is out of range.

    Not a ValueError on purpose: pydantic turns ValueErrors raised while building a model into its own
    ValidationError, and FlyChatModel / FlyLLM should raise this type, with this message, as it is.
    """


class InvalidPromptError(FlyError, ValueError):
    """The prompt is empty, malformed, or does not fit the model's context window."""


class ModelNotFoundError(FlyError, FileNotFoundError):
    """A model reference names nothing that exists (no file, directory, built-in name or reachable Hub id)."""


class CacheError(FlyError, OSError):
    """The model cache folder cannot be created or written (FLY_CACHE_DIR names a file, or no write permission)."""


class ModelIntegrityError(FlyError):
    """A model file is corrupt or truncated (size or sha256 does not match)."""


class IncompatibleModelsError(FlyError, ValueError):
    """The drafter and the target do not share a tokenizer, so draft ids mean nothing to the target."""


class EngineBusyError(FlyError, RuntimeError):
    """This thread asked the engine for a request while it holds one of its streams open: waiting would never end."""


class FlyWarning(UserWarning):
    """Something the user should know before it costs time (a prompt that takes minutes to read)."""
