"""Choosing a model for a time budget: how big a GPT this machine can train well in the time given
(Chinchilla's rule or a sweep's frontier, at the speed measured here), the context and learning rate
that suit it, and the default model for a data set when there is no budget. train() trains what it
is given; the CLI (or the caller) chooses here first."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .calc import (
    TOKENS_PER_PARAM,
    ScalingLaw,
    compute_optimal,
    count_params,
    flops_per_token,
    format_count,
    shape_for_params,
    smallest_shape,
)
from .config.fields import from_mapping
from .config.model import GPTConfig, with_arch
from .config.train import TrainConfig
from .device import resolve_device, resolve_dtype
from .errors import ConfigError

SIZE_FIELDS = ("n_layer", "n_head", "n_embd")  # setting any of these turns budget sizing off

MIN_SIZED_STEPS = 100  # a model sized for a time budget gets at least this many optimizer steps

# ... and a context short enough for this many planned steps, down to MIN_SIZED_CONTEXT. At least
# 2,000 real steps is what paid on the corpora measured; the plan asks 3,000, since a run makes
# 75-110% of its plan on a shared 2-core host (the probe's speed is not the chosen model's, and the
# host's moves): `make demo` planned 2,180 steps at context 256 and made 1,674 (2.05 bits a char,
# against 1.93 at context 128 with 3,940 steps).
SIZED_STEPS = 3_000

# Muon gets more from each token and each step: a budget trained with it buys a model of
# MUON_TOKENS_PER_PARAM training tokens a parameter (Chinchilla's 20 for AdamW) at a context that
# plans MUON_SIZED_STEPS steps. Measured with `make demo`'s run (5 minutes, the stdlib as BPE 1024,
# the modern recipe, a 2-core Sapphire Rapids), bits per character on the val split: sized by
# Chinchilla's rule 2 x 80 (338K parameters, 25 tokens each, 5,565 steps at context 128) 1.80;
# 4 x 128 (1.1M, 3.8 tokens each) 1.52, 4 x 192 (2.2M, 1.7) 1.41, 4 x 256 (3.4M, 0.7) 1.56, each
# 776-1,353 steps at context 256.
MUON_TOKENS_PER_PARAM = 2.0
MUON_SIZED_STEPS = 1_000

MIN_SIZED_CONTEXT = 64


def default_model_config(vocab_size: int, train_tokens: int, val_tokens: int) -> GPTConfig:
    """A model that suits the data when no model flags are given: the lesson's `stretch` model for a
    corpus of a million tokens or more, a 4-layer, 128-wide model below that; the context is
    shortened when a split is too small to hold one."""
    if train_tokens >= 1_000_000:
        cfg = GPTConfig.from_preset("stretch", vocab_size=vocab_size)
    else:
        cfg = GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128)
    shortest = min(train_tokens, val_tokens) if val_tokens else train_tokens
    block = cfg.block_size
    while block > 8 and block + 1 > shortest:
        block //= 2
    cfg.block_size = block
    return cfg


@dataclass
class ModelChoice:
    """The model choose_model picked, and why.

    Args:
        config: the architecture.
        rule: "given" (size fields were set), "data" (no time budget: sized for the data),
            "chinchilla" or "sweep" (sized for a time budget by that rule).
        reason: one line for the user.
        plan: for a time budget: seconds, flops_per_second, flops, params, tokens, steps, epochs, lr.
        lr: for a time budget, the peak learning rate that suits the model (sized_lr); train()
            uses it when TrainConfig.lr is left None (`tinygpt train` without --lr).
    """

    config: GPTConfig
    rule: str
    reason: str
    plan: dict[str, Any] | None = None
    lr: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "reason": self.reason, "config": self.config.to_dict(), "plan": self.plan}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelChoice:
        """A choice as to_dict() wrote it (train_config.json's notes.model_choice); its lr is in the
        run's training settings, not here.

        Raises:
            ConfigError: a field is missing or malformed.
        """
        try:
            plan = data.get("plan")
            if not (isinstance(data["rule"], str) and isinstance(data["reason"], str)
                    and (plan is None or isinstance(plan, dict))):
                raise TypeError("rule, reason or plan")
            return cls(GPTConfig.from_dict(data["config"]), data["rule"], data["reason"], plan)
        except (KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"the recorded model choice is not valid ({e})") from None


def eval_overhead(cfg: TrainConfig) -> float:
    """Evaluation time as a share of training time: an evaluation runs 2 x eval_iters forward passes
    every eval_interval steps, and a forward pass is about a third of a training step."""
    return (2 * cfg.eval_iters) / (3 * cfg.grad_accum * cfg.eval_interval)


def _describe(cfg: GPTConfig) -> str:
    layers, heads = ("layer" if cfg.n_layer == 1 else "layers"), ("head" if cfg.n_head == 1 else "heads")
    return (f"{cfg.n_layer} {layers} x {cfg.n_embd} wide, {cfg.n_head} {heads} "
            f"({format_count(count_params(cfg).total)} parameters)")


def choose_model(
    vocab_size: int,
    train_tokens: int,
    val_tokens: int,
    train_config: TrainConfig | None = None,
    *,
    fixed: dict[str, Any] | None = None,
    sweep: ScalingLaw | None = None,
    flops_per_second: float | None = None,
) -> ModelChoice:
    """The model to train when none is given: sized for the time budget if there is one, else for the data.

    With train_config.max_time set and none of n_layer, n_head, n_embd fixed, the model is sized
    for the compute the budget buys here. The speed is measured with a few real training steps
    at the run's batch size, context, device and dtype: once on a probe (about 1M parameters on a
    CPU, GPT-2 small's size on a GPU), then again on the size that speed points to, since smaller
    models run at fewer FLOP/s.
    The compute C = FLOP/s x max_time, less the share evaluations take, gives N by the sweep's
    frontier (`sweep`) or Chinchilla's rule N = sqrt(C / 120) (with Muon MUON_TOKENS_PER_PARAM tokens a
    parameter for Chinchilla's 20); calc.shape_for_params turns N into
    a shape, no smaller than the smallest one and small enough to get MIN_SIZED_STEPS steps of
    batch_size x grad_accum x block_size tokens. Unless block_size is fixed, the context is halved
    (down to MIN_SIZED_CONTEXT) until the plan reaches SIZED_STEPS steps (MUON_SIZED_STEPS), and the choice carries a
    learning rate for the model's width (sized_lr). Without a time budget it is default_model_config's
    model. Fields in `fixed` are kept either way (block_size among them: it changes FLOPs per
    token and speed, so the sizing uses it).

    Args:
        vocab_size, train_tokens, val_tokens: the data's, as its meta.json gives them.
        train_config: batch_size, grad_accum, max_time, eval settings, device and dtype (TrainConfig()).
        fixed: model fields set by the user (block_size, dropout, bias, ...).
        sweep: a sweep's fit (tinygpt.lab.sweep.load_fit) to size by, instead of Chinchilla's rule.
        flops_per_second: a known training speed, instead of measuring it.

    Raises:
        ConfigError: a sweep without a time budget, or with size fields fixed; invalid fixed fields.
    """
    cfg = train_config or TrainConfig()
    fixed = dict(fixed or {})
    base = from_mapping(GPTConfig, with_arch(default_model_config(vocab_size, train_tokens, val_tokens).to_dict(), fixed))
    sized_by_user = [f for f in SIZE_FIELDS if f in fixed]
    if sweep is not None and (cfg.max_time is None or sized_by_user):
        why = "a time budget (max_time)" if cfg.max_time is None else f"no size fields (got {', '.join(sized_by_user)})"
        raise ConfigError(f"a sweep's fit sizes the model for a time budget: it needs {why}")
    if sized_by_user:
        return ModelChoice(base, "given", f"model: {_describe(base)}, as given")
    if cfg.max_time is None:
        return ModelChoice(base, "data", f"model: {_describe(base)}, the default for {train_tokens:,} training tokens")
    return _size_for_budget(base, cfg, train_tokens, "block_size" in fixed, sweep, flops_per_second)


@dataclass
class _Sizer:
    """Turns a compute budget into a model: the rule's parameter count, made into a shape that gets
    enough optimizer steps of `sequences` sequences, at the longest of `contexts` that gets `planned_steps`.

    Args:
        base: the data's default with the user's fixed fields (everything but the size).
        sequences: sequences per optimizer step (batch_size x grad_accum).
        contexts: the block sizes to try, longest first.
        sweep: a sweep's fit, else Chinchilla's rule with `tokens_per_param`.
        planned_steps: the steps a context must plan to be chosen.
    """

    base: GPTConfig
    sequences: int
    contexts: list[int]
    sweep: ScalingLaw | None
    tokens_per_param: float = TOKENS_PER_PARAM
    planned_steps: int = SIZED_STEPS

    def steps(self, model: GPTConfig, flops: float) -> int:
        return int(flops / flops_per_token(model).training // (self.sequences * model.block_size))

    def size(self, flops: float) -> tuple[GPTConfig, float, list[str]]:
        """(model, the rule's parameter count, notes for the user) for `flops` of training."""
        for T in self.contexts:
            model, target, notes = self.size_at(flops, T)
            if self.steps(model, flops) >= self.planned_steps:
                break
        return model, target, notes

    def size_at(self, flops: float, T: int) -> tuple[GPTConfig, float, list[str]]:
        vocab = self.base.vocab_size
        at = dataclasses.replace(self.base, block_size=T)
        smallest = smallest_shape(vocab_size=vocab, block_size=T, base=at)
        target = (self.sweep.optimal_params(flops) if self.sweep is not None
                  else compute_optimal(flops=flops, tokens_per_param=self.tokens_per_param).params)
        notes = []
        if target <= count_params(smallest).total:
            model = smallest
            notes.append("the smallest model: the budget buys less")
        else:
            model = shape_for_params(target, vocab_size=vocab, block_size=T, base=at)
        # a model too big for the batch would take a handful of steps: shrink it until it gets enough
        smaller = target
        while model is not smallest and self.steps(model, flops) < MIN_SIZED_STEPS:
            smaller *= 0.8
            if smaller <= count_params(smallest).total:
                model = smallest
            else:
                model = shape_for_params(smaller, vocab_size=vocab, block_size=T, base=at)
            if not notes or "steps" not in notes[-1]:
                notes.append(f"made smaller to get {MIN_SIZED_STEPS} steps of {self.sequences * T:,} tokens")
        return model, target, notes


def _contexts(base: GPTConfig, block_fixed: bool) -> list[int]:
    """The contexts a budget may train at, longest first. A small budget trains better on more,
    shorter steps, so the context is halved (unless it is given) down to MIN_SIZED_CONTEXT: see the
    README's Performance section (time to quality) for the runs that showed it."""
    contexts = [base.block_size]
    while not block_fixed and contexts[-1] // 2 >= MIN_SIZED_CONTEXT:
        contexts.append(contexts[-1] // 2)
    return contexts


def _probe(base: GPTConfig, cfg: TrainConfig) -> GPTConfig:
    """The first model to time: what a laptop trains in minutes, or GPT-2 small on a GPU (where a
    small model would time kernel launches rather than compute)."""
    guess = 124e6 if resolve_device(cfg.device).type == "cuda" else 1e6
    smallest = smallest_shape(vocab_size=base.vocab_size, block_size=base.block_size, base=base)
    guess = max(guess, 2 * count_params(smallest).total)  # a big vocabulary sets a floor
    return shape_for_params(guess, vocab_size=base.vocab_size, block_size=base.block_size, base=base)


def _size_for_budget(
    base: GPTConfig, cfg: TrainConfig, train_tokens: int, block_fixed: bool, sweep: ScalingLaw | None,
    flops_per_second: float | None,
) -> ModelChoice:
    """choose_model for a time budget: the speed (measured here unless given), the model it buys, the plan."""
    seconds = cfg.max_time
    share = 1 / (1 + eval_overhead(cfg))
    muon = cfg.optimizer == "muon"
    sizer = _Sizer(base, cfg.batch_size * cfg.grad_accum, _contexts(base, block_fixed), sweep,
                   MUON_TOKENS_PER_PARAM if muon else TOKENS_PER_PARAM, MUON_SIZED_STEPS if muon else SIZED_STEPS)
    measured = flops_per_second is None
    speed = _measure_speed(_probe(base, cfg), cfg) if measured else flops_per_second
    model, target, notes = sizer.size(speed * seconds * share)
    if measured:
        # the probe's speed is not the chosen model's: small models do fewer FLOP/s; measure that one
        speed = _measure_speed(model, cfg)
        model, target, notes = sizer.size(speed * seconds * share)
    flops = speed * seconds * share
    tokens = flops / flops_per_token(model).training
    plan = {"seconds": seconds, "flops_per_second": speed, "measured": measured, "flops": flops, "target_params": target,
            "params": count_params(model).total, "tokens": tokens, "steps": sizer.steps(model, flops),
            "epochs": tokens / max(1, train_tokens), "tokens_per_step": sizer.sequences * model.block_size,
            "lr": sized_lr(model)}
    if sweep is not None:
        rule = "sweep"
        law = f"the sweep{' in ' + sweep.source if sweep.source else ''} ({sweep.rule})"
        low, high = sweep.flops_range
        if not low / 10 <= flops <= high * 10:
            notes.append(f"extrapolated: the sweep spans {low:.2g}-{high:.2g} FLOP")
    elif sizer.tokens_per_param == TOKENS_PER_PARAM:
        rule, law = "chinchilla", "Chinchilla's rule N = sqrt(C/120)"
    else:
        k = sizer.tokens_per_param
        rule, law = "chinchilla", f"Chinchilla's rule at Muon's {k:g} tokens a parameter N = sqrt(C/{6 * k:g})"
    return ModelChoice(model, rule, _budget_reason(model, cfg, plan, law, notes), plan, plan["lr"])


def _budget_reason(model: GPTConfig, cfg: TrainConfig, plan: dict[str, Any], law: str, notes: list[str]) -> str:
    """The one line that says what a time budget bought and why."""
    seconds, T = plan["seconds"], model.block_size
    where = "measured here" if plan["measured"] else "given"
    batch = f"{cfg.batch_size} x {T}" if cfg.grad_accum == 1 else f"{cfg.batch_size} x {cfg.grad_accum} x {T}"
    return (
        f"model: {_describe(model)} for a {seconds:g} s budget: {plan['flops_per_second'] / 1e9:.3g} GFLOP/s "
        f"({where}) x {seconds:g} s = {plan['flops']:.3g} FLOP after evaluations; {law} -> "
        f"N = {format_count(plan['target_params'])}; about {format_count(plan['tokens'])} tokens, "
        f"{plan['steps']:,} steps of {batch} tokens at lr {plan['lr']:.2g}"
        + (f", {plan['epochs']:.1f} epochs of the data" if plan["epochs"] >= 1 else "")
        + "".join(f"; {n}" for n in notes)
    )


def sized_lr(config: GPTConfig) -> float:
    """The peak learning rate for a model sized for a time budget: 3e-3 up to 128 wide, then falling
    as 1/width (1e-3 at 384, 5e-4 at 768: what char models and GPT-2 small train well at). A model
    sized for a small budget is narrow and trains few steps, so it takes the higher rate; the runs
    behind it are in the README's Performance section (time to quality)."""
    return 3e-3 * min(1.0, 128 / config.n_embd)


def _measure_speed(model: GPTConfig, cfg: TrainConfig) -> float:
    """Training FLOP/s of `model` here, with the run's batch size, device and dtype (a few real steps)."""
    from .device import DTYPES
    from .throughput import measure_training_throughput

    device = resolve_device(cfg.device)
    dtype = {v: k for k, v in DTYPES.items()}[resolve_dtype(cfg.dtype, device)]
    dtype = "bfloat16" if dtype == "float16" else dtype  # measured alike; float16 is not a measuring dtype
    return measure_training_throughput(
        model, batch_size=cfg.batch_size, steps=3, warmup=1, dtype=dtype, device=str(device), seed=cfg.seed,
        optimizer=cfg.optimizer,
    ).flops_per_second

