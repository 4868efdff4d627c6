"""Properties of generation, checked on random inputs (hypothesis): cached decoding chooses what
uncached decoding chooses, for any prompt length (past block_size too) and sampling settings; and
no path returns more than max_new_tokens (generate, generate_stream, the HTTP server).

The tokenizer round trips (byte-level BPE for any text, char for text from its vocabulary) are
property tests in tests/test_tokenizer.py.
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinygpt import GPT, GPTConfig, generate, generate_stream

pytestmark = pytest.mark.reliability

V, BLOCK = 29, 8
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16, init="torch")).eval()


sampling = st.fixed_dictionaries({
    "temperature": st.floats(0.3, 2.0),
    "top_k": st.none() | st.integers(1, V),
    "top_p": st.none() | st.floats(0.05, 1.0),
    "repetition_penalty": st.floats(0.5, 2.0),
})


@torch.no_grad()
def _greedy_agrees(model, prompt: torch.Tensor, out: torch.Tensor) -> bool:
    """Each token the cached loop chose is the uncached model's argmax for the same context, or ties
    it within float rounding (the two paths sum in different orders)."""
    for t in range(prompt.shape[1], out.shape[1]):
        logits = model(out[:, max(0, t - BLOCK) : t])[:, -1]  # (B, V)
        chosen = logits.gather(1, out[:, t : t + 1]).squeeze(1)
        if not bool((chosen >= logits.max(-1).values - 1e-4).all()):
            return False
    return True


@FAST
@given(prompt_len=st.integers(1, 3 * BLOCK), batch=st.integers(1, 3), n=st.integers(0, 2 * BLOCK),
       seed=st.integers(0, 2**31), greedy=st.booleans(), settings_=sampling)
def test_cached_and_uncached_decoding_agree(model, prompt_len, batch, n, seed, greedy, settings_):
    idx = torch.randint(0, V, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    kw = {"greedy": True, "repetition_penalty": settings_["repetition_penalty"]} if greedy else settings_
    cached = generate(model, idx, n, generator=torch.Generator().manual_seed(seed), **kw)
    uncached = generate(model, idx, n, generator=torch.Generator().manual_seed(seed), use_cache=False, **kw)
    assert cached.shape == uncached.shape == (batch, prompt_len + n)
    if greedy and kw["repetition_penalty"] == 1.0:
        assert torch.equal(cached, uncached) or _greedy_agrees(model, idx, cached)
    else:
        assert torch.equal(cached, uncached)


@FAST
@given(prompt_len=st.integers(1, 2 * BLOCK), batch=st.integers(1, 3), n=st.integers(0, 3 * BLOCK),
       stops=st.sets(st.integers(0, V - 1), max_size=6), seed=st.integers(0, 2**31), use_cache=st.booleans())
def test_never_more_than_max_new_tokens(model, prompt_len, batch, n, stops, seed, use_cache):
    idx = torch.randint(0, V, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    steps = list(generate_stream(model, idx, n, stop_tokens=stops, generator=g, use_cache=use_cache))
    assert len(steps) <= n and all(s.shape == (batch,) for s in steps)
    if not stops:
        assert len(steps) == n
    out = generate(model, idx, n, stop_tokens=stops, generator=torch.Generator().manual_seed(seed),
                   use_cache=use_cache)
    assert prompt_len <= out.shape[1] <= prompt_len + n and torch.equal(out[:, :prompt_len], idx)


@pytest.fixture(scope="module")
def http():
    from server_util import NAME, tiny_model, tiny_tokenizer

    from tinygpt.server import create_app

    with TestClient(create_app(tiny_model(block_size=16), tiny_tokenizer(), model_name=NAME, max_tokens=40)) as c:
        yield c


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(max_tokens=st.integers(1, 40), n=st.integers(1, 4), stream=st.booleans(), chat=st.booleans(),
       stop=st.lists(st.text("abcdefgh eo", min_size=1, max_size=2), max_size=4), seed=st.integers(0, 2**31))
def test_the_server_never_returns_more_than_max_tokens(http, max_tokens, n, stream, chat, stop, seed):
    import json

    body = {"model": "tiny", "max_tokens": max_tokens, "n": n, "stop": stop, "seed": seed, "stream": stream}
    if chat:
        route, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hello"}],
                                               "logprobs": True, "top_logprobs": 0}
    else:
        route, body = "/v1/completions", {**body, "prompt": "hello", "logprobs": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    tokens = [0] * n
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
        for c in chunks[:-1]:
            for choice in c["choices"]:
                lp = choice["logprobs"]
                tokens[choice["index"]] += len(lp["content"] if chat else lp["tokens"]) if lp else 0
    else:
        usage = r.json()["usage"]
        for choice in r.json()["choices"]:
            lp = choice["logprobs"]
            tokens[choice["index"]] = len(lp["content"] if chat else lp["tokens"])
    assert all(t <= max_tokens for t in tokens), tokens  # the tokens whose text was sent
    assert usage["completion_tokens"] <= n * max_tokens
