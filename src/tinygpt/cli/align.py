"""`tinygpt grpo` (a pretrained model trained against rewards: group relative policy optimisation), the
course's last stage beside learning from preferences."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from .common import FRACTION, NATURAL, POSITIVE, RATE, Number
from .finetune import add_method_flags, run_tuning, tuning_configs
from .train import add_training_flags

# the defaults the training flags' help shows for grpo (tinygpt.config.grpo.DEFAULT_TRAIN, FINETUNE_LR)
GRPO_DEFAULTS = dict(batch_size="64: completions, 8 prompts x --num-generations 8", lr="3e-5 full, 2e-4 lora",
                     warmup="0", max_iters="200 unless --max-time is given", weight_decay="0", eval_interval="25",
                     eval_iters="4: the held-out prompts in as many parts", schedule="constant",
                     optimizer="adamw; muon goes with --method full")
# GRPOConfig's fields the flags set (dest: field); --reward is rewards, appended
GRPO_FLAGS = ("task", "prompts", "eval_prompts", "num_generations", "max_completion_length", "temperature", "top_k",
              "top_p", "beta", "epsilon", "epsilon_high", "num_iterations", "loss_type", "scale_rewards",
              "mask_truncated_completions", "eval_size", "pass_k")


def _grpo_config(args: argparse.Namespace, saved: dict | None):
    """The GRPOConfig of the flags, over a resumed run's recorded settings but for its rewards: those are
    named again on the command line (a run folder names no code tinygpt imports on its own)."""
    from ..config.fields import from_mapping
    from ..config.grpo import GRPOConfig

    values = {k: v for k, v in (saved or {}).items() if k not in ("rewards", "reward_weights")}
    for name in GRPO_FLAGS:
        value = getattr(args, name)
        if value is not None and value is not False:
            values[name] = value
    values["rewards"] = list(args.reward or [])
    if args.reward_weights is not None:
        values["reward_weights"] = args.reward_weights
    elif saved and saved.get("reward_weights") is not None and list(saved.get("rewards") or []) == values["rewards"]:
        values["reward_weights"] = saved["reward_weights"]
    return from_mapping(GRPOConfig, values)


def cmd_grpo(args: argparse.Namespace) -> int:
    """Train a model against rewards with GRPO (group relative policy optimisation), on the same training loop
    as `train` and `finetune`.

    For each prompt a group of --num-generations completions is sampled from the model itself (on tinygpt's
    own decoding, every completion of a step in one batch), each is scored, and the model learns to make the
    completions that scored above their group's mean likelier and those below it less likely: no value
    model, no labels, only a checker. The prompts are a built-in task's (--task addition writes its own and
    keeps a held-out set) or a JSONL file in TRL's prompt-only format (--prompts FILE: a "prompt" string or
    a list of messages, and any other columns, which reach the reward functions by name). The rewards are
    the task's checker, any Python function named by --reward module:function with TRL's signature
    (prompts, completions, **columns -> one float or None per completion), and any reward model named by
    --reward RUN (`tinygpt reward train`'s run, or a Hugging Face *ForSequenceClassification folder: its score
    of each prompt and completion), summed with --reward-weights. A --reward runs only because the command line
    names it: the run records its name, and a resume is given the same --reward again. FROM is a language
    model: a reward model there is refused. --loss-type (grpo, dr_grpo, dapo), --scale-rewards, --beta (a KL
    term to FROM, 0 by default as TRL), --epsilon and --num-iterations are TRL's GRPOConfig settings, named as
    there. --batch-size counts completions (TRL's per_device_train_batch_size).

    Each evaluation answers the held-out prompts greedily (their mean reward; with a task, the accuracy) and
    samples --pass-k answers each (pass@1, pass@k). At the end it prints, and keeps in RUN/finetune_report.json,
    what changed (`tinygpt report RUN`); `tinygpt plot RUN --out FILE` draws the reward, KL and accuracy.
    """
    from ..align.grpo_run import grpo
    from ..config.grpo import DEFAULT_TRAIN
    from ..run_folder import RunFolder

    def configs(resume: bool):
        saved = RunFolder(args.out).settings("grpo", ConfigError) if resume else None
        return (_grpo_config(args, saved), *tuning_configs(args, resume, DEFAULT_TRAIN))

    return run_tuning(args, configs, lambda cfg, ft, train_cfg, **run: grpo(args.base, args.out, cfg, ft, train_cfg,
                                                                            merge=args.merge, **run),
                      "a lower --lr usually cures it")


def add_grpo(sub: argparse._SubParsersAction) -> None:
    """`tinygpt grpo` and its flags."""
    from ..align.tasks import TASKS
    from ..config.grpo import LOSS_TYPES, SCALE_REWARDS

    p = sub.add_parser("grpo", help="train a model against rewards: GRPO on a task a program checks or your reward "
                       "functions", description=cmd_grpo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: a model that writes sums, taught by a checker alone (make align-demo)\n"
                              "  tinygpt grpo runs/sft --task addition --out runs/grpo --lr 3e-4\n"
                              "  tinygpt grpo runs/sft --prompts prompts.jsonl --reward myrewards:correct "
                              "--out runs/grpo")
    p.add_argument("base", metavar="FROM", help="a run folder or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3)")
    p.add_argument("--out", required=True, help="the run folder to create (or continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint (name its "
                   "--reward again)")
    p.add_argument("--merge", metavar="MERGED", help="with lora: also write the adapters folded in, as a plain run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    d = p.add_argument_group("prompts and rewards")
    d.add_argument("--task", choices=sorted(TASKS), help="a built-in task a program checks: its prompts, its "
                   "held-out set and its reward")
    d.add_argument("--prompts", metavar="FILE", help="TRL's prompt-only JSONL: \"prompt\" and any other columns")
    d.add_argument("--eval-prompts", metavar="FILE", help="held-out prompts (default: the task's, else every tenth "
                   "row of --prompts)")
    d.add_argument("--reward", action="append", metavar="MODULE:FUNCTION|RUN",
                   help="a reward function with TRL's signature, imported from MODULE (the current directory "
                        "first), or a reward model's folder (its score of each prompt and completion); repeatable")
    d.add_argument("--reward-weights", type=Number("float", 0, items=True), metavar="LIST",
                   help="each reward's weight, the task's first (1 each)")
    r = p.add_argument_group("rollouts and the loss (TRL's GRPOConfig)")
    r.add_argument("--num-generations", type=POSITIVE, help="completions sampled for each prompt, at least 2 (8)")
    r.add_argument("--max-completion-length", type=POSITIVE, help="a completion's most tokens (a task's longest "
                   "answer; else 64)")
    r.add_argument("--temperature", type=RATE, help="the rollouts' sampling temperature (1)")
    r.add_argument("--top-k", type=POSITIVE, help="sample among the k likeliest tokens (all)")
    r.add_argument("--top-p", type=Number("float", 0, 1, low_open=True), help="nucleus sampling (1)")
    r.add_argument("--loss-type", choices=LOSS_TYPES, help="how tokens' losses are reduced (dapo)")
    r.add_argument("--scale-rewards", choices=SCALE_REWARDS, help="advantages divided by the std of the group "
                   "(default), the batch, or not at all")
    r.add_argument("--beta", type=Number("float", 0), help="the KL term's weight to FROM (0: no reference kept)")
    r.add_argument("--epsilon", type=FRACTION, help="the probability ratio's clipping range (0.2)")
    r.add_argument("--epsilon-high", type=Number("float", 0), help="its upper side (--epsilon)")
    r.add_argument("--num-iterations", type=POSITIVE, help="optimizer steps on each step's rollouts (1)")
    r.add_argument("--mask-truncated-completions", action="store_true",
                   help="completions cut at --max-completion-length do not count in the loss")
    e = p.add_argument_group("evaluation and the report")
    e.add_argument("--eval-size", type=POSITIVE, help="held-out prompts each evaluation answers (200)")
    e.add_argument("--pass-k", type=NATURAL, help="samples of each held-out prompt for pass@k, 0: none (8)")
    e.add_argument("--reference", metavar="FILE", help="a text whose loss change measures forgetting (default: a "
                   "tinygpt FROM's own validation data)")
    add_method_flags(p)
    add_training_flags(p.add_argument_group("training"), GRPO_DEFAULTS)
    p.set_defaults(func=cmd_grpo, hub_args=("base",))
