"""Loss curves: runs' train and val loss against steps, tokens and wall-clock time (with their probes,
and the curves of preference pairs, below where they have any), a run trained against rewards' reward,
accuracy and KL against steps, and the recipe bench's val loss against tokens and training time."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .figures import figure, save
from .induction import PROBE_PANELS, draw_probes
from .metrics import RunMetrics, smooth
from .preference import draw_pairs, has_pairs


def plot_loss(runs: Sequence[RunMetrics], out: str | os.PathLike, *, title: str | None = None):
    """Train and val loss of one or more runs, against optimizer steps, tokens and wall-clock time.

    Each run gets a color: its per-step training loss as a faint line with a smoothed line over
    it, and the evaluations (the same batches each time) as markers: train dashed, val solid. The
    time panel compares runs that go at different speeds (a resumed run's clock carries on).

    Args:
        runs: what `read_metrics` returned for each run.
        out: the picture to write (.png, .svg or .pdf).
        title: a title over the panels.

    Runs with probes (tinygpt.lab.probes) get a row of draw_probes' four panels; runs trained on preference
    pairs (DPO, a reward model) a row of draw_pairs' three: rewards, margin and accuracy, log-probs.

    Returns:
        the matplotlib Figure (three axes: by step, by token, by time; then the probes' four, the pairs' three).
    """
    from matplotlib.ticker import EngFormatter

    if not runs:
        raise ConfigError("plot needs at least one run")
    probed, paired = any(m.probes for m in runs), any(has_pairs(m) for m in runs)
    rows = 1 + probed + paired
    fig = figure(16.0, 4.6 + 5.0 * (rows - 1))
    parts = list(fig.subfigures(rows, 1)) if rows > 1 else [fig]
    by_step, by_token, by_time = parts[0].subplots(1, 3, sharey=True)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for m, color in zip(runs, colors):
        span = max(1, len(m.loss) // 100)
        panels = ((by_step, m.steps, m.eval_steps), (by_token, m.tokens, m.eval_tokens),
                  (by_time, m.times, m.eval_times))
        for ax, x, x_eval in panels:
            if m.loss:
                ax.plot(x, m.loss, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(x, smooth(m.loss, span), color=color, linewidth=1.2, label=f"{m.name}: train (per step)")
            if m.eval_steps:
                ax.plot(x_eval, m.train_loss, color=color, linestyle="--", marker="o", markersize=3,
                        label=f"{m.name}: train (eval)")
                ax.plot(x_eval, m.val_loss, color=color, linestyle="-", marker="s", markersize=3,
                        linewidth=2, label=f"{m.name}: val")
    by_step.set_xlabel("optimizer step")
    by_step.set_ylabel("loss (nats per token)")
    by_token.set_xlabel("training tokens")
    by_token.xaxis.set_major_formatter(EngFormatter(sep=""))
    by_time.set_xlabel("wall-clock time (s)")
    for ax in (by_step, by_token, by_time):
        ax.grid(True, alpha=0.3)
    by_time.legend(fontsize=8, loc="upper right")
    if probed:
        draw_probes(dict(zip(PROBE_PANELS, parts[1].subplots(1, 4))), runs)
    if paired:
        draw_pairs(parts[-1].subplots(1, 3), runs)
    if title:
        fig.suptitle(title)
    save(fig, out)
    return fig


def plot_rewards(runs: Sequence[RunMetrics], out: str | os.PathLike, *, title: str | None = None):
    """A run trained against rewards (GRPO), against optimizer steps: the rollouts' mean reward (per step,
    faint, and smoothed) with the held-out prompts' greedy reward; the held-out accuracy and pass@k; and
    the KL to the reference (with beta > 0), else the completions' mean length.

    Args:
        runs: what `read_metrics` returned for each run.
        out: the picture to write (.png, .svg or .pdf).
        title: a title over the panels.

    Returns:
        the matplotlib Figure (three axes).
    """
    if not runs:
        raise ConfigError("plot needs at least one run")
    fig = figure(16.0, 4.6)
    reward, accuracy, third = fig.subplots(1, 3)
    kl = any("kl" in m.logged for m in runs)
    for i, m in enumerate(runs):
        color = f"C{i % 10}"
        steps, values = m.series("reward")
        if values:
            reward.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            reward.plot(steps, smooth(values, max(1, len(values) // 50)), color=color, linewidth=1.2,
                        label=f"{m.name}: rollouts")
        reward.plot(*m.series("val_reward"), color=color, marker="s", markersize=3, linewidth=2,
                    label=f"{m.name}: held-out, greedy")
        for name, style in [("val_accuracy", "-"), *((k, ":") for k in m.logged if k.startswith("val_pass@"))]:
            accuracy.plot(*m.series(name), color=color, linestyle=style, marker="o", markersize=3,
                          label=f"{m.name}: {name.removeprefix('val_')}")
        steps, values = m.series("kl" if kl else "completions/mean_length")
        third.plot(steps, smooth(values, max(1, len(values) // 50)), color=color, label=m.name)
    reward.set_ylabel("mean reward")
    accuracy.set_ylabel("held-out accuracy (greedy), pass@k (sampled)")
    third.set_ylabel("KL to the reference (per token)" if kl else "completion length (tokens)")
    for ax in (reward, accuracy, third):
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    save(fig, out)
    return fig


def plot_recipes(result: dict[str, Any], out: str | os.PathLike):
    """The recipe bench (tinygpt.lab.recipes.run's result): each recipe's val loss against training
    tokens and training wall time, every seed faint and the mean over them solid, and the target (the
    reference's mean final val loss) dashed.

    Returns:
        the path written.
    """
    from matplotlib.ticker import EngFormatter

    fig = figure(12.0, 4.6)
    by_token, by_time = fig.subplots(1, 2, sharey=True)
    for i, name in enumerate(result["recipes"]):
        color = f"C{i % 10}"
        runs = [r["evals"] for r in result["runs"] if r["recipe"] == name]
        for run in runs:
            by_token.plot([e["tokens"] for e in run], [e["val_loss"] for e in run], color=color, alpha=0.25)
            by_time.plot([e["seconds"] for e in run], [e["val_loss"] for e in run], color=color, alpha=0.25)
        mean = [sum(run[j]["val_loss"] for run in runs) / len(runs) for j in range(len(runs[0]))]
        seconds = [sum(run[j]["seconds"] for run in runs) / len(runs) for j in range(len(runs[0]))]
        by_token.plot([e["tokens"] for e in runs[0]], mean, color=color, linewidth=2, marker="o", markersize=3,
                      label=name)
        by_time.plot(seconds, mean, color=color, linewidth=2, marker="o", markersize=3, label=name)
    for ax in (by_token, by_time):
        ax.axhline(result["target"], color="grey", linestyle="--", linewidth=1,
                   label=f"{result['reference']}'s final val loss")
        ax.grid(True, alpha=0.3)
    by_token.set_xlabel("training tokens")
    by_token.xaxis.set_major_formatter(EngFormatter(sep=""))
    by_token.set_ylabel("val loss (nats per token)")
    by_time.set_xlabel("training wall time (s, evaluations not counted)")
    by_time.legend(fontsize=8, loc="upper right")
    shape = result["shape"]
    fig.suptitle(f"recipes on {Path(result['data']).name}: {shape['n_layer']} x {shape['n_embd']}, "
                 f"{result['seeds']} seeds, {result['machine']['processor']}")
    return save(fig, out)
