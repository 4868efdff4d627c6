"""tinygpt: build, train, inspect and serve small GPTs on your own text."""

from .checkpoint import load, save
from .config import GPTConfig, SampleConfig, TrainConfig
from .data import prepare
from .errors import CheckpointError, ConfigError, DataError, TinyGPTError, TokenizerError, TrainingError
from .generate import generate, generate_stream
from .kv_cache import KVCache
from .model import GPT
from .quantize import quantize
from .tokenizer import load_tokenizer
from .train import train

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPTConfig",
    "SampleConfig",
    "TrainConfig",
    "KVCache",
    "generate",
    "generate_stream",
    "prepare",
    "train",
    "save",
    "load",
    "load_tokenizer",
    "quantize",
    "TinyGPTError",
    "ConfigError",
    "DataError",
    "TokenizerError",
    "CheckpointError",
    "TrainingError",
]
