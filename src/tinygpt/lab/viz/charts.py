"""Charts of counts: few-shot accuracy against the number of worked examples, and a data folder's
document lengths in power-of-two bins."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ...errors import ConfigError
from .figures import figure, save


def plot_fewshot(
    shots: Sequence[int],
    accuracy: Sequence[float],
    out: str | os.PathLike,
    *,
    title: str | None = None,
    chance: float | None = None,
    counts: Sequence[tuple[int, int]] | None = None,
):
    """Accuracy against the number of worked examples in the prompt.

    Args:
        shots: the k values.
        accuracy: the accuracy for each k, in [0, 1].
        out: the picture to write (.png, .svg or .pdf).
        title: the figure's title.
        chance: draw the accuracy of guessing as a dotted line.
        counts: (correct, total) per k, written above the points.

    Returns:
        the matplotlib Figure.
    """
    from matplotlib.ticker import PercentFormatter

    if len(shots) != len(accuracy) or not shots:
        raise ConfigError("plot_fewshot needs one accuracy per number of shots")
    fig = figure(5.5, 4.0)
    ax = fig.subplots()
    percent = [100 * a for a in accuracy]
    ax.plot(list(shots), percent, marker="o", linewidth=2, color="C0", label="model")
    for i, (k, p) in enumerate(zip(shots, percent)):
        note = f"{p:.0f}%" if counts is None else f"{p:.0f}% ({counts[i][0]}/{counts[i][1]})"
        ax.annotate(note, (k, p), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    if chance is not None:
        ax.axhline(100 * chance, color="gray", linestyle=":", label=f"chance ({100 * chance:.0f}%)")
    ax.set_xticks(list(shots))
    ax.set_xlim(min(shots) - 0.4, max(shots) + 0.4)
    ax.set_xlabel("worked examples in the prompt (k-shot)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 105)
    ax.yaxis.set_major_formatter(PercentFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    save(fig, out)
    return fig


def plot_lengths(bins: Sequence[dict[str, int]], out: str | os.PathLike, *, what: str = "documents",
                 title: str | None = None):
    """A bar chart of document lengths in power-of-two bins (tinygpt.data.inspect_data's "bins").

    Args:
        bins: each {"low", "high", "documents"}: the lengths (tokens) a bar counts and how many.
        out: the picture to write (.png, .svg or .pdf).
        what: what the bars count ("documents", "conversations").
        title: the figure's title.

    Returns:
        the matplotlib Figure.
    """
    fig = figure(max(5.0, 1.2 + 0.45 * len(bins)), 4.0)
    ax = fig.subplots()
    from matplotlib.ticker import MaxNLocator

    from ...data.inspect import length_label

    labels = [length_label(b["low"], b["high"]) for b in bins]
    ax.bar(range(len(bins)), [b["documents"] for b in bins], color="C0")
    ax.set_xticks(range(len(bins)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("length in tokens")
    ax.set_ylabel(what)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    save(fig, out)
    return fig
