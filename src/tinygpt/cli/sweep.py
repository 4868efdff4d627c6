"""`tinygpt sweep`: an IsoFLOP grid of training runs and the scaling laws fitted to it."""

from __future__ import annotations

import argparse
import sys

from ..calc.units import plural
from ..errors import ConfigError
from .common import EXIT_INTERRUPTED, Number, add_device_flag, int_flag, json_line, seed_type


def _counts(values: list[str] | None, flag: str) -> list[float] | None:
    """Numbers given as separate words or comma lists ("1e12 3e12" or "1e12,3e12"), each checked."""
    from ..calc import parse_count

    if values is None:
        return None
    return [parse_count(v, flag) for value in values for v in value.split(",") if v.strip()]


def cmd_sweep(args: argparse.Namespace) -> int:
    """Train a grid of models (IsoFLOP: several sizes per compute budget), fit the scaling laws, plot them.

    For each budget C (training FLOPs) and model size N the model trains for C / (FLOPs per token)
    tokens. Results go to --out: results.json and .csv (final val loss against parameters, tokens
    and FLOPs), fit.json (the compute-optimal frontier N_opt ∝ C^a, D_opt ∝ C^b and the parametric
    loss L = E + A/N^alpha + B/D^beta), PNG plots, and runs/ (each model's run folder). Rerunning
    the same command trains only the points not finished yet.

    Args (flags):
        --budgets C [C ...]: compute budgets (1e12, 3e12 ... or 1e12,3e12); or --quick.
        --sizes N [N ...]: model sizes to train at every budget (default: --points sizes --spread
            apart around --centre x Chinchilla's N for each budget).
        --quick: a small grid that finishes in under 20 minutes on a 2-core laptop CPU.
        --batch-size, --block-size, --lr, --eval-iters, --seed, --device, --dtype: how every model trains.
        --threads N: CPU threads for training (default 1).
    """

    from ..lab import sweep

    grid = _sweep_grid(args)
    flags = {"batch_size": int_flag(args.batch_size, "--batch-size"),
             "block_size": int_flag(args.block_size, "--block-size"),
             "eval_iters": int_flag(args.eval_iters, "--eval-iters"), "seed": int_flag(args.seed, "--seed"),
             "lr": None if args.lr is None else _counts([args.lr], "--lr")[0], "device": args.device,
             "dtype": args.dtype}
    defaults = sweep.SweepSettings().to_dict()
    settings = sweep.SweepSettings(**{**defaults, **{k: v for k, v in flags.items() if v is not None}})
    result = sweep.run_sweep(args.data, args.out, **grid, settings=settings, progress=not args.quiet,
                             on_point=_print_point, plots=not args.no_plots,
                             threads=int_flag(args.threads, "--threads"))
    for line in result.skipped:
        print(f"skipped {line}")
    done = len(result.points)
    if result.interrupted:
        print(f"interrupted: {plural(done, 'grid point')} done; run the same command again to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    minutes = result.seconds / 60
    files = [sweep.RESULTS, sweep.RESULTS_CSV, sweep.FIT, *(p.name for p in result.plots)]
    print(f"\n{plural(done, 'model')} ({result.trained} trained now, {minutes:.1f} min) in {result.out}; "
          f"{', '.join(files)}")
    for line in sweep.summary_lines(result.fit):
        print(line)
    if args.json:
        print(json_line(result.fit))
    return 0


def _sweep_grid(args: argparse.Namespace) -> dict:
    """run_sweep's grid (budgets, sizes, points, spread, centre) from the flags: --quick's, or the one given."""
    from ..lab import sweep

    budgets = _counts(args.budgets, "--budgets")
    sizes = _counts(args.sizes, "--sizes")
    points = int_flag(args.points, "--points")
    spread = None if args.spread is None else _counts([args.spread], "--spread")[0]
    centre = None if args.centre is None else _counts([args.centre], "--centre")[0]
    if args.quick:
        given = [flag for flag, v in (("--budgets", budgets), ("--sizes", sizes), ("--points", points),
                                      ("--spread", spread), ("--centre", centre)) if v is not None]
        if given:
            raise ConfigError(f"--quick chooses the grid itself: drop {', '.join(given)} or --quick")
        budgets, points, centre = list(sweep.QUICK_BUDGETS), sweep.QUICK_POINTS, sweep.QUICK_CENTRE
    elif budgets is None:
        raise ConfigError("give the compute budgets: --budgets 1e12 3e12 1e13 (training FLOPs), or --quick")
    if sizes is not None and (points is not None or spread is not None or centre is not None):
        raise ConfigError("--points, --spread and --centre place sizes around Chinchilla's N: "
                          "give them or --sizes, not both")
    return dict(budgets=budgets, sizes=sizes, points=5 if points is None else points,
                spread=2.0 if spread is None else spread, centre=1.0 if centre is None else centre)


def _print_point(i: int, n: int, record: dict, new: bool) -> None:
    """One line per grid point of a sweep, as it finishes (or as it is found done by an earlier run)."""
    from ..calc import format_count

    head = (f"[{i + 1}/{n}] C={record['budget']:.3g}  N={format_count(record['params'])} "
            f"({record['n_layer']}x{record['n_embd']})  D={format_count(record['tokens'])}, {record['steps']:,} steps")
    outcome = "diverged (left out of the fit)" if record["val_loss"] is None else f"val loss {record['val_loss']:.4f}"
    when = f"{record['seconds']:.0f}s" if new else "done before"
    print(f"{head}: {outcome}  ({when})", flush=True)


def add_sweep(sub: argparse._SubParsersAction) -> None:
    """`tinygpt sweep` and its flags."""
    seed = seed_type()
    p = sub.add_parser(
        "sweep", help="train an IsoFLOP grid of models and fit the scaling laws",
        description=cmd_sweep.__doc__.split("\n\n")[0] + "\n\n" + cmd_sweep.__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt sweep --data data/stdlib --out sweeps/quick --quick\n"
               "  tinygpt sweep --data data/stdlib --out sweeps/mine --budgets 1e12 3e12 1e13 --points 5\n"
               "  tinygpt sweep --data data/stdlib --out sweeps/fixed --budgets 1e12,1e13 --sizes 50K,100K,200K,400K",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="a folder written by `tinygpt prepare`")
    p.add_argument("--out", required=True, metavar="DIR", help="the sweep folder (rerun to continue it)")
    counts = Number("count", items=True, keep_text=True)  # 1e12 3e12, or 1e12,3e12
    grouped = Number("int", 1, grouped=True, keep_text=True)
    p.add_argument("--budgets", nargs="+", metavar="C", type=counts,
                   help="compute budgets in training FLOPs (e.g. 1e12 1e13)")
    p.add_argument("--sizes", nargs="+", metavar="N", type=counts, help="model sizes for every budget (e.g. 50K 200K 1M)")
    p.add_argument("--points", metavar="K", type=grouped, help="sizes per budget around Chinchilla's N (default 5)")
    p.add_argument("--spread", metavar="F", type=Number("float", 1, low_open=True, keep_text=True),
                   help="ratio between neighbouring default sizes (default 2)")
    p.add_argument("--centre", metavar="F", type=Number("float", 0, low_open=True, keep_text=True),
                   help="default sizes centre on F x Chinchilla's N (default 1)")
    p.add_argument("--quick", action="store_true", help="the small built-in grid (< 20 minutes on a laptop CPU)")
    p.add_argument("--batch-size", metavar="B", type=grouped, help="sequences per step for every model (16)")
    p.add_argument("--block-size", metavar="T", type=grouped, help="context of every model (128)")
    p.add_argument("--lr", metavar="LR", type=Number("float", 0, low_open=True, keep_text=True),
                   help="peak learning rate for every model (2e-3)")
    p.add_argument("--eval-iters", metavar="K", type=grouped, help="val batches behind each final loss (20)")
    p.add_argument("--seed", metavar="S", type=Number("int", 0, seed.high, grouped=True, keep_text=True),
                   help="initialization and batch order (1337)")
    add_device_flag(p, help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", metavar="N", type=grouped, default="1",
                   help="CPU threads for training (1: small models, and steady on a busy machine)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib: the viz extra)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="end with fit.json's content on one line")
    p.set_defaults(func=cmd_sweep)
