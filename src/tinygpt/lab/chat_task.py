"""A chat task whose answers can be checked exactly, and exact-match accuracy on held-out conversations.

The task (what `make chat-demo` trains on): the system message holds a small table of facts, the
user asks for one, the assistant answers with it:

    system     ann=blue cid=jade dan=gold
    user       cid?
    assistant  jade

Every conversation has its own table (three of four names, in order, each with a colour drawn at
random), so the answer cannot be memorised: the model has to find the name in its context and copy
what follows it. `fact_text` is the same task as plain lines, without the chat structure (a base
model's text): "ann=blue cid=jade dan=gold cid? jade".
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..generate import generate_stream
from ..tokenizer.base import Tokenizer
from ..tokenizer.chat import render_chat_prompt, stop_ids
from ..tokenizer.incremental import IncrementalDecoder

NAMES = ("ann", "bob", "cid", "dan")
COLOURS = ("blue", "gold", "pink", "gray", "jade", "rust", "teal", "plum", "lime", "navy")


def fact_table(rng: random.Random, pairs: int) -> list[tuple[str, str]]:
    """`pairs` distinct names in alphabetical order, each with a colour (colours may repeat)."""
    return [(name, rng.choice(COLOURS)) for name in sorted(rng.sample(NAMES, pairs))]


def fact_conversations(n: int, *, seed: int = 0, pairs: int = 3, exclude: Iterable[dict] = ()) -> list[dict]:
    """n conversations {"messages": [system table, user question, assistant answer]}, as JSONL records.

    Args:
        n: how many.
        seed: the random table and question of each.
        pairs: facts per table.
        exclude: conversations whose tables must not appear (held-out ones): such tables are drawn again.
    """
    rng = random.Random(seed)
    taken = {r["messages"][0]["content"] for r in exclude}
    out = []
    while len(out) < n:
        table = " ".join(f"{k}={v}" for k, v in fact_table(rng, pairs))
        if table in taken:
            continue
        name, colour = rng.choice([pair.split("=") for pair in table.split()])
        out.append({"messages": [
            {"role": "system", "content": table},
            {"role": "user", "content": f"{name}?"},
            {"role": "assistant", "content": colour},
        ]})
    return out


def fact_text(conversations: list[dict]) -> str:
    """The conversations as plain text, one a line (table, question, answer): the task without the chat
    structure, for a base model."""
    return "".join(" ".join(m["content"] for m in r["messages"]) + "\n" for r in conversations)


@dataclass
class ExactMatch:
    """Held-out accuracy: how many replies equal the reference answer exactly, and a few of them."""

    correct: int
    total: int
    examples: list[tuple[str, str, str]]  # (question, reference, reply)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@torch.no_grad()
def exact_match(model, tokenizer: Tokenizer, conversations: list[dict], *, max_new_tokens: int = 12,
                show: int = 3) -> ExactMatch:
    """Greedy replies to each conversation's messages before its last (assistant) turn, compared with it.

    A reply ends at the template's end-of-turn token (or <|endoftext|>, or max_new_tokens).

    Args:
        model: the GPT (its vocabulary covers the tokenizer's).
        tokenizer: a tokenizer with a chat template.
        conversations: {"messages": [..., {"role": "assistant", "content": reference}]} records.
        max_new_tokens: the longest reply.
        show: how many (question, reference, reply) examples to keep.
    """
    model.eval()
    device = next(model.parameters()).device
    stops = stop_ids(tokenizer)
    correct, examples = 0, []
    for record in conversations:
        *context, answer = record["messages"]
        ids = torch.tensor([render_chat_prompt(tokenizer, context)], device=device)
        reply, decoder = [], IncrementalDecoder(tokenizer)
        for token in generate_stream(model, ids, max_new_tokens, greedy=True, stop_tokens=stops,
                                     vocab_size=tokenizer.vocab_size):
            if int(token[0]) in stops:
                break
            reply.append(decoder.push([int(token[0])]))
        text = "".join(reply) + decoder.flush()
        correct += text == answer["content"]
        if len(examples) < show:
            examples.append((context[-1]["content"], answer["content"], text))
    return ExactMatch(correct, len(conversations), examples)
