"""The bench's GRPO row: steps of `tinygpt grpo` (tinygpt.align.grpo_run.grpo, the real run: a group of
completions a prompt sampled on tinygpt's own decoding with the KV cache, the rewards and advantages, the
policy's forward and backward, AdamW) beside steps of TRL's GRPOTrainer on the same model (its Hugging Face
export: transformers' generate, then TRL's loss), with the same prompts, reward function, group size, prompts
a step and completion length, TRL's defaults otherwise (beta 0, the dapo loss, one pass, temperature 1),
float32, in the same process: the milliseconds a step of each, and their ratio. A GRPO step is mostly its
rollouts, so this is where tinygpt's decoding shows. TRL (the dev extra) is imported only in the rows and
their shared policy module, and only when installed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from .policy import implementations, random_policy, run_step_seconds, trl_step_seconds, trl_timing, words

PROMPTS = 64  # prompt rows, of 12-20 words
COMPLETION = 32  # a completion's most tokens, on both sides (a random policy rarely ends one sooner)
REWARD = "bench:variety"  # the name tinygpt's run records the reward by (handed in, never imported)


def variety(prompts: list, completions: list[str], **columns: Any) -> list[float]:
    """The reward both sides score with: a completion's distinct words (it differs within a group, so every step
    has advantages to learn from; TRL's reward-function signature).

    Args:
        prompts: each completion's prompt.
        completions: the completions' texts.
        columns: the rows' other columns (none here).
    """
    return [float(len(set(c.split()))) for c in completions]


def grpo_tinygpt(base: Path, prompts: Path, out: Path, per_step: int, group: int, steps: int, warmup: int) -> float:
    """Median seconds of a `tinygpt grpo` step (after `warmup` untimed ones), from the run's own timing."""
    from ...align.grpo_run import grpo
    from ...align.rewards import Reward
    from ...config.grpo import GRPOConfig
    from ...config.train import TrainConfig

    cfg = GRPOConfig(prompts=str(prompts), rewards=(REWARD,), num_generations=group, max_completion_length=COMPLETION,
                     eval_size=1, pass_k=0)
    train = TrainConfig(max_iters=warmup + steps, batch_size=per_step * group, lr=1e-6, lr_schedule="constant",
                        warmup=0, eval_interval=10**6, eval_iters=1, weight_decay=0.0, dtype="float32", seed=0)
    grpo(base, out, cfg, None, train, rewards=[Reward(REWARD, variety)])
    return run_step_seconds(out, warmup)


def grpo_trl(hf: Path, rows: list[dict[str, str]], out: Path, per_step: int, group: int, steps: int,
             warmup: int) -> float:
    """Median seconds of a TRL GRPOTrainer step (after `warmup` untimed ones): its rollouts (transformers'
    generate with the cache), the rewards, the policy's forward and backward, and the optimizer."""
    import datasets
    import transformers
    import trl

    policy = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(hf, split_special_tokens=False)
    args = trl.GRPOConfig(per_device_train_batch_size=per_step * group, num_generations=group,
                          max_completion_length=COMPLETION, **trl_timing(out, warmup + steps))
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=variety, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(rows))
    return trl_step_seconds(trainer, warmup)


def grpo_rows(per_step: int, group: int, steps: int, peers: bool, log) -> list[dict[str, Any]]:
    """The GRPO row: tinygpt's step and, with `peers` and TRL installed, TRL's, on the same model and prompts.

    Args:
        per_step: prompts a step.
        group: completions a prompt (num_generations).
        steps: timed steps (after 2 untimed).
        peers: measure TRL beside tinygpt.
        log: called with each row's line.
    """
    warmup = 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, hf, rng = random_policy(root)
        prompts = [{"prompt": words(rng, rng.randint(12, 20)).strip()} for _ in range(PROMPTS)]
        (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
        for impl in implementations("grpo", peers, log):
            seconds = (grpo_tinygpt(base, root / "prompts.jsonl", root / "run", per_step, group, steps, warmup)
                       if impl == "tinygpt" else grpo_trl(hf, prompts, root / "trl", per_step, group, steps, warmup))
            rows.append({"model": "qwen2 4x256", "impl": impl, "dtype": "float32", "prompts": per_step, "group": group,
                         "completion": COMPLETION, "ms_per_step": seconds * 1000})
            log(f"grpo  qwen2 4x256 {impl:16s} float32  {per_step} prompts x {group}, {COMPLETION} tokens: "
                f"{seconds * 1000:10,.0f} ms a step")
    return rows
