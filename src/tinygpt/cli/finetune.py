"""`tinygpt finetune` (a pretrained model trained further on your text: full, LoRA or frozen layers) and
`tinygpt report` (what a fine-tuning changed, from the run's finetune_report.json)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from ..calc.units import plural
from ..errors import ConfigError
from .common import (EXIT_NONFINITE, EXIT_SIGNAL, FRACTION, NATURAL, POSITIVE, RATE, json_line, kept_checkpoint,
                     time_trained)
from .train import add_training_flags, train_settings

# the defaults the training flags' help shows for finetune (tinygpt.finetune.DEFAULT_TRAIN and FINETUNE_LR)
FINETUNE_DEFAULTS = dict(batch_size="12", lr="3e-5 full, 2e-4 lora: far below pretraining's 1e-3", warmup="10",
                         max_iters="200 unless --max-time is given", weight_decay="0", eval_interval="50",
                         eval_iters="10", schedule="constant, nanoGPT's fine-tuning recipe",
                         optimizer="adamw; muon goes with --method full")
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
FREEZE_FLAGS = ("freeze_embeddings", "freeze_layers")


def finetune_config(args: argparse.Namespace, saved: dict | None):
    """The FinetuneConfig of the flags (finetune's, or the ones add_method_flags gives another command), over
    a resumed run's recorded one.

    Args:
        args: the parsed command line.
        saved: the run's recorded settings (RunFolder.finetune_settings), on resume.
    """
    from ..config.fields import from_mapping
    from ..config.finetune import FinetuneConfig

    values = {k: v for k, v in (saved or {}).items() if k not in ("from", "base_checksum")}  # the base, not settings
    for name in ("method", *LORA_FLAGS, *FREEZE_FLAGS, "keep", "block_size", "dropout", "grad_checkpoint",
                 "reference"):
        value = getattr(args, name, None)
        if value is not None and value is not False:
            values[name] = value
    if isinstance(values.get("lora_targets"), str):
        values["lora_targets"] = values["lora_targets"].split(",")
    if getattr(args, "prompt", None):
        values["prompts"] = args.prompt
    method = values.get("method", "full")
    given = [n for n in (LORA_FLAGS if method == "full" else FREEZE_FLAGS) if getattr(args, n) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag} goes with --method {'lora' if method == 'full' else 'full'}, not {method}")
    return from_mapping(FinetuneConfig, values)


def tuning_configs(args: argparse.Namespace, resume: bool, defaults: dict[str, Any]):
    """(FinetuneConfig, TrainConfig) of the flags of a command training FROM: a new run's over `defaults` (the
    command's recipe), a resumed run's over the settings it recorded.

    Args:
        args: the parsed command line.
        resume: whether the run in --out resumes.
        defaults: the TrainConfig's fields the command sets when its flags do not.
    """
    from ..config.fields import from_mapping
    from ..config.train import TrainConfig
    from ..run_folder import RunFolder

    _, train_over, _ = train_settings(args)
    if not resume:
        if "max_time" in train_over:  # a time budget is the run's length: the recipe's step count is for none
            defaults = {k: v for k, v in defaults.items() if k != "max_iters"}
        return finetune_config(args, None), from_mapping(TrainConfig, {**defaults, **train_over})
    folder = RunFolder(args.out)
    saved_train, _ = folder.train_config()
    ft = finetune_config(args, folder.finetune_settings(ConfigError))
    return ft, from_mapping(TrainConfig, {**saved_train.to_dict(), **train_over})


def run_tuning(args: argparse.Namespace, configs: Callable[[bool], tuple], tune: Callable[..., Any], cure: str) -> int:
    """What a command training FROM does around its library function (finetune's, or another objective's):
    --resume of a folder with no checkpoint yet starts a new run there, said once; under torchrun one process
    group, where only rank 0 prints; a non-finite loss ends it in one line; the run's summary and its report.

    Args:
        args: the parsed command line (its out, resume and quiet).
        configs: the settings of the flags, given whether the run resumes; the TrainConfig last.
        tune: the library function, called with those settings, resume and progress (a FinetuneResult back).
        cure: what usually cures a non-finite loss, for its message.
    """
    from ..device import resolve_device
    from ..distributed import process_group
    from ..errors import NonFiniteError
    from ..run_folder import RunFolder

    resume = args.resume and RunFolder(args.out).has_weights()
    if args.resume and not resume and os.environ.get("RANK", "0") == "0":
        print(f"no checkpoint in {args.out} yet: starting a new run there", file=sys.stderr)
    settings = configs(resume)
    train_cfg = settings[-1]
    # under torchrun, as for train: one group until rank 0 has printed, and only rank 0 prints
    with process_group(resolve_device(train_cfg.device), train_cfg.dist_timeout) as ctx:
        try:
            result = tune(*settings, resume=resume, progress=not args.quiet)
        except NonFiniteError as e:
            if ctx.is_main:
                print(f"tinygpt: error: {e}; {kept_checkpoint(args.out)} ({cure})", file=sys.stderr)
            return EXIT_NONFINITE
        t = result.train
        if ctx.is_main:
            procs = f" on {ctx.world_size} processes" if ctx.enabled else ""
            print(f"{t.stopped}: {plural(t.step, 'step')}{procs}, {t.tokens:,} tokens in {time_trained(t)}; "
                  f"saved to {t.run}")
            print("\n".join(format_report(result.report)))
            if result.merged is not None:
                print(f"merged: the adapters folded into a plain run in {result.merged}, in "
                      f"{result.report['dtype']['base']} as FROM")
        ctx.barrier()
    return EXIT_SIGNAL.get(t.stopped, 0)


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a pretrained model on your text, on the same training loop as `train`.

    FROM is a tinygpt run folder or a Hugging Face folder of GPT-2, Llama, Qwen2 or Qwen3 (GPT-2
    124M, SmolLM2, Qwen2.5, Qwen3, TinyLlama or Llama 3.2 as Hugging Face's own tools download them). DATA must be prepared with FROM's tokenizer:
    `tinygpt prepare TEXT --tokenizer-file FROM --out DATA`, or for supervised fine-tuning on
    conversations `tinygpt prepare FILE.jsonl --format chat --tokenizer-file FROM --out DATA`: the
    chat template's special tokens then get new embedding rows (each the mean of the old ones),
    only the assistant's tokens are learned, and RUN's tokenizer carries the template (`tinygpt
    chat RUN`); that needs --method full without --freeze-embeddings. --method full (default) trains every
    weight (less --freeze-embeddings and the first --freeze-layers N blocks); --method lora trains
    low-rank adapters alone and RUN stores only them, naming FROM (`tinygpt merge` folds them in).
    The learning rate defaults far below pretraining's (3e-5 full, 2e-4 LoRA), held constant after
    a short warmup. Training is in float32 whatever FROM stores (a bfloat16 FROM's updates would
    round away), and RUN is saved in FROM's dtype (LoRA's adapters in float32); --dtype is the
    compute's. --block-size bounds the training window only: RUN keeps FROM's context. At the end
    it prints, and keeps in RUN/finetune_report.json, what changed: the validation loss and bits
    before and after, the same prompts sampled before and after, the loss
    on a reference text (forgetting), parameters, peak memory and time (`tinygpt report RUN`).
    """
    from ..finetune import DEFAULT_TRAIN, finetune

    return run_tuning(args, lambda resume: tuning_configs(args, resume, DEFAULT_TRAIN),
                      lambda ft, train_cfg, **run: finetune(args.base, args.data, args.out, ft, train_cfg,
                                                            merge=args.merge, **run),
                      "a lower --lr, or --dtype float32, usually cures a NaN at the first steps")


def format_report(report: dict) -> list[str]:
    """A report of a run trained from FROM (tinygpt.report) as the lines its command and `report` print.

    Args:
        report: what read_report (or the command's library function) returned.
    """
    from ..calc import format_bytes

    before, after = report["before"], report["after"]
    lines = [f"{report.get('title', 'fine-tuned')} from {report['from']} ({report['method']}, keep {report['keep']}): "
             f"{plural(report['steps'], 'step')}, {report['tokens']:,} tokens",
             *_kept(report), f"{'':<32}{'before':>9}{'after':>9}{'change':>9}"]
    labels = {"data": "validation", "reference": "reference (forgetting)"}
    for name, b in before.items():
        a = after[name]
        if name == "samples":
            continue
        if "loss" not in b:  # an objective's own numbers (GRPO's held-out accuracy, ...)
            lines.extend(f"  {name.replace('_', '-') + ' ' + k.replace('_', ' '):<30}{b[k]:>9.4f}{a[k]:>9.4f}"
                         f"{a[k] - b[k]:>+9.4f}" for k in b)
            continue
        unit = next(k for k in b if k.startswith("bits_per_"))
        label = labels.get(name, name)
        lines.append(f"  {label + ' loss':<30}{b['loss']:>9.4f}{a['loss']:>9.4f}{a['loss'] - b['loss']:>+9.4f}")
        lines.append(f"  {'  ' + unit.replace('_', ' '):<30}{b[unit]:>9.4f}{a[unit]:>9.4f}{a[unit] - b[unit]:>+9.4f}")
        lines.append(f"    on {b['text']}")
    if "reference" not in before and report.get("objective") != "reward":  # a score has no loss to measure
        lines.append("  reference: none (--reference FILE measures forgetting; a tinygpt base uses its own val data)")
    p = report["params"]
    share = 100 * p["trainable"] / p["total"] if p["total"] else 0.0
    lines.append(f"  {'trainable parameters':<30}{p['trainable']:,} of {p['total']:,} ({share:.2f}%)")
    dtype = report.get("dtype")  # (absent from a report written before it was kept)
    if dtype is not None:
        kept = (f"the adapters saved in float32 over FROM's {dtype['base']}" if report["method"] == "lora"
                else f"saved in {dtype['saved']}, FROM's dtype")
        lines.append(f"  {'weights':<30}trained in float32, {kept}")
    lines.append(f"  {'peak memory':<30}{format_bytes(report['memory']['peak_rss_bytes'])} (this process's RSS)")
    lines.append(f"  {'time':<30}{report['seconds']:.1f}s ({report['train_seconds']:.1f}s training)")
    for b, a in zip(before["samples"], after["samples"]):
        lines.append(f"  sample of {b['prompt']!r} ({report.get('sampled', 'same seed')}):")
        lines.append(f"    before: {b['text']!r}")
        lines.append(f"    after:  {a['text']!r}")
    return lines


def _kept(report: dict) -> list[str]:
    """What keep best kept, in words (none for keep last, or a report from before kept_step was recorded)."""
    kept = report.get("kept_step")
    if report["keep"] != "best" or kept is None:
        return []
    if kept > 0:
        return [f"  kept step {kept}: the lowest validation loss, below FROM's own at step 0"]
    what = "its adapters at zero, FROM itself" if report["method"] == "lora" else "FROM's weights"
    return [f"  kept step 0, {what}: no step's validation loss went below FROM's, so after is before"]


def cmd_report(args: argparse.Namespace) -> int:
    """Show what a fine-tuning changed: the report `tinygpt finetune` (or another command that trains a
    pretrained model) kept in RUN/finetune_report.json."""
    from ..report import read_report

    report = read_report(args.run)
    print(json_line(report, indent=1) if args.json else "\n".join(format_report(report)))
    return 0


def add_finetune(sub: argparse._SubParsersAction) -> None:
    """`tinygpt finetune` and its flags."""
    p = sub.add_parser("finetune", help="fine-tune a run or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3) on your text (full, LoRA, frozen)",
                       description=cmd_finetune.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: GPT-2 as Hugging Face's own tools download it (docs/tutorials/finetune.md), then\n"
                              "LoRA on your notes\n"
                              "  hf download openai-community/gpt2 config.json model.safetensors vocab.json merges.txt "
                              "--local-dir hf/gpt2\n"
                              "  tinygpt prepare notes.txt --tokenizer-file hf/gpt2 --out data/notes\n"
                              "  tinygpt finetune hf/gpt2 --data data/notes --out runs/notes --method lora")
    p.add_argument("base", metavar="FROM", help="a run folder or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3)")
    p.add_argument("--data", required=True, help="a folder prepared with FROM's tokenizer (prepare --tokenizer-file FROM; "
                   "chat data: prepare FILE.jsonl --format chat --tokenizer-file FROM)")
    p.add_argument("--out", required=True, help="the run folder to create (or continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--merge", metavar="MERGED", help="with lora: also write the adapters folded in, as a plain run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_method_flags(p, window=True)
    r = p.add_argument_group("the report")
    r.add_argument("--reference", metavar="FILE", help="a text whose loss change measures forgetting (default: a "
                   "tinygpt FROM's own validation data)")
    r.add_argument("--prompt", action="append", help="a prompt sampled before and after (repeatable; default: the "
                   "start of the validation text)")
    add_training_flags(p.add_argument_group("training"), FINETUNE_DEFAULTS)
    p.set_defaults(func=cmd_finetune, hub_args=("base",))


def add_method_flags(p: argparse.ArgumentParser, *, window: bool = False) -> argparse._ArgumentGroup:
    """The flags of what trains that every command training FROM takes (finetune, grpo): the method, LoRA's
    adapters, frozen parts, the checkpoint kept, dropout, and with `window` the training window (--block-size);
    their group, for a command's own beside them."""
    m = p.add_argument_group("what trains")
    m.add_argument("--method", choices=("full", "lora"), help="full (default): every weight; lora: adapters only")
    m.add_argument("--lora-rank", type=POSITIVE, help="adapters' rank (8)")
    m.add_argument("--lora-alpha", type=RATE, help="adapters' output scaled by alpha/rank (8)")
    m.add_argument("--lora-targets", metavar="LIST",
                   help="GPT-2: c_attn, attn.c_proj, c_fc, mlp.c_proj; llama layout: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or the groups attn, mlp (PEFT's default: c_attn; q_proj,v_proj)")
    m.add_argument("--lora-dropout", type=FRACTION, help="dropout on the adapters' input (0)")
    m.add_argument("--freeze-embeddings", action="store_true", help="with full: wte and wpe do not train")
    m.add_argument("--freeze-layers", type=NATURAL, metavar="N", help="with full: the first N blocks do not train")
    m.add_argument("--keep", choices=("last", "best"), help="the checkpoint to keep: last (default) or the lowest "
                   "validation loss")
    if window:
        m.add_argument("--block-size", type=POSITIVE, help="the training window, at most FROM's context (default: "
                       "all of it); the run keeps FROM's whole context")
    m.add_argument("--dropout", type=FRACTION, help="dropout while fine-tuning (FROM's)")
    m.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each block's activations in backward: less memory, ~1/3 more compute")
    return m


def add_report(sub: argparse._SubParsersAction) -> None:
    """`tinygpt report` and its flags."""
    p = sub.add_parser("report", help="what a fine-tuning changed (RUN/finetune_report.json)",
                       description=cmd_report.__doc__)
    p.add_argument("run", metavar="RUN", help="a run written by `tinygpt finetune`")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=cmd_report)
