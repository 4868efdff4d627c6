"""The lesson's worked examples, computed with tinygpt's own objects.

Each function returns what the lesson prints, so tests can compare against the lesson's code, and
tour() turns them into the text `tinygpt lesson` shows step by step. The seeds and sizes are the lesson's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..config.model import GPTConfig
from ..generate import generate_stream
from ..model import GPT, attention, lm_loss

LESSON_SEED = 42


def causal_mask(T: int = 5) -> torch.Tensor:
    """The lower-triangular mask: row t has ones at the positions token t may attend to."""
    return torch.tril(torch.ones(T, T)).int()


@dataclass
class AttentionTrace:
    scores: torch.Tensor  # (T, T) raw scores Q K^T / sqrt(d_k), before the mask
    weights: torch.Tensor  # (T, T) after the mask and the softmax
    out: torch.Tensor  # (T, d_k) weights @ V


def attention_trace(seed: int = 7, d_k: int = 4, T: int = 4) -> AttentionTrace:
    """One head's causal attention on random Q, K, V drawn in the lesson's order (Q, then K, then V)."""
    torch.manual_seed(seed)
    q, k, v = torch.randn(T, d_k), torch.randn(T, d_k), torch.randn(T, d_k)
    out, weights = attention(q, k, v, explicit=True)
    scores = (q @ k.T) / d_k**0.5
    return AttentionTrace(scores=scores, weights=weights, out=out)


def lesson_model(seed: int = LESSON_SEED, **overrides) -> GPT:
    """TinyGPT: the `lesson` preset (vocab 50, d 64, 4 heads, 2 layers, context 8) built under `seed`."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("lesson", **overrides))


def clm_training(steps: int = 20, seed: int = LESSON_SEED, lr: float = 1e-3) -> list[float]:
    """The lesson's CLM loop: 8 random sequences of 8 tokens, input = x[:, :-1], target = x[:, 1:], Adam.

    Returns the loss of every step (the lesson prints steps 1, 5, 10 and 20).
    """
    model = lesson_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    cfg = model.config
    data = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    inp, tgt = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(inp), tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class GenerationStep:
    context: list[int]  # what the model saw (the last block_size tokens)
    token: int  # the argmax of the last position's logits


def greedy_steps(start: tuple[int, ...] | list[int] = (5, 12, 3), max_new: int = 5, seed: int = LESSON_SEED) -> list[GenerationStep]:
    """Greedy generation from `start` with a freshly built TinyGPT, one record per step."""
    model = lesson_model(seed)
    tokens = list(start)
    steps = []
    for token in generate_stream(model, torch.tensor([tokens]), max_new, greedy=True):
        steps.append(GenerationStep(context=tokens[-model.config.block_size :], token=int(token[0])))
        tokens.append(int(token[0]))
    return steps


# ---------------------------------------------------------------------------------------------
# The chapter's common pitfalls, made visible: a model without the causal mask, and how the
# decoding settings trade repetition for incoherence.


def zen_of_python() -> str:
    """A small built-in text: the Zen of Python, from the standard library's `this` module.

    The module stores it ROT13-encoded and prints it when imported, so its source is read instead.
    """
    import ast
    import codecs
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("this")
    source = Path(spec.origin).read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["s"]:
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    raise RuntimeError(f"{spec.origin}: the Zen of Python was not found")  # pragma: no cover


