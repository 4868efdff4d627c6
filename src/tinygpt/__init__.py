"""tinygpt: build, train, inspect and serve small GPTs on your own text."""

from .config import GPTConfig, SampleConfig
from .errors import ConfigError, DataError, TinyGPTError, TokenizerError
from .generate import generate, generate_stream
from .kv_cache import KVCache
from .model import GPT
from .tokenizer import load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPTConfig",
    "SampleConfig",
    "KVCache",
    "generate",
    "generate_stream",
    "load_tokenizer",
    "ConfigError",
    "DataError",
    "TokenizerError",
    "TinyGPTError",
]
