"""The `tinygpt` command: parses flags into configs and calls the library. Only this layer prints
messages for the user and chooses exit codes."""

from __future__ import annotations

import argparse
import math
import sys

from .errors import ConfigError, TinyGPTError

EXIT_ERROR = 2


def _fmt(values, digits: int = 4) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def cmd_lesson(args: argparse.Namespace) -> int:
    """Walk through the lesson's worked examples with tinygpt's own objects."""
    from . import lesson

    def section(title: str, why: str) -> None:
        print(f"\n== {title}\n   {why}\n")

    section("1. The causal mask (T=5)", "Row t marks the positions token t may attend to: itself and the past.")
    print(lesson.causal_mask(5))

    section(
        "2. Causal attention for token 0 (seed 7, d_k=4, T=4)",
        "Scores Q K^T / sqrt(d_k); future positions get -inf, so after the softmax token 0 sees only itself.",
    )
    trace = lesson.attention_trace()
    print("scores[0]:", _fmt(trace.scores[0]))
    print("attn[0]:  ", _fmt(trace.weights[0]))
    print("out[0]:   ", _fmt(trace.out[0]), " (= V[0], the only value token 0 can read)")

    section(
        "3. TinyGPT (vocab 50, d 64, 4 heads, 2 layers, context 8), seed 42",
        "Token + position embeddings, 2 pre-norm blocks (attention, 4x GELU MLP), final LayerNorm, untied head.",
    )
    model = lesson.lesson_model()
    import torch

    print(f"parameters: {model.num_params():,}")
    print("logits shape for a (2, 8) batch:", tuple(model(torch.randint(0, 50, (2, 8))).shape))

    section(
        "4. CLM training: 20 Adam steps (lr 1e-3) on 8 random sequences of 8 tokens",
        f"Input x[:, :-1], target x[:, 1:]. Random tokens start near ln(50) = {math.log(50):.4f}.",
    )
    for step, loss in enumerate(lesson.clm_training(), start=1):
        mark = "  <- printed by the lesson" if step in (1, 5, 10, 20) else ""
        print(f"step {step:>2}: loss={loss:.4f}{mark}")

    section(
        "5. Greedy generation from [5, 12, 3], 5 new tokens",
        "Each step: run the model on the last 8 tokens, take the argmax of the last position's logits, append.",
    )
    steps = lesson.greedy_steps()
    for i, step in enumerate(steps, start=1):
        print(f"step {i}: context {step.context} -> next {step.token}")
    print("generated:", steps[0].context + [s.token for s in steps])
    return 0


def _int_flag(value: str | None, flag: str) -> int | None:
    """An integer flag parsed here rather than by argparse, so a bad value is a one-line error."""
    if value is None:
        return None
    try:
        return int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise ConfigError(f"{flag}: expected an integer, got {value!r}") from None


