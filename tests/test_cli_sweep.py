"""`tinygpt sweep` and budget sizing in `tinygpt train` through the command line, bad input included."""

import json
import subprocess
import sys

import pytest

from tinygpt.cli import main
from tinygpt.config import GPTConfig
from tinygpt.sizing import sized_lr

TINY = ["--batch-size", "4", "--block-size", "16", "--eval-iters", "2", "--device", "cpu", "--quiet"]


def tinygpt(*args):
    return subprocess.run([sys.executable, "-m", "tinygpt", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def assert_clean_error(argv, capsys, *fragments):
    """Bad input, run in-process (the same main() the command runs): exit 2 and one line on stderr."""
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinygpt: error: "), captured.err
    for f in fragments:
        assert f in lines[0], lines[0]


def test_sweep_command_runs_resumes_and_reports(char_data, tmp_path):
    out = tmp_path / "sweep"
    r = tinygpt("sweep", "--data", char_data, "--out", out, "--budgets", "1e8", "--sizes", "4K", "--no-plots", *TINY)
    assert r.returncode == 0, r.stderr
    assert "[1/1] C=1e+08" in r.stdout and "val loss" in r.stdout
    assert "no frontier" in r.stdout  # one budget, one size: said plainly, not a crash
    assert "\n1 model (1 trained now" in r.stdout  # once "1 models"
    assert (out / "results.csv").exists() and (out / "fit.json").exists()
    again = tinygpt("sweep", "--data", char_data, "--out", out, "--budgets", "1e8", "--sizes", "4K", "--no-plots",
                    "--json", *TINY)
    assert again.returncode == 0, again.stderr
    assert "done before" in again.stdout and "0 trained now" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["points"] == 1


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--budgets", "0", "1e12"], "--budgets"),
        (["--budgets=-1e12"], "--budgets"),
        (["--budgets", "1e12,soon"], "--budgets"),
        (["--budgets", "1e12", "--sizes", "0"], "--sizes"),
        ([], "--budgets"),
        (["--quick", "--budgets", "1e12"], "--quick"),
        (["--budgets", "1e12", "--sizes", "1M", "--points", "3"], "--sizes"),
        (["--budgets", "1e12", "--points", "0"], "points"),
        (["--budgets", "1e12", "--batch-size", "0"], "--batch-size"),
    ],
)
def test_sweep_bad_input_is_a_clean_error(char_data, tmp_path, capsys, flags, fragment):
    assert_clean_error(["sweep", "--data", char_data, "--out", tmp_path / "s", *flags], capsys, fragment)
    assert not (tmp_path / "s").exists()


def test_train_with_a_time_budget_and_no_model_flags_says_what_it_chose(char_data, tmp_path):
    run = tmp_path / "run"
    r = tinygpt("train", "--data", char_data, "--out", run, "--max-time", "1s", "--device", "cpu", "--batch-size", "4",
                "--eval-iters", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("model: ") and "Chinchilla" in first and "GFLOP/s (measured here)" in first
    assert r.stdout.startswith(("max_time", "max_iters")) and len(r.stdout.strip().splitlines()) == 1
    notes = json.loads((run / "train_config.json").read_text())["notes"]
    assert notes["model_choice"]["rule"] == "chinchilla" and notes["model_choice"]["reason"] == first
    config = json.loads((run / "config.json").read_text())
    assert config == notes["model_choice"]["config"]
    # the choice's learning rate is the run's, unless --lr is given
    saved = json.loads((run / "train_config.json").read_text())["train"]
    assert saved["lr"] == notes["model_choice"]["plan"]["lr"] == pytest.approx(sized_lr(GPTConfig(**config)))
    given = tmp_path / "given"
    r = tinygpt("train", "--data", char_data, "--out", given, "--max-time", "1s", "--device", "cpu",
                "--batch-size", "4", "--eval-iters", "2", "--quiet", "--lr", "7e-4")
    assert r.returncode == 0, r.stderr
    assert json.loads((given / "train_config.json").read_text())["train"]["lr"] == 7e-4


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--sweep", "SWEEP"], "time budget"),
        (["--sweep", "SWEEP", "--max-time", "5s", "--n-layer", "2"], "n_layer"),
        (["--sweep", "SWEEP", "--max-time", "5s", "--preset", "lesson"], "--preset"),
        (["--sweep", "MISSING", "--max-time", "5s"], "no fit.json"),
    ],
)
def test_train_sweep_flag_bad_combinations(char_data, tmp_path, capsys, flags, fragment):
    from test_sweep import LAW, isoflop_records

    from tinygpt.lab.sweep import fit_sweep

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "fit.json").write_text(json.dumps(fit_sweep(isoflop_records(LAW, [1e14, 1e15, 1e16]))))
    flags = [str(sweep) if f == "SWEEP" else str(tmp_path / "missing") if f == "MISSING" else f for f in flags]
    assert_clean_error(["train", "--data", char_data, "--out", tmp_path / "run", *flags], capsys, fragment)
    assert not (tmp_path / "run").exists()


def test_train_sized_by_a_sweep(char_data, tmp_path):
    from tinygpt.calc import PowerLaw
    from tinygpt.lab.sweep import fit_sweep

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    fit = fit_sweep([])
    fit.update(frontier={"params": PowerLaw(2.0, 0.35).to_dict(), "tokens": PowerLaw(0.1, 0.65).to_dict()},
               flops_range=[1e8, 1e12])
    (sweep / "fit.json").write_text(json.dumps(fit))
    r = tinygpt("train", "--data", char_data, "--out", tmp_path / "run", "--sweep", sweep, "--max-time", "1s",
                "--device", "cpu", "--batch-size", "4", "--eval-iters", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("model: ") and f"the sweep in {sweep}" in r.stderr.splitlines()[0]
    notes = json.loads((tmp_path / "run" / "train_config.json").read_text())["notes"]
    assert notes["model_choice"]["rule"] == "sweep"
