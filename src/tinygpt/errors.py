"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""


class TinyGPTError(Exception):
    """Base class of every error tinygpt raises on purpose."""


class ConfigError(TinyGPTError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class TokenizerError(TinyGPTError, ValueError):
    """A tokenizer file is missing or corrupt, or text/ids do not fit the tokenizer's vocabulary."""


class DataError(TinyGPTError, ValueError):
    """A text source or a prepared data folder cannot be used."""
