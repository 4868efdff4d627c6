"""The probes' pictures (tinygpt.lab.probes): induction and previous-token heads, copying and in-context
learning against steps, every head's scores as heatmaps, and the emergence lab's figure."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from .figures import figure, save
from .metrics import RunMetrics, smooth


PROBE_PANELS = ("second_copy_loss", "second_copy_accuracy", "scores", "icl_score")


def draw_probes(axes: dict[str, Any], runs: Sequence[RunMetrics], marks: Sequence[int | None] = ()) -> None:
    """Draw runs' probes against steps on the axes named by PROBE_PANELS (any of them): the second
    copy's loss and accuracy, the best head's induction (solid) and previous-token (dashed) scores,
    and the in-context learning score; a dotted vertical line at each run's step in `marks`."""
    from ..probes import summarize

    for i, m in enumerate(runs):
        if not m.probes:
            continue
        color, curves = f"C{i % 10}", summarize(m.probes)
        steps = curves["steps"]
        lines = {"second_copy_loss": [(curves["second_copy_loss"], "-", m.name)],
                 "second_copy_accuracy": [(curves["second_copy_accuracy"], "-", m.name)],
                 "scores": [(curves["induction_score"], "-", f"{m.name}: induction"),
                            (curves["previous_token_score"], "--", f"{m.name}: previous token")],
                 "icl_score": [([math.nan if v is None else v for v in curves["icl_score"]], "-", m.name)]}
        for name, ax in axes.items():
            for values, style, label in lines[name]:
                ax.plot(steps, values, style, color=color, linewidth=1.5, label=label)
            if i < len(marks) and marks[i] is not None:
                ax.axvline(marks[i], color=color, linestyle=":", linewidth=1.2)
    labels = {"second_copy_loss": ("loss on the second copy (nats)", "copying: loss"),
              "second_copy_accuracy": ("accuracy on the second copy", "copying: accuracy"),
              "scores": ("best head's score", "induction and previous-token heads"),
              "icl_score": ("late minus early loss (nats)", "in-context learning score (val)")}
    for name, ax in axes.items():
        ylabel, title = labels[name]
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if name in ("second_copy_accuracy", "scores"):
            ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)


def plot_head_scores(induction: Sequence[Sequence[float]], previous: Sequence[Sequence[float]],
                     out: str | os.PathLike, *, title: str | None = None):
    """Two heatmaps, layers by heads: every head's induction score and its previous-token score.

    Returns:
        the matplotlib Figure (two heatmaps and their colorbar).
    """
    import numpy as np

    panels = (("induction score", np.asarray(induction, dtype=float)),
              ("previous-token score", np.asarray(previous, dtype=float)))
    n_layer, n_head = panels[0][1].shape
    fig = figure(2 * (1.2 + 0.55 * n_head) + 1.0, 1.4 + 0.45 * n_layer)
    axes = fig.subplots(1, 2)
    image = None
    for ax, (name, data) in zip(axes, panels):
        image = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(n_head))
        ax.set_yticks(range(n_layer))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize=10)
        if n_layer * n_head <= 64:
            for (i, j), v in np.ndenumerate(data):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 else "white")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="mean attention")
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, out)
    return fig


def plot_emergence(runs: Sequence[RunMetrics], out: str | os.PathLike, *, marks: Sequence[int | None] = (),
                   title: str | None = None):
    """The emergence lab's figure: training loss, the second copy's loss and accuracy, and the best
    induction and previous-token scores against steps, one color per run, with each run's phase
    change (`marks`) as a dotted line.

    Returns:
        the matplotlib Figure (four axes).
    """
    fig = figure(12.0, 8.0)
    (loss_ax, copy_loss), (copy_acc, scores) = fig.subplots(2, 2)
    for i, m in enumerate(runs):
        loss_ax.plot(m.steps, m.loss, color=f"C{i % 10}", alpha=0.25, linewidth=0.8)
        loss_ax.plot(m.steps, smooth(m.loss, max(1, len(m.loss) // 50)), color=f"C{i % 10}", label=m.name)
        if i < len(marks) and marks[i] is not None:
            loss_ax.axvline(marks[i], color=f"C{i % 10}", linestyle=":", linewidth=1.2,
                            label=f"{m.name}: phase change (step {marks[i]})")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("training loss (nats per token)")
    loss_ax.set_title("training loss", fontsize=10)
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend(fontsize=8)
    draw_probes({"second_copy_loss": copy_loss, "second_copy_accuracy": copy_acc, "scores": scores}, runs, marks)
    if title:
        fig.suptitle(title)
    save(fig, out)
    return fig
