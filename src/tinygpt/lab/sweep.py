"""The scaling experiment: train a grid of models through tinygpt.train, fit how the best model size and
the loss move with compute, and hand the results to viz for the plots.

The grid is an IsoFLOP design (Hoffmann et al. 2022, "approach 2"): for each compute budget C,
models of several sizes N each train for D = C / (training FLOPs per token) tokens, so every model
of one budget costs the same. The FLOPs per token are calc's count (6N plus the attention term),
which on small models is noticeably more than 6N. Three fits follow:

- per budget, a parabola of the final val loss in log N: its vertex is that budget's best N (and
  a parabola in log D gives its best D);
- across budgets, power laws through the vertices: N_opt = k·C^a and D_opt = k·C^b (Chinchilla
  found a ≈ b ≈ 0.5);
- over every point, the parametric loss L(N, D) = E + A/N^alpha + B/D^beta ("approach 3"), fitted
  as Hoffmann et al. did: a Huber loss on log residuals, from the best starts of a grid.

Everything lands in the output folder: results.json (every finished point, so a rerun trains only
what is missing) and results.csv, fit.json, the PNG plots, and runs/ with each model's run folder.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..calc import (
    ASPECT_RATIO,
    CHINCHILLA_EXPONENTS,
    LossFit,
    PowerLaw,
    ScalingLaw,
    compute_optimal,
    count_params,
    flops_per_token,
    format_count,
    plural,
    shape_for_params,
)
from ..config.fields import MAX_THREADS
from ..config.model import GPTConfig
from ..config.train import TrainConfig
from ..data.folder import load_data
from ..errors import ConfigError, NonFiniteError, SweepError
from ..fileio import atomic_write, read_json, write_json
from ..run_folder import RunFolder
from ..train.loop import train

RESULTS = "results.json"
RESULTS_CSV = "results.csv"
FIT = "fit.json"
RUNS = "runs"
FORMAT = "tinygpt-sweep"
VERSION = 1
MIN_STEPS = 10  # a grid point with fewer optimizer steps than this is skipped: it would measure warmup

# The --quick grid, small enough for a laptop CPU in one sitting (the README's "The quick grid" says
# how long it took): four budgets a factor ~3 apart, five sizes each 2x apart, centred on 0.4 x
# Chinchilla's N (a first run centred on Chinchilla's N found the best sizes of char models this
# small at 0.3-0.6 x it).
QUICK_BUDGETS = (1e11, 3e11, 1e12, 3e12)
QUICK_POINTS = 5
QUICK_CENTRE = 0.4


@dataclass
class SweepSettings:
    """How every model of a sweep trains (the same for all, so only size and tokens vary).

    Args:
        batch_size: sequences per optimizer step.
        block_size: context length of every model (and of its training sequences).
        lr: peak learning rate; cosine to lr/10 over each model's own number of steps.
        warmup_fraction: share of each model's steps spent warming the learning rate up.
        eval_iters: val batches behind each final loss (the same batches for every model).
        seed: initialization and batch order.
        device, dtype: as for `tinygpt train`.
        aspect_ratio: n_embd / n_layer the model shapes aim for.
    """

    batch_size: int = 16
    block_size: int = 128
    lr: float = 2e-3
    warmup_fraction: float = 0.05
    eval_iters: int = 20
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    aspect_ratio: float = ASPECT_RATIO

    def __post_init__(self) -> None:
        for name in ("batch_size", "block_size", "eval_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise ConfigError(f"lr: must be a finite number more than zero, got {self.lr!r}")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction!r}")
        if not (isinstance(self.aspect_ratio, (int, float)) and 0 < self.aspect_ratio < math.inf):
            raise ConfigError(f"aspect_ratio: must be a finite number more than zero, got {self.aspect_ratio!r}")

    def train_config(self, steps: int) -> TrainConfig:
        """The TrainConfig of a model trained for `steps` steps: one evaluation, at the end."""
        return TrainConfig(
            batch_size=self.batch_size, lr=self.lr, warmup=round(self.warmup_fraction * steps), max_iters=steps,
            eval_interval=steps, eval_iters=self.eval_iters, seed=self.seed, device=self.device, dtype=self.dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GridPoint:
    """One model of the grid: a budget, the size asked for, the shape that has about that size, its steps."""

    budget: float
    target: float
    config: GPTConfig
    steps: int
    batch_size: int

    @property
    def params(self) -> int:
        return count_params(self.config).total

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.config.block_size

    @property
    def flops(self) -> float:
        return float(flops_per_token(self.config).training) * self.tokens

    @property
    def name(self) -> str:
        """The run folder's name: budget and shape, e.g. C1e12-L2-D96."""
        mantissa, exponent = f"{self.budget:.2e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"C{mantissa}e{int(exponent)}-L{self.config.n_layer}-D{self.config.n_embd}"

    def key(self) -> tuple:
        c = self.config
        return (f"{self.budget:.6g}", c.n_layer, c.n_head, c.n_embd)

    def record(self) -> dict[str, Any]:
        """The point's facts as results.json keeps them (the training outcome is added to it)."""
        c, counts = self.config, count_params(self.config)
        return {
            "budget": self.budget, "target_params": self.target, "params": counts.total,
            "non_embedding": counts.non_embedding, "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd,
            "block_size": c.block_size, "batch_size": self.batch_size, "steps": self.steps, "tokens": self.tokens,
            "flops": self.flops, "flops_per_token": flops_per_token(c).training,
            "six_nd": 6.0 * counts.total * self.tokens, "run": f"{RUNS}/{self.name}",
        }


