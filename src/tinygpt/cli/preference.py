"""Learning from preference pairs: `tinygpt dpo` (direct preference optimisation of FROM), `reward train` (a
reward model from FROM), `reward score` (a reward model's score of a prompt and completion), and what
`eval` reports on preference pairs (pair accuracy)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError, DataError
from .common import POSITIVE, RATE, Number, json_line


def eval_pairs(args: argparse.Namespace, model, dataset) -> int:
    """`eval` on preference pairs: the share of validation pairs whose chosen side the model prefers (a
    language model: the likelier completion, by its summed log-probs; a reward model: the higher score),
    each side's mean and their margin, the pairs fitted to the model's context as training fits them."""
    from ..align.preferences import measure_pairs
    from ..data.batches import Pairs

    if dataset is None or not dataset.is_preference:
        raise ConfigError(f"{args.run} is a reward model: it scores preference pairs and has no next-token loss; give "
                          "--data DIR, pairs prepared with `tinygpt prepare FILE.jsonl --format preference`")
    pairs = Pairs.of(dataset, "val", model.config.block_size)
    if not len(pairs):
        raise DataError(f"the val split of {dataset.path} has no pair that fits {model.config.block_size} tokens "
                        f"({pairs.dropped} dropped); prepare it with a --val-fraction above 0")
    report = measure_pairs(model, pairs, args.batch_size, next(model.parameters()).device)
    dropped = f" ({pairs.dropped:,} longer than the model's context left out)" if pairs.dropped else ""
    print(f"the val split of {dataset.path}: {report['pairs']:,} pairs{dropped}")
    what = "scores" if report["values"] == "scores" else "log-probs of the completions"
    loss = f"  loss {report['loss']:.4f}" if "loss" in report else ""
    print(f"pair accuracy {report['accuracy']:.4f}  chosen {report['chosen']:.4f}  rejected {report['rejected']:.4f}  "
          f"margin {report['margin']:.4f} ({what}){loss}")
    if args.json:
        print(json_line(report))
    return 0


DPO_FLAGS = ("loss", "beta", "label_smoothing", "sft_weight", "ref_model", "precompute_ref")
CURE = "a lower --lr usually cures a NaN at the first steps"


def _objective_config(args: argparse.Namespace, resume: bool, cls, name: str, flags: tuple[str, ...]):
    """The objective's config (DPOConfig, RewardConfig) of the flags given, over a resumed run's recorded one."""
    from ..config.fields import from_mapping
    from ..run_folder import RunFolder

    values = dict((RunFolder(args.out).settings(name, ConfigError) or {}) if resume else {})
    given = {k: getattr(args, k) for k in flags}
    values.update({k: v for k, v in given.items() if v is not None and v is not False})  # 0 is a value; False: unset
    return from_mapping(cls, values)


def cmd_dpo(args: argparse.Namespace) -> int:
    """Direct preference optimisation (DPO) of a pretrained model on preference pairs, on the same training
    loop as `train` and `finetune`.

    DATA holds pairs in TRL's formats prepared with FROM's tokenizer: `tinygpt prepare FILE.jsonl --format
    preference --tokenizer-file FROM --out DATA`. Each step raises the policy's log-prob of the chosen
    completions against the rejected ones, relative to a reference: FROM frozen (for --method lora, FROM with
    the adapters off: no second copy in memory), --ref-model RUN, or with --precompute-ref the reference's
    log-probs of every pair computed once before training. --loss is TRL's loss_type (sigmoid, ipo, hinge,
    robust with --label-smoothing); --sft-weight adds the chosen completions' negative log-likelihood, which
    keeps them likely (0 is pure DPO, whose chosen log-probs may fall with the rejected ones: it warns in one
    line when the validation pairs show that). A pair is cut to --max-length tokens from the start of its
    prompt; one whose completion leaves no room for a prompt token is dropped. It logs TRL's metrics
    (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) a step
    and for the validation pairs at step 0 and every evaluation (`tinygpt plot RUN --out FILE` draws them), and
    reports, before and after, the preference accuracy on the validation pairs, greedy answers to the same
    prompts and the loss on a reference text (`tinygpt report RUN`).
    """
    from ..align.dpo import CollapseWatch
    from ..align.preference_run import dpo
    from ..config.preference import DPOConfig
    from ..finetune import DEFAULT_TRAIN
    from .finetune import run_tuning, tuning_configs

    watch = CollapseWatch(lambda message: print(f"tinygpt: warning: {message}", file=sys.stderr))

    def configs(resume: bool):
        ft, train_cfg = tuning_configs(args, resume, DEFAULT_TRAIN)
        return ft, _objective_config(args, resume, DPOConfig, "dpo", DPO_FLAGS), train_cfg

    return run_tuning(args, configs, lambda ft, config, train_cfg, **run: dpo(
        args.base, args.data, args.out, config, ft, train_cfg, merge=args.merge, callbacks=[watch], **run), CURE)


def cmd_reward_train(args: argparse.Namespace) -> int:
    """Train a reward model: FROM with its language-model head replaced by a score, trained in full on
    preference pairs with the Bradley-Terry loss (TRL's RewardTrainer's: -log sigmoid(r_chosen - r_rejected -
    margin), the data's margins in it; --center adds TRL's centering). A text's score is the model's output at
    its last token. It reports the validation pairs' accuracy (the share whose chosen side scores higher)
    before and after; `tinygpt reward score RUN` scores a completion, `tinygpt eval RUN` a data folder's pairs,
    and `tinygpt export RUN --format hf` writes the Hugging Face sequence classifier transformers loads.
    """
    from ..align.preference_run import train_reward
    from ..config.preference import RewardConfig
    from ..finetune import DEFAULT_TRAIN
    from .finetune import run_tuning, tuning_configs

    def configs(resume: bool):
        ft, train_cfg = tuning_configs(args, resume, DEFAULT_TRAIN)
        return ft, _objective_config(args, resume, RewardConfig, "reward", ("center",)), train_cfg

    return run_tuning(args, configs, lambda ft, config, train_cfg, **run: train_reward(
        args.base, args.data, args.out, config, ft, train_cfg, **run), CURE)


def cmd_reward_score(args: argparse.Namespace) -> int:
    """A reward model's score of a completion to a prompt: its output at the last token of the prompt followed
    by the completion (as training scored a standard pair's side, without the end of text)."""
    from ..align.preference_run import reward_score

    score = reward_score(args.run, args.prompt, args.completion, args.device)
    print(json_line({"score": score}) if args.json else f"{score:.6f}")
    return 0


def _add_common(p: argparse.ArgumentParser, window_help: str):
    """What dpo and reward train share: FROM, the data, the run folder, resume, what trains, the window."""
    from .finetune import add_method_flags

    p.add_argument("base", metavar="FROM", help="a run folder or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3)")
    p.add_argument("--data", required=True, help="preference pairs prepared with FROM's tokenizer (prepare FILE.jsonl "
                   "--format preference --tokenizer-file FROM)")
    p.add_argument("--out", required=True, help="the run folder to create (or continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    m = add_method_flags(p)
    m.add_argument("--max-length", dest="block_size", type=POSITIVE, metavar="N", help=window_help)
    return m


def add_dpo(sub: argparse._SubParsersAction) -> None:
    """`tinygpt dpo` and its flags."""
    from ..config.preference import DPO_LOSSES
    from .finetune import FINETUNE_DEFAULTS
    from .train import add_training_flags

    p = sub.add_parser("dpo", help="direct preference optimisation of a run or a Hugging Face folder on preference "
                       "pairs (full, LoRA)", description=cmd_dpo.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(p, "a pair's most tokens, prompt and completion: longer ones lose their prompt's start (FROM's "
                "context)")
    p.add_argument("--merge", metavar="MERGED", help="with lora: also write the adapters folded in, as a plain run")
    d = p.add_argument_group("DPO (TRL's names)")
    d.add_argument("--loss", choices=DPO_LOSSES, help="TRL's loss_type (sigmoid)")
    d.add_argument("--beta", type=RATE, help="how strongly the policy is held to the reference (0.1)")
    d.add_argument("--label-smoothing", type=Number("float", 0, 0.5), help="with --loss robust: the share of pairs "
                   "taken to be flipped, below 0.5 (0)")
    d.add_argument("--sft-weight", type=Number("float", 0), help="the weight of the chosen completions' NLL added "
                   "to the loss; 0 is pure DPO (1)")
    d.add_argument("--ref-model", metavar="RUN", help="the reference: another run or Hugging Face folder (FROM "
                   "frozen; with lora, FROM with the adapters off)")
    d.add_argument("--precompute-ref", "--precompute-ref-log-probs", dest="precompute_ref", action="store_true",
                   help="compute the reference's log-probs of every pair once, and keep no reference model")
    r = p.add_argument_group("the report")
    r.add_argument("--reference", metavar="FILE", help="a text whose loss change measures what the alignment cost "
                   "elsewhere (default: a tinygpt FROM's own validation data)")
    r.add_argument("--prompt", action="append", help="a prompt answered before and after (repeatable; default: the "
                   "first validation pairs' prompts)")
    add_training_flags(p.add_argument_group("training"), {**FINETUNE_DEFAULTS, "batch_size": "12 pairs"})
    p.set_defaults(func=cmd_dpo, hub_args=("base",))


def add_reward(sub: argparse._SubParsersAction) -> None:
    """`tinygpt reward train` and `reward score`, and their flags."""
    from .common import add_device_flag
    from .finetune import FINETUNE_DEFAULTS
    from .train import add_training_flags

    p = sub.add_parser("reward", help="train a reward model on preference pairs, or score a text with one",
                       description="Train a reward model (reward train FROM) or score a text with one (reward score "
                       "RUN).")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = what.add_parser("train", help="a reward model from a run or a Hugging Face folder, on preference pairs",
                        description=cmd_reward_train.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(t, "a pair's most tokens, prompt and completion: longer ones lose their prompt's start (FROM's "
                "context)")
    t.add_argument("--center", type=Number("float", 0), help="TRL's center_rewards_coefficient: the weight of the "
                   "squared sum of a pair's scores (none)")
    add_training_flags(t.add_argument_group("training"), {**FINETUNE_DEFAULTS, "batch_size": "12 pairs"})
    t.set_defaults(func=cmd_reward_train, hub_args=("base",))
    s = what.add_parser("score", help="a reward model's score of a completion to a prompt",
                        description=cmd_reward_score.__doc__)
    s.add_argument("run", metavar="RUN", help="a reward model: a run of `reward train`, or a Hugging Face "
                   "*ForSequenceClassification folder")
    s.add_argument("--prompt", required=True, help="the prompt")
    s.add_argument("--completion", required=True, help="the completion scored")
    s.add_argument("--json", action="store_true", help="print one JSON line")
    add_device_flag(s)
    s.set_defaults(func=cmd_reward_score, hub_args=("run",))
