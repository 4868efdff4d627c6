"""What DPO and a reward model do to a small task model, on two CPU cores: the figures of the tutorial
"Align a model: preferences" (docs/tutorials/align-preferences.md).

    .venv/bin/python benchmarks/preference.py [--out DIR] [--base-steps 2800] [--dpo-steps 200] [--reward-steps 400]

The task is tinygpt.align.tasks' addition ("37+58=" -> "95"), held-out prompts never trained on. A
Qwen2-shaped model (2 layers, 64 wide, 107K parameters, byte-level tokenizer) is pretrained on worked
examples until it answers about half the held-out prompts; then, from its own answers:

    DPO pairs      the prompt, the right answer chosen, the model's own wrong answer rejected (its greedy
                   answer when that is wrong, else a wrong one of 4 samples): 3,000 train prompts, and the
                   held-out prompts' pairs as the validation split
    reward pairs   the right answer chosen, the same sum with a wrong last digit rejected (a preference a
                   reward model can learn: the last digit is the operands' last digits' sum, mod 10)

It runs `tinygpt dpo` pure (--sft-weight 0) and with the SFT term (1, the default), in full (lr 3e-4) and
with LoRA (rank 8 on attention and the MLP, lr 3e-3), and `tinygpt reward train` (lr 1e-3), and prints,
before and after: the held-out pairs' preference accuracy (the share whose right answer the model finds the
likelier, or scores higher) and the held-out prompts' greedy accuracy (what the task asks); the time of
each run. The pure run's collapse shows in its log-probs: the chosen answers' fall.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HELD_OUT = 400  # held-out prompts: greedy accuracy, and the validation pairs made from them
TRAIN_PROMPTS = 3000


def answers(model, tok, rows, *, greedy: bool, k: int = 1, seed: int = 0) -> list[list[str]]:
    """Each row's k answers (greedy: one), the prompts of one length decoded together."""
    import torch

    from tinygpt.generate import generate

    by_length = defaultdict(list)
    for i, row in enumerate(rows):
        by_length[len(tok.encode(row["prompt"]))].append(i)
    out: list[list[str]] = [[] for _ in rows]
    g = torch.Generator().manual_seed(seed)
    for n, idx in by_length.items():
        x = torch.tensor([tok.encode(rows[i]["prompt"]) for i in idx for _ in range(k)])
        written = generate(model, x, 5, greedy=greedy, stop_tokens=tok.encode("\n"), generator=g)[:, n:].tolist()
        for j, i in enumerate(idx):
            out[i] = [tok.decode(w) for w in written[j * k:(j + 1) * k]]
    return out


def accuracy(model, tok, task, rows) -> float:
    """The share of rows the model answers right, greedily."""
    model.eval()
    said = answers(model, tok, rows, greedy=True)
    return sum(task.correct(a[0], r["answer"]) for r, a in zip(rows, said)) / len(rows)


def dpo_pairs(model, tok, task, rows, seed: int) -> list[dict]:
    """The right answer chosen, the model's own wrong one rejected; rows it answers right every time left out."""
    greedy = answers(model, tok, rows, greedy=True)
    sampled = answers(model, tok, rows, greedy=False, k=4, seed=seed)
    pairs = []
    for row, g, s in zip(rows, greedy, sampled):
        wrong = [task.answer_of(a) for a in g + s if not task.correct(a, row["answer"])]
        if wrong and wrong[0] != row["answer"]:
            pairs.append({"prompt": row["prompt"], "chosen": row["answer"] + "\n", "rejected": wrong[0] + "\n"})
    return pairs