def _record_key(record: dict[str, Any]) -> tuple:
    return (f"{record['budget']:.6g}", record["n_layer"], record["n_head"], record["n_embd"])


def parse_budgets(values: list[float]) -> list[float]:
    """The budgets sorted, repeats dropped; each must be a positive finite number of FLOPs."""
    out = []
    for value in values:
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ConfigError(f"budgets: each must be a finite number of FLOPs more than zero, got {value!r}")
        out.append(float(value))
    if not out:
        raise ConfigError("budgets: give at least one compute budget (e.g. 1e12)")
    return sorted(set(out))


def plan_grid(
    budgets: list[float],
    *,
    vocab_size: int,
    settings: SweepSettings | None = None,
    sizes: list[float] | None = None,
    points: int = 5,
    spread: float = 2.0,
    centre: float = 1.0,
) -> tuple[list[GridPoint], list[str]]:
    """The IsoFLOP grid: for each budget, models of several sizes, each with the steps the budget buys.

    Args:
        budgets: compute budgets C in training FLOPs (calc's count).
        vocab_size: the data's vocabulary.
        settings: batch size, context and shapes (SweepSettings()).
        sizes: parameter counts to train at every budget; default: `points` sizes per budget,
            `spread` times apart, centred on `centre` x Chinchilla's N = sqrt(C / 120) for that budget.
        points: sizes per budget when `sizes` is not given (at least 3 for a parabola).
        spread: the ratio between neighbouring default sizes.
        centre: where the default sizes centre, as a multiple of Chinchilla's N.

    Returns:
        (grid, skipped): the points, and one line per size left out (no shape of about that size,
        a repeat of a shape, or fewer than MIN_STEPS steps).
    """
    settings = settings or SweepSettings()
    budgets = parse_budgets(budgets)
    if sizes is not None:
        if not sizes:
            raise ConfigError("sizes: give at least one model size")
        for n in sizes:
            if isinstance(n, bool) or not (isinstance(n, (int, float)) and 0 < n < math.inf):
                raise ConfigError(f"sizes: each must be a parameter count more than zero, got {n!r}")
    elif isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ConfigError(f"points: must be an integer >= 1, got {points!r}")
    if not (isinstance(spread, (int, float)) and 1 < spread < math.inf):
        raise ConfigError(f"spread: must be a number more than 1, got {spread!r}")
    if not (isinstance(centre, (int, float)) and 0 < centre < math.inf):
        raise ConfigError(f"centre: must be a number more than 0, got {centre!r}")
    base = GPTConfig(vocab_size=vocab_size, block_size=settings.block_size, dropout=0.0)
    B, T = settings.batch_size, settings.block_size
    grid: list[GridPoint] = []
    skipped: list[str] = []
    for budget in budgets:
        if sizes is None:
            middle = centre * compute_optimal(flops=budget).params
            try:
                targets = [middle * spread ** (k - (points - 1) / 2) for k in range(points)]
            except OverflowError:
                targets = [math.inf]
            if not all(0 < t < math.inf for t in targets):
                over = plural(points, "point")
                raise ConfigError(f"spread {spread:g} over {over} sizes models past what a float can hold "
                                  f"around C={budget:.3g}; give a smaller --spread or fewer --points")
        else:
            targets = sorted(float(n) for n in sizes)
        seen: set[tuple] = set()
        for target in targets:
            where = f"C={budget:.3g}, N={format_count(target)}"
            try:
                cfg = shape_for_params(target, vocab_size=vocab_size, block_size=T, aspect_ratio=settings.aspect_ratio,
                                       base=base)
            except ConfigError as e:
                skipped.append(f"{where}: {e}")
                continue
            steps = round(budget / (flops_per_token(cfg).training * B * T))
            point = GridPoint(budget, target, cfg, steps, B)
            if point.key() in seen:
                skipped.append(f"{where}: the same shape as a smaller size ({cfg.n_layer} x {cfg.n_embd})")
            elif steps < MIN_STEPS:
                skipped.append(f"{where}: only {plural(steps, 'step')} of {B} x {T} tokens "
                               f"(fewer than {MIN_STEPS})")
            else:
                seen.add(point.key())
                grid.append(point)
    return grid, skipped


