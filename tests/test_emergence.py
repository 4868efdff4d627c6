"""The emergence lab (tinygpt.lab.emergence, `tinygpt emergence`): an induction head forms in a 2-layer
model and not in the 1-layer control, on a setting other than the defaults (vocabulary, context,
period range and width all changed); emergence.json's keys; `tinygpt inspect heads` names the heads;
`tinygpt train --probe-interval` probes any run."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tinygpt.cli import main
from tinygpt.lab import emergence

# a second setting, small enough to form its induction head in a few seconds (~350 of 500 steps)
SETTING = ["--vocab-size", "32", "--context", "24", "--period", "4-12", "--n-embd", "32", "--steps", "500",
           "--probe-interval", "25"]
RUN_KEYS = {"n_layer", "run", "steps", "second_copy_loss", "second_copy_accuracy", "induction_score",
            "previous_token_score", "icl_score", "phase_change_step", "seconds"}


def run_cli(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("lab") / "emergence"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["emergence", "--out", str(out), *SETTING, "--quiet", "--json"])
    assert code == 0
    lines = stdout.getvalue().splitlines()
    return out, lines, json.loads(lines[-1])


def test_the_two_layer_model_forms_an_induction_head_and_the_control_does_not(lab):
    out, lines, summary = lab
    one, two = summary["runs"]
    assert (one["n_layer"], two["n_layer"]) == (1, 2)
    assert two["induction_score"][0] < 0.2 and two["second_copy_accuracy"][0] < 0.2  # nothing at step 0
    assert two["induction_score"][-1] >= 0.6 and two["second_copy_accuracy"][-1] >= 0.9
    crossed = [next(s for s, v in zip(two["steps"], two[k]) if v >= 0.5)
               for k in ("induction_score", "second_copy_accuracy")]
    assert abs(crossed[0] - crossed[1]) <= 200
    assert two["phase_change_step"] == crossed[0]
    assert one["phase_change_step"] is None
    assert max(one["induction_score"]) <= two["induction_score"][-1] - 0.4
    assert one["second_copy_accuracy"][-1] <= two["second_copy_accuracy"][-1] - 0.4
    assert any(line.split()[:1] == ["2"] and "step" in line for line in lines)  # the table's row


def test_emergence_json_is_as_documented(lab):
    out, _, summary = lab
    assert json.loads((out / "emergence.json").read_text()) == summary
    assert set(summary) == {"settings", "runs"}
    s = summary["settings"]
    assert (s["vocab_size"], s["context"], s["period"], s["steps"], s["layers"]) == (32, 24, [4, 12], 500, [1, 2])
    for r in summary["runs"]:
        assert set(r) == RUN_KEYS
        assert r["steps"] == list(range(0, 501, 25))
        assert all(len(r[k]) == len(r["steps"]) for k in RUN_KEYS if isinstance(r[k], list))
        assert r["run"] == str(out / f"L{r['n_layer']}")
    assert (out / "emergence.png").stat().st_size > 10_000


def test_the_runs_are_ordinary_runs_on_the_repeated_data(lab, capsys):
    out, _, _ = lab
    text = (out / "text" / "train.txt").read_text()
    assert set(text) == set(emergence.ALPHABET[:32])
    row = text[: 4 * 24]  # one row: a segment repeated over four contexts
    period = next(p for p in range(4, 13) if row[p:] == row[:-p])
    assert len(set(row[:period])) == period
    r = run_cli(capsys, "sample", out / "L2", "--prompt", "abcdefgabcd", "--max-new-tokens", "3", "--greedy",
                "--device", "cpu")
    assert r.returncode == 0 and "abcdefgabcdefg" in r.stdout  # it completes a repeat it never saw


def test_inspect_heads_names_the_induction_and_previous_token_heads(lab, capsys, tmp_path):
    out, _, _ = lab
    r = run_cli(capsys, "inspect", "heads", out / "L2", "--out", tmp_path / "heads.png", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    kinds = {(h["layer"], h["kind"]) for h in report["heads"]}
    assert (1, "induction head") in kinds and (0, "previous-token head") in kinds
    assert (0, "induction head") not in kinds
    command = next(line for line in r.stdout.splitlines() if line.startswith("induction head at layer 1"))
    assert f"tinygpt attention {out / 'L2'} --prompt" in command and "--layer 1 --head" in command
    assert (tmp_path / "heads.png").exists()
    r = run_cli(capsys, "inspect", "heads", out / "L1")
    assert r.returncode == 0 and "induction head at" not in r.stdout


def test_bad_settings_are_one_line_errors(capsys, tmp_path):
    for args, words in ((["--period", "10-5"], "MIN <= MAX"), (["--period", "4-20"], "do not fit a context"),
                        (["--period", "x"], "MIN-MAX"), (["--layers", "0,2"], "--layers"),
                        (["--vocab-size", "8", "--period", "4-10", "--context", "32"], "distinct tokens")):
        r = run_cli(capsys, "emergence", "--out", tmp_path / "x", *args)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    r = run_cli(capsys, "emergence", "--out", tmp_path / "full", "--steps", "5")
    assert r.returncode == 2 and (tmp_path / "full" / "mine.txt").read_text() == "keep"


def test_train_probe_interval_probes_any_run(char_data, tmp_path, capsys):
    r = run_cli(capsys, "train", "--data", char_data, "--out", tmp_path / "run", "--n-layer", "1", "--n-head", "2",
                "--n-embd", "16", "--block-size", "16", "--max-iters", "6", "--eval-interval", "6", "--eval-iters", "1",
                "--batch-size", "4", "--device", "cpu", "--probe-interval", "3", "--quiet")
    assert r.returncode == 0, r.stderr
    probed = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in probed if "probe" in x] == [0, 3, 6]
    r = run_cli(capsys, "plot", tmp_path / "run", "--out", tmp_path / "loss.png")
    assert r.returncode == 0 and (tmp_path / "loss.png").exists()


def test_repeated_segments():
    rows = emergence.repeated_segments(200, 40, 20, (3, 9), np.random.default_rng(0))
    periods = set()
    for row in rows:
        p = next(p for p in range(3, 10) if np.array_equal(row[p:], row[:-p]))
        assert len(set(row[:p].tolist())) == p
        periods.add(p)
    assert periods == set(range(3, 10))


def test_the_commands_help_shows_the_labs_defaults():
    import argparse

    from tinygpt.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["emergence"]
    helps = {a.dest: a.help for a in sub._actions}
    d = emergence.EmergenceSettings()
    for field in ("vocab_size", "context", "steps", "probe_interval", "seed", "n_head", "n_embd", "init", "activation",
                  "batch_size", "lr", "warmup", "weight_decay", "device"):
        assert helps[field].endswith(f"({getattr(d, field):g})" if isinstance(getattr(d, field), float)
                                     else f"({getattr(d, field)})"), field
    assert helps["period"].endswith(f"({d.period[0]}-{d.period[1]})") and helps["layers"].endswith("(1,2)")
    assert not d.tie_weights and helps["tie_weights"].endswith("(no)")
    kinds = {a.dest: a.type for a in sub._actions}
    assert (kinds["vocab_size"].high, kinds["context"].high) == (len(emergence.ALPHABET), emergence.MAX_CONTEXT)
