"""Every numeric flag and every --device of every command, walked from the real parser: a value outside
the flag's range is a one-line usage error with exit code 2, never a traceback. In-process and fast:
parsing fails before any command runs, so no case loads a model."""

import argparse
import math

import pytest
import torch

from tinygpt import cli
from tinygpt.cli import MAX_INT, Number, build_parser, main

# metavars that name a number: a flag spelled with one must have a Number type, so a new numeric flag
# cannot slip in as a plain string or a bare int
NUMERIC_METAVARS = {"N", "B", "T", "K", "C", "D", "F", "R", "S", "LR"}


PARSER = build_parser()


@pytest.fixture(autouse=True)
def _one_parser(monkeypatch):
    # main() builds the same parser every call (15 ms); build it once for the hundreds of cases here
    monkeypatch.setattr(cli, "build_parser", lambda: PARSER)


def flags(parser=PARSER, prefix=""):
    """(command, flag, action) for every option of every subcommand, nested ones (`inspect heads`) too."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from flags(sub, f"{prefix}{name} ")
            elif action.option_strings and action.option_strings[0] not in ("-h", "--help"):
                yield prefix + name, action.option_strings[-1], action


NUMERIC = [(c, f, a.type) for c, f, a in flags() if isinstance(a.type, Number)]
DEVICES = [(c, f, a.type) for c, f, a in flags() if a.dest == "device"]


def test_every_numeric_flag_has_a_range():
    untyped = [f"{c} {f}" for c, f, a in flags() if a.type in (int, float)]
    assert not untyped, f"use a Number type (a range) for {untyped}"
    strings = [f"{c} {f}" for c, f, a in flags() if a.type is None and a.metavar in NUMERIC_METAVARS]
    assert not strings, f"numeric flags without a Number type: {strings}"
    assert len(NUMERIC) > 60 and len(DEVICES) >= 7  # the walk found the commands' flags
    for command, flag, kind in NUMERIC:
        assert kind.low is not None, f"{command} {flag} has no lower bound"
        if kind.kind == "int":
            assert kind.high is not None and kind.high <= MAX_INT, f"{command} {flag}"


HUGE_INT = "1" + "0" * 30  # far past int64
# (text, the number it names; None: not a number of that kind at all)
CANDIDATES = {
    "int": [("0", 0), ("-1", -1), (HUGE_INT, 10**30), (str(2**63), 2**63), ("nan", None), ("inf", None),
            ("-inf", None), ("abc", None), ("2.5", None), ("", None), ("1e3", None)],
    "float": [("0", 0.0), ("-1", -1.0), ("1e400", math.inf), ("nan", None), ("inf", None), ("-inf", None),
              ("abc", None), ("", None)],
    "count": [("0", 0.0), ("-1", None), ("1e400", math.inf), ("nan", None), ("inf", None), ("abc", None),
              ("", None), ("-5B", None)],
    "duration": [("0", 0.0), ("0s", 0.0), ("-1", None), ("1e400", None), ("nan", None), ("inf", None),
                 ("abc", None), ("", None), ("5x", None)],
}


def takes(kind: Number, value) -> bool:
    """The test's own reading of the declared range (not the type's code)."""
    if value is None or not math.isfinite(value):
        return False
    above = value > kind.low if kind.low_open else value >= kind.low
    below = kind.high is None or (value < kind.high if kind.high_open else value <= kind.high)
    return above and below


def run(argv, capsys):
    code = main(argv)  # a usage error is returned as exit code 2, as every bad input is
    return code, capsys.readouterr().err


def assert_one_line_usage_error(code, err, flag):
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tinygpt: error: argument {flag}: "), lines[0]


@pytest.mark.parametrize("command, flag, kind", NUMERIC, ids=[f"{c} {f}" for c, f, _ in NUMERIC])
def test_numeric_flag_refuses_values_outside_its_range(command, flag, kind, capsys):
    refused = 0
    for text, value in CANDIDATES[kind.kind]:
        if takes(kind, value):
            kind(text)  # inside the range: parses without an error
            continue
        refused += 1
        code, err = run([*command.split(), f"{flag}={text}"], capsys)
        assert_one_line_usage_error(code, err, flag)
    assert refused >= 5  # NaN, infinities, wrong types and huge values at least


def test_ranges_that_include_zero_or_negatives_are_the_declared_ones(capsys):
    # a few flags take 0: the range says so, and parsing agrees
    by_flag = {(c, f): k for c, f, k in NUMERIC}
    assert by_flag["serve", "--port"].low == 0 and by_flag["serve", "--port"]("0") == 0
    assert by_flag["train", "--grad-clip"]("0") == 0.0 and by_flag["train", "--warmup"]("0") == 0
    assert by_flag["sample", "--max-new-tokens"]("0") == 0 and by_flag["sample", "--temperature"]("0") == 0.0
    assert by_flag["train", "--seed"](str(2**63 - 1)) == 2**63 - 1
    code, err = run(["sample", "run", "--seed", "99999999999999999999"], capsys)
    assert_one_line_usage_error(code, err, "--seed")
    code, err = run(["eval", "run", "--batch-size", "-1"], capsys)
    assert_one_line_usage_error(code, err, "--batch-size")


def unavailable_devices():
    names = ["xpu", "meta", "hpu", "cuda:99", "bogus", "cpu:3", "mps:2", ""]
    if not torch.cuda.is_available():
        names += ["cuda", "cuda:0"]
    if not torch.backends.mps.is_available():
        names.append("mps")
    return names


@pytest.mark.parametrize("command, flag, kind", DEVICES, ids=[f"{c} {f}" for c, f, _ in DEVICES])
def test_device_flag_takes_only_devices_this_torch_can_use(command, flag, kind, capsys):
    for name in unavailable_devices():
        code, err = run([*command.split(), f"{flag}={name}"], capsys)
        assert_one_line_usage_error(code, err, flag)
    assert kind("cpu") == "cpu"


def test_resolve_device_refuses_what_tinygpt_cannot_run_on():
    from tinygpt.device import resolve_device
    from tinygpt.errors import ConfigError

    for name in unavailable_devices():
        with pytest.raises(ConfigError, match="device"):
            resolve_device(name)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")
