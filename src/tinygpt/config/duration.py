"""Durations as a user types them ("90s", "10m", "1h30m"): one syntax for every time budget."""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
# Days, hours, minutes, seconds: largest first, each at most once, spaces allowed between parts.
_DURATION = re.compile(r"\s*".join(f"(?:{_NUMBER}\\s*{unit})?" for unit in "dhms"))
_DURATION_SECONDS = (86400.0, 3600.0, 60.0, 1.0)


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in a duration such as "90s", "10m", "1h", "1h30m", "1.5h" or a bare "90" (seconds).

    One syntax for every time budget (`tinygpt train --max-time`, `tinygpt chinchilla --time`).

    Args:
        text: the duration as the user typed it; units d, h, m, s, largest first, each at most once.
        what: the name the error message starts with (e.g. "--max-time").

    Raises:
        ConfigError: the text is not such a duration, or it is zero.
    """
    raw = text.strip().lower() if isinstance(text, str) else ""
    if re.fullmatch(_NUMBER, raw):
        seconds = float(raw)
    else:
        match = _DURATION.fullmatch(raw)
        if not raw or match is None:
            raise ConfigError(f"{what}: expected something like 90s, 10m, 1h or 1h30m, got {text!r}")
        seconds = sum(float(n) * unit for n, unit in zip(match.groups(), _DURATION_SECONDS) if n is not None)
    if not 0 < seconds < math.inf:
        raise ConfigError(f"{what}: must be finite and more than zero, got {text!r}")
    return seconds
