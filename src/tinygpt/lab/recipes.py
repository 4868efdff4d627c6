"""The recipe bench behind `tinygpt bench --recipes`: time to quality of the 2019 training recipe
(GPT-2's block, AdamW, warmup + cosine) against the modern one (rotary positions, RMSNorm, SwiGLU,
QK-norm, zero-initialised output projections, an untied head; Muon; warmup-stable-decay: what a new
`tinygpt train` run trains) and the steps between, each trained through tinygpt.train on the same
data, for the same steps and tokens, from the same seeds.

Runs are interleaved (seed 1's recipes, then seed 2's, ...) so a shared machine's load falls on
every recipe alike, and every ratio is against the reference recipe measured in the same run:

    val loss     at fixed shares of the run's tokens, the mean over the seeds (and the spread),
                 in nats per token and, at the end, in bits per character
    to target    the steps, tokens and training wall time (evaluations not counted) a recipe's mean
                 curve needs to reach the reference's mean final val loss, linearly interpolated
                 between evaluations, and their ratios to the reference's own (the time's: the median
                 over seeds of each run's against the reference's run from the same seed)

The evaluations use the same batches at every step (train's estimate_loss), so the curves compare.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..calc import count_params, format_count
from ..config.fields import from_mapping
from ..config.model import GPTConfig, with_arch
from ..config.train import RECIPE_MODEL, RECIPE_TRAIN, TrainConfig
from ..data.folder import load_data
from ..errors import ConfigError
from ..train.callbacks import TrainCallback
from ..train.loop import train


@dataclass(frozen=True)
class Recipe:
    """A way to train a model from scratch: its architecture choices over the bench's shape, and its
    training settings over TrainConfig's."""

    about: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


# the modern block (config.RECIPE_MODEL: the llama layout with QK-norm, zero-initialised output
# projections and an untied head) and Muon with warmup-stable-decay (RECIPE_TRAIN): what a new
# `tinygpt train` run gets; "relu2" is the modded-nanoGPT speedrun's MLP in it, which no Hugging Face
# or llama.cpp architecture has
ADAMW_COSINE = dict(optimizer="adamw", lr_schedule="cosine")

REFERENCE = "2019"
RECIPES: dict[str, Recipe] = {
    "2019": Recipe("GPT-2's block (learned positions, LayerNorm, GELU, tied head), AdamW, warmup + cosine",
                   dict(arch="gpt2"), ADAMW_COSINE),
    "block": Recipe("the modern block (rotary, RMSNorm, SwiGLU, QK-norm, zero-init projections, untied head), "
                    "AdamW, warmup + cosine", RECIPE_MODEL, ADAMW_COSINE),
    "muon": Recipe("GPT-2's block, Muon, warmup-stable-decay", dict(arch="gpt2"), RECIPE_TRAIN),
    "modern": Recipe("the modern block, Muon, warmup-stable-decay: tinygpt train's default", RECIPE_MODEL,
                     RECIPE_TRAIN),
    "relu2": Recipe("the modern block with ReLU^2 for SwiGLU (the speedrun's), Muon, warmup-stable-decay",
                    {**RECIPE_MODEL, "mlp": "relu2"}, RECIPE_TRAIN),
}
DEFAULT_RECIPES = ("2019", "muon", "modern")

# The reference scale: 4 layers x 128 wide, characters, batch 32 x 128.
SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=128)
STEPS = 800
BATCH_SIZE = 32
SEEDS = 3
EVALS = 16  # evaluations per run, evenly spaced
SHARES = (0.25, 0.5, 0.75, 1.0)  # the shares of the run's tokens the table shows the val loss at


class _Curve(TrainCallback):
    """Records each evaluation's val loss beside the training time spent up to its step (the steps'
    own time, taken from each step's tokens per second: evaluations and checkpoints not counted)."""

    def __init__(self) -> None:
        self.seconds, self.tokens, self.evals = 0.0, 0, []

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        if record["tokens_per_s"]:
            self.seconds += (record["tokens"] - self.tokens) / record["tokens_per_s"]
        self.tokens = record["tokens"]
        for e in self.evals:  # an evaluation comes before its step's on_step
            if e["seconds"] is None:
                e["seconds"] = self.seconds

    def on_eval(self, record: dict[str, Any]) -> None:
        seconds = self.seconds if record["tokens"] == self.tokens else None  # the last one comes after
        self.evals.append({"step": record["step"], "tokens": record["tokens"], "val_loss": record["val_loss"],
                           "seconds": seconds})


