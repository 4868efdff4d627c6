"""The `tinygpt` command: parses flags into configs and calls the library. Only this layer prints
messages for the user and chooses exit codes."""

from __future__ import annotations

import argparse
import math
import sys

from .errors import TinyGPTError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinygpt", description="Build, train, inspect and serve small GPTs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("lesson", help="a guided tour of the lesson's worked examples", description=cmd_lesson.__doc__)
    p.set_defaults(func=cmd_lesson)
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