@dataclass
class SweepResult:
    """What run_sweep did.

    Args:
        out: the sweep folder.
        points: the records of the grid's finished points (results.json's, for this grid).
        fit: fit.json's content (see fit_sweep).
        plots: the PNG files written.
        skipped: sizes left out of the grid, one line each.
        trained: points trained (or finished) by this call.
        interrupted: a signal stopped training; rerun to continue.
        seconds: wall time of this call.
    """

    out: Path
    points: list[dict[str, Any]]
    fit: dict[str, Any]
    plots: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    trained: int = 0
    interrupted: bool = False
    seconds: float = 0.0


def _open_results(out: Path, data: Path, settings: SweepSettings) -> dict[str, Any]:
    """results.json of `out`, created for these settings, or checked to have been made with them."""
    path = out / RESULTS
    fresh = {"format": FORMAT, "version": VERSION, "data": str(data), "settings": settings.to_dict(), "points": []}
    if not path.exists():
        if out.exists() and any(out.iterdir()):
            raise SweepError(f"{out} is not empty and holds no sweep ({RESULTS}): pick another --out")
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, fresh)
        return fresh
    state = read_json(path, SweepError)
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("points"), list):
        raise SweepError(f"{path} is not a tinygpt sweep's results file")
    if state.get("data") != str(data):
        raise SweepError(f"{out} is a sweep over {state.get('data')}, not {data}: pick another --out")
    saved = state.get("settings")
    if saved != fresh["settings"]:
        diffs = ", ".join(
            f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in fresh["settings"].items()
            if not isinstance(saved, dict) or saved.get(k) != v
        )
        raise SweepError(f"{out} was swept with other settings ({diffs}): use the same flags, or another --out")
    return state


def _last_eval(run: Path) -> tuple[float | None, float | None]:
    """The last (train_loss, val_loss) a run's metrics.jsonl recorded."""
    import json

    last = (None, None)
    path = RunFolder(run).metrics_file
    if path.exists():
        for line in path.read_text().splitlines():
            if '"val_loss"' in line:
                record = json.loads(line)
                last = (record.get("train_loss"), record.get("val_loss"))
    return last


CSV_COLUMNS = ("budget", "params", "non_embedding", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "steps",
               "tokens", "flops", "six_nd", "val_loss", "train_loss", "seconds", "status", "run")


