"""`tinygpt` with a trace of what each process trained on: `python tests/traced_train.py DIR ARGS...`
runs `tinygpt ARGS...` (under torchrun too) with a Tracer added to every tinygpt.train.train call,
so process R writes DIR/rank{R}.jsonl (its pid, the batch offsets of every micro-step by step, how
it ended) and DIR/rank{R}.safetensors (its parameters at the end, in full).

The tests in one process install it with `trace_cli(DIR, monkeypatch.setattr)` instead."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tinygpt.train import TrainCallback


class Tracer(TrainCallback):
    """Writes the trace of one process (see the module's docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.file, self.rank, self.offsets = Path(folder), None, 0, []

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def on_start(self, start) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = start.rank
        self.file = open(self.folder / f"rank{start.rank}.jsonl", "a")
        self._write({"rank": start.rank, "world_size": start.world_size, "pid": os.getpid()})

    def on_batch(self, offsets: torch.Tensor) -> None:
        self.offsets.append(offsets.tolist())

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        self._write({"step": record["step"], "offsets": self.offsets})
        self.offsets = []

    def on_end(self, result, model: torch.nn.Module) -> None:
        from safetensors.torch import save_file

        from tinygpt.distributed import full_parameters

        params = full_parameters(model)  # a collective under FSDP: every process is here
        save_file(params, str(self.folder / f"rank{self.rank}.safetensors"))
        self._write({"end": result.step, "stopped": result.stopped})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def trace_cli(folder: str | Path, patch) -> list:
    """Make every tinygpt.train.train call (the CLI's among them) add a Tracer writing to `folder`.
    `patch(obj, name, value)` is setattr or pytest's monkeypatch.setattr; returns the list of the
    tracers made, one per call, so a caller can tell that the CLI went through train()."""
    import tinygpt.cli  # noqa: F401  (its modules, if they hold `train` themselves, are patched too)

    train_module = importlib.import_module("tinygpt.train.loop")
    real, tracers = train_module.train, []

    def traced(*args, callbacks=(), **kwargs):
        tracers.append(Tracer(Path(folder)))
        return real(*args, callbacks=[*callbacks, tracers[-1]], **kwargs)

    homes = ("tinygpt.train", "tinygpt.train.loop")  # the package's name for it, and where it is defined
    for name, module in list(sys.modules.items()):
        if name in homes or (name.startswith("tinygpt.cli") and getattr(module, "train", None) is real):
            patch(module, "train", traced)
    return tracers


def main(argv: list[str]) -> int:
    from tinygpt import cli

    tracers = trace_cli(argv[0], setattr)
    code = cli.main(argv[1:])
    if not tracers:
        print("traced_train: the command never called tinygpt.train.train, so nothing was traced", file=sys.stderr)
        return 99
    return code


if __name__ == "__main__":
    from tinygpt.cli import leave

    leave(main(sys.argv[1:]))
