"""Attention maps: every layer's and head's attention weights for one sequence, a printable label for
each token, and the heatmaps, one panel per head."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from ...errors import ConfigError
from .figures import figure, save


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
    fig = figure(side * cols + 0.9, side * rows + (0.5 if suptitle else 0.1))
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
    save(fig, out)
    return fig


def _cmap():
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="#e6e6e6")  # masked (future) cells: light gray
