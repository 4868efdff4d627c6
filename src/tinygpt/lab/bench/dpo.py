"""The bench's DPO row: steps of `tinygpt dpo` (tinygpt.align.preference_run.dpo, the real run: the reference's
forward, the policy's forward and backward, AdamW) beside steps of TRL's DPOTrainer on the same model (its
Hugging Face export, with an explicit frozen reference), the same pairs and batch, float32, in the same
process: the milliseconds a step of each, and their ratio. TRL (the dev extra) is imported only in the rows and
their shared policy module, and only when installed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from .policy import implementations, random_policy, run_step_seconds, trl_step_seconds, trl_timing, words

PAIRS = 64


def _world(root: Path) -> tuple[Path, Path, list[dict[str, str]]]:
    """The bench's policy (policy.random_policy), and PAIRS standard pairs of about 40 prompt words and 10-20
    completion words, prepared with its tokenizer (the run's own data)."""
    from ...data.preference import prepare_preference

    base, _, rng = random_policy(root)
    rows = [{"prompt": words(rng, 40).strip(), "chosen": words(rng, rng.randint(10, 20)),
             "rejected": words(rng, rng.randint(10, 20))} for _ in range(PAIRS)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_preference(root / "pairs.jsonl", root / "pairs", tokenizer_file=base, val_fraction=0.05)
    return base, root / "pairs", rows


def dpo_tinygpt(base: Path, pairs: Path, out: Path, batch: int, steps: int, warmup: int) -> float:
    """Median seconds of a `tinygpt dpo` step (after `warmup` untimed ones), from the run's own timing."""
    from ...align.preference_run import dpo
    from ...config.preference import DPOConfig
    from ...config.train import TrainConfig

    cfg = TrainConfig(max_iters=warmup + steps, batch_size=batch, lr=1e-6, lr_schedule="constant", warmup=0,
                      eval_interval=10**6, eval_iters=1, weight_decay=0.0, dtype="float32", seed=0)
    dpo(base, pairs, out, DPOConfig(sft_weight=0.0), None, cfg)  # TRL's sigmoid loss alone
    return run_step_seconds(out, warmup)


def dpo_trl(hf: Path, rows: list[dict[str, str]], out: Path, batch: int, steps: int, warmup: int) -> float:
    """Median seconds of a TRL DPOTrainer step (after `warmup` untimed ones): its training_step, the reference's
    log-probs, the policy's forward and backward, and the optimizer, timed between its step callbacks."""
    import datasets
    import transformers
    import trl

    policy = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(hf, split_special_tokens=False)
    args = trl.DPOConfig(beta=0.1, per_device_train_batch_size=batch, **trl_timing(out, warmup + steps))
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(rows))
    return trl_step_seconds(trainer, warmup)


def dpo_rows(batch: int, steps: int, peers: bool, log) -> list[dict[str, Any]]:
    """The DPO row: tinygpt's step and, with `peers` and TRL installed, TRL's, on the same model and pairs.

    Args:
        batch: pairs a step.
        steps: timed steps (after 2 untimed).
        peers: measure TRL beside tinygpt.
        log: called with each row's line.
    """
    warmup = 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, pairs, train_rows = _world(root)
        for impl in implementations("dpo", peers, log):
            seconds = (dpo_tinygpt(base, pairs, root / "run", batch, steps, warmup) if impl == "tinygpt"
                       else dpo_trl(root / "hf", train_rows, root / "trl", batch, steps, warmup))
            rows.append({"model": "qwen2 4x256", "impl": impl, "dtype": "float32", "batch": batch, "ms_per_step":
                         seconds * 1000})
            log(f"dpo   qwen2 4x256 {impl:16s} float32  {batch} pairs: {seconds * 1000:10,.0f} ms a step")
    return rows
