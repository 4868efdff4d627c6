"""`make chat-demo`: supervised fine-tuning on conversations, measured by exact match on held-out ones.

The task (tinygpt.lab.chat_task): the system message holds a small table of facts, the user asks for
one, the assistant answers with it. A base model learns the task's text without the chat structure;
`tinygpt finetune` then trains that same model on the conversations (SFT: fine-tuning with the loss
mask, so only the assistant's tokens are learned), its vocabulary grown by the chat template's
special tokens, each new row the mean embedding. "Before" is the base as fine-tuning starts from it
(tinygpt.finetune.start_model), "after" the fine-tuned run: one model before and after SFT. Both
answer the same held-out conversations through the chat template, greedily; a reply counts when it
equals the answer exactly and ends its turn.

    python benchmarks/chat_demo.py [--out runs/chat-demo] [--conversations 6000] [--sft-iters 3000]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

import tinygpt
from tinygpt.cli import main as tinygpt_main
from tinygpt.finetune import start_model
from tinygpt.lab.chat_task import ExactMatch, exact_match, fact_conversations, fact_text

# GPT-2's block trained by AdamW with cosine, the recipe the figures in docs/tutorials/chat.md came from
MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "96", "--arch", "gpt2"]
BASE_RECIPE = ["--optimizer", "adamw", "--lr-schedule", "cosine"]
TRAIN = ["--batch-size", "16", "--lr", "3e-3", "--warmup", "100", "--eval-iters", "5", "--quiet"]


def run(*args: str) -> None:
    print("$ tinygpt " + shlex.join(args), flush=True)
    code = tinygpt_main(list(args))
    if code:
        raise SystemExit(code)


def score(name: str, model, tokenizer, held: list[dict]) -> ExactMatch:
    """Print and return exact match on `held`, and how many replies at least begin with the answer."""
    result = exact_match(model, tokenizer, held, show=len(held))
    starts = sum(reply.startswith(answer) for _, answer, reply in result.examples)
    print(f"{name:<18} exact match {result.correct:>4}/{result.total} = {100 * result.accuracy:5.1f}%   "
          f"reply starts with the answer: {100 * starts / result.total:5.1f}%")
    for question, answer, reply in result.examples[:3]:
        print(f"    {question:<6} answer {answer!r:<8} reply {reply!r}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/chat-demo")
    parser.add_argument("--conversations", type=int, default=6000)
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--base-iters", type=int, default=600)
    parser.add_argument("--sft-iters", type=int, default=3000)
    args = parser.parse_args()
    out = Path(args.out)
    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    held = fact_conversations(args.heldout, seed=3)
    # neither the base nor the chat run ever sees a held-out table
    (text / "base.txt").write_text(fact_text(fact_conversations(args.conversations, seed=1, exclude=held)))
    records = fact_conversations(args.conversations, seed=2, exclude=held)
    (text / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (text / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))

    run("prepare", str(text / "base.txt"), "--out", str(out / "data-base"))
    run("train", "--data", str(out / "data-base"), "--out", str(out / "base"), "--max-iters", str(args.base_iters),
        "--eval-interval", str(args.base_iters), *MODEL, *BASE_RECIPE, *TRAIN)
    # the chat data keeps the base's characters (same ids) and adds the template's tokens after them
    run("prepare", str(text / "chat.jsonl"), "--format", "chat", "--tokenizer-file", str(out / "base"),
        "--out", str(out / "data-chat"))
    run("finetune", str(out / "base"), "--data", str(out / "data-chat"), "--out", str(out / "chat"),
        "--max-iters", str(args.sft_iters), "--eval-interval", "500", *TRAIN)

    base, chat_tok = start_model(out / "base", out / "data-chat")  # the template's tokens: mean embedding rows
    sft, sft_tok = tinygpt.checkpoint.load_run(out / "chat", "cpu")
    print(f"\nheld-out conversations: {len(held)} (tables the training data did not hold)")
    before = score("before SFT (base)", base, chat_tok, held)
    after = score("after SFT", sft, sft_tok, held)
    print(f"SFT gained {100 * (after.accuracy - before.accuracy):.1f} points of exact match "
          f"in {time.perf_counter() - started:.0f} s\n")
    system, user = (m["content"] for m in held[0]["messages"][:2])
    run("chat", str(out / "chat"), "--system", system, "--prompt", user, "--temperature", "0")


if __name__ == "__main__":
    main()