@contextmanager
def _one_thread():
    """Models this small run faster on one thread: syncing two costs more than their arithmetic
    (and on a busy machine, far more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class TinyRun:
    """A character-level model trained for seconds on a small text."""

    model: GPT
    tokenizer: object
    losses: list[float]  # the training loss of every step


def train_tiny(text: str, *, causal: bool = True, steps: int = 300, seed: int = LESSON_SEED,
               block_size: int = 16, batch_size: int = 16, lr: float = 3e-3) -> TinyRun:
    """Train a 2-layer, 64-wide character model on `text` with the lesson's loop (Adam, next-token loss).

    Args:
        text: the training text.
        causal: False trains without the causal mask (the pitfall).
        steps, seed, block_size, batch_size, lr: the run; two runs with the same arguments apart
            from `causal` see the same initial weights and the same batches.
    """
    import numpy as np

    from ..data.batches import get_batch
    from ..tokenizer.char import CharTokenizer

    tokenizer = CharTokenizer.from_text(text)
    tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=2, n_head=4, n_embd=64))
    model.causal = causal
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batches = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        offsets = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=batches)
        x, y = get_batch(tokens, offsets, block_size)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return TinyRun(model, tokenizer, losses)


@torch.no_grad()
def last_position_loss(run: TinyRun, text: str, windows: int = 64, seed: int = 0) -> float:
    """Loss of predicting the token after random windows of `text` from the window's last position only.

    There the future is out of sight even without a mask, as it always is during generation.
    """
    import numpy as np

    from ..data.batches import get_batch

    tokens = np.asarray(run.tokenizer.encode(text), dtype=np.int64)
    block = run.model.config.block_size
    offsets = torch.randint(0, len(tokens) - block, (windows,), generator=torch.Generator().manual_seed(seed))
    x, y = get_batch(tokens, offsets, block)
    return lm_loss(run.model(x)[:, -1:], y[:, -1:]).item()


def continue_text(run: TinyRun, prompt: str, n: int, seed: int = 0, **sampling) -> str:
    """`n` characters after `prompt`; plain loop (no KV cache), which a non-causal model needs."""
    from ..generate import generate

    idx = torch.tensor([run.tokenizer.encode(prompt)])
    out = generate(run.model, idx, n, use_cache=False, generator=torch.Generator().manual_seed(seed),
                   vocab_size=run.tokenizer.vocab_size, **sampling)
    return run.tokenizer.decode(out[0, idx.shape[1] :].tolist())


@dataclass
class MaskPitfall:
    runs: dict[str, TinyRun]  # "masked" and "unmasked"
    steps: int
    train_loss: dict[str, float]  # "masked"/"unmasked": mean loss of the last 20 steps
    last_loss: dict[str, float]  # loss where nothing in the future is visible (as in generation)
    prompt: str
    samples: dict[str, str]  # greedy continuations of the prompt


def causal_mask_pitfall(steps: int = 300, prompt: str = "Beautiful is ", n: int = 60) -> MaskPitfall:
    """The chapter's pitfall 1: the same model trained twice on the Zen of Python, with and without
    the causal mask. Without it, position t reads token t+1 (its own target) and the training loss
    collapses; generation has no future to read, and the text turns to nonsense."""
    text = zen_of_python()
    with _one_thread():
        runs = {"masked": train_tiny(text, causal=True, steps=steps),
                "unmasked": train_tiny(text, causal=False, steps=steps)}
        return MaskPitfall(
            runs=runs,
            steps=steps,
            train_loss={k: sum(r.losses[-20:]) / len(r.losses[-20:]) for k, r in runs.items()},
            last_loss={k: last_position_loss(r, text) for k, r in runs.items()},
            prompt=prompt,
            samples={k: continue_text(r, prompt, n, greedy=True) for k, r in runs.items()},
        )


def distinct_ngrams(text: str, n: int = 4) -> float:
    """Share of the text's character n-grams that are distinct (1.0: no n-gram repeats)."""
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@dataclass
class DecodingSample:
    label: str
    text: str
    distinct4: float  # diversity: share of distinct 4-grams
    loss: float  # the model's own loss on the text, nats per character: how plausible it finds it


DECODING_SETTINGS: list[tuple[str, dict]] = [
    ("greedy", dict(greedy=True)),
    ("temperature 0.8", dict(temperature=0.8)),
    ("top-p 0.9", dict(temperature=1.0, top_p=0.9)),
    ("temperature 2.0", dict(temperature=2.0)),
]


def decoding_pitfall(run: TinyRun | None = None, prompt: str = "Beautiful is ", n: int = 200,
                     seed: int = 1) -> list[DecodingSample]:
    """Pitfalls 3 and 4: greedy decoding repeats itself; too high a temperature makes noise.

    One model (trained on the Zen of Python unless `run` is given), one prompt, four settings.
    """
    import numpy as np

    from ..train.evaluation import evaluate

    out = []
    with _one_thread():
        run = run or train_tiny(zen_of_python())
        for label, sampling in DECODING_SETTINGS:
            text = continue_text(run, prompt, n, seed=seed, **sampling)
            ids = np.asarray(run.tokenizer.encode(prompt + text), dtype=np.int64)
            loss = evaluate(run.model, ids)["loss"]
            out.append(DecodingSample(label, text, distinct_ngrams(text), loss))
    return out


# ---- the tour: what `tinygpt lesson` shows, as text ---------------------------------------------


def _fmt(values, digits: int = 4) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def _section(title: str, why: str) -> str:
    return f"\n== {title}\n   {why}\n"


def _attention_sections() -> Iterator[str]:
    """Sections 1 and 2: the causal mask, then attention for one token."""
    yield _section("1. The causal mask (T=5)", "Row t marks the positions token t may attend to: itself and the past.")
    yield str(causal_mask(5))
    yield _section(
        "2. Causal attention for token 0 (seed 7, d_k=4, T=4)",
        "Scores Q K^T / sqrt(d_k); future positions get -inf, so after the softmax token 0 sees only itself.",
    )
    trace = attention_trace()
    yield f"scores[0]: {_fmt(trace.scores[0])}"
    yield f"attn[0]:   {_fmt(trace.weights[0])}"
    yield f"out[0]:    {_fmt(trace.out[0])}  (= V[0], the only value token 0 can read)"


