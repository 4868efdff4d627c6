"""Every subcommand's flags, as `--help` shows them, held against tests/cli_flags.json.

The command line is a promise to scripts and to the README: a change to a flag (its name, default,
choices, type of value or help) must be one somebody meant. To accept one, rerun this file with
TINYGPT_UPDATE_CLI_SNAPSHOT=1 and commit the new cli_flags.json with the change.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tinygpt import cli

SNAPSHOT = Path(__file__).with_name("cli_flags.json")


def type_name(kind) -> str | None:
    """A flag's value type by name (a function's repr holds its address)."""
    if kind is None:
        return None
    return getattr(kind, "__qualname__", None) or repr(kind)


def describe(parser: argparse.ArgumentParser) -> dict:
    flags = {}
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        flags[name] = {
            "dest": action.dest,
            "default": repr(action.default),
            "choices": sorted(map(str, action.choices)) if action.choices and not isinstance(action.choices, dict)
            else None,
            "nargs": repr(action.nargs),
            "required": action.required,
            "metavar": repr(action.metavar),
            "type": type_name(action.type),
            "help": action.help,
        }
    return {"description": parser.description, "usage": parser.format_usage(), "flags": flags}


def commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every subcommand, nested ones as "inspect heads"."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from commands(sub, f"{prefix}{name} ")


def current() -> dict:
    parser = cli.build_parser()
    return {"tinygpt": describe(parser), **{name: describe(p) for name, p in sorted(commands(parser))}}


def test_every_commands_flags_are_the_snapshots():
    now = current()
    if os.environ.get("TINYGPT_UPDATE_CLI_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    saved = json.loads(SNAPSHOT.read_text())
    assert sorted(now) == sorted(saved), "commands added or removed: update the snapshot (see the docstring)"
    for command in saved:
        assert now[command] == saved[command], f"tinygpt {command}: its flags changed (see the docstring)"
