"""Sizing a model by arithmetic on its config: `tinygpt params` (parameters, FLOPs per token, memory) and
`chinchilla` (a compute-optimal plan for a budget)."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from .common import Number, add_device_flag, int_flag, json_line


def _run_config(run: str) -> tuple[dict, str]:
    """The architecture in a run folder's config.json (or a Hugging Face GPT-2 folder's, or the file itself)."""
    from pathlib import Path

    from ..config.model import GPTConfig
    from ..fileio import parse_json
    from ..interop.hf import is_hf_config
    from ..run_folder import RunFolder

    folder = RunFolder(run)
    path, name = Path(run), folder.config_file.name
    if path.is_dir():
        path = folder.config_file
        if not path.is_file():
            raise ConfigError(f"{run}: no {name} in this folder (is it a tinygpt run?)")
    elif not path.is_file():
        raise ConfigError(f"{run}: no such run folder or {name} file")
    try:
        data = parse_json(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if is_hf_config(data):
        from ..interop.hf import config_from_hf

        return config_from_hf(data, str(run)).to_dict(), str(run)
    return GPTConfig.from_dict(data).to_dict(), str(run)


def _params_config(args: argparse.Namespace):
    """The GPTConfig `tinygpt params` describes: a preset, a run folder's config.json, or defaults, then flags."""
    from ..config.model import GPTConfig

    if args.preset and args.run:
        raise ConfigError("give --preset or a RUN folder, not both")
    if args.run:
        base, name = _run_config(args.run)
    elif args.preset:
        base, name = GPTConfig.from_preset(args.preset).to_dict(), args.preset
    else:
        base, name = GPTConfig().to_dict(), None
    overrides = {
        field: int_flag(getattr(args, field), "--" + field.replace("_", "-"))
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
    }
    overrides.update(bias=args.bias, tie_weights=args.tie)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name is None:
        name = "custom" if overrides else "GPTConfig defaults (gpt2)"
    elif overrides:
        name += " (modified)"
    return GPTConfig(**{**base, **overrides}), name


def _params_method(args: argparse.Namespace) -> dict:
    """The training method `tinygpt params` sizes: LoRA from any --lora-* flag, freezing from --freeze-*."""
    from ..config.lora import LoraConfig

    lora = None
    if args.lora_rank is not None or args.lora_alpha is not None or args.lora_targets is not None:
        given = {"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": args.lora_targets}
        lora = LoraConfig(**{k: v for k, v in given.items() if v is not None})
    return dict(lora=lora, freeze_embeddings=args.freeze_embeddings, freeze_layers=args.freeze_layers or 0,
                grad_checkpoint=args.grad_checkpoint)


def cmd_params(args: argparse.Namespace) -> int:
    """Count a model's parameters, FLOPs per token and memory, from its architecture alone.

    Args (flags):
        --preset NAME | RUN: the model (a preset, or a run folder holding config.json); model flags
            override either. Without both, GPTConfig's defaults (GPT-2 small) with the flags.
        --batch-size, --seq-len: the batch the KV cache and the training activations are sized for.
        --dtype: compute dtype of activations, KV cache and inference weights.
        --lora-rank R, --lora-alpha A, --lora-targets LIST: trainable parameters and training memory
            for LoRA (any of the three turns it on; defaults rank 8, alpha 8, and PEFT's targets:
            c_attn for GPT-2, q_proj and v_proj for the llama layout).
        --freeze-layers N, --freeze-embeddings: the same for full training with the first N blocks
            and/or the embeddings frozen.
        --grad-checkpoint: the training memory with each block's activations recomputed in backward
            (finetune's --grad-checkpoint).
        --family: the GPT-2 family table instead of one model.
        --json: one JSON object (last line); for one model its "total" is the parameter count.
    """

    from ..calc import report

    batch_size = int_flag(args.batch_size, "--batch-size")
    seq_len = int_flag(args.seq_len, "--seq-len")
    method = _params_method(args)
    if args.family:
        model_flags = [args.preset, args.run, args.n_layer, args.n_head, args.n_embd, args.vocab_size,
                       args.block_size, args.bias, args.tie, batch_size, seq_len, method["lora"],
                       args.freeze_layers, args.freeze_embeddings or None, args.grad_checkpoint or None]
        if any(v is not None for v in model_flags):
            raise ConfigError("--family describes the four GPT-2 sizes: it takes no model, batch or method flags")
        rows = report.family_report(args.dtype)
        print(json_line({"family": rows}) if args.json else report.render_family(rows, args.dtype))
        return 0
    config, name = _params_config(args)
    result = report.model_report(
        config, name=name, batch_size=1 if batch_size is None else batch_size, seq_len=seq_len, dtype=args.dtype,
        **method,
    )
    print(json_line(result) if args.json else report.render_model_report(result))
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

    from ..calc import compute_optimal, format_count, parse_count, report
    from ..config.duration import parse_duration

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
        from ..throughput import measure_training_throughput

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
        print(json_line(out))
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


