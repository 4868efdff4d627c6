"""Units for the calculators: bytes per dtype, counts written as "70B" or "1.4e12", readable sizes."""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

# Bytes per element of the floating-point dtypes tinygpt trains and runs in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}

# Count suffixes as people write model and data sizes: 124M parameters, 1.4T tokens.
_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_COUNT = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([kmbgtp]?)")


def check_int(value: int, what: str, low: int = 1, high: int | None = None) -> int:
    """`value` if it is an integer in [low, high]; else a ConfigError naming `what`."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{what}: must be an integer {bounds}, got {value!r}")
    return value


def dtype_name(dtype: str) -> str:
    """The canonical name ("float32", "bfloat16", "float16") of a dtype name or alias such as "bf16"."""
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return name


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` (a name such as "float32" or "bf16")."""
    return DTYPE_BYTES[dtype_name(dtype)]


def parse_count(text: str, what: str = "value") -> float:
    """A positive number written plainly, in e-notation or with a K/M/B/T suffix: "1.4e12", "70B", "124M".

    Args:
        text: what the user typed.
        what: the name used in the error message (e.g. "--params").

    Raises:
        ConfigError: not a number, not finite, or not more than zero.
    """
    match = _COUNT.fullmatch(str(text).strip().lower().replace(",", "").replace("_", ""))
    if match is None:
        raise ConfigError(f"{what}: expected a number such as 1e21, 70B or 1.4T, got {text!r}")
    value = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if not 0 < value < math.inf:
        raise ConfigError(f"{what}: must be finite and more than zero, got {text!r}")
    return value


def plural(count: int, noun: str) -> str:
    """"1 step", "2 steps", "1,024 steps": a count and its noun, an s added unless the count is one."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_count(n: float, digits: int = 3) -> str:
    """A short count: 124M, 69.3B, 1.39T (3 significant digits by default)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}g}{suffix}"
    return f"{n:.{digits}g}"


def format_bytes(n: float) -> str:
    """Bytes in binary units: 474.7 MiB, 1.86 GiB."""
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {suffix}"
    return f"{int(n)} B"


def format_flops(n: float) -> str:
    """FLOPs with an SI prefix (745 MFLOP, 1.01 GFLOP), in e-notation beyond peta: 5.76e+23 FLOP."""
    for suffix, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}" if abs(n) < 1e18 else f"{n:.3g} FLOP"
    return f"{n:.3g} FLOP"
