"""Helpers for the server tests: a tiny random model, and a real uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import torch

import tinygpt
from tinygpt.tokenizer import CharTokenizer

# printable ASCII and a newline: enough for the chat template and ordinary prompts
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
NAME = "tiny"


def tiny_model(block_size: int = 32, seed: int = 0, vocab_size: int | None = None) -> tinygpt.GPT:
    """A randomly initialised 2-layer GPT. PyTorch's default init gives logits with clear gaps
    between tokens, so greedy choices do not flip on float rounding between batch sizes."""
    torch.manual_seed(seed)
    cfg = tinygpt.GPTConfig(vocab_size=vocab_size or len(CHARS), block_size=block_size, n_layer=2, n_head=2,
                            n_embd=32, init="torch", tie_weights=False)
    return tinygpt.GPT(cfg).eval()


def tiny_tokenizer() -> CharTokenizer:
    return CharTokenizer(CHARS)


# The sampling setting that poison_sampler's fault recognises: a request with top_k 13 is poisoned.
POISON_TOP_K = 13


def poison_sampler(patch) -> None:
    """Make choosing a token raise for sequences sampled with top_k=POISON_TOP_K, and only those: a
    fault no request can cause once the known ones are fixed, to test that one failing sequence ends
    alone. `patch(obj, name, value)`: pytest's monkeypatch.setattr, or setattr in a server process."""
    from tinygpt.server import scheduler

    real = scheduler.choose

    def choose(processed, cfg, generator=None):
        if cfg.top_k == POISON_TOP_K:
            raise RuntimeError("injected sampling fault")
        return real(processed, cfg, generator)

    patch(scheduler, "choose", choose)


def save_tiny_run(path, block_size: int = 32):
    """A run folder (config.json, model.safetensors, tokenizer.json) `tinygpt serve` can load."""
    return tinygpt.save(tiny_model(block_size), path, tiny_tokenizer())


def stopping_model(tok, prompt: list[int], block_size: int = 64):
    """A tiny random model that, at temperature 0, answers `prompt` with a few tokens and then its end of
    turn: lm_head's rows of the end token and of the first new token of its greedy answer trade places,
    which changes nothing before that point (the input embeddings are untied and stay)."""
    model = tiny_model(block_size, vocab_size=tok.vocab_size)
    end = tok.special_ids()[tok.chat_template.end]
    answer = tinygpt.generate(model, torch.tensor([prompt]), 6, greedy=True)[0, len(prompt):].tolist()
    k = next(k for k in range(1, len(answer)) if answer[k] not in answer[:k] and end not in answer[: k + 1])
    with torch.no_grad():
        w = model.lm_head.weight
        w[[end, answer[k]]] = w[[answer[k], end]]
    return model, tok.decode(answer[:k])


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` with uvicorn on a free port in a background thread; yields the base URL."""
    import uvicorn

    from tinygpt.server import listen

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll until predicate() is truthy; returns its value or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(interval)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()