def recipe_configs(name: str, vocab_size: int, shape: dict[str, Any], train_over: dict[str, Any]
                   ) -> tuple[GPTConfig, TrainConfig]:
    """The model and training settings recipe `name` trains at `shape` (GPTConfig fields) over the
    data's vocabulary, with `train_over` (batch size, steps, device, ...) under the recipe's own."""
    if name not in RECIPES:
        raise ConfigError(f"recipe: unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    model = from_mapping(GPTConfig, with_arch({**GPTConfig(**shape, vocab_size=vocab_size).to_dict()}, recipe.model))
    return model, from_mapping(TrainConfig, {**train_over, **recipe.train})


def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first x where the piecewise-linear curve through `points` ((x, loss), x rising) comes down
    to `target`, or None where it never does."""
    prev = None
    for x, y in points:
        if y <= target:
            if prev is None or prev[1] == y:
                return float(x)
            (x0, y0) = prev
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
        prev = (x, y)
    return None


def at(points: Sequence[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve through `points` at x (held flat before the first point)."""
    prev = None
    for x1, y1 in points:
        if x1 >= x:
            if prev is None:
                return float(y1)
            x0, y0 = prev
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        prev = (x1, y1)
    return float(points[-1][1])


def summarize(runs: list[dict[str, Any]], names: Sequence[str], reference: str,
              bits_per_nat: float) -> tuple[float, dict[str, dict[str, Any]]]:
    """The reference's mean final val loss (the target) and, per recipe, its mean curve's figures
    (see the module's docstring) and ratios to the reference's."""
    out: dict[str, dict[str, Any]] = {}
    curves = {}
    for name in names:
        mine = [r["evals"] for r in runs if r["recipe"] == name]
        steps = [e["step"] for e in mine[0]]
        losses = [statistics.fmean(run[i]["val_loss"] for run in mine) for i in range(len(steps))]
        seconds = [statistics.fmean(run[i]["seconds"] for run in mine) for i in range(len(steps))]
        finals = [run[-1]["val_loss"] for run in mine]
        curves[name] = (steps, losses, seconds, mine[0], mine)
        out[name] = {
            "seeds": len(mine), "final_val_loss": losses[-1],
            "final_spread": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
            "final_bits": losses[-1] * bits_per_nat, "train_seconds": seconds[-1],
        }
    target = out[reference]["final_val_loss"]
    for name in names:
        steps, losses, seconds, first, _ = curves[name]
        tokens_per_step = first[-1]["tokens"] / steps[-1]
        total = steps[-1] * tokens_per_step
        out[name]["val_loss_at"] = {f"{s:g}": at([(st * tokens_per_step, l) for st, l in zip(steps, losses)],
                                                 s * total) for s in SHARES}
        step = crossing(list(zip(steps, losses)), target)
        out[name]["steps_to_target"] = step
        out[name]["tokens_to_target"] = None if step is None else step * tokens_per_step
        out[name]["seconds_to_target"] = None if step is None else at(list(zip(steps, seconds)), step)
    ref = out[reference]
    ref_runs = curves[reference][4]
    for name, s in out.items():
        s["step_ratio"] = None if s["steps_to_target"] is None else s["steps_to_target"] / ref["steps_to_target"]
        s["loss_ratio"] = s["final_val_loss"] / ref["final_val_loss"]
        # each seed's time against the reference's run from the same seed, which ran just before or
        # after it: a shared machine's load moves between seeds far more than between neighbours
        s["time_ratio"] = None if s["steps_to_target"] is None else statistics.median(
            at([(e["step"], e["seconds"]) for e in run], s["steps_to_target"])
            / at([(e["step"], e["seconds"]) for e in base], ref["steps_to_target"])
            for run, base in zip(curves[name][4], ref_runs))
    return target, out


def run(
    data: str | Path,
    *,
    recipes: Sequence[str] = DEFAULT_RECIPES,
    seeds: int = SEEDS,
    steps: int = STEPS,
    batch_size: int = BATCH_SIZE,
    shape: dict[str, Any] | None = None,
    evals: int = EVALS,
    eval_iters: int = 20,
    device: str = "auto",
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Train every recipe from every seed on a prepared data folder, interleaved, and summarize.

    Args:
        data: a folder `tinygpt prepare` wrote (characters or BPE).
        recipes: names from RECIPES; the first is the reference every ratio is against.
        seeds: seeds 1 .. seeds, each recipe trained from each.
        steps, batch_size: every run's optimizer steps and sequences per step (equal tokens for all).
        shape: n_layer, n_head, n_embd, block_size (SHAPE by default); each recipe's model is this
            shape in its own layout, so the parameter counts differ only by position embeddings and
            the head (both shown).
        evals: evaluations per run, every steps // evals steps (and at the end).
        eval_iters: batches of the validation split per evaluation (the same batches each time).
        device: where to train (TrainConfig.device).
        log: called with a line as each run starts and ends.

    Returns:
        a JSON-ready dict: the machine, the settings, each recipe's model and parameter count, every
        run's evaluations, and the summary (see summarize); render() prints it.

    Raises:
        ConfigError: an unknown recipe, fewer than two steps per evaluation, a recipe named twice.
    """
    from .bench.machine import load_average, machine
    from ..device import resolve_device

    recipes = list(recipes)
    if not recipes:
        raise ConfigError("recipes: name at least one")
    if len(set(recipes)) != len(recipes):
        raise ConfigError(f"recipes: each recipe once, got {', '.join(recipes)}")
    shape = {**SHAPE, **(shape or {})}
    interval = steps // evals
    if interval < 1:
        raise ConfigError(f"steps: {steps} steps cannot hold {evals} evaluations; give at least {evals}")
    dataset = load_data(data)
    val_chars, val_tokens = dataset.meta.get("val_chars"), dataset.meta.get("val_tokens")
    chars_per_token = val_chars / val_tokens if val_chars and val_tokens else None
    over = dict(batch_size=batch_size, max_iters=steps, eval_interval=interval, eval_iters=eval_iters,
                device=device)
    configs = {name: recipe_configs(name, dataset.vocab_size, shape, over) for name in recipes}
    started = time.perf_counter()
    info = machine(resolve_device(device))
    runs = _train_runs(data, configs, seeds, steps, log)
    target, summary = summarize(runs, recipes, recipes[0], 1 / math.log(2) / (chars_per_token or 1))
    info["load_average_end"] = load_average()
    return {
        "machine": info, "data": str(data), "tokenizer": dataset.meta.get("tokenizer"),
        "chars_per_token": chars_per_token, "unit": "bits per char" if chars_per_token else "bits per token",
        "steps": steps, "batch_size": batch_size, "shape": shape, "seeds": seeds, "eval_interval": interval,
        "eval_iters": eval_iters, "reference": recipes[0], "target": target,
        "recipes": {name: {"about": RECIPES[name].about, "params": count_params(configs[name][0]).total,
                           "model": configs[name][0].to_dict(), "train": configs[name][1].to_dict()}
                    for name in recipes},
        "runs": runs, "summary": summary, "seconds": time.perf_counter() - started,
    }


def _train_runs(data: str | Path, configs: dict[str, tuple[GPTConfig, TrainConfig]], seeds: int, steps: int,
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every recipe trained from seeds 1 .. seeds, interleaved (seed 1's recipes, then seed 2's, ...) so that
    a shared machine's load falls on every recipe alike; each run's evaluations, timed by a _Curve."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tinygpt-recipes-") as tmp:
        for seed in range(1, seeds + 1):
            for name, (model, cfg) in configs.items():
                cfg = from_mapping(TrainConfig, {**cfg.to_dict(), "seed": seed})
                clock = _Curve()
                log(f"recipe {name}, seed {seed}: {steps} steps ...")
                res = train(data, Path(tmp) / f"{name}-{seed}", model, cfg, callbacks=[clock])
                runs.append({"recipe": name, "seed": seed, "evals": clock.evals, "stopped": res.stopped})
                log(f"recipe {name}, seed {seed}: val loss {clock.evals[-1]['val_loss']:.4f} "
                    f"in {clock.evals[-1]['seconds']:.1f} s of training")
    return runs


def _fmt(value: float | None, spec: str, none: str = "not reached") -> str:
    return none if value is None else format(value, spec)


def render(result: dict[str, Any]) -> str:
    """The run as a table for a terminal (and the README)."""
    m, ref = result["machine"], result["reference"]
    shape = result["shape"]
    tokens = result["steps"] * result["batch_size"] * shape["block_size"]
    lines = [
        f"tinygpt bench --recipes: {m['processor']}, {m['threads']} threads, torch {m['torch']}, load "
        f"{m['load_average']} -> {m.get('load_average_end')}, {result['seconds']:.0f} s",
        f"data {result['data']} ({result['tokenizer']}); {shape['n_layer']} layers x {shape['n_embd']}, context "
        f"{shape['block_size']}, batch {result['batch_size']}, {result['steps']} steps ({tokens:,} tokens), "
        f"{result['seeds']} seeds each, interleaved; target: {ref}'s final val loss {result['target']:.4f}",
        "",
        "| recipe | params | " + " | ".join(f"val @ {float(s):.0%}" for s in SHARES)
        + f" | final ({result['unit']}) | steps to target | x {ref} | train time to it | x {ref} |",
        "|---|---:|" + "---:|" * len(SHARES) + "---:|---:|---:|---:|---:|",
    ]
    for name, s in result["summary"].items():
        spread = f" ± {s['final_spread']:.3f}" if s["seeds"] > 1 else ""
        lines.append(
            f"| {name} | {format_count(result['recipes'][name]['params'])} | "
            + " | ".join(f"{s['val_loss_at'][f'{x:g}']:.3f}" for x in SHARES)
            + f" | {s['final_val_loss']:.3f}{spread} ({s['final_bits']:.3f}) | {_fmt(s['steps_to_target'], '.0f')} | "
            f"{_fmt(s['step_ratio'], '.2f', '-')} | {_fmt(s['seconds_to_target'], '.1f')} s | "
            f"{_fmt(s['time_ratio'], '.2f', '-')} |".replace("not reached s", "not reached"))
    lines += ["", "val loss in nats per token (mean over seeds; ± the seeds' spread); recipes:"]
    lines += [f"  {name}: {r['about']}" for name, r in result["recipes"].items()]
    return "\n".join(lines)
