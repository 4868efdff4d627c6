"""`make align-demo`: the course's last stage on two CPU cores, from nothing, in a few minutes.

A tiny model learns to add from worked sums; then a checker alone teaches it further:

    1. pretrain   a 2-layer, 64-wide model of Qwen3's layout (90K parameters, a byte-level tokenizer) on the
                  addition task's worked examples ("37+58=95", one a line: the prompt and its answer, the
                  data SFT would train on), at a constant rate, stopped once it answers 40% of the held-out
                  prompts: room to improve, and samples right often enough for a reward to say something
    2. GRPO       `tinygpt grpo --task addition` for a minute: groups of 8 sampled answers to 8 training
                  prompts a step, each scored 1 or 0 by the task's checker; the report compares the held-out
                  prompts' greedy accuracy and pass@k before and after, and `tinygpt plot` draws the reward,
                  the accuracy and the completions' length against steps

The held-out prompts are never trained on (tinygpt.align.tasks splits the operand pairs once and for all).
Then the preference half on the same base: pairs of its own answers (the right one chosen, its own wrong one
rejected), `tinygpt dpo` with the SFT term (the default) and pure (--sft-weight 0), each with its report and
plot: the pairs' preference accuracy rises in both, and the held-out greedy accuracy with the SFT term only
(pure DPO pushes the chosen answers' log-probs down with the rejected ones: its known collapse).

    python benchmarks/align_demo.py [--out runs/align-demo] [--target 0.4] [--grpo-time 60s] [--dpo-steps 200]
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from tinygpt.align.tasks import task
from tinygpt.cli import main as tinygpt_main
from tinygpt.report import read_report

# Qwen3's layout at a size two cores train in a minute: rotary positions, RMSNorm, SwiGLU, grouped-query
# attention, QK-norm, an untied head (the modern recipe's block, trained by Muon: `tinygpt train`'s defaults)
MODEL = ["--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
         "--intermediate-size", "128", "--block-size", "32"]
# a constant rate: accuracy rises smoothly with the steps, where a decay at the end of a short run turns 10%
# into 80% within a hundred steps and leaves nothing for GRPO to do
PRETRAIN = ["--batch-size", "32", "--lr", "3e-3", "--lr-schedule", "constant", "--warmup", "10"]
WORKED_SUMS = 20_000  # lines of the pretraining text
CHUNK = 50  # pretraining steps between two looks at the held-out accuracy (its leap takes a hundred)


def run(*args: str) -> None:
    print("$ tinygpt " + shlex.join(args), flush=True)
    code = tinygpt_main(list(args))
    if code:
        raise SystemExit(code)


def held_out_accuracy(folder: Path, n: int) -> float:
    """The share of the first n held-out prompts a run answers right, greedily: GRPO's "before" on them."""
    from tinygpt.align.rollouts import sample_groups
    from tinygpt.checkpoint import load_run
    from tinygpt.config.sampling import SampleConfig

    add = task("addition")
    model, tok = load_run(folder, "cpu")
    rows = add.rows("held-out", n)
    answers = sample_groups(model, [tok.encode(row["prompt"]) for row in rows], 1, 5,
                            config=SampleConfig(greedy=True), stop_tokens=tok.encode(add.end))
    return sum(add.correct(tok.decode(answers.ids(i)), row["answer"]) for i, row in enumerate(rows)) / n


def pretrain(out: Path, target: float, most: int, n: int) -> Path:
    """The base: the task's worked examples as a byte-level text (its bytes and an end of text, the token
    TRL's standard preference pairs close with), and a model trained on them CHUNK steps at a time (a resumed
    run goes on as if it never stopped) until it answers `target` of the held-out prompts, or `most` steps.
    Its accuracy leaps where it learns to carry, at a step that moves by hundreds with any small change (a
    warmup of 20 steps instead of 10 left it at 14% after 900 steps, not 44%): a fixed count would not."""
    text = out / "text" / "sums.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(task("addition").text(WORKED_SUMS, seed=1))
    data, base = out / "data", out / "base"
    run("prepare", str(text), "--tokenizer", "bpe", "--vocab-size", "257", "--out", str(data))
    step = 0
    while step < most:
        step = min(step + CHUNK, most)
        first = [*MODEL, *PRETRAIN] if step <= CHUNK else ["--resume"]
        run("train", "--data", str(data), "--out", str(base), *first, "--max-iters", str(step),
            "--eval-interval", str(CHUNK), "--quiet")
        accuracy = held_out_accuracy(base, n)
        print(f"held-out greedy accuracy at step {step}: {accuracy:.3f}", flush=True)
        if accuracy >= target:
            break
    return base


