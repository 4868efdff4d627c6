"""Which setting keeps an induction head from forming? The emergence lab's 2-layer run, one change at a time.

The lab's defaults are the lesson's settings (PyTorch's init, an untied head, exact GELU, no weight
decay) at a 32-token context. Each row below changes one of them (the last row changes GPT-2's
three together: its init, tied weights and a 64-token context) and trains the same data, seed and
steps; it reports the step where the best induction score first reaches 0.5 (the phase change), and
the best induction score and second-copy accuracy at the end.

    python benchmarks/emergence_ablation.py [--out runs/emergence-ablation] [--steps 2000] [--seeds 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch

from tinygpt.lab.emergence import EmergenceSettings, run_emergence

CHANGES = {
    "defaults (the lesson's settings)": {},
    "GPT-2 init": {"init": "gpt2"},
    "tied weights": {"tie_weights": True},
    "context 64": {"context": 64},
    "tanh GELU": {"activation": "gelu_tanh"},
    "weight decay 0.1": {"weight_decay": 0.1},
    "GPT-2 init + tied weights + context 64": {"init": "gpt2", "tie_weights": True, "context": 64},
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/emergence-ablation")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--only", help="run only the changes whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out)
    rows = []
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'change':<42} {'seed':>4} {'phase change':>12} {'induction':>9} {'copy acc.':>9} {'time':>6}")
    for name, change in CHANGES.items():
        if args.only and args.only not in name:
            continue
        for seed in (int(s) for s in args.seeds.split(",")):
            settings = dataclasses.replace(EmergenceSettings(steps=args.steps, probe_interval=25, layers=(2,),
                                                             seed=seed), **change)
            folder = out / f"{'-'.join(f'{k}={v}' for k, v in change.items()) or 'defaults'}-seed{seed}"
            shutil.rmtree(folder, ignore_errors=True)
            t0 = time.perf_counter()
            run = run_emergence(folder, settings, plot=False)["runs"][0]
            seconds = time.perf_counter() - t0
            step = run["phase_change_step"]
            rows.append({"change": name, "settings": change, "seed": seed, "phase_change_step": step,
                         "induction_score": run["induction_score"][-1],
                         "second_copy_accuracy": run["second_copy_accuracy"][-1], "seconds": round(seconds, 1)})
            print(f"{name:<42} {seed:>4} {'none' if step is None else step:>12} {run['induction_score'][-1]:9.3f} "
                  f"{run['second_copy_accuracy'][-1]:9.3f} {seconds:5.0f}s", flush=True)
    (out / "ablation.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out / 'ablation.json'}")


if __name__ == "__main__":
    main()