def _params_config(args: argparse.Namespace):
    """The GPTConfig `tinygpt params` describes: a preset, a run folder's config.json, or defaults, then flags."""
    import json
    from pathlib import Path

    from .config import GPTConfig

    if args.preset and args.run:
        raise ConfigError("give --preset or a RUN folder, not both")
    if args.run:
        path = Path(args.run)
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"{args.run}: no config.json in this folder (is it a tinygpt run?)")
        elif not path.is_file():
            raise ConfigError(f"{args.run}: no such run folder or config.json file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        base, name = GPTConfig.from_dict(data).to_dict(), str(args.run)
    elif args.preset:
        base, name = GPTConfig.from_preset(args.preset).to_dict(), args.preset
    else:
        base, name = GPTConfig().to_dict(), None
    overrides = {
        field: _int_flag(getattr(args, field), "--" + field.replace("_", "-"))
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
    }
    overrides.update(bias=args.bias, tie_weights=args.tie)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name is None:
        name = "custom" if overrides else "GPTConfig defaults (gpt2)"
    elif overrides:
        name += " (modified)"
    return GPTConfig(**{**base, **overrides}), name


def cmd_params(args: argparse.Namespace) -> int:
    """Count a model's parameters, FLOPs per token and memory, from its architecture alone.

    Args (flags):
        --preset NAME | RUN: the model (a preset, or a run folder holding config.json); model flags
            override either. Without both, GPTConfig's defaults (GPT-2 small) with the flags.
        --batch-size, --seq-len: the batch the KV cache and the training activations are sized for.
        --dtype: compute dtype of activations, KV cache and inference weights.
        --family: the GPT-2 family table instead of one model.
        --json: one JSON object (last line); for one model its "total" is the parameter count.
    """
    import json

    from .calc import report

    batch_size = _int_flag(args.batch_size, "--batch-size")
    seq_len = _int_flag(args.seq_len, "--seq-len")
    if args.family:
        model_flags = [args.preset, args.run, args.n_layer, args.n_head, args.n_embd, args.vocab_size,
                       args.block_size, args.bias, args.tie, batch_size, seq_len]
        if any(v is not None for v in model_flags):
            raise ConfigError("--family describes the four GPT-2 sizes: it takes no model or batch flags")
        rows = report.family_report(args.dtype)
        print(json.dumps({"family": rows}) if args.json else report.render_family(rows, args.dtype))
        return 0
    config, name = _params_config(args)
    result = report.model_report(
        config, name=name, batch_size=1 if batch_size is None else batch_size, seq_len=seq_len, dtype=args.dtype
    )
    print(json.dumps(result) if args.json else report.render_model_report(result))
    return 0


def cmd_chinchilla(args: argparse.Namespace) -> int:
    """Plan a compute-optimal run: C = 6·N·D with D = 20·N, and the loss Hoffmann et al.'s fit predicts.

    Args (flags):
        --flops C | --params N | --tokens D: the budget (numbers like 5.76e23, 70B, 1.4T). Two or
            three may be given only if they agree.
        --time T: measure this machine's training FLOP/s with a few real steps and plan for T
            (90s, 10m, 1h30m).
        --tokens-per-param R: the D / N ratio (default 20).
        --dtype, --device: how --time measures (float32 or bfloat16 autocast; cpu or cuda).
        --json: one JSON object (last line) with params, tokens, flops, loss.
    """
    import json

    from .calc import compute_optimal, format_count, parse_count, report
    from .config import parse_duration

    budgets = {flag: getattr(args, flag) for flag in ("flops", "params", "tokens")}
    given = {flag: parse_count(v, "--" + flag) for flag, v in budgets.items() if v is not None}
    ratio = parse_count(args.tokens_per_param, "--tokens-per-param")
    if args.time is not None and given:
        raise ConfigError("--time measures the compute budget: give it alone, without --flops/--params/--tokens")
    if args.time is None and (args.dtype is not None or args.device is not None):
        raise ConfigError("--dtype and --device choose how --time measures: use them with --time")
    if args.time is None and not given:
        raise ConfigError("give a budget: --flops C, --params N, --tokens D or --time T (e.g. --flops 5.76e23)")
    measured = None
    if args.time is not None:
        from .throughput import measure_training_throughput

        seconds = parse_duration(args.time, "--time")
        measured = measure_training_throughput(dtype=args.dtype or "float32", device=args.device)
        given = {"flops": measured.flops_per_second * seconds}
        source = f"--time {args.time} on this machine"
    else:
        source = ", ".join(f"--{flag} {args_value}" for flag, args_value in budgets.items() if args_value is not None)
    plan = compute_optimal(**given, tokens_per_param=ratio)
    if args.json:
        out = plan.to_dict()
        if measured is not None:
            out.update(seconds=seconds, measured=measured.to_dict())
        print(json.dumps(out))
        return 0
    if measured is not None:
        c = measured.config
        print(
            f"Measured: {measured.steps} training steps (forward, backward, AdamW) of a {c.n_layer}-layer, "
            f"{c.n_embd}-wide GPT ({format_count(measured.params)} parameters),\n"
            f"  batch {measured.batch_size} x {measured.seq_len} random tokens, {measured.dtype} on {measured.device}: "
            f"{measured.flops_per_second / 1e9:.1f} GFLOP/s, {measured.tokens_per_second:,.0f} tokens/s, "
            f"{measured.step_seconds * 1000:.0f} ms a step\n"
            f"Budget: {args.time} = {seconds:,.0f} s x {measured.flops_per_second / 1e9:.1f} GFLOP/s = "
            f"{plan.flops:.3g} FLOP (measured speed; the rest below is arithmetic)\n"
        )
    print(report.render_plan(plan, source))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Turn text into token files for training: train.bin, val.bin, tokenizer.json and meta.json.

    SOURCE is a text file, a folder (every text file below it, binary files skipped), or a
    built-in corpus: python-stdlib (this Python's standard library sources) or shakespeare
    (downloaded once). Files are read as UTF-8; line endings are kept as they are.
    """
    import time

    from .data import prepare

    start = time.perf_counter()
    progress, close = _progress_bars() if args.progress else (None, lambda: None)
    try:
        meta = prepare(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            errors=args.errors,
            tokenizer_file=args.tokenizer_file,
            progress=progress,
        )
    finally:
        close()
    files = sum(s["files"] for s in meta["sources"])
    size = sum(s["bytes"] for s in meta["sources"])
    names = ", ".join(s["name"] for s in meta["sources"])
    seconds = time.perf_counter() - start
    plural = "s" if files != 1 else ""
    print(f"prepared {args.out} in {seconds:.1f}s from {names} ({files:,} file{plural}, {size / 1e6:.1f} MB)")
    vocab = f"{meta['vocab_size']:,}"
    if meta.get("requested_vocab_size", meta["vocab_size"]) != meta["vocab_size"]:
        vocab += f" (of {meta['requested_vocab_size']:,} asked: the corpus had no more merges)"
    print(f"  tokenizer  {meta['tokenizer']}, vocab {vocab}, {meta['dtype']}")
    for split in ("train", "val"):
        print(
            f"  {split:<5}      {meta[f'{split}_tokens']:>12,} tokens  {meta[f'{split}_chars']:>12,} chars"
            f"  {meta[f'{split}_bytes']:>12,} bytes"
        )
    skipped = sum(s["skipped"] for s in meta["sources"])
    if skipped:
        print(f"  skipped {skipped:,} files (binary, or not decodable as Python source)")
    if meta["errors"] == "replace":
        print(f"  replaced {meta['replacements']:,} invalid byte sequences with U+FFFD")
    return 0


def _progress_bars():
    """A tqdm bar per phase of `prepare`, on stderr; returns (callback, close)."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in bars:
            for bar in bars.values():
                bar.close()
            bars[phase] = tqdm(total=total, desc=phase, unit="B", unit_scale=True, file=sys.stderr)
        bars[phase].update(done - bars[phase].n)

    def close() -> None:
        for bar in bars.values():
            bar.close()

    return update, close


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinygpt", description="Build, train, inspect and serve small GPTs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("lesson", help="a guided tour of the lesson's worked examples", description=cmd_lesson.__doc__)
    p.set_defaults(func=cmd_lesson)

    p = sub.add_parser(
        "params", help="parameters, FLOPs and memory of a model, from its config",
        description=cmd_params.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt params --preset gpt2\n  tinygpt params RUN --batch-size 32 --dtype bfloat16\n"
               "  tinygpt params --n-layer 6 --n-head 6 --n-embd 384 --vocab-size 65 --block-size 256 --json\n"
               "  tinygpt params --family",
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="a run folder holding config.json (or the file itself)")
    p.add_argument("--preset", help="a preset name: lesson, stretch, baby, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--vocab-size", "--block-size"):
        p.add_argument(flag, metavar="N", help="override the architecture")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None, help="biases in Linear and LayerNorm")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to wte")
    p.add_argument("--batch-size", metavar="B", help="sequences per batch for memory figures (default 1)")
    p.add_argument("--seq-len", metavar="T", help="training sequence length (default block_size)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype (default float32)")
    p.add_argument("--family", action="store_true", help="print the GPT-2 family table")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)

    p = sub.add_parser(
        "chinchilla", help="compute-optimal model and data size for a budget",
        description=cmd_chinchilla.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt chinchilla --flops 5.76e23\n  tinygpt chinchilla --params 70B --json\n"
               "  tinygpt chinchilla --time 10m",
    )
    p.add_argument("--flops", metavar="C", help="training compute in FLOPs (e.g. 5.76e23)")
    p.add_argument("--params", metavar="N", help="model parameters (e.g. 70B)")
    p.add_argument("--tokens", metavar="D", help="training tokens (e.g. 1.4T)")
    p.add_argument("--time", metavar="T", help="a training time on this machine (90s, 10m, 1h30m); measures FLOP/s")
    p.add_argument("--tokens-per-param", metavar="R", default="20", help="the D / N ratio (default 20)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --time: measure in this dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), help="with --time: measure on this device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_chinchilla)
    p = sub.add_parser("prepare", help="turn text into token files for training", description=cmd_prepare.__doc__)
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="text file, folder, python-stdlib or shakespeare")
    p.add_argument("--out", required=True, metavar="DIR", help="the data folder to write")
    p.add_argument(
        "--tokenizer",
        choices=("char", "bpe", "gpt2"),
        help="char (default), bpe (trained on the corpus) or gpt2 (GPT-2's BPE)",
    )
    p.add_argument("--vocab-size", type=int, metavar="N", help="BPE vocabulary size to train (default 4096)")
    p.add_argument(
        "--val-fraction", type=float, default=0.1, metavar="F", help="share held out for validation, 0-0.5 (0.1)"
    )
    p.add_argument(
        "--errors", choices=("strict", "replace"), default="strict", help="invalid UTF-8: stop (default) or put U+FFFD"
    )
    p.add_argument(
        "--tokenizer-file",
        metavar="PATH",
        help="GPT-2's vocab.json + merges.txt or .tiktoken file, or a tinygpt tokenizer.json / data folder to reuse",
    )
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.set_defaults(func=cmd_prepare)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (TinyGPTError, ValueError, OSError) as e:
        print(f"tinygpt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
