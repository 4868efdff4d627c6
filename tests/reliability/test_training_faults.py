"""Faults inside training: a NaN loss or gradient stops the run before the optimizer step, with
exit code 3 (the only code `tinygpt train` uses for it) and the step-before's checkpoint on disk;
gradient clipping holds exploding gradients to the norm it is given."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tinygpt import cli
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.train import train

from . import faults

pytestmark = pytest.mark.reliability

# lr == min_lr and one warmup step: the same rate at every step whatever --max-iters (a run's warmup is at most
# a tenth of its length), so a run stopped at step K - 1 and one that fails at K agree up to it
MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
         "--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "1", "--eval-iters", "1", "--device", "cpu", "--quiet"]
K = 5  # the step that goes wrong


@pytest.fixture(scope="module")
def before_k(char_data, tmp_path_factory):
    """The weights of a run trained straight to step K - 1."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert cli.main([str(a) for a in ("train", "--data", char_data, "--out", run, "--max-iters", K - 1,
                                      "--eval-interval", 1, *MODEL)]) == 0
    return load_file(run / "model.safetensors")


@pytest.mark.parametrize("fault, what", [("nan-loss", "the loss is nan"), ("nan-grad", "the gradient norm is nan")])
def test_a_nan_at_step_k_stops_before_the_update(char_data, tmp_path, monkeypatch, capsys, before_k, fault, what):
    run = tmp_path / "run"
    updates = []
    real_step = torch.optim.AdamW.step

    def counted_step(self, *args, **kw):
        updates.append(1)
        return real_step(self, *args, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted_step)
    faults.inject(fault, K, monkeypatch.setattr)
    code = cli.main([str(a) for a in ("train", "--data", char_data, "--out", run, "--max-iters", 20,
                                      "--eval-interval", 1, *MODEL)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_NONFINITE == 3
    assert len(err) == 1 and f"step {K}: {what}; stopped before the update" in err[0], err
    assert "the last checkpoint" in err[0] and "is unchanged" in err[0]
    assert len(updates) == K - 1  # no optimizer step for step K
    after = load_file(run / "model.safetensors")  # the step-(K-1) checkpoint, equal to a run stopped there
    assert after.keys() == before_k.keys() and all(torch.equal(after[k], before_k[k]) for k in after)
    assert all(torch.isfinite(t).all() for t in after.values())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == K - 1  # nothing logged for the step that failed


def test_a_nan_before_the_first_checkpoint_says_none_was_saved(char_data, tmp_path, monkeypatch, capsys):
    faults.inject("nan-loss", 2, monkeypatch.setattr)
    code = cli.main([str(a) for a in ("train", "--data", char_data, "--out", tmp_path / "run", "--max-iters", 20,
                                      "--eval-interval", 10, *MODEL)])
    err = capsys.readouterr().err
    assert code == 3 and "no checkpoint was saved" in err and "last checkpoint" not in err, err
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_exit_code_3_is_only_for_a_nonfinite_stop(char_data, tmp_path, capsys):
    """Other failures of `tinygpt train` exit 2: 3 tells a script the run diverged, nothing else."""
    bad = ["train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "r"), *MODEL]
    assert cli.main(bad) == 2
    assert cli.main(["train", "--data", str(char_data), "--out", str(tmp_path / "r"), *MODEL, "--n-head", "3"]) == 2
    assert "not divisible by n_head=3" in capsys.readouterr().err


def test_clipping_holds_exploding_gradients_to_max_norm(char_data, tmp_path, monkeypatch):
    """Gradients scaled by 1e6 (the loss times 1e6): the norm logged is the unclipped one, and the
    gradients the optimizer sees have norm <= grad_clip."""
    train_module = __import__("tinygpt.train.objectives", fromlist=["batch_loss"])
    real_loss = train_module.batch_loss
    monkeypatch.setattr(train_module, "batch_loss", lambda model, batch, device: real_loss(model, batch, device) * 1e6)
    clipped = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *args, **kw):
        parameters = list(parameters)
        total = real_clip(parameters, max_norm, *args, **kw)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters if p.grad is not None]))
        clipped.append((float(total), float(after), max_norm))
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    model = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    cfg = TrainConfig(batch_size=4, max_iters=5, eval_interval=5, eval_iters=1, grad_clip=1.0, device="cpu",
                      dtype="float32")
    train(char_data, tmp_path / "run", model, cfg, progress=False)
    assert len(clipped) == 5
    for before, after, max_norm in clipped:
        assert max_norm == 1.0 and before > 1e4 and math.isfinite(before)
        assert after <= max_norm * (1 + 1e-5)
    logged = [json.loads(x)["grad_norm"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "grad_norm" in x]
    assert logged == pytest.approx([c[0] for c in clipped])  # the norm before clipping is what is logged
