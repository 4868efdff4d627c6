"""Pictures: attention maps, loss curves, few-shot accuracy, document lengths (and scaling plots).

matplotlib is an optional dependency (`pip install 'tinygpt[viz]'`), imported inside the
functions that draw. Figures are built with matplotlib's object API (`Figure`, no pyplot), so
nothing here touches a global backend or opens a window: saving renders with Agg. Every picture
is written atomically, so a failed save never leaves half a PNG where an old one was.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError, MissingDependencyError
from ..fileio import atomic_write, check_output_file

# ---------------------------------------------------------------------------------------------
# Shared helpers


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


def _figure(width: float, height: float):
    """A matplotlib Figure: no pyplot, so no global state and no window."""
    check_picture("x.png")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(fig, out: str | os.PathLike) -> Path:
    """Write `fig` to `out` atomically, in the format its suffix names (png, svg or pdf)."""
    fmt = check_picture(out)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt))
    return out


# ---------------------------------------------------------------------------------------------
# Attention maps


@torch.no_grad()
def attention_weights(model, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Every layer's and head's attention weights for one sequence, from the explicit attention path.

    Args:
        model: a tinygpt GPT.
        idx: token ids, (T,) or (1, T), T <= block_size.

    Returns:
        (n_layer, n_head, T, T) float32: row i holds how much query i attends to each key j;
        rows sum to 1 and, in a causal model, the entries above the diagonal are exactly zero.
    """
    try:
        idx = torch.as_tensor(idx, device=next(model.parameters()).device)
    except (TypeError, ValueError) as e:  # ragged lists, text, objects
        raise ConfigError(f"expected token ids, got {type(idx).__name__}: {str(e).splitlines()[0]}") from None
    if idx.dim() == 1:
        idx = idx.unsqueeze(0)
    if idx.dim() != 2 or idx.shape[0] != 1 or idx.shape[1] == 0:
        raise ConfigError(f"expected the token ids of one non-empty sequence, got shape {tuple(idx.shape)}")
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():  # a float would be truncated
        raise ConfigError(f"expected integer token ids, got {idx.dtype}")
    vocab = model.config.vocab_size
    if int(idx.min()) < 0 or int(idx.max()) >= vocab:  # the embedding's IndexError did not say which
        raise ConfigError(f"token ids must be in 0..{vocab - 1} (the model's vocabulary), "
                          f"got {int(idx.min())}..{int(idx.max())}")
    idx = idx.long()
    block_size = model.config.block_size
    if idx.shape[1] > block_size:
        raise ConfigError(
            f"the prompt is {idx.shape[1]} tokens, longer than the model's context of {block_size}; shorten it"
        )
    was_training = model.training
    model.eval()  # no dropout on the weights we draw
    try:
        _, weights = model(idx, return_attention=True)  # n_layer x (1, n_head, T, T)
    finally:
        model.train(was_training)
    return torch.stack([w[0] for w in weights]).float().cpu()


