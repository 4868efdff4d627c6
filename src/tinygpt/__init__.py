"""tinygpt: build, train, inspect and serve small GPTs on your own text.

The names below are imported when first used (PEP 562), so `import tinygpt.calc` and
`from tinygpt import GPTConfig` stay free of torch: the pure layers (config, calc, errors) load in
milliseconds, and the model, training and generation modules only when something asks for them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPTConfig",
    "SampleConfig",
    "TrainConfig",
    "FinetuneConfig",
    "KVCache",
    "generate",
    "generate_stream",
    "prepare",
    "train",
    "finetune",
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

# public name -> the submodule that defines it
_HOME = {
    "GPT": "model",
    "GPTConfig": "config",
    "SampleConfig": "config",
    "TrainConfig": "config",
    "FinetuneConfig": "config",
    "KVCache": "kv_cache",
    "generate": "generate",
    "generate_stream": "generate",
    "prepare": "data",
    "train": "train",
    "finetune": "finetune",
    "save": "checkpoint",
    "load": "checkpoint",
    "load_tokenizer": "checkpoint",  # a Hugging Face folder's tokenizer too, as `load` opens the folder
    "quantize": "interop.quantize",
    "TinyGPTError": "errors",
    "ConfigError": "errors",
    "DataError": "errors",
    "TokenizerError": "errors",
    "CheckpointError": "errors",
    "TrainingError": "errors",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from .checkpoint import load, load_tokenizer, save
    from .config import FinetuneConfig, GPTConfig, SampleConfig, TrainConfig
    from .data import prepare
    from .finetune import finetune
    from .errors import CheckpointError, ConfigError, DataError, TinyGPTError, TokenizerError, TrainingError
    from .generate import generate, generate_stream
    from .kv_cache import KVCache
    from .model import GPT
    from .interop.quantize import quantize
    from .train import train


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use; any other submodule (tinygpt.lab.sweep, ...) likewise."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps `tinygpt.generate`, `tinygpt.train` and `tinygpt.finetune` the functions of those names.

    Importing a submodule sets it as an attribute of its package, which would hide the function of
    the same name (`import tinygpt.train` would turn `tinygpt.train(...)` into a module); the eager
    `from .train import train` used to undo that, and this does the same when the submodule arrives.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (_HOME.get(name) == name and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
