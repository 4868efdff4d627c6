"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""


class TinyGPTError(Exception):
    """Base class of every error tinygpt raises on purpose."""


class ConfigError(TinyGPTError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class TokenizerError(TinyGPTError, ValueError):
    """A tokenizer file is missing or corrupt, or text/ids do not fit the tokenizer's vocabulary."""


class DataError(TinyGPTError, ValueError):
    """A text source or a prepared data folder cannot be used."""


class CheckpointError(TinyGPTError):
    """A run folder or one of its files is missing, corrupt, or disagrees with itself."""


class TrainingError(TinyGPTError):
    """Training cannot start or continue (data too short, a resume that does not match, ...)."""


class NonFiniteError(TrainingError):
    """A non-finite loss or gradient norm; training stopped before the optimizer step."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class MissingDependencyError(TinyGPTError, ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


class SweepError(TinyGPTError):
    """A sweep folder cannot be used or continued (other settings, other data, a damaged results file)."""


class ChatError(TinyGPTError, ValueError):
    """A conversation cannot be rendered: an unknown role, empty content, no assistant turn, a
    tokenizer without a chat template."""


class GrammarError(TinyGPTError, ValueError):
    """A constraint on a reply (a JSON Schema, a regex, choices, a grammar) cannot be compiled, or the model's
    vocabulary cannot write it."""


class RewardError(TrainingError):
    """A reward function raised, or answered with something other than one number (or None) a completion."""