def _model_sections() -> Iterator[str]:
    """Sections 3 to 5: the lesson's model, its training steps, greedy generation."""
    yield _section(
        "3. TinyGPT (vocab 50, d 64, 4 heads, 2 layers, context 8), seed 42",
        "Token + position embeddings, 2 pre-norm blocks (attention, 4x GELU MLP), final LayerNorm, untied head.",
    )
    model = lesson_model()
    yield f"parameters: {model.num_params():,}"
    yield f"logits shape for a (2, 8) batch: {tuple(model(torch.randint(0, 50, (2, 8))).shape)}"
    yield _section(
        "4. CLM training: 20 Adam steps (lr 1e-3) on 8 random sequences of 8 tokens",
        f"Input x[:, :-1], target x[:, 1:]. Random tokens start near ln(50) = {math.log(50):.4f}.",
    )
    for step, loss in enumerate(clm_training(), start=1):
        mark = "  <- printed by the lesson" if step in (1, 5, 10, 20) else ""
        yield f"step {step:>2}: loss={loss:.4f}{mark}"
    yield _section(
        "5. Greedy generation from [5, 12, 3], 5 new tokens",
        "Each step: run the model on the last 8 tokens, take the argmax of the last position's logits, append.",
    )
    steps = greedy_steps()
    for i, step in enumerate(steps, start=1):
        yield f"step {i}: context {step.context} -> next {step.token}"
    yield f"generated: {steps[0].context + [s.token for s in steps]}"


def _pitfall_sections() -> Iterator[str]:
    """Sections 6 and 7: training without the causal mask; greedy decoding and too high a temperature."""
    yield _section(
        "6. Pitfall: forgetting the causal mask",
        "One tiny character model trained twice on the Zen of Python (300 Adam steps, same start, same batches),\n"
        "   with the mask and without it. Without it, position t reads token t+1 - its own target.",
    )
    pit = causal_mask_pitfall()
    yield f"{'':<44}{'with mask':>10}{'without':>10}"
    yield (f"{'training loss (last 20 steps)':<44}{pit.train_loss['masked']:>10.3f}{pit.train_loss['unmasked']:>10.3f}"
           "   <- collapses without the mask")
    yield (f"{'loss where no future is visible (generation)':<44}{pit.last_loss['masked']:>10.3f}"
           f"{pit.last_loss['unmasked']:>10.3f}   <- what generation really gets")
    yield f"greedy continuation of {pit.prompt!r}:"
    yield f"  with mask:    {pit.samples['masked']!r}"
    yield f"  without mask: {pit.samples['unmasked']!r}"
    yield _section(
        "7. Pitfalls: greedy decoding repeats itself, too high a temperature makes noise",
        "The masked model above continues one prompt four ways. distinct-4: the share of 4-character pieces that\n"
        "   are not repeats (1.0 = none repeats); model loss: how unlikely the model finds its own text (nats/char).",
    )
    for s in decoding_pitfall(pit.runs["masked"], prompt=pit.prompt):
        yield f"{s.label:<16} distinct-4 {s.distinct4:.2f}   model loss {s.loss:.2f}"
        yield "\n".join("    | " + line for line in (pit.prompt + s.text).split("\n"))


def _emergence_section() -> Iterator[str]:
    """Section 8: where the lesson reaches emergent abilities, the labs that show them (nothing trained here)."""
    yield _section(
        "8. Emergent abilities: in-context learning, watched as it forms",
        "Nothing in next-token training asks for in-context learning, yet models learn to read tasks off their\n"
        "   prompt. In small transformers the ability appears abruptly, with an induction head: a layer-2 head\n"
        "   that, at a repeated token, attends to what followed its earlier occurrence, fed by a layer-1 head that\n"
        "   looks one token back.",
    )
    yield "watch it form (about a minute): tinygpt emergence --out runs/emergence   (or: make emergence-demo)"
    yield "score any run's heads:         tinygpt inspect heads RUN"
    yield "few-shot accuracy, measured:   make fewshot-demo, then tinygpt fewshot RUN --task synthetic"


def tour() -> Iterator[str]:
    """The lesson's worked examples one after another, as the text `tinygpt lesson` prints: each item
    one print() (a line, or a section heading), yielded as soon as it is computed, since the last two
    sections train small models and take a while."""
    yield from _attention_sections()
    yield from _model_sections()
    yield from _pitfall_sections()
    yield from _emergence_section()
