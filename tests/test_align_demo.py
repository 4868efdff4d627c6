"""`make align-demo` (benchmarks/align_demo.py) at the smallest sizes: every command it runs, and what it leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tinygpt
from tinygpt.report import read_report
from tinygpt.run_folder import RunFolder

ROOT = Path(__file__).resolve().parent.parent


def test_the_align_demo_pretrains_then_grpo_and_dpo_with_their_reports_and_plots(tmp_path):
    """The demo pretrains until its target (0 here: the first look), trains with GRPO, then DPO with and
    without the SFT term from the same base, and leaves the runs, the reports with the scores before and
    after, the plots and a summary line each."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(Path(tinygpt.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "align_demo.py"), "--out", str(out), "--target", "0",
                        "--base-steps", "10", "--grpo-steps", "2", "--dpo-steps", "2", "--eval-size", "4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert RunFolder(out / "base").weights_step() == 10
    assert "held-out greedy accuracy at step 10: " in p.stdout
    report = read_report(out / "grpo")
    assert report["objective"] == "grpo" and report["steps"] == 2
    before, after = report["before"]["held_out"], report["after"]["held_out"]
    assert {"accuracy", "pass@1", "pass@8"} <= before.keys() & after.keys()
    assert f"GRPO: held-out greedy accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}" in p.stdout
    assert (out / "grpo.png").stat().st_size > 0
    evals = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "val_accuracy" in r] == [0, 2]
    for name, label, weight in (("dpo", "DPO with the SFT term", 1.0), ("dpo-pure", "pure DPO", 0.0)):
        report = read_report(out / name)
        assert report["objective"] == "dpo" and report["steps"] == 2
        assert RunFolder(out / name).settings("dpo")["sft_weight"] == weight
        pairs = f"{report['before']['pairs']['accuracy']:.3f} -> {report['after']['pairs']['accuracy']:.3f}"
        assert f"{label}: held-out pair accuracy {pairs}, greedy accuracy " in p.stdout
        assert (out / f"{name}.png").stat().st_size > 0
