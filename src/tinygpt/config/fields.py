"""What every config shares: the checks of its fields, the bounds of the numbers torch takes, and the
reading of a config from a plain mapping (a config.json, a config file's table) with from_mapping."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, TypeVar

from ..errors import ConfigError

MAX_THREADS = 1024  # torch.set_num_threads takes a C int; more threads than this is a typo
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit; this leaves room for the seed + rank / + step offsets training adds
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (torch.finfo(torch.float32).max)

T = TypeVar("T")


def check(ok: bool, field: str, message: str) -> None:
    """Refuse a field's value unless `ok`.

    Args:
        ok: whether the value is acceptable.
        field: the name the error starts with.
        message: what is wrong with it.

    Raises:
        ConfigError: "FIELD: MESSAGE", when not ok.
    """
    if not ok:
        raise ConfigError(f"{field}: {message}")


def is_int(value: Any) -> bool:
    """Whether value is an integer: not a bool, which Python counts as one (top_k=True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether value is an int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(value: Any, field: str, minimum: int) -> None:
    """Refuse anything but an integer of at least `minimum`.

    Args:
        value: the field's value.
        field: its name, as the error gives it.
        minimum: the smallest value allowed.
    """
    check(is_int(value) and value >= minimum, field, f"must be an integer >= {minimum}, got {value!r}")


def check_bools(obj: Any, names: tuple[str, ...]) -> None:
    """Refuse any of these fields of `obj` that is not True or False (a config file's 1 or "yes").

    Args:
        obj: the config.
        names: the fields that are switches.
    """
    for name in names:
        check(isinstance(getattr(obj, name), bool), name, f"must be true or false, got {getattr(obj, name)!r}")


def finite(obj: Any, names: tuple[str, ...]) -> None:
    """Each field must be a real, finite number (or None): NaN slips past every `>=` check, and inf
    past most, and either would reach the optimizer (a file's `lr = nan` or `weight_decay = inf`).

    Args:
        obj: the config.
        names: the fields that hold numbers.
    """
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        check(is_number(value) and math.isfinite(value), name, f"must be a finite number, got {value!r}")


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check one JSON/TOML value against a dataclass field's type; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(name, value, option)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is float:
        if is_number(value):
            return float(value)
    elif annotation is int:
        if is_int(value):
            return value
    elif annotation in (bool, str):
        if isinstance(value, annotation):
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            (item,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
            return tuple(_coerce(name, v, item) for v in value)
    else:  # pragma: no cover - a field type this helper does not know is a programming error
        raise TypeError(f"unsupported field type {annotation!r} for {name}")
    expected = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def from_mapping(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build dataclass `cls` from a plain mapping, refusing unknown keys and wrong types.

    Args:
        cls: the config's dataclass.
        data: its fields by name (a parsed JSON object or TOML table).
        where: what the mapping is (a file and its table), said first in the errors.

    Raises:
        ConfigError: not a mapping, a key `cls` has no field for, or a value of the wrong type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}unknown key(s) for {cls.__name__}: {', '.join(unknown)}")
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)