def _write_results(out: Path, state: dict[str, Any]) -> None:
    write_json(out / RESULTS, state)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for record in sorted(state["points"], key=lambda r: (r["budget"], r["params"])):
        writer.writerow(record)
    atomic_write(out / RESULTS_CSV, lambda tmp: tmp.write_text(buffer.getvalue()))


def run_sweep(
    data: str | Path,
    out: str | Path,
    budgets: list[float],
    *,
    sizes: list[float] | None = None,
    points: int = 5,
    spread: float = 2.0,
    centre: float = 1.0,
    settings: SweepSettings | None = None,
    progress: bool = True,
    on_point: Callable[[int, int, dict[str, Any], bool], None] | None = None,
    plots: bool = True,
    threads: int | None = 1,
) -> SweepResult:
    """Train the IsoFLOP grid (each model through train.train), fit it, and plot it.

    Resumable: results.json records each finished point, and a rerun with the same data and
    settings trains only the missing ones (a point stopped by Ctrl-C continues from its checkpoint).
    The budgets and sizes may change between runs; the fit uses the points of this call's grid.

    Args:
        data: a folder written by `tinygpt prepare`.
        out: the sweep folder (created; an existing one must be a sweep with the same settings).
        budgets, sizes, points, spread, centre: the grid (see plan_grid).
        settings: how each model trains (SweepSettings()).
        progress: show each model's progress bar.
        on_point: called as on_point(i, n, record, new) when grid point i of n is finished (new) or
            found finished by an earlier call.
        plots: draw the PNGs (needs matplotlib, the viz extra).
        threads: CPU threads for training (None: torch's default). One by default: a sweep's models
            are small, and on a machine shared with other work two threads fighting for two cores
            run far slower than one (the README's "Scaling on a laptop" has the figure).

    Raises:
        ConfigError: bad budgets, sizes or settings, or a grid with no point left.
        SweepError: `out` holds something else, or a sweep with other data or settings.
    """
    started = time.perf_counter()
    settings = settings or SweepSettings()
    out, data = Path(out), Path(data).expanduser().resolve()
    dataset = load_data(data)
    vocab = int(dataset.meta["vocab_size"])
    grid, skipped = plan_grid(budgets, vocab_size=vocab, settings=settings, sizes=sizes, points=points, spread=spread,
                              centre=centre)
    if not grid:
        raise ConfigError("no grid point left to train: " + "; ".join(skipped[:3]))
    for split in ("train", "val"):
        n = len(getattr(dataset, split))
        if n < settings.block_size + 1:
            raise ConfigError(f"the {split} split has {n} tokens, fewer than block_size + 1 = {settings.block_size + 1}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise ConfigError(f"threads: must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
    from ..device import resolve_device, resolve_dtype

    # what train() would refuse at the first point, refused before anything is written
    resolve_dtype(settings.dtype, resolve_device(settings.device))
    state = _open_results(out, data, settings)
    done = {_record_key(r): r for r in state["points"]}
    import torch

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        trained, interrupted = _train_grid(data, out, grid, settings, state, done, progress, on_point)
    finally:
        torch.set_num_threads(saved_threads)
    records = [done[p.key()] for p in grid if p.key() in done]
    fit = fit_sweep(records, data=str(data))
    write_json(out / FIT, fit)
    drawn: list[Path] = []
    if plots and fit["points"] > 0:
        from .viz import plot_scaling

        drawn = plot_scaling(records, fit, out)
    return SweepResult(out, records, fit, drawn, skipped, trained, interrupted, time.perf_counter() - started)


def _train_grid(data: Path, out: Path, grid: list[GridPoint], settings: SweepSettings, state: dict[str, Any],
                done: dict[tuple, dict[str, Any]], progress: bool, on_point) -> tuple[int, bool]:
    """Train the grid's unfinished points in order, recording each; (trained, interrupted)."""
    trained = 0
    for i, point in enumerate(grid):
        if point.key() in done:
            if on_point:
                on_point(i, len(grid), done[point.key()], False)
            continue
        run = out / point.record()["run"]
        t0 = time.perf_counter()
        record = point.record()
        try:
            result = train(data, run, point.config, settings.train_config(point.steps),
                           resume=RunFolder(run).has_weights(), progress=progress,
                           notes={"sweep": {k: record[k] for k in ("budget", "target_params", "params", "steps")}})
        except NonFiniteError as e:
            record.update(status="diverged", val_loss=None, train_loss=None, error=str(e))
        else:
            if result.stopped != "max_iters":
                return trained, True
            train_loss, val_loss = (result.train_loss, result.val_loss)
            if result.val_loss is None:  # a run that had finished before its point was recorded
                train_loss, val_loss = _last_eval(run)
            record.update(status="ok", val_loss=val_loss, train_loss=train_loss)
        record["seconds"] = round(time.perf_counter() - t0, 2)
        state["points"].append(record)
        done[point.key()] = record
        _write_results(out, state)
        trained += 1
        if on_point:
            on_point(i, len(grid), record, True)
    return trained, False


# --------------------------------------------------------------------------------------------------
# Fitting (numpy; scipy for the parametric loss)


def fit_power_law(x: Any, y: Any) -> PowerLaw:
    """Least squares of log y on log x: y = coef · x^exponent.

    Args:
        x, y: positive values, at least two distinct x.

    Raises:
        ConfigError: fewer than two points, a value that is not positive, or a single x.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ConfigError("a power law needs at least two (x, y) points")
    if not (np.all(x > 0) and np.all(y > 0) and np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ConfigError("a power law is fitted to positive finite values only")
    if np.ptp(np.log(x)) == 0:
        raise ConfigError("a power law needs at least two different x values")
    exponent, log_coef = np.polyfit(np.log(x), np.log(y), 1)
    return PowerLaw(coef=float(np.exp(log_coef)), exponent=float(exponent))


def fit_parabola_minimum(x: Any, loss: Any) -> dict[str, Any]:
    """The vertex of the parabola fitted to loss against log x (an IsoFLOP curve).

    Returns:
        {"ok": bool, "x": the x at the vertex, "loss": the parabola's value there, "interior": whether
        the vertex lies within the sampled x, "coefs": [c2, c1, c0] in ln x, "why": when not ok}.
    """
    x, loss = np.asarray(x, dtype=float), np.asarray(loss, dtype=float)
    u = np.log(x)
    if np.unique(u).size < 3:
        return {"ok": False, "why": "fewer than 3 sizes"}
    c2, c1, c0 = np.polyfit(u, loss, 2)
    if c2 <= 0:
        return {"ok": False, "why": "the losses bend the wrong way (no minimum)", "coefs": [c2, c1, c0]}
    vertex = -c1 / (2 * c2)
    return {
        "ok": True, "x": float(np.exp(vertex)), "loss": float(c0 - c1 * c1 / (4 * c2)),
        "interior": bool(u.min() <= vertex <= u.max()), "coefs": [float(c2), float(c1), float(c0)],
    }


def fit_isoflops(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget: the parabola vertices in log N and in log D (the budget's compute-optimal N and D).

    Args:
        records: points with "budget", "params", "tokens" and a finite "val_loss".
    """
    out = []
    for budget in sorted({r["budget"] for r in records}):
        group = sorted((r for r in records if r["budget"] == budget), key=lambda r: r["params"])
        losses = [r["val_loss"] for r in group]
        by_n = fit_parabola_minimum([r["params"] for r in group], losses)
        by_d = fit_parabola_minimum([r["tokens"] for r in group], losses)
        entry: dict[str, Any] = {"budget": budget, "points": len(group), "ok": by_n["ok"] and by_d["ok"]}
        if entry["ok"]:
            entry.update(params_opt=by_n["x"], tokens_opt=by_d["x"], loss_opt=by_n["loss"],
                         interior=by_n["interior"] and by_d["interior"], parabola=by_n["coefs"])
        else:
            entry["why"] = by_n.get("why") or by_d.get("why")
        out.append(entry)
    return out


def fit_frontier(isoflops: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Power laws N_opt = k·C^a and D_opt = k·C^b through the IsoFLOP vertices.

    Vertices inside their sampled range are used when there are two or more of them; otherwise
    every vertex is, and the result is marked extrapolated. None with fewer than two.
    """
    ok = [m for m in isoflops if m["ok"]]
    interior = [m for m in ok if m["interior"]]
    use = interior if len(interior) >= 2 else ok
    if len({m["budget"] for m in use}) < 2:
        return None
    budgets = [m["budget"] for m in use]
    return {
        "params": fit_power_law(budgets, [m["params_opt"] for m in use]).to_dict(),
        "tokens": fit_power_law(budgets, [m["tokens_opt"] for m in use]).to_dict(),
        "budgets_used": budgets,
        "extrapolated": use is not interior,
    }


def _log_loss_model(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """log(E + A/N^alpha + B/D^beta) with theta = (log A, log B, log E, alpha, beta), computed stably."""
    from scipy.special import logsumexp

    a, b, e, alpha, beta = theta
    return logsumexp(np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)]), axis=0)


def fit_loss(params: Any, tokens: Any, losses: Any, *, delta: float = 1e-3) -> tuple[LossFit, float]:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to measured losses (Hoffmann et al.'s approach 3).

    For fixed exponents the loss is linear in E, A, B: a grid of (alpha, beta) with non-negative
    least squares for the rest finds the starts, and the best three are refined on Chinchilla's
    objective, the Huber loss (delta 1e-3) of log(predicted) - log(measured), robust to a few bad runs.

    Args:
        params, tokens, losses: one value per trained model (N, D, final loss), at least 5.
        delta: the Huber threshold on log residuals.

    Returns:
        (fit, rms): the LossFit and the root-mean-square log residual.

    Raises:
        ConfigError: fewer than 5 points or values that are not positive.
    """
    from scipy.optimize import least_squares, nnls

    n, d, loss = (np.asarray(v, dtype=float) for v in (params, tokens, losses))
    if not (n.shape == d.shape == loss.shape) or n.size < 5:
        raise ConfigError("the parametric loss fit needs at least 5 (N, D, loss) points")
    if not all(np.all(v > 0) and np.all(np.isfinite(v)) for v in (n, d, loss)):
        raise ConfigError("the parametric loss fit needs positive finite N, D and losses")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    # scale N and D to about 1 so the grid's linear solves are well conditioned
    n0, d0 = float(np.exp(log_n.mean())), float(np.exp(log_d.mean()))
    starts = []
    for alpha in np.linspace(0.05, 1.5, 30):
        for beta in np.linspace(0.05, 1.5, 30):
            design = np.stack([np.ones_like(n), (n / n0) ** -alpha, (d / d0) ** -beta], axis=1)
            coef, residual = nnls(design, loss)
            starts.append((residual, alpha, beta, coef))
    starts.sort(key=lambda s: s[0])
    tiny = 1e-12
    best = None
    for _, alpha, beta, (E, A, B) in starts[:3]:
        x0 = np.array([np.log(max(A, tiny)) + alpha * np.log(n0), np.log(max(B, tiny)) + beta * np.log(d0),
                       np.log(max(E, tiny)), alpha, beta])
        result = least_squares(
            lambda t: _log_loss_model(t, log_n, log_d) - log_l, x0, loss="huber", f_scale=delta,
            bounds=([-np.inf, -np.inf, -np.inf, 0.0, 0.0], [np.inf, np.inf, np.inf, 3.0, 3.0]),
            xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=5000,
        )
        if best is None or result.cost < best.cost:
            best = result
    a, b, e, alpha, beta = (float(v) for v in best.x)
    fit = LossFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)
    rms = float(np.sqrt(np.mean((_log_loss_model(best.x, log_n, log_d) - log_l) ** 2)))
    return fit, rms


def fit_sweep(records: list[dict[str, Any]], *, data: str | None = None) -> dict[str, Any]:
    """Every fit of a sweep, as fit.json holds it.

    Args:
        records: results.json points (those without a finite val_loss are left out).
        data: the data folder, recorded for `tinygpt train --sweep`.

    Returns:
        {"points", "flops_range", "isoflops" (per budget), "frontier" (power laws, or None),
        "loss_fit" (E, A, B, alpha, beta, rms_log_residual, implied exponents; or None),
        "chinchilla" (the exponents to compare with), "notes" (what could not be fitted, and why), "data"}.
    """
    good = [r for r in records if r.get("val_loss") is not None and math.isfinite(r["val_loss"])]
    notes: list[str] = []
    budgets = sorted({r["budget"] for r in records}) or [0.0]
    isoflops = fit_isoflops(good)
    for m in isoflops:
        if not m["ok"]:
            notes.append(f"C={m['budget']:.3g}: no IsoFLOP minimum ({m['why']})")
        elif not m["interior"]:
            notes.append(f"C={m['budget']:.3g}: the best size lies outside the sizes trained (extrapolated)")
    frontier = fit_frontier(isoflops)
    if frontier is None:
        notes.append("no frontier: it needs IsoFLOP minima at two or more budgets")
    elif frontier["extrapolated"]:
        notes.append("the frontier rests on extrapolated minima: widen the sizes around them")
    loss_fit = None
    if len(good) >= 5 and len({r["budget"] for r in good}) >= 2:
        fit, rms = fit_loss([r["params"] for r in good], [r["tokens"] for r in good], [r["val_loss"] for r in good])
        s = fit.alpha + fit.beta
        loss_fit = {**asdict(fit), "rms_log_residual": rms,
                    "implied": {"a": fit.beta / s if s else None, "b": fit.alpha / s if s else None}}
    else:
        notes.append("no parametric loss fit: it needs 5 or more finished points over two or more budgets")
    return {
        "data": data, "points": len(good), "flops_range": [budgets[0], budgets[-1]], "isoflops": isoflops,
        "frontier": frontier, "loss_fit": loss_fit, "chinchilla": dict(CHINCHILLA_EXPONENTS), "notes": notes,
    }


def load_fit(folder: str | Path) -> ScalingLaw:
    """The scaling law a sweep folder's fit.json holds, for sizing a model (`tinygpt train --sweep`).

    Raises:
        SweepError: no fit.json, or one that is not valid.
    """
    path = Path(folder) / FIT
    if not path.exists():
        raise SweepError(f"{folder}: no {FIT} here (run `tinygpt sweep --data DIR --out {folder}` first)")
    try:
        return ScalingLaw.from_dict(read_json(path, SweepError), str(path), source=str(folder))
    except ConfigError as e:
        raise SweepError(str(e)) from None


def summary_lines(fit: dict[str, Any]) -> list[str]:
    """A readable account of a fit.json: the frontier's exponents next to Chinchilla's, the loss fit."""
    lines = []
    chin = fit["chinchilla"]
    for m in fit["isoflops"]:
        if m["ok"]:
            edge = "" if m["interior"] else "  (outside the sizes trained: extrapolated)"
            lines.append(f"  C={m['budget']:.3g}: best N {format_count(m['params_opt'])}, D {format_count(m['tokens_opt'])}, "
                         f"loss {m['loss_opt']:.4f}{edge}")
    frontier = fit["frontier"]
    if frontier:
        a, b = frontier["params"]["exponent"], frontier["tokens"]["exponent"]
        lines.append(f"frontier: N_opt ∝ C^{a:.2f}, D_opt ∝ C^{b:.2f}  (Chinchilla: C^{chin['a']:.2f}, C^{chin['b']:.2f})")
    loss = fit["loss_fit"]
    if loss:
        implied = loss["implied"]
        lines.append(
            f"loss fit: L = {loss['E']:.3f} + {loss['A']:.4g}/N^{loss['alpha']:.3f} + {loss['B']:.4g}/D^{loss['beta']:.3f}"
            f"  (rms log residual {loss['rms_log_residual']:.4f}; implies N_opt ∝ C^{implied['a']:.2f}, "
            f"D_opt ∝ C^{implied['b']:.2f})"
        )
    lines += [f"note: {n}" for n in fit["notes"]]
    return lines
