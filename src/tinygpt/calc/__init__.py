"""Calculators: pure arithmetic on a GPTConfig. Parameters, FLOPs, memory, Chinchilla planning,
model shapes for a parameter count, scaling laws.

No torch here (layer L0): the counts come from the architecture alone, and the tests hold them
equal to the built model's `sum(p.numel())` and to torch's FLOP counter.
"""

from .chinchilla import CHINCHILLA_FIT, TOKENS_PER_PARAM, ChinchillaPlan, LossFit, compute_optimal
from .flops import FlopCounts, flops_per_token, inference_flops_per_token, six_n, training_flops
from .memory import TrainingMemory, activation_bytes, kv_cache_bytes, training_memory
from .params import ParamCounts, TrainableParams, count_params, lora_params, projections, trainable_params
from .scaling import CHINCHILLA_EXPONENTS, PowerLaw, ScalingLaw
from .shapes import ASPECT_RATIO, heads_for, shape_for_params, smallest_shape
from .units import (DTYPE_BYTES, dtype_bytes, dtype_name, format_bytes, format_count, format_flops, parse_count,
                    plural)

__all__ = [
    "CHINCHILLA_FIT",
    "TOKENS_PER_PARAM",
    "ChinchillaPlan",
    "LossFit",
    "compute_optimal",
    "FlopCounts",
    "flops_per_token",
    "inference_flops_per_token",
    "six_n",
    "training_flops",
    "TrainingMemory",
    "activation_bytes",
    "kv_cache_bytes",
    "training_memory",
    "ParamCounts",
    "count_params",
    "TrainableParams",
    "lora_params",
    "projections",
    "trainable_params",
    "CHINCHILLA_EXPONENTS",
    "PowerLaw",
    "ScalingLaw",
    "ASPECT_RATIO",
    "heads_for",
    "shape_for_params",
    "smallest_shape",
    "DTYPE_BYTES",
    "dtype_bytes",
    "dtype_name",
    "format_bytes",
    "format_count",
    "format_flops",
    "parse_count",
    "plural",
]