def grpo(out: Path, base: Path, budget: str, steps: int | None, eval_size: int) -> dict:
    """GRPO on the addition task from the base, its report, and its picture; the held-out scores before and
    after, and the seconds it trained."""
    length = ["--max-iters", str(steps)] if steps else ["--max-time", budget]
    run("grpo", str(base), "--task", "addition", "--out", str(out / "grpo"), "--lr", "3e-4", *length,
        "--eval-interval", "100", "--eval-size", str(eval_size), "--quiet")
    run("plot", str(out / "grpo"), "--out", str(out / "grpo.png"), "--title", "GRPO on the addition task")
    report = read_report(out / "grpo")
    return {"before": report["before"]["held_out"], "after": report["after"]["held_out"],
            "seconds": report["train_seconds"]}


def dpo(out: Path, base: Path, steps: int, eval_size: int) -> dict[str, dict]:
    """DPO from the base on pairs of its own answers, with the SFT term and without; each run's held-out pair
    accuracy and greedy accuracy before and after."""
    from preference import dpo_pairs, write_pairs  # benchmarks/preference.py: the tutorial's pairs

    from tinygpt.checkpoint import load_run

    add = task("addition")
    model, tok = load_run(base, "cpu")
    pairs = write_pairs(out / "pairs", dpo_pairs(model, tok, add, add.rows("train", 10 * eval_size, seed=7), 1),
                        dpo_pairs(model, tok, add, add.rows("held-out", eval_size, seed=7), 2), base)
    scores, greedy_before = {}, held_out_accuracy(base, eval_size)
    for name, weight in (("dpo", "1"), ("dpo-pure", "0")):
        run("dpo", str(base), "--data", str(pairs), "--out", str(out / name), "--sft-weight", weight, "--lr", "3e-4",
            "--lr-schedule", "constant", "--batch-size", "16", "--max-iters", str(steps),
            "--eval-interval", str(max(1, steps // 4)), "--quiet")
        run("plot", str(out / name), "--out", str(out / f"{name}.png"), "--title", f"DPO, sft weight {weight}")
        report = read_report(out / name)
        scores[name] = {"pairs": (report["before"]["pairs"]["accuracy"], report["after"]["pairs"]["accuracy"]),
                        "greedy": (greedy_before, held_out_accuracy(out / name, eval_size))}
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/align-demo")
    parser.add_argument("--target", type=float, default=0.4, help="the held-out accuracy pretraining stops at")
    parser.add_argument("--base-steps", type=int, default=3000, help="pretraining's most steps")
    parser.add_argument("--grpo-time", default="60s", help="GRPO's time budget")
    parser.add_argument("--grpo-steps", type=int, help="GRPO's steps instead of a time budget")
    parser.add_argument("--dpo-steps", type=int, default=200, help="each DPO run's steps")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out prompts each evaluation answers")
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    base = pretrain(out, args.target, args.base_steps, args.eval_size)
    scores = grpo(out, base, args.grpo_time, args.grpo_steps, args.eval_size)
    preferred = dpo(out, base, args.dpo_steps, args.eval_size)
    before, after = scores["before"], scores["after"]
    print(f"\nGRPO: held-out greedy accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
          f"({after['accuracy'] - before['accuracy']:+.3f}) in {scores['seconds']:.0f} s of training; "
          f"pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f}")
    for name, label in (("dpo", "DPO with the SFT term"), ("dpo-pure", "pure DPO")):
        (pb, pa), (gb, ga) = preferred[name]["pairs"], preferred[name]["greedy"]
        print(f"{label}: held-out pair accuracy {pb:.3f} -> {pa:.3f}, greedy accuracy {gb:.3f} -> {ga:.3f}")
    print(f"the whole demo: {time.perf_counter() - started:.0f} s; runs, reports and {out / 'grpo.png'} in {out}")


if __name__ == "__main__":
    main()
