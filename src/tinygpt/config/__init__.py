"""Configs, presets and their JSON round-trip. Pure Python: no torch here.

A module a topic: `fields` (the checks every config shares, from_mapping), `model` (GPTConfig, the
layouts, the families' PRESETS), `sampling` (SampleConfig), `train` (TrainConfig, its optimizers and
schedules, the default recipe), `lora` (LoraConfig, which every method that trains adapters takes),
`finetune` (FinetuneConfig) and `duration` (parse_duration). A training method of its own (preference
pairs, a reward model, rollouts) gets its config module beside `finetune`. tinygpt's modules import
from the topic module; this package gives the names users import from `tinygpt.config`.
"""

from .duration import parse_duration
from .finetune import FinetuneConfig
from .lora import LoraConfig
from .model import PRESETS, GPTConfig, with_arch
from .sampling import SampleConfig
from .train import DEFAULT_LR, MUON_LR, RECIPE_MODEL, RECIPE_TRAIN, TrainConfig

__all__ = [
    "GPTConfig", "PRESETS", "with_arch", "SampleConfig", "TrainConfig", "DEFAULT_LR", "MUON_LR", "RECIPE_MODEL",
    "RECIPE_TRAIN", "LoraConfig", "FinetuneConfig", "parse_duration",
]
