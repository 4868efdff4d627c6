"""The `tinygpt` command: parses flags into configs and calls the library. Only this layer prints
messages for the user and chooses exit codes.

Each command lives in the module of its family, its flags (`add_NAME`) beside its handler
(`cmd_NAME`); this module puts the parser together and turns errors into exit codes. A new
command goes in the module of its family (or a new one) and into COMMANDS below.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import NoReturn

from ..distributed import joined_a_group
from ..errors import TinyGPTError
from . import (align, bench, chat, finetune, inspect, interchange, lab, preference, prepare, run, scale, serve, sweep,
               train)
from .common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_PIPE, EXIT_SIGNAL, MAX_INT, Number
from .prepare import default_data_folder

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_NONFINITE", "EXIT_PIPE", "EXIT_SIGNAL", "MAX_INT", "Number",
           "build_parser", "command", "default_data_folder", "leave", "main"]

# every command's parser, in the order `tinygpt --help` lists them
COMMANDS = (
    lab.add_lesson, train.add_train, finetune.add_finetune, align.add_grpo, preference.add_dpo, preference.add_reward,
    finetune.add_report, run.add_sample,
    inspect.add_attention, inspect.add_plot, inspect.add_inspect, lab.add_emergence, lab.add_fewshot,
    lab.add_fewshot_data, run.add_eval,
    scale.add_params, scale.add_chinchilla, sweep.add_sweep, prepare.add_prepare, interchange.add_export,
    interchange.add_import, interchange.add_merge, serve.add_serve, chat.add_chat, bench.add_bench,
)


class _UsageError(Exception):
    """A command line argparse refused; main() prints it as every other error, on one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are the CLI's one-line errors (`tinygpt: error: argument --lr: ...`, no
    usage block), returned by main() as exit code 2 like any other bad input."""

    def error(self, message: str):
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command's flags, each with its range (Number) or its check (--device)."""
    parser = _Parser(prog="tinygpt", description="Build, train, inspect and serve small GPTs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)  # its parsers are _Parsers too
    for add in COMMANDS:
        add(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _report(message: str) -> int:
    rank = os.environ.get("RANK", "0")  # under torchrun every process may report
    print(f"tinygpt: error: {'' if rank == '0' else f'[rank {rank}] '}{message}", file=sys.stderr)
    return EXIT_ERROR


_CPU_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _out_of_memory(e: RuntimeError) -> str | None:
    """The one-line message for an allocation that failed (a size flag too big for this machine), or
    None for any other RuntimeError: those are bugs, and keep their traceback."""
    advice = "choose smaller sizes (model, batch, context, adapters' rank)"
    cpu = _CPU_ALLOCATION.search(str(e))
    if cpu:
        return f"not enough memory: one allocation of {int(cpu.group(1)) / 2**30:,.1f} GiB failed; {advice}"
    if str(e).startswith("Storage size calculation overflowed"):
        return f"not enough memory: a tensor larger than any machine's memory was asked for; {advice}"
    if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError: CUDA, MPS, XPU
        return f"out of memory on the device ({str(e).splitlines()[0][:200]}); {advice}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command line (default: sys.argv) and return its exit code.

    Args:
        argv: the arguments after `tinygpt`.
    """
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        print(f"tinygpt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        _resolve_hub_ids(args)
        return args.func(args) or 0
    except BrokenPipeError:  # the reader went away (`tinygpt sample ... | head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
        return EXIT_PIPE
    except (TinyGPTError, ValueError, OSError) as e:
        return _report(str(e))
    except RuntimeError as e:
        message = _out_of_memory(e)
        if message is None:
            raise
        return _report(message)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _resolve_hub_ids(args: argparse.Namespace) -> None:
    """A command's FROM (the arguments its parser lists in hub_args) given as a Hugging Face Hub id becomes
    the model's folder in huggingface_hub's cache, fetched when online (tinygpt.interop.hub)."""
    for name in getattr(args, "hub_args", ()):
        value = getattr(args, name, None)
        if value is not None:
            from ..interop.hub import looks_like_hub_id, resolve

            if looks_like_hub_id(value):
                setattr(args, name, str(resolve(value)))


def command() -> NoReturn:
    """The `tinygpt` program (its console script, `python -m tinygpt`): main() on sys.argv, then leave()."""
    leave(main())


def leave(code: int) -> NoReturn:
    """End the process with exit status `code`. A process that joined a multi-process job ends with
    os._exit, its output flushed first: PyTorch's gloo threads outlive the job's group, and the
    interpreter's teardown can abort the process under them (distributed.joined_a_group says how)."""
    if not joined_a_group():
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(code)
