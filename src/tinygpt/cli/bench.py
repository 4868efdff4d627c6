"""`tinygpt bench`: this machine's training and generation speed, beside transformers and llama.cpp."""

from __future__ import annotations

import argparse
import sys

from .common import add_device_flag


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure this machine's limits, training and generation speed, beside transformers and llama.cpp.

    Prints tables and the target ratios, all measured in the same run (a shared machine's absolute
    figures move between runs; the ratios are what to compare).

    Args (flags):
        --quick: a shorter run (a few minutes on a 2-core CPU).
        --smoke: every kind of row once at the smallest sizes, in seconds: that the bench runs here.
        --device: where to measure (auto: cuda where there is one); a GPU has a plan of its own.
        --json FILE: also write every figure as JSON.
        --only SECTION: limits, train or generate (repeatable; default all).
        --no-peers: skip transformers and llama.cpp even when they are installed.
    """

    from pathlib import Path

    from ..errors import ConfigError
    from ..fileio import check_output_file, write_json
    from ..lab import bench

    if args.json:
        check_output_file(args.json, ConfigError)  # before the minutes of measuring, not after
    sections = tuple(args.only or ("limits", "train", "generate"))
    result = bench.run(quick=args.quick, smoke=args.smoke, device=args.device, sections=sections,
                       peers=not args.no_peers, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench.render(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
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
    p.add_argument("--only", action="append", choices=("limits", "train", "generate"), help="measure only this")
    p.add_argument("--no-peers", action="store_true", help="skip transformers and llama.cpp")
    p.set_defaults(func=cmd_bench)
