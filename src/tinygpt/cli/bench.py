"""`tinygpt bench`: this machine's training and generation speed, beside transformers and llama.cpp."""

from __future__ import annotations

import argparse
import sys

from .common import POSITIVE, Number, add_device_flag


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure this machine's limits, training and generation speed, beside transformers and llama.cpp.

    Prints tables and the target ratios, all measured in the same run (a shared machine's absolute
    figures move between runs; the ratios are what to compare).

    Args (flags):
        --quick: a shorter run (a few minutes on a 2-core CPU).
        --smoke: every kind of row once at the smallest sizes, in seconds: that the bench runs here.
        --device: where to measure (auto: cuda where there is one); a GPU has a plan of its own.
        --json FILE: also write every figure as JSON.
        --only SECTION: limits, train, step, generate, dpo or grpo (step: the default block's training step
            against GPT-2's and the matmul limit; dpo, grpo: a `tinygpt dpo` or `tinygpt grpo` step beside TRL's
            DPOTrainer's or GRPOTrainer's on a CPU; repeatable; default all).
        --no-peers: skip transformers and llama.cpp even when they are installed.
    """

    from pathlib import Path

    from ..errors import ConfigError
    from ..fileio import check_output_file, write_json
    from ..lab import bench

    if args.json:
        check_output_file(args.json, ConfigError)  # before the minutes of measuring, not after
    if args.recipes:
        return _bench_recipes(args)
    if args.data or args.plot:
        raise ConfigError(f"{'--data' if args.data else '--plot'} goes with --recipes")
    sections = tuple(args.only or ("limits", "train", "step", "generate", "dpo", "grpo"))
    result = bench.run(quick=args.quick, smoke=args.smoke, device=args.device, sections=sections,
                       peers=not args.no_peers, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench.render(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_recipes(args: argparse.Namespace) -> int:
    """`tinygpt bench --recipes`: the recipe bench (tinygpt.lab.recipes), its table, JSON and plot."""
    from pathlib import Path

    from ..errors import ConfigError
    from ..fileio import write_json
    from ..lab import recipes

    if not args.data:
        raise ConfigError("--recipes needs --data DIR: a folder tinygpt prepare wrote (text the defaults were not tuned on)")
    if args.plot:
        from ..lab.viz import check_picture

        check_picture(args.plot)
    shape = {k: v for k in ("n_layer", "n_head", "n_embd", "block_size") if (v := getattr(args, k)) is not None}
    result = recipes.run(args.data, recipes=args.recipe or recipes.DEFAULT_RECIPES, seeds=args.seeds,
                         steps=args.steps, batch_size=args.batch_size, shape=shape, evals=args.evals,
                         eval_iters=args.eval_iters, device=args.device,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    print(recipes.render(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from ..lab.viz import plot_recipes

        print(f"wrote {plot_recipes(result, args.plot)}", file=sys.stderr)
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    """`tinygpt bench` and its flags."""
    p = sub.add_parser("bench", help="training and generation speed against transformers and llama.cpp, in one run",
                       description=cmd_bench.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a shorter run (a few minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="every kind of row once at the smallest sizes, in seconds: checks the bench runs (no figure to read)")
    add_device_flag(p, help="where to measure (auto: cuda where there is one, with the GPU's plan)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--only", action="append", choices=("limits", "train", "step", "generate", "dpo", "grpo"),
                   help="measure only this (step: the default block's training step against GPT-2's and the matmul "
                        "limit)")
    p.add_argument("--no-peers", action="store_true", help="skip transformers and llama.cpp")
    from ..lab import recipes

    r = p.add_argument_group(
        "the recipe bench (--recipes)",
        "time to quality: the 2019 recipe (GPT-2's block, AdamW, cosine) against the modern one (the modern block, "
        "Muon, warmup-stable-decay: tinygpt train's default) and the steps between, at equal steps and tokens, "
        "seeds interleaved; "
        "val loss at fixed token counts and the steps and training time each needs to reach the first recipe's "
        "final val loss, as ratios to it")
    r.add_argument("--recipes", action="store_true", help="run the recipe bench instead of the speed bench")
    r.add_argument("--data", metavar="DIR", help="a prepared data folder (characters or BPE)")
    r.add_argument("--recipe", action="append", choices=tuple(recipes.RECIPES),
                   help=f"a recipe to train (repeatable; the first is the reference; default {', '.join(recipes.DEFAULT_RECIPES)})")
    r.add_argument("--seeds", type=Number("int", 1, 100), default=recipes.SEEDS, help=f"seeds per recipe ({recipes.SEEDS})")
    r.add_argument("--steps", type=POSITIVE, default=recipes.STEPS, help=f"optimizer steps per run ({recipes.STEPS})")
    r.add_argument("--batch-size", type=POSITIVE, default=recipes.BATCH_SIZE,
                   help=f"sequences per step ({recipes.BATCH_SIZE})")
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        r.add_argument("--" + name.replace("_", "-"), type=POSITIVE, help=f"the model's shape ({recipes.SHAPE[name]})")
    r.add_argument("--evals", type=POSITIVE, default=recipes.EVALS, help=f"evaluations per run ({recipes.EVALS})")
    r.add_argument("--eval-iters", type=POSITIVE, default=20, help="validation batches per evaluation (20)")
    r.add_argument("--plot", metavar="FILE", help="draw val loss against tokens and training time (.png, .svg, .pdf)")
    p.set_defaults(func=cmd_bench)
