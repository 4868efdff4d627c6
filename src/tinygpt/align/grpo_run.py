"""A GRPO run: a pretrained model trained against rewards on the one training loop, and its report.

    grpo(from_, out, GRPOConfig(task="addition"))   FROM (a run or a Hugging Face folder), full or LoRA as
                                                    fine-tuning trains it, learning from its own completions'
                                                    rewards; the report says what changed on held-out prompts

The run is tinygpt.finetune.tune's (FROM loaded and checked, full or LoRA, its checksum, resume, the
report); GRPOTuning is what GRPO brings to it: the prompts (a task's, or a file's) and the rewards, settled
against FROM's tokenizer and context (Plan), the GRPO objective (tinygpt.align.grpo), and the held-out
prompts' scores as the report's section. The loop trains on the prompts as a DataSet in memory, whose
tokenizer is FROM's. train_config.json records the GRPO settings and the rewards' names; a resume is given
the rewards again, and they must be the same.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.finetune import FinetuneConfig
from ..config.grpo import DEFAULT_TRAIN, GRPOConfig
from ..config.sampling import SampleConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet
from ..device import resolve_device
from ..errors import ConfigError
from ..finetune import Base, FinetuneResult, Tuning, tune
from ..model import GPT
from ..run_folder import RunFolder
from ..tokenizer.base import encode_named
from ..tokenizer.chat import render_chat_prompt, stop_ids
from ..train.callbacks import TrainCallback
from . import tasks
from .grpo import GRPO, Plan, Prompts, held_out_scores
from .rewards import Reward, named_reward, read_prompts, task_reward
from .rollouts import check_room, sample_groups

TASK_PROMPTS = 10_000  # a task's training prompts, drawn once (with repeats: the rollouts draw from them)
SAMPLES_SHOWN = 4  # held-out prompts whose answers the report shows before and after
DEFAULT_COMPLETION = 64  # a completion's most tokens without a task


def grpo(
    from_: str | Path,
    out: str | Path,
    config: GRPOConfig,
    finetune_config: FinetuneConfig | None = None,
    train_config: TrainConfig | None = None,
    *,
    rewards: Sequence[Reward] | None = None,
    resume: bool = False,
    merge: str | Path | None = None,
    progress: bool = False,
    callbacks: Sequence[TrainCallback] = (),
    should_stop: Callable[[int], bool] | None = None,
) -> FinetuneResult:
    """Train FROM with GRPO against rewards, on the same loop as train() and finetune().

    Args:
        from_: the base: a tinygpt run folder or a Hugging Face folder.
        out: the run folder (a plain run for method full, an adapter run for lora).
        config: the prompts, the rewards, the rollouts and the loss (GRPOConfig).
        finetune_config: what trains (method full or lora, frozen layers, keep) and the report's reference
            text (FinetuneConfig); its block_size and prompts are not GRPO's.
        train_config: the optimization (default: config.grpo.DEFAULT_TRAIN); batch_size counts completions.
        rewards: the functions config.rewards names, in its order (default: from their names, here: the
            caller named them; "module:function" imported, a reward model's folder loaded to score).
        resume: continue the run in `out` from its checkpoint; config.rewards must name the rewards the run
            was trained with.
        merge: with lora, also write the adapters folded into the base as a plain run here.
        progress, callbacks, should_stop: as for train().

    The report (RUN/finetune_report.json) holds, before and after, on the held-out prompts: the greedy
    answers' mean reward and length, and with a task their accuracy and pass@1 and pass@k of sampled
    answers; a few held-out answers side by side; the loss on the reference text (what the training cost
    elsewhere); parameters, memory and time.

    Raises:
        ConfigError: bad settings, a reward that does not import (or a language model named as one), FROM a
            reward model, other rewards than a resumed run's.
        DataError: a prompts file that does not read or has bad lines.
        CheckpointError, TrainingError: as for finetune(); RewardError when a reward function fails.
    """
    ft = finetune_config or FinetuneConfig()
    if ft.block_size is not None or ft.prompts:
        raise ConfigError("GRPO's completions are as long as max_completion_length, and its samples are the "
                          "held-out prompts': block_size and prompts are fine-tuning's settings")
    train_config = train_config or TrainConfig(**DEFAULT_TRAIN)
    named = _rewards(config, rewards, resolve_device(train_config.device))
    if resume:
        _check_rewards(RunFolder(out), config)
    return tune(from_, None, out, GRPOTuning(config, named), ft, train_config, resume=resume, merge=merge,
                progress=progress, callbacks=callbacks, should_stop=should_stop)


class GRPOTuning(Tuning):
    """GRPO as tune() trains it: the rollouts' objective on the prompts, scored by the rewards; its report's
    section the held-out prompts' scores ("held_out"), its samples their greedy answers.

    Args:
        config: the GRPO settings.
        rewards: the reward functions, the task's first, each with its weight.
    """

    name, title, sampled = "grpo", "trained with GRPO", "greedy"

    def __init__(self, config: GRPOConfig, rewards: list[Reward]) -> None:
        self.config, self.rewards = config, rewards

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        self.plan, self.keep = _plan(self.config, self.rewards, base), cfg.keep

    def measure(self, model: GPT) -> dict[str, Any]:
        """The held-out scores, and the first held-out prompts' greedy answers."""
        model.eval()
        plan = self.plan
        shown = plan.held_out.ids[:SAMPLES_SHOWN]
        greedy = sample_groups(model, shown, 1, plan.max_new_tokens, config=SampleConfig(greedy=True),
                               stop_tokens=plan.stops, vocab_size=plan.tokenizer.vocab_size)
        prompts = [row["prompt"] for row in plan.held_out.rows[:SAMPLES_SHOWN]]
        samples = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "text": t}
                   for p, t in zip(prompts, plan.texts(greedy))]
        return {"held_out": held_out_scores(model, plan), "samples": samples}

    def trains_on(self, data: Any) -> DataSet:
        """The prompts as the loop takes a run's data: a DataSet in memory, its tokenizer the policy's (no token
        arrays: the objective draws its own rows), named by the file, or the task."""
        config, tokenizer = self.config, self.plan.tokenizer
        name = str(Path(config.prompts).resolve()) if config.prompts is not None else f"task:{config.task}"
        meta = {"format": "prompts", "vocab_size": tokenizer.vocab_size,
                "tokenizer_fingerprint": tokenizer.fingerprint(), "train_prompts": len(self.plan.train),
                "held_out_prompts": len(self.plan.held_out)}
        empty = np.zeros(0, dtype=np.uint16)
        return DataSet(Path(name), meta, empty, empty, tokenizer)

    def objective(self) -> Callable[..., GRPO]:
        return functools.partial(GRPO, plan=self.plan)

    def settings(self) -> dict[str, Any]:
        return self.config.to_dict()