# How invisible characters are drawn in axis labels.
_VISIBLE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u2192", "\r": "\\r"}


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One printable label per token: spaces as ␣, newlines as ↵, tabs as →, other controls escaped."""
    labels = []
    for i in ids:
        text = tokenizer.decode([int(i)])
        shown = "".join(_VISIBLE.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in text)
        labels.append(shown or "\u2205")
    return labels


def plot_attention(
    weights: torch.Tensor,
    labels: Sequence[str],
    out: str | os.PathLike,
    *,
    titles: Sequence[str] | None = None,
    suptitle: str | None = None,
):
    """Draw attention heatmaps, one panel per head, tokens on both axes, and save them.

    Args:
        weights: (T, T) for one head or (N, T, T) for N panels (a grid, four to a row).
        labels: the T token labels (see `token_labels`), for the queries (rows) and keys (columns).
        out: the picture to write (.png, .svg or .pdf).
        titles: one title per panel.
        suptitle: a title over the whole figure.

    Returns:
        the matplotlib Figure (its axes: the panels, then the colorbar).
    """
    import numpy as np

    w = torch.as_tensor(weights).detach().float().cpu()
    if w.dim() == 2:
        w = w.unsqueeze(0)
    n, t_q, t_k = w.shape
    if t_q != len(labels) or t_k != len(labels):
        raise ConfigError(f"{len(labels)} labels for attention maps of {t_q} x {t_k}")
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    side = min(12.0, max(3.2, 0.3 * t_q + 1.4))  # inches per panel: cells stay readable
    if n > 1:
        side = min(side, 6.0)
    fig = _figure(side * cols + 0.9, side * rows + (0.5 if suptitle else 0.1))
    axes = fig.subplots(rows, cols, squeeze=False)
    cmap = _cmap()
    font = 10 if t_q <= 16 else 8 if t_q <= 32 else 6
    every = max(1, math.ceil(t_q / 64))  # past 64 tokens, label every n-th one
    wide = any(len(label) > 2 for label in labels)
    upper = np.triu(np.ones((t_q, t_k), dtype=bool), k=1)
    image = None
    for p, ax in enumerate(axes.flat):
        if p >= n:
            ax.remove()
            continue
        data = w[p].numpy()
        # exactly-zero future cells are the causal mask, drawn apart from small-but-real weights
        shown = np.ma.masked_where(upper & (data == 0), data)
        image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ticks = list(range(0, t_q, every))
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90 if wide else 0, fontsize=font)
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font)
        if p // cols == rows - 1 or p + cols >= n:  # axis names on the outer panels only
            ax.set_xlabel("key (attended to)", fontsize=9)
        if p % cols == 0:
            ax.set_ylabel("query (attending)", fontsize=9)
        if titles is not None:
            ax.set_title(titles[p], fontsize=10)
        if t_q <= 12 and n <= 4:
            for i, j in zip(*np.nonzero(~np.ma.getmaskarray(shown))):
                v = data[i, j]
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 else "white")
    fig.colorbar(image, ax=axes.ravel().tolist()[:n], shrink=0.8, label="attention weight")
    if suptitle:
        fig.suptitle(suptitle)
    _save(fig, out)
    return fig


def _cmap():
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="#e6e6e6")  # masked (future) cells: light gray


# ---------------------------------------------------------------------------------------------
# Loss curves


@dataclass
class RunMetrics:
    """A training run's metrics.jsonl: per-step training loss, the periodic evaluations and the probes
    (tinygpt.lab.probes: (step, probe record) pairs)."""

    name: str
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds since the run began, at each step
    eval_steps: list[int] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    eval_times: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    probes: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


def read_metrics(run: str | os.PathLike, name: str | None = None) -> RunMetrics:
    """Read a run folder's metrics.jsonl (or the file itself).

    A last line cut short (a run killed while writing it) is skipped; anything else that is not
    a metrics line is an error.

    Raises:
        CheckpointError: no such run, no metrics.jsonl, a corrupt line, or no step logged yet.
    """
    path = Path(run)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not path.exists():
        raise CheckpointError(f"{run}: no such run folder")
    if not file.is_file():
        raise CheckpointError(f"{run}: no metrics.jsonl here (is it a tinygpt training run?)")
    m = RunMetrics(name or (path.name if path.is_dir() else path.parent.name))
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    offset = last = 0.0  # a resumed run's clock starts again at 0: it carries on from the last time
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, tokens = int(record["step"]), int(record["tokens"])
            if "probe" in record:
                if not isinstance(record["probe"], dict):
                    raise TypeError("a probe is a JSON object")
                m.probes.append((step, record["probe"]))
            elif "val_loss" in record:
                m.eval_steps.append(step)
                m.eval_tokens.append(tokens)
                m.eval_times.append(offset + last)  # an evaluation follows its step
                m.train_loss.append(float(record["train_loss"]))
                m.val_loss.append(float(record["val_loss"]))
            else:
                loss = float(record["loss"])
                t = float(record.get("time", last))
                if t < last:
                    offset += last
                m.steps.append(step)
                m.tokens.append(tokens)
                m.times.append(offset + t)
                m.loss.append(loss)
                last = t
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if number == len(lines) and isinstance(e, json.JSONDecodeError):
                break  # cut short by a kill; the lines before it are whole
            raise CheckpointError(f"{file}, line {number}: not a metrics line ({e})") from None
    if not m.steps and not m.eval_steps:
        raise CheckpointError(f"{file}: no training step logged yet")
    return m


def _smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled toward 0."""
    if span <= 1:
        return list(values)
    alpha, avg, out = 2.0 / (span + 1), 0.0, []
    for i, v in enumerate(values, start=1):
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def plot_loss(runs: Sequence[RunMetrics], out: str | os.PathLike, *, title: str | None = None):
    """Train and val loss of one or more runs, against optimizer steps, tokens and wall-clock time.

    Each run gets a color: its per-step training loss as a faint line with a smoothed line over
    it, and the evaluations (the same batches each time) as markers: train dashed, val solid. The
    time panel compares runs that go at different speeds (a resumed run's clock carries on).

    Args:
        runs: what `read_metrics` returned for each run.
        out: the picture to write (.png, .svg or .pdf).
        title: a title over the panels.

    Runs with probes (tinygpt.lab.probes) get a second row: draw_probes' four panels.

    Returns:
        the matplotlib Figure (three axes: by step, by token, by time; then the probes' four).
    """
    from matplotlib.ticker import EngFormatter

    if not runs:
        raise ConfigError("plot needs at least one run")
    probed = any(m.probes for m in runs)
    fig = _figure(16.0, 9.6 if probed else 4.6)
    top, bottom = fig.subfigures(2, 1) if probed else (fig, None)
    by_step, by_token, by_time = top.subplots(1, 3, sharey=True)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for m, color in zip(runs, colors):
        span = max(1, len(m.loss) // 100)
        panels = ((by_step, m.steps, m.eval_steps), (by_token, m.tokens, m.eval_tokens),
                  (by_time, m.times, m.eval_times))
        for ax, x, x_eval in panels:
            if m.loss:
                ax.plot(x, m.loss, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(x, _smooth(m.loss, span), color=color, linewidth=1.2, label=f"{m.name}: train (per step)")
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
    if bottom is not None:
        draw_probes(dict(zip(PROBE_PANELS, bottom.subplots(1, 4))), runs)
    if title:
        fig.suptitle(title)
    _save(fig, out)
    return fig


def plot_recipes(result: dict[str, Any], out: str | os.PathLike):
    """The recipe bench (tinygpt.lab.recipes.run's result): each recipe's val loss against training
    tokens and training wall time, every seed faint and the mean over them solid, and the target (the
    reference's mean final val loss) dashed.

    Returns:
        the path written.
    """
    from matplotlib.ticker import EngFormatter

    fig = _figure(12.0, 4.6)
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
    return _save(fig, out)


# ---------------------------------------------------------------------------------------------
# Probes (tinygpt.lab.probes): induction and previous-token heads, copying, in-context learning

PROBE_PANELS = ("second_copy_loss", "second_copy_accuracy", "scores", "icl_score")


def draw_probes(axes: dict[str, Any], runs: Sequence[RunMetrics], marks: Sequence[int | None] = ()) -> None:
    """Draw runs' probes against steps on the axes named by PROBE_PANELS (any of them): the second
    copy's loss and accuracy, the best head's induction (solid) and previous-token (dashed) scores,
    and the in-context learning score; a dotted vertical line at each run's step in `marks`."""
    from .probes import summarize

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
    fig = _figure(2 * (1.2 + 0.55 * n_head) + 1.0, 1.4 + 0.45 * n_layer)
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
    _save(fig, out)
    return fig


def plot_emergence(runs: Sequence[RunMetrics], out: str | os.PathLike, *, marks: Sequence[int | None] = (),
                   title: str | None = None):
    """The emergence lab's figure: training loss, the second copy's loss and accuracy, and the best
    induction and previous-token scores against steps, one color per run, with each run's phase
    change (`marks`) as a dotted line.

    Returns:
        the matplotlib Figure (four axes).
    """
    fig = _figure(12.0, 8.0)
    (loss_ax, copy_loss), (copy_acc, scores) = fig.subplots(2, 2)
    for i, m in enumerate(runs):
        loss_ax.plot(m.steps, m.loss, color=f"C{i % 10}", alpha=0.25, linewidth=0.8)
        loss_ax.plot(m.steps, _smooth(m.loss, max(1, len(m.loss) // 50)), color=f"C{i % 10}", label=m.name)
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
    _save(fig, out)
    return fig


# ---------------------------------------------------------------------------------------------
# Few-shot accuracy


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
    fig = _figure(5.5, 4.0)
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
    _save(fig, out)
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
    fig = _figure(max(5.0, 1.2 + 0.45 * len(bins)), 4.0)
    ax = fig.subplots()
    from matplotlib.ticker import MaxNLocator

    from ..data import length_label

    labels = [length_label(b["low"], b["high"]) for b in bins]
    ax.bar(range(len(bins)), [b["documents"] for b in bins], color="C0")
    ax.set_xticks(range(len(bins)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("length in tokens")
    ax.set_ylabel(what)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    _save(fig, out)
    return fig


# ---------------------------------------------------------------------------------------------
# (end of attention maps, loss curves and few-shot plots; scaling plots follow)


# ---------------------------------------------------------------------------------------------
# Scaling plots (tinygpt sweep): loss against compute with the frontier, IsoFLOP curves, N_opt and D_opt


def _scaling_figure(width: float, height: float, panels: int = 1):
    """A Figure (the shared _figure) with `panels` axes side by side."""
    fig = _figure(width, height)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _budget_colors(budgets: list[float]) -> dict[float, Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n = max(1, len(budgets) - 1)
    return {b: cmap(0.9 * i / n) for i, b in enumerate(sorted(budgets))}


def _finished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("val_loss") is not None and math.isfinite(r["val_loss"])]


def _vertices(fit: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The IsoFLOP vertices the frontier rests on, and the others (extrapolated beyond the sizes trained)."""
    ok = [m for m in fit["isoflops"] if m["ok"]]
    frontier = fit.get("frontier")
    used = set(frontier["budgets_used"]) if frontier else {m["budget"] for m in ok if m["interior"]}
    return [m for m in ok if m["budget"] in used], [m for m in ok if m["budget"] not in used]


def draw_loss_vs_flops(ax, records: list[dict[str, Any]], fit: dict[str, Any]) -> None:
    """Final val loss against training FLOPs, colored by model size, with the IsoFLOP minima as the frontier."""
    from matplotlib.colors import LogNorm

    points = _finished(records)
    sizes = [r["params"] for r in points]
    norm = LogNorm(vmin=min(sizes), vmax=max(sizes)) if len(set(sizes)) > 1 else None
    dots = ax.scatter([r["flops"] for r in points], [r["val_loss"] for r in points], c=sizes, cmap="plasma",
                      norm=norm, s=28, edgecolors="none", zorder=2)
    ax.figure.colorbar(dots, ax=ax, label="parameters N")
    minima, _ = _vertices(fit)
    if minima:
        ax.plot([m["budget"] for m in minima], [m["loss_opt"] for m in minima], "-", color="black", lw=1.2, zorder=3,
                label="frontier: each budget's best loss (IsoFLOP vertex)")
        ax.scatter([m["budget"] for m in minima], [m["loss_opt"] for m in minima], marker="*", s=140, color="black",
                   zorder=4)
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs C")
    ax.set_ylabel("final val loss (nats/token)")
    ax.set_title("Loss against compute")
    ax.grid(True, which="both", alpha=0.25)


def draw_isoflops(ax, records: list[dict[str, Any]], fit: dict[str, Any]) -> None:
    """One curve per budget: loss against model size, its fitted parabola in log N and the vertex."""
    import numpy as np

    points = _finished(records)
    budgets = sorted({r["budget"] for r in points})
    colors = _budget_colors(budgets)
    vertices = {m["budget"]: m for m in fit["isoflops"]}
    for budget in budgets:
        group = sorted((r for r in points if r["budget"] == budget), key=lambda r: r["params"])
        n = [r["params"] for r in group]
        ax.plot(n, [r["val_loss"] for r in group], "o", color=colors[budget], ms=5, label=f"C = {budget:.2g}")
        m = vertices.get(budget)
        if m and m["ok"]:
            c2, c1, c0 = m["parabola"]
            u = np.linspace(math.log(n[0]) - 0.2, math.log(n[-1]) + 0.2, 100)
            ax.plot(np.exp(u), c2 * u * u + c1 * u + c0, "-", color=colors[budget], lw=1, alpha=0.8)
            if m["interior"]:  # a vertex beyond the sizes trained is a guess: not drawn as a finding
                ax.plot([m["params_opt"]], [m["loss_opt"]], "*", color=colors[budget], ms=13, mec="black", mew=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final val loss (nats/token)")
    ax.set_title("IsoFLOP curves (star: each budget's best N, where inside the sizes trained)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.25)


def draw_optimal_scaling(ax, fit: dict[str, Any]) -> None:
    """The best N and D of each budget against C, the fitted power laws, and Chinchilla's slope of 0.5."""
    import numpy as np

    minima, guesses = _vertices(fit)
    frontier = fit.get("frontier")
    chin = fit["chinchilla"]
    if minima:
        c = np.array([m["budget"] for m in minima])
        for key, law_key, color, name in (("params_opt", "params", "tab:blue", "N_opt"),
                                          ("tokens_opt", "tokens", "tab:orange", "D_opt")):
            y = np.array([m[key] for m in minima])
            ax.plot(c, y, "o", color=color, ms=6)
            if guesses:
                ax.plot([m["budget"] for m in guesses], [m[key] for m in guesses], "o", mfc="none", color=color, ms=6,
                        label="extrapolated vertex (not fitted)" if law_key == "params" else None)
            grid = np.geomspace(c.min() / 2, c.max() * 2, 50)
            if frontier:
                law = frontier[law_key]
                ax.plot(grid, law["coef"] * grid ** law["exponent"], "-", color=color,
                        label=f"{name} ∝ C^{law['exponent']:.2f}")
            # Chinchilla's slope through the middle of the measured points, for comparison
            slope = chin["a"] if law_key == "params" else chin["b"]
            mid_c, mid_y = np.exp(np.log(c).mean()), np.exp(np.log(y).mean())
            ax.plot(grid, mid_y * (grid / mid_c) ** slope, ":", color=color, alpha=0.8,
                    label=f"Chinchilla's slope {slope:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs C")
    ax.set_ylabel("compute-optimal N (parameters) and D (tokens)")
    ax.set_title("Compute-optimal size and data")
    if minima:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no IsoFLOP minimum to show:\nit takes 3 or more sizes per budget,\nwith a dip among them",
                transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.4")
    ax.grid(True, which="both", alpha=0.25)


def plot_scaling(records: list[dict[str, Any]], fit: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write a sweep's plots as PNG files in `out_dir`.

    Args:
        records: results.json's points (each with budget, params, tokens, flops, val_loss).
        fit: fit.json's content (tinygpt.lab.sweep.fit_sweep).
        out_dir: where the files go.

    Returns:
        The paths: loss_vs_flops.png, isoflops.png (IsoFLOP curves beside N_opt and D_opt against C)
        and scaling.png (all three panels in one picture).
    """
    out = Path(out_dir)
    paths = []

    def save(fig, name: str) -> None:
        paths.append(_save(fig, out / name))

    fig, (ax,) = _scaling_figure(6.4, 4.6)
    draw_loss_vs_flops(ax, records, fit)
    save(fig, "loss_vs_flops.png")
    fig, (left, right) = _scaling_figure(12, 4.6, panels=2)
    draw_isoflops(left, records, fit)
    draw_optimal_scaling(right, fit)
    save(fig, "isoflops.png")
    fig, axes = _scaling_figure(18, 4.8, panels=3)
    draw_loss_vs_flops(axes[0], records, fit)
    draw_isoflops(axes[1], records, fit)
    draw_optimal_scaling(axes[2], fit)
    save(fig, "scaling.png")
    return paths
