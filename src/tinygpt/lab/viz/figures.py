"""What every picture shares: the check, before any work, that a picture can be written (its format,
its folder, matplotlib installed), a Figure made without pyplot, and the atomic save."""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import ConfigError, MissingDependencyError
from ...fileio import atomic_write, check_output_file


FORMATS = ("png", "svg", "pdf")


def check_picture(out: str | os.PathLike) -> str:
    """Check, before any work, that `out` names a picture we can write and matplotlib is there.

    Returns the format (png, svg or pdf). Raises ConfigError or MissingDependencyError.
    """
    fmt = Path(out).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ConfigError(f"{out}: the picture's name must end in .png, .svg or .pdf")
    check_output_file(out, ConfigError)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "drawing needs matplotlib: pip install 'tinygpt[viz]' (or pip install matplotlib)"
        ) from None
    return fmt


def figure(width: float, height: float):
    """A matplotlib Figure: no pyplot, so no global state and no window."""
    check_picture("x.png")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def save(fig, out: str | os.PathLike) -> Path:
    """Write `fig` to `out` atomically, in the format its suffix names (png, svg or pdf)."""
    fmt = check_picture(out)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt))
    return out