def _rewards(config: GRPOConfig, given: Sequence[Reward] | None, device: torch.device) -> list[Reward]:
    """The reward functions, the task's first, each with its weight; the named ones imported (or a reward model
    loaded, to score on `device`) unless given."""
    weights = config.weights()
    named = list(given) if given is not None else [named_reward(name, device=device) for name in config.rewards]
    if [r.name for r in named] != list(config.rewards):
        raise ConfigError(f"rewards: {[r.name for r in named]} are not the rewards the config names, "
                          f"{list(config.rewards)}")
    out = [task_reward(tasks.task(config.task))] if config.task is not None else []
    return [dataclasses.replace(r, weight=w) for r, w in zip([*out, *named], weights)]


def _check_rewards(folder: RunFolder, config: GRPOConfig) -> None:
    """A resumed GRPO run is given the rewards it was trained with, by the same names (they are never taken
    from the folder: a run folder names no code tinygpt imports on its own), and its task and prompts. A
    folder that is no GRPO run is left to tune()'s checks, which say what continues it."""
    record = folder.settings("grpo", ConfigError)
    if record is None or not folder.has_weights():
        return
    saved = list(record.get("rewards") or [])
    if saved != list(config.rewards):
        given = " ".join(f"--reward {r}" for r in saved) or "no --reward"
        raise ConfigError(f"{folder.path} was trained with {given}: resume it with the same rewards, named again")
    for key in ("task", "prompts", "num_generations", "loss_type", "num_iterations"):
        if record.get(key) != getattr(config, key):
            raise ConfigError(f"{folder.path} was trained with {key} {record.get(key)!r}, not "
                              f"{getattr(config, key)!r}: drop the setting to resume it")


def _plan(config: GRPOConfig, rewards: list[Reward], base: Base) -> Plan:
    """The prompts (trained on and held out, encoded), the stops and a completion's length."""
    task = tasks.task(config.task) if config.task is not None else None
    rows = read_prompts(config.prompts) if config.prompts is not None else task.rows("train", TASK_PROMPTS)
    if config.eval_prompts is not None:
        held = read_prompts(config.eval_prompts)
    elif task is not None:
        held = task.rows("held-out", config.eval_size)
    else:  # every tenth row held out, the rest trained on
        if len(rows) < 2:
            raise ConfigError(f"{config.prompts}: one prompt cannot be both trained on and held out: give more, "
                              "or --eval-prompts FILE")
        rows, held = [r for i, r in enumerate(rows) if i % 10 != 9], [r for i, r in enumerate(rows) if i % 10 == 9]
    held = held[: config.eval_size]
    tokenizer = base.tokenizer
    train_prompts, held_out = _encoded(rows, tokenizer, "--prompts"), _encoded(held, tokenizer, "held-out prompts")
    hidden = set(stop_ids(tokenizer))
    end = tokenizer.encode(task.end) if task is not None else []
    stops = sorted(hidden | set(end[:1] if len(end) == 1 else []))
    length = config.max_completion_length or (
        len(tokenizer.encode(str(2 * task.largest) + task.end)) if task is not None else DEFAULT_COMPLETION)
    check_room(base.model, [*train_prompts.ids, *held_out.ids], length)
    return Plan(config, train_prompts, held_out, rewards, tokenizer, stops, hidden, length, task, base.reference())


def _encoded(rows: list[dict[str, Any]], tokenizer: Any, what: str) -> Prompts:
    """Rows and their prompts' ids: a string encoded, a conversation rendered with the chat template."""
    ids = [render_chat_prompt(tokenizer, row["prompt"]) if isinstance(row["prompt"], list)
           else encode_named(tokenizer, row["prompt"], what) for row in rows]
    return Prompts(rows, ids)
