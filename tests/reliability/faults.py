"""Faults injected into this process the way the real layer fails, for the reliability tests.

`inject(fault, at, patch)` installs one; `patch(obj, name, value)` is pytest's `monkeypatch.setattr`,
so the test undoes it. Faults on the checkpoint's write path strike the first time the file is
written, after part of the data went out, with the error the real layer raises on a full disk:
    state      train_state.pt: torch.save writing through a file whose write() raises ENOSPC
               (torch reports a RuntimeError whose context is the OSError)
    weights    model.safetensors: safetensors' writer stops half-way with its SafetensorError
               "I/O error: No space left on device (os error 28)"
    config     config.json: the JSON write raises ENOSPC half-way
    fsync      the fsync of the new weights raises ENOSPC (a filesystem that reports at fsync)
    metrics    the metrics.jsonl line of step AT raises ENOSPC
Faults in training (AT is the optimizer step, from 1):
    nan-loss   the loss of step AT is NaN
    nan-grad   the loss of step AT is finite but its gradient is NaN
"""

from __future__ import annotations

import builtins
import errno
import importlib
import os
from pathlib import Path

import torch


class _FullFile:
    """A binary file that accepts `budget` bytes, then fails like a full disk."""

    def __init__(self, f, budget: int) -> None:
        self._f, self._budget = f, budget

    def write(self, data) -> int:
        if len(data) > self._budget:
            self._f.write(bytes(data)[: self._budget])
            self._budget = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _once(predicate):
    """A predicate that is true the first time only."""
    fired = []

    def check(*args) -> bool:
        if not fired and predicate(*args):
            fired.append(True)
            return True
        return False

    return check


def inject(fault: str, at: int | None, patch) -> None:
    checkpoint = importlib.import_module("tinygpt.checkpoint")
    run_folder = importlib.import_module("tinygpt.run_folder")
    objectives = importlib.import_module("tinygpt.train.objectives")

    if fault == "state":
        strike = _once(lambda path, mode: str(path).endswith("train_state.pt.tmp") and "w" in mode)

        def open_(path, mode="r", *args, **kw):
            f = builtins.open(path, mode, *args, **kw)
            return _FullFile(f, 4096) if strike(path, mode) else f

        patch(checkpoint, "open", open_, raising=False)  # a module global: found before the builtin
    elif fault == "weights":
        from safetensors import SafetensorError

        real = checkpoint.save_file
        strike = _once(lambda: True)

        def save_file(tensors, filename, metadata=None):
            if not strike():
                return real(tensors, filename, metadata=metadata)
            real(tensors, filename, metadata=metadata)
            with open(filename, "rb+") as f:
                f.truncate(os.path.getsize(filename) // 2)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        patch(checkpoint, "save_file", save_file)
    elif fault == "config":
        real_write_text = Path.write_text
        strike = _once(lambda path: path.name.startswith(".config.json.tmp"))

        def write_text(self, data, *args, **kw):
            if strike(self):
                real_write_text(self, data[: len(data) // 2], *args, **kw)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write_text(self, data, *args, **kw)

        patch(Path, "write_text", write_text)
    elif fault == "fsync":
        real_fsync = os.fsync
        strike = _once(lambda fd: os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith(".model.safetensors"))

        def fsync(fd):
            if strike(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        patch(os, "fsync", fsync)
    elif fault == "metrics":
        lines = []

        class Metrics:
            def __init__(self, f) -> None:
                self._f = f

            def write(self, text: str) -> int:
                if '"loss"' in text:
                    lines.append(text)
                    if len(lines) == at:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return self._f.write(text)

            def __getattr__(self, name):
                return getattr(self._f, name)

        def open_(path, mode="r", *args, **kw):
            f = builtins.open(path, mode, *args, **kw)
            return Metrics(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f

        patch(run_folder, "open", open_, raising=False)
    elif fault in ("nan-loss", "nan-grad"):
        real_loss = objectives.batch_loss
        calls = []

        class NanGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad * float("nan")

        def batch_loss(model, batch, device):
            loss = real_loss(model, batch, device)
            if torch.is_grad_enabled():  # training steps only, not evaluation
                calls.append(1)
                if len(calls) == at:
                    return loss * float("nan") if fault == "nan-loss" else NanGrad.apply(loss)
            return loss

        patch(objectives, "batch_loss", batch_loss)
    else:
        raise ValueError(f"unknown fault {fault!r}")
