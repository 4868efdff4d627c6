"""The curves of a run trained on preference pairs (DPO, a reward model), under TRL's metric names: each
side's implicit reward, the margin and accuracy, and the policy's log-probs of each side, per step (faint,
smoothed over) and on the validation pairs at each evaluation (markers), step 0 included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .metrics import RunMetrics, smooth

# panel -> (its title, its y label, the curves: (logged name, line style, label))
PAIR_PANELS: dict[str, tuple[str, str, tuple[tuple[str, str, str], ...]]] = {
    "rewards": ("implicit rewards: beta x (policy - reference) log-prob", "reward",
                (("rewards/chosen", "-", "chosen"), ("rewards/rejected", "--", "rejected"))),
    "margins": ("margin and accuracy", "margin; share of pairs",
                (("rewards/margins", "-", "margin"), ("rewards/accuracies", ":", "accuracy"),
                 ("margin", "-", "score margin"), ("accuracy", ":", "accuracy"))),
    "logps": ("the policy's log-probs of the completions", "log-prob (nats)",
              (("logps/chosen", "-", "chosen"), ("logps/rejected", "--", "rejected"),
               ("mean_reward", "-", "mean score"))),
}


def has_pairs(m: RunMetrics) -> bool:
    """Whether a run logged any of the curves PAIR_PANELS draws."""
    return any(name in m.logged for _, _, curves in PAIR_PANELS.values() for name, _, _ in curves)


def draw_pairs(axes: Sequence[Any], runs: Sequence[RunMetrics]) -> None:
    """Draw the runs' preference curves against steps on three axes (PAIR_PANELS' order): each curve's
    per-step values faint with a smoothed line over them, and the validation pairs' (val_NAME) as markers.

    Args:
        axes: three matplotlib axes.
        runs: what read_metrics returned for each run.
    """
    for i, m in enumerate(runs):
        color = f"C{i % 10}"
        for ax, (_, _, curves) in zip(axes, PAIR_PANELS.values()):
            for name, style, label in curves:
                steps, values = m.series(name)
                if steps:
                    ax.plot(steps, values, style, color=color, alpha=0.2, linewidth=0.8)
                    ax.plot(steps, smooth(values, max(1, len(values) // 50)), style, color=color, linewidth=1.2,
                            label=f"{m.name}: {label}")
                steps, values = m.series(f"val_{name}")
                if steps:
                    ax.plot(steps, values, style, color=color, marker="s", markersize=3, linewidth=1.6,
                            label=f"{m.name}: {label} (val)")
    for ax, (title, ylabel, _) in zip(axes, PAIR_PANELS.values()):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
