"""Killed at any moment, or out of disk space mid-save, a training run loses at most one save
interval and never its checkpoint.

Kills: `tinygpt train` saving every step is killed with SIGKILL at random moments (a few trials by
default, 30 in `make reliability`), then resumed each time. After each kill the folder must hold a
complete checkpoint no more than one save interval behind the last step the killed run logged,
and the next --resume must load it and go on; at the end the weights must equal, bit for bit, a
run trained straight to the same step.

Full disk: each write of a save fails in turn (tests/reliability/faults.py injects ENOSPC the
way each writer reports it), and once more for real, through the kernel's file size limit. The
previous checkpoint must stay byte-identical, the command must exit with one clear line, and a
later --resume must carry on from that checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinygpt.checkpoint import load, load_training, weights_step
from tinygpt.cli import main

from . import faults

pytestmark = pytest.mark.reliability

# lr == min_lr and one warmup step (a run's warmup is at most a tenth of its length, at least one step): the
# schedule does not depend on --max-iters, so runs of different lengths agree step for step; constant, so the
# only saves are the checkpoints these tests break (a WSD run this short saves before-decay/ as well); one
# thread: the same arithmetic in every process
MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
         "--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "1", "--lr-schedule", "constant", "--eval-iters", "1", "--device", "cpu", "--quiet"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CHECKPOINT = ("config.json", "model.safetensors", "tokenizer.json", "train_state.pt")


def tinygpt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinygpt", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=ENV)


def logged_steps(run: Path) -> list[int]:
    file = run / "metrics.jsonl"
    if not file.exists():
        return []
    steps = []
    for line in file.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def temp_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if ".tmp" in p.name) if run.exists() else []


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ---- kills ------------------------------------------------------------------------------------


def pending_step(file: Path) -> int | None:
    """The step of a training state a kill left as train_state.pt.tmp (None: cut short itself)."""
    try:
        return torch.load(file, weights_only=True)["step"]
    except Exception:
        return None


def metrics_inode(run: Path) -> int | None:
    try:
        return os.stat(run / "metrics.jsonl").st_ino
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("trials", [3, pytest.param(30, marks=pytest.mark.slow)])
def test_sigkill_at_random_moments_then_resume(char_data, tmp_path, trials, figure):
    run = tmp_path / "run"
    rng = random.Random(trials)
    base = ["train", "--data", char_data, "--out", run]
    inside_save = rolled_forward = 0
    resumed_from = []
    for trial in range(trials):
        step = weights_step(run) if (run / "model.safetensors").exists() else 0
        inode = metrics_inode(run)
        p = subprocess.Popen([sys.executable, "-m", "tinygpt", *map(str, base), "--max-iters", "100000",
                              "--eval-interval", "1", *MODEL, "--resume"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
        if trial % 3 == 0:  # any moment: starting up, loading, finishing a cut-short save, training
            time.sleep(rng.uniform(0.0, 3.0))
        else:  # a moment of training: once this process has logged a step of its own
            deadline = time.monotonic() + 60
            while p.poll() is None and time.monotonic() < deadline:
                # a resume rewrites metrics.jsonl (a new file) before it logs step + 1
                if metrics_inode(run) not in (None, inode) and max(logged_steps(run), default=0) > step:
                    break
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.5))
        assert p.poll() is None, p.stderr.read()  # still training: the kill comes mid-run
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stderr.close()
        if not (run / "model.safetensors").exists():
            continue  # killed before its first save: the next --resume starts afresh
        logged = logged_steps(run)
        inside_save += bool(temp_files(run))
        step = weights_step(run)
        pending = run / "train_state.pt.tmp"
        if pending.exists() and pending_step(pending) == step:
            rolled_forward += 1  # killed between the two renames: the resume finishes the save
        # a complete checkpoint, at most one save interval (one step) behind what was logged
        assert load(run) is not None
        assert not logged or step >= max(logged) - 1, (step, max(logged))
        resumed_from.append(step)
    # one last resume: it must load what the last kill left, and finish
    final = max(resumed_from, default=0) + 3
    r = tinygpt(*base, "--max-iters", final, "--eval-interval", 1, *MODEL, "--resume")
    assert r.returncode == 0, r.stderr
    assert load_training(run)["step"] == final and temp_files(run) == []
    assert logged_steps(run) == list(range(1, final + 1))  # each step logged once: resumes redo, never skip
    straight = tmp_path / "straight"
    r = tinygpt("train", "--data", char_data, "--out", straight, "--max-iters", final, "--eval-interval", final,
                *MODEL)
    assert r.returncode == 0, r.stderr
    assert same_weights(run, straight)  # every resume continued exactly where its checkpoint was
    assert len(resumed_from) >= trials // 2  # most trials got past a first save
    figure(f"SIGKILL trials survived ({trials} kills)", f"{trials} of {trials}",
           f"{inside_save} kills left a save unfinished, {rolled_forward} of them between its two renames "
           f"(rolled forward); no resume lost more than 1 step; the final weights equal a straight run's")


def test_killed_before_its_first_save_resumes_as_it_began(char_data, tmp_path):
    """--resume on a run that has no checkpoint yet starts it over with the model and settings it
    began with (train_config.json records them before the first step), not the data's default."""
    run = tmp_path / "run"
    began = ["--n-layer", "1", "--n-head", "2", "--n-embd", "24", "--block-size", "8", "--batch-size", "3",
             "--eval-iters", "1", "--device", "cpu", "--quiet"]
    p = subprocess.Popen([sys.executable, "-m", "tinygpt", "train", "--data", str(char_data), "--out", str(run),
                          "--max-iters", "100000", "--eval-interval", "100000", *began],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline and len(logged_steps(run)) < 2:
        time.sleep(0.05)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stderr.close()
    assert not (run / "model.safetensors").exists()
    r = tinygpt("train", "--data", char_data, "--out", run, "--resume", "--max-iters", 3, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "starting it over with the settings it began with" in r.stderr
    config = json.loads((run / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["block_size"]) == (1, 24, 8)
    settings = json.loads((run / "train_config.json").read_text())
    assert settings["train"]["batch_size"] == 3 and settings["train"]["max_iters"] == 3
    assert settings["notes"]["model_choice"]["rule"] == "given"
    assert logged_steps(run) == [1, 2, 3]  # the killed run's steps are not kept


# ---- a full disk --------------------------------------------------------------------------------


def cli(capsys, *args) -> tuple[int, list[str]]:
    """`tinygpt ARGS` in this process: its exit code and its stderr lines."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def saved_run(char_data, tmp_path_factory):
    """A run with a checkpoint at step 2 (eval-interval 2), and its files' bytes."""
    run = tmp_path_factory.mktemp("disk") / "run"
    assert main([str(a) for a in ("train", "--data", char_data, "--out", run, "--max-iters", 2,
                                  "--eval-interval", 2, *MODEL)]) == 0
    return run, {name: (run / name).read_bytes() for name in CHECKPOINT}


def copy_run(saved_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_run[0], out)
    return out


def assert_checkpoint_unchanged(run: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (run / name).read_bytes() == data, f"{name} changed"
    assert temp_files(run) == []


KEPT = "could not save the checkpoint of step 4: No space left on device; the checkpoint of step 2 is unchanged"


@pytest.mark.parametrize("fault, message", [("state", KEPT), ("weights", KEPT), ("config", KEPT), ("fsync", KEPT),
                                            ("metrics", "No space left on device: ")])
def test_a_full_disk_keeps_the_previous_checkpoint(saved_run, char_data, tmp_path, monkeypatch, capsys, fault,
                                                   message):
    run = copy_run(saved_run, tmp_path)
    args = ["train", "--data", char_data, "--out", run, "--resume", "--max-iters", 6, "--eval-interval", 2, *MODEL]
    with monkeypatch.context() as m:
        faults.inject(fault, 1, m.setattr)
        code, lines = cli(capsys, *args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tinygpt: error: "), lines
    assert message in lines[0], lines[0]
    assert_checkpoint_unchanged(run, saved_run[1])
    assert cli(capsys, *args)[0] == 0  # space again: the run carries on from step 2
    assert load_training(run)["step"] == 6 and logged_steps(run) == list(range(1, 7))


def test_a_real_write_failure_from_the_kernel(saved_run, char_data, tmp_path):
    """No injection: the kernel refuses writes past a file size limit (RLIMIT_FSIZE, EFBIG) set just
    above the small files, so the new training state and weights cannot be written."""
    run = copy_run(saved_run, tmp_path)
    files = saved_run[1]
    limit = max(len(files["config.json"]), len(files["tokenizer.json"]), 64 * 1024)
    assert limit < len(files["model.safetensors"]) < len(files["train_state.pt"])

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = ["train", "--data", char_data, "--out", run, "--resume", "--max-iters", 4, "--eval-interval", 2, *MODEL]
    r = subprocess.run([sys.executable, "-m", "tinygpt", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=ENV, preexec_fn=limit_file_size)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "could not save the checkpoint of step 4: File too large; the checkpoint of step 2 is unchanged" in lines[0]
    assert_checkpoint_unchanged(run, files)


def test_a_metrics_line_cut_short_does_not_stop_a_resume(saved_run, char_data, tmp_path, capsys):
    """A disk that filled up (or a power cut) in the middle of a metrics.jsonl line: the resume drops
    the broken line with the others after the checkpoint, and goes on."""
    run = copy_run(saved_run, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "tokens": 19')
    args = ["train", "--data", char_data, "--out", run, "--resume", "--max-iters", 4, "--eval-interval", 2, *MODEL]
    assert cli(capsys, *args)[0] == 0
    assert logged_steps(run) == [1, 2, 3, 4]
