"""Scaling plots (tinygpt sweep): loss against compute with the frontier, IsoFLOP curves, and the
compute-optimal N and D against C beside Chinchilla's slopes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .figures import figure, save


def _scaling_figure(width: float, height: float, panels: int = 1):
    """A Figure (figures.figure) with `panels` axes side by side."""
    fig = figure(width, height)
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

    def write(fig, name: str) -> None:
        paths.append(save(fig, out / name))

    fig, (ax,) = _scaling_figure(6.4, 4.6)
    draw_loss_vs_flops(ax, records, fit)
    write(fig, "loss_vs_flops.png")
    fig, (left, right) = _scaling_figure(12, 4.6, panels=2)
    draw_isoflops(left, records, fit)
    draw_optimal_scaling(right, fit)
    write(fig, "isoflops.png")
    fig, axes = _scaling_figure(18, 4.8, panels=3)
    draw_loss_vs_flops(axes[0], records, fit)
    draw_isoflops(axes[1], records, fit)
    draw_optimal_scaling(axes[2], fit)
    write(fig, "scaling.png")
    return paths