def reward_pairs(rows, seed: int) -> list[dict]:
    """The right answer chosen, the same sum with another last digit rejected."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        s = int(row["answer"])
        wrong = s - s % 10 + (s % 10 + rng.randint(1, 9)) % 10
        out.append({"prompt": row["prompt"], "chosen": f"{s}\n", "rejected": f"{wrong}\n"})
    return out


def write_pairs(path: Path, train: list[dict], held_out: list[dict], base: Path) -> Path:
    """The pairs as TRL's standard JSONL, prepared with the base's tokenizer, the held-out ones the val split."""
    from tinygpt.data.preference import prepare_preference

    path.with_suffix(".jsonl").write_text("".join(json.dumps(p) + "\n" for p in train + held_out))
    prepare_preference(path.with_suffix(".jsonl"), path, tokenizer_file=base,
                       val_fraction=len(held_out) / (len(train) + len(held_out)))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="a folder to keep the runs in (default: a temporary one)")
    p.add_argument("--base-steps", type=int, default=2800)
    p.add_argument("--dpo-steps", type=int, default=200)
    p.add_argument("--reward-steps", type=int, default=400)
    args = p.parse_args()

    import torch

    import tinygpt
    from tinygpt import GPTConfig, TrainConfig
    from tinygpt.align.preference_run import dpo, train_reward
    from tinygpt.align.tasks import task
    from tinygpt.config.finetune import FinetuneConfig
    from tinygpt.config.preference import DPOConfig, RewardConfig
    from tinygpt.data.text import prepare
    from tinygpt.tokenizer.bpe import BPETokenizer

    torch.set_num_threads(1)  # one core each, as the TRL figures
    root = Path(args.out or tempfile.mkdtemp(prefix="preference-"))
    root.mkdir(parents=True, exist_ok=True)
    add = task("addition")
    text = add.text(20_000, seed=1)
    (root / "add.txt").write_text(text)
    tok = BPETokenizer.train([text], 257)  # bytes and the end of text: a character each
    prepare([str(root / "add.txt")], root / "text", tokenizer=tok, val_fraction=0.05)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=128, arch="llama", qkv_bias=True, tie_weights=False)
    t0 = time.perf_counter()
    tinygpt.train(root / "text", root / "base", config, TrainConfig(max_iters=args.base_steps, batch_size=32, lr=3e-3,
                                                                      eval_interval=args.base_steps, warmup=20))
    base_s = time.perf_counter() - t0
    base = tinygpt.load(root / "base")
    held, train_rows = add.rows("held-out", HELD_OUT, seed=7), add.rows("train", TRAIN_PROMPTS, seed=7)
    before = accuracy(base, tok, add, held)
    print(f"base: {sum(p.numel() for p in base.parameters()):,} parameters, {args.base_steps} steps in {base_s:.0f}s; "
          f"held-out greedy accuracy {before:.3f}")
    pairs = write_pairs(root / "pairs", dpo_pairs(base, tok, add, train_rows, 1), dpo_pairs(base, tok, add, held, 2),
                        root / "base")
    rows = []
    lora = FinetuneConfig(method="lora", lora_targets=("attn", "mlp"))
    runs = (("DPO, full, sft weight 0", 0.0, None, 3e-4), ("DPO, full, sft weight 1", 1.0, None, 3e-4),
            ("DPO, LoRA, sft weight 1", 1.0, lora, 3e-3))
    for name, weight, ft, lr in runs:
        steps = TrainConfig(max_iters=args.dpo_steps, batch_size=16, lr=lr, lr_schedule="constant", warmup=10,
                            eval_interval=50, eval_iters=10, weight_decay=0.0)
        t0 = time.perf_counter()
        out = root / name.replace(", ", "-").replace(" ", "")
        result = dpo(root / "base", pairs, out, DPOConfig(sft_weight=weight), ft, steps)
        seconds = time.perf_counter() - t0
        b, a = result.report["before"]["pairs"], result.report["after"]["pairs"]
        rows.append({"run": name, "pref_before": b["accuracy"], "pref_after": a["accuracy"],
                     "chosen_before": b["chosen"], "chosen_after": a["chosen"], "task_before": before,
                     "task_after": accuracy(tinygpt.load(result.run), tok, add, held), "seconds": seconds})
    reward_data = write_pairs(root / "reward-pairs", reward_pairs(train_rows, 3), reward_pairs(held, 4), root / "base")
    t0 = time.perf_counter()
    result = train_reward(root / "base", reward_data, root / "reward", RewardConfig(), None,
                          TrainConfig(max_iters=args.reward_steps, batch_size=16, lr=1e-3, lr_schedule="constant",
                                      warmup=10, eval_interval=100, eval_iters=10, weight_decay=0.0))
    b, a = result.report["before"]["pairs"], result.report["after"]["pairs"]
    rows.append({"run": "reward model (last digit)", "pref_before": b["accuracy"], "pref_after": a["accuracy"],
                 "seconds": time.perf_counter() - t0})
    print(f"{'':28}{'held-out pairs':>22}{'chosen log-prob':>22}{'held-out greedy':>22}{'time':>8}")
    for r in rows:
        chosen = f"{r['chosen_before']:9.2f} -> {r['chosen_after']:6.2f}" if "chosen_before" in r else ""
        task_acc = f"{r['task_before']:9.3f} -> {r['task_after']:6.3f}" if "task_before" in r else ""
        print(f"{r['run']:28}{r['pref_before']:12.3f} -> {r['pref_after']:5.3f}{chosen:>22}{task_acc:>22}"
              f"{r['seconds']:7.0f}s")
    print(json.dumps({"base_accuracy": before, "rows": rows}))


if __name__ == "__main__":
    main()
