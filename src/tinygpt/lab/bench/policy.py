"""What the bench's DPO and GRPO rows share: the policy they train (a random Qwen2-shaped model saved as a tinygpt
run and exported to Hugging Face, its tokenizer a BPE of random words), text of those words, and a step's time
as each side measures it (the tinygpt run's own per-step timing; TRL's step callbacks). TRL (the dev extra) is
imported only here and in the rows, and only when installed."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ...config.model import GPTConfig

# a Qwen2-shaped model a step of which takes a fraction of a second on two cores
POLICY_MODEL = dict(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=256,
                    intermediate_size=768, arch="llama", qkv_bias=True, tie_weights=False, dropout=0.0)
WORDS = "the a sky sea grass cat mat is was blue green red sat on in what colour and of to".split()


def implementations(row: str, peers: bool, log) -> list[str]:
    """Who a row times: tinygpt, and TRL beside it where `peers` asks and TRL (with the datasets it reads) imports;
    where it does not, a line says so.

    Args:
        row: the row's name (dpo, grpo).
        peers: measure TRL beside tinygpt.
        log: called with the line.
    """
    if not peers:
        return ["tinygpt"]
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        log(f"{row}: TRL is not installed (the dev extra): measuring tinygpt's {row.upper()} step alone")
        return ["tinygpt"]
    return ["tinygpt", "trl"]


def trl_timing(out: Path, steps: int) -> dict[str, Any]:
    """The settings of a TRL trainer's config that the rows time it with: on the CPU in float32, `steps` steps at a
    constant tiny rate, no dropout, nothing logged, saved or drawn.

    Args:
        out: its output folder.
        steps: max_steps, the untimed ones included.
    """
    return dict(output_dir=str(out), use_cpu=True, bf16=False, report_to=[], save_strategy="no", max_steps=steps,
                learning_rate=1e-6, lr_scheduler_type="constant", logging_steps=10**6, disable_dropout=True, seed=0,
                disable_tqdm=True)


def random_policy(root: Path) -> tuple[Path, Path, random.Random]:
    """A random POLICY_MODEL with a BPE tokenizer of WORDS, saved as a tinygpt run (root/base) and exported to
    Hugging Face (root/hf); and the random generator the rows draw their text from.

    Args:
        root: an empty folder.
    """
    from ...checkpoint import save
    from ...interop.hf import export_hf
    from ...model import GPT
    from ...tokenizer.bpe import BPETokenizer

    rng = random.Random(0)
    tok = BPETokenizer.train([words(rng, 20_000).strip()], POLICY_MODEL["vocab_size"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**POLICY_MODEL))
    save(model, root / "base", tok)
    export_hf(model, tok, root / "hf")
    return root / "base", root / "hf", rng


def words(rng: random.Random, n: int) -> str:
    """n random WORDS, a space before each.

    Args:
        rng: the draws.
        n: how many.
    """
    return " " + " ".join(rng.choice(WORDS) for _ in range(n))


def run_step_seconds(run: Path, warmup: int) -> float:
    """The median seconds of a tinygpt run's optimizer steps after the first `warmup`, from its own timing (each
    step's tokens over its tokens a second).

    Args:
        run: the run folder.
        warmup: untimed steps.
    """
    from ...run_folder import RunFolder

    lines = [json.loads(line) for line in RunFolder(run).metrics_file.read_text().splitlines()]
    steps = [r for r in lines if "tokens_per_s" in r]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *steps], steps)]
    return statistics.median(n / r["tokens_per_s"] for n, r in list(zip(tokens, steps))[warmup:])


def trl_step_seconds(trainer: Any, warmup: int) -> float:
    """Train a TRL trainer and return the median seconds of its steps after the first `warmup`: its training_step
    (a GRPO step's rollouts included), backward and optimizer, timed between its step callbacks.

    Args:
        trainer: a TRL trainer, its max_steps set.
        warmup: untimed steps.
    """
    import transformers

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    trainer.add_callback(Clock())
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line is not the bench's to print
    trainer.train()
    return statistics.median(times[warmup:])
