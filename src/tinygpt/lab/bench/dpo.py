"""The bench's DPO row: steps of `tinygpt dpo` (tinygpt.align.preference_run.dpo, the real run: the reference's
forward, the policy's forward and backward, AdamW) beside steps of TRL's DPOTrainer on the same model (its
Hugging Face export, with an explicit frozen reference), the same pairs and batch, float32, in the same
process: the milliseconds a step of each, and their ratio. TRL (the dev extra) is imported only here, and only
when installed."""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...config.model import GPTConfig

# a Qwen2-shaped model a step of which takes a fraction of a second on two cores
DPO_MODEL = dict(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=768,
                 arch="llama", qkv_bias=True, tie_weights=False, dropout=0.0)
PAIRS = 64
WORDS = "the a sky sea grass cat mat is was blue green red sat on in what colour and of to".split()


def trl_available() -> bool:
    """Whether TRL (and the datasets it reads) import."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def _world(root: Path) -> tuple[Path, Path, list[dict[str, str]]]:
    """A random model saved as a tinygpt run and exported to Hugging Face, and PAIRS standard pairs of about
    40 prompt words and 10-20 completion words, prepared with its tokenizer (the run's own data)."""
    from ...checkpoint import save
    from ...data.preference import prepare_preference
    from ...interop.hf import export_hf
    from ...model import GPT
    from ...tokenizer.bpe import BPETokenizer

    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(20_000))
    tok = BPETokenizer.train([text], DPO_MODEL["vocab_size"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**DPO_MODEL))
    save(model, root / "base", tok)
    export_hf(model, tok, root / "hf")

    def words(n: int) -> str:
        return " " + " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"prompt": words(40).strip(), "chosen": words(rng.randint(10, 20)), "rejected": words(rng.randint(10, 20))}
            for _ in range(PAIRS)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_preference(root / "pairs.jsonl", root / "pairs", tokenizer_file=root / "base", val_fraction=0.05)
    return root / "base", root / "pairs", rows


def dpo_tinygpt(base: Path, pairs: Path, out: Path, batch: int, steps: int, warmup: int) -> float:
    """Median seconds of a `tinygpt dpo` step (after `warmup` untimed ones), from the run's own timing."""
    from ...align.preference_run import dpo
    from ...config.preference import DPOConfig
    from ...config.train import TrainConfig
    from ...run_folder import RunFolder

    cfg = TrainConfig(max_iters=warmup + steps, batch_size=batch, lr=1e-6, lr_schedule="constant", warmup=0,
                      eval_interval=10**6, eval_iters=1, weight_decay=0.0, dtype="float32", seed=0)
    dpo(base, pairs, out, DPOConfig(sft_weight=0.0), None, cfg)  # TRL's sigmoid loss alone
    lines = [json.loads(line) for line in RunFolder(out).metrics_file.read_text().splitlines()]
    steps_logged = [r for r in lines if "tokens_per_s" in r]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *steps_logged], steps_logged)]
    return statistics.median(n / r["tokens_per_s"] for n, r in list(zip(tokens, steps_logged))[warmup:])


def dpo_trl(hf: Path, rows: list[dict[str, str]], out: Path, batch: int, steps: int, warmup: int) -> float:
    """Median seconds of a TRL DPOTrainer step (after `warmup` untimed ones): its training_step, the reference's
    log-probs, the policy's forward and backward, and the optimizer, timed between its step callbacks."""
    import time

    import datasets
    import transformers
    import trl

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    policy = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(hf, split_special_tokens=False)
    args = trl.DPOConfig(output_dir=str(out), beta=0.1, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                         per_device_train_batch_size=batch, max_steps=warmup + steps, learning_rate=1e-6,
                         lr_scheduler_type="constant", logging_steps=10**6, disable_dropout=True, seed=0,
                         disable_tqdm=True)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(rows), callbacks=[Clock()])
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line is not the bench's to print
    trainer.train()
    return statistics.median(times[warmup:])


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
        impls = ["tinygpt", *(["trl"] if peers and trl_available() else [])]
        if peers and len(impls) == 1:
            log("dpo: TRL is not installed (the dev extra): measuring tinygpt's DPO step alone")
        for impl in impls:
            seconds = (dpo_tinygpt(base, pairs, root / "run", batch, steps, warmup) if impl == "tinygpt"
                       else dpo_trl(root / "hf", train_rows, root / "trl", batch, steps, warmup))
            rows.append({"model": "qwen2 4x256", "impl": impl, "dtype": "float32", "batch": batch, "ms_per_step":
                         seconds * 1000})
            log(f"dpo   qwen2 4x256 {impl:16s} float32  {batch} pairs: {seconds * 1000:10,.0f} ms a step")
    return rows
