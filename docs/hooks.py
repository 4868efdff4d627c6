"""MkDocs hook: the reference pages made from the code at build time, so they cannot drift from it.

A page holding `<!-- cli-reference -->` gets every command's --help (the argparse parsers tinygpt runs);
one holding `<!-- api-reference -->` gets a mkdocstrings block for each name in `tinygpt.__all__`.
"""

from __future__ import annotations

import argparse
import os

CLI_MARKER = "<!-- cli-reference -->"
API_MARKER = "<!-- api-reference -->"
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS


def _commands(parser: argparse.ArgumentParser, prefix: str):
    """(command line, one-line help, parser) for every subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                yield f"{prefix} {choice.dest}", choice.help, sub
                yield from _commands(sub, f"{prefix} {choice.dest}")


def cli_reference() -> str:
    from tinygpt import cli

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parts = []
        for name, summary, parser in _commands(cli.build_parser(), "tinygpt"):
            parts.append(f"## `{name}`\n\n{summary[0].upper() + summary[1:]}.\n\n```text\n{parser.format_help()}```\n")
        return "\n".join(parts)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def api_reference() -> str:
    import tinygpt

    return "\n".join(f"::: tinygpt.{tinygpt._HOME[name]}.{name}\n" for name in tinygpt.__all__)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    return markdown