def add_params(sub: argparse._SubParsersAction) -> None:
    """`tinygpt params` and its flags."""
    p = sub.add_parser(
        "params", help="parameters, FLOPs and memory of a model, from its config",
        description=cmd_params.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt params --preset gpt2\n  tinygpt params RUN --batch-size 32 --dtype bfloat16\n"
               "  tinygpt params --n-layer 6 --n-head 6 --n-embd 384 --vocab-size 65 --block-size 256 --json\n"
               "  tinygpt params --preset gpt2 --batch-size 4 --seq-len 256 --lora-rank 8 --lora-targets attn,mlp\n"
               "  tinygpt params --preset gpt2 --freeze-layers 10 --freeze-embeddings\n"
               "  tinygpt params --family",
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="a run folder holding config.json (or the file itself)")
    p.add_argument("--preset", help="a preset name: lesson, stretch, baby, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--vocab-size", "--block-size"):
        p.add_argument(flag, metavar="N", type=Number("int", 1, grouped=True, keep_text=True),
                       help="override the architecture")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None, help="biases in Linear and LayerNorm")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to wte")
    p.add_argument("--batch-size", metavar="B", type=Number("int", 1, grouped=True, keep_text=True),
                   help="sequences per batch for memory figures (default 1)")
    p.add_argument("--seq-len", metavar="T", type=Number("int", 1, grouped=True, keep_text=True),
                   help="training sequence length (default block_size)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype (default float32)")
    f = p.add_argument_group("fine-tuning method (trainable parameters and training memory; default: full)")
    f.add_argument("--lora-rank", metavar="R", type=Number("int", 1), help="LoRA adapters of rank R (8)")
    f.add_argument("--lora-alpha", metavar="A", type=Number("float", 0, low_open=True), help="LoRA's scale is alpha / rank (alpha 8)")
    f.add_argument("--lora-targets", metavar="LIST",
                   help="projections to adapt: GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj; the llama layout's "
                        "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or attn, mlp "
                        "(PEFT's default: c_attn; q_proj,v_proj)")
    f.add_argument("--freeze-layers", metavar="N", type=Number("int", 0), help="full training with the first N blocks frozen")
    f.add_argument("--freeze-embeddings", action="store_true", help="full training with wte and wpe frozen")
    f.add_argument("--grad-checkpoint", action="store_true",
                   help="activations recomputed block by block in backward (finetune --grad-checkpoint)")
    p.add_argument("--family", action="store_true", help="print the GPT-2 family table")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params, hub_args=("run",))


def add_chinchilla(sub: argparse._SubParsersAction) -> None:
    """`tinygpt chinchilla` and its flags."""
    p = sub.add_parser(
        "chinchilla", help="compute-optimal model and data size for a budget",
        description=cmd_chinchilla.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt chinchilla --flops 5.76e23\n  tinygpt chinchilla --params 70B --json\n"
               "  tinygpt chinchilla --time 10m",
    )
    count = Number("count", keep_text=True)
    p.add_argument("--flops", metavar="C", type=count, help="training compute in FLOPs (e.g. 5.76e23)")
    p.add_argument("--params", metavar="N", type=count, help="model parameters (e.g. 70B)")
    p.add_argument("--tokens", metavar="D", type=count, help="training tokens (e.g. 1.4T)")
    p.add_argument("--time", metavar="T", type=Number("duration", keep_text=True),
                   help="a training time on this machine (90s, 10m, 1h30m); measures FLOP/s")
    p.add_argument("--tokens-per-param", metavar="R", type=count, default="20", help="the D / N ratio (default 20)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --time: measure in this dtype")
    add_device_flag(p, None, choices=("cpu", "cuda"), help="with --time: measure on this device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_chinchilla)
