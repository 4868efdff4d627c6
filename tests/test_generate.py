import copy
import importlib
import os
import time

import pytest
import torch

from tinygpt import GPT, ConfigError, GPTConfig, KVCache, fastpath, generate, generate_stream, quantize
from tinygpt.generate import decode_step, prefill
from tinygpt import kernels
from tinygpt.interop.quantize import FORMATS, FloatLinear, activation_dtype

generate_module = importlib.import_module("tinygpt.generate")  # the package's `generate` is the function


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # init "torch" gives peaked, varied logits, so greedy ties are unlikely
    return GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16, init="torch")).eval()


# the Llama family's choices all at once: rotary positions (Llama 3's scaling, short enough to act
# inside 8 positions), grouped-query attention, qk-norm, q/k/v biases, an untied head
LLAMA = dict(arch="llama", n_head=4, n_kv_head=2, qk_norm=True, qkv_bias=True, tie_weights=False,
             rope_scaling="llama3", rope_factor=4.0, rope_original_context=4, rope_theta=100.0)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def any_model(request, model):
    """The GPT-2 fixture, and a model of the llama layout: every cache test holds for both."""
    if request.param == "gpt2":
        return model
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_embd=16, init="torch", **LLAMA)).eval()


@pytest.mark.parametrize("prompt_len", range(1, 9))
def test_cached_equals_uncached_greedy_batch2(any_model, prompt_len):
    idx = torch.randint(0, 29, (2, prompt_len))
    n = 16 - prompt_len  # continue to 2 x block_size
    a = generate(any_model, idx, n, greedy=True)
    b = generate(any_model, idx, n, greedy=True, use_cache=False)
    assert a.shape == (2, 16)
    assert torch.equal(a, b)


@pytest.mark.parametrize("prompt_len", [1, 4, 8, 11])
def test_cached_equals_uncached_seeded_sampling(any_model, prompt_len):
    idx = torch.randint(0, 29, (2, prompt_len))
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.2)
    a = generate(any_model, idx, 20, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(any_model, idx, 20, generator=torch.Generator().manual_seed(5), use_cache=False, **kw)
    c = generate(any_model, idx, 20, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_prefill_and_decode_step_match_full_forward(any_model):
    idx = torch.randint(0, 29, (3, 6))
    cache = KVCache.for_model(any_model, 3)
    full = any_model(idx)
    torch.testing.assert_close(prefill(any_model, idx[:, :4], cache), full[:, 3], atol=1e-5, rtol=0)
    torch.testing.assert_close(decode_step(any_model, idx[:, 4], cache, 4), full[:, 4], atol=1e-5, rtol=0)
    # per-row positions: the same step expressed with a (B,) position tensor
    torch.testing.assert_close(
        decode_step(any_model, idx[:, 5], cache, torch.full((3,), 5)), full[:, 5], atol=1e-5, rtol=0
    )


def test_the_cache_knows_its_size_before_it_is_allocated(any_model):
    cache = KVCache.for_model(any_model, 3)
    assert KVCache.bytes_for_model(any_model, 3) == cache.k.nbytes + cache.v.nbytes
    assert KVCache.bytes_for_model(any_model, 20_000_000) == (
        20_000_000 * (cache.k.nbytes + cache.v.nbytes) // 3)


def test_cache_slots_hold_sequences_at_different_positions(any_model):
    a, b = torch.randint(0, 29, (1, 5)), torch.randint(0, 29, (1, 3))
    cache = KVCache.for_model(any_model, 2)
    prefill(any_model, a[:, :4], cache.slot(0))
    prefill(any_model, b[:, :2], cache.slot(1))
    logits = decode_step(any_model, torch.tensor([a[0, 4], b[0, 2]]), cache, torch.tensor([4, 2]))
    torch.testing.assert_close(logits[0], any_model(a)[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], any_model(b)[0, -1], atol=1e-5, rtol=0)


def test_stream_yields_each_token(model):
    idx = torch.randint(0, 29, (2, 3))
    steps = list(generate_stream(model, idx, 5, greedy=True))
    assert len(steps) == 5 and all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), generate(model, idx, 5, greedy=True)[:, 3:])


def test_stop_tokens(model):
    idx = torch.randint(0, 29, (2, 3))
    free = generate(model, idx, 12, greedy=True)
    stop = int(free[0, 5])  # the third new token of row 0
    out = generate(model, idx, 12, greedy=True, stop_tokens=[stop])
    row0 = out[0, 3:].tolist()
    first = row0.index(stop)
    assert row0[: first + 1] == free[0, 3 : 3 + first + 1].tolist()
    assert all(t == stop for t in row0[first:])
    # a stop token that every row hits at once ends generation early
    one = idx[:1]
    first_tok = int(generate(model, one, 1, greedy=True)[0, -1])
    assert generate(model, one, 10, greedy=True, stop_tokens=[first_tok]).shape == (1, 4)


def test_zero_new_tokens_and_temperature_zero(model):
    idx = torch.randint(0, 29, (1, 4))
    assert torch.equal(generate(model, idx, 0), idx)
    assert torch.equal(generate(model, idx, 6, temperature=0), generate(model, idx, 6, greedy=True))


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.5), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.2), dict(top_k=0),
     dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan"))],
)
def test_invalid_sampling_settings(model, kwargs):
    with pytest.raises(ConfigError):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


def test_invalid_inputs(model):
    idx = torch.zeros(1, 2, dtype=torch.long)
    for steps in (-1, True):
        with pytest.raises(ConfigError, match="max_new_tokens"):
            generate(model, idx, steps)
    with pytest.raises(ConfigError, match="token ids"):
        generate(model, torch.full((1, 2), 29), 3)
    with pytest.raises(ConfigError, match="shape"):
        generate(model, torch.zeros(2, dtype=torch.long), 3)
    # once an AttributeError ('list' object has no attribute 'dim')
    with pytest.raises(ConfigError, match=r"idx: expected a tensor .* got a list"):
        generate(model, [1, 2, 3], 3)
    # a string was read as its characters (torch's "too many dimensions 'str'"), an id as not iterable
    for stops, message in (("a", "a collection"), (3, "a collection"), ([1.5], "integer token ids"),
                           ([True], "integer token ids")):
        with pytest.raises(ConfigError, match=f"stop_tokens: expected {message}"):
            generate(model, idx, 3, stop_tokens=stops)
    # ids in any collection of integers: a set, a tensor, numpy's integers
    import numpy as np

    for stops in ({5}, torch.tensor([5]), np.array([5])):
        assert generate(model, idx, 3, stop_tokens=stops).shape == (1, 5)


def test_compiled_decoding_refuses_what_it_cannot_compile(model):
    from tinygpt.interop.quantize import on_cpu_kernels

    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ConfigError, match="use_cache=False has none"):
        generate(model, idx, 3, compile=True, use_cache=False)
    assert not on_cpu_kernels(model) and not on_cpu_kernels(quantize(copy.deepcopy(model), "fp32", pack=False))
    converted = quantize(copy.deepcopy(model), "int8")
    if on_cpu_kernels(converted):  # fbgemm's or tinygpt's kernels, where this CPU has them
        with pytest.raises(ConfigError, match="CPU kernels torch.compile cannot trace"):
            generate(converted, idx, 3, compile=True)


@pytest.mark.slow  # a first compile takes tens of seconds on a CPU; tests/test_gpu.py runs it on a GPU
@pytest.mark.parametrize("rows", [1, 2])
def test_compiled_decoding_gives_eager_s_tokens(model, rows):
    idx = torch.randint(0, 29, (rows, 3), generator=torch.Generator().manual_seed(4))
    n = 2 * model.config.block_size  # past block_size: the cache is rebuilt, then decoded into again
    assert torch.equal(generate(model, idx, n, greedy=True, compile=True), generate(model, idx, n, greedy=True))


@pytest.mark.parametrize("use_cache", [True, False])
def test_observer_sees_every_step_and_changes_nothing(model, use_cache):
    from tinygpt.config import SampleConfig
    from tinygpt.sampling import process_logits

    idx = torch.randint(0, 29, (2, 5))
    kw = dict(temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.3)
    seen = []
    traced = generate(model, idx, 12, generator=torch.Generator().manual_seed(3), use_cache=use_cache,
                      observer=seen.append, **kw)
    plain = generate(model, idx, 12, generator=torch.Generator().manual_seed(3), use_cache=use_cache, **kw)
    assert torch.equal(traced, plain)
    assert [s.step for s in seen] == list(range(12))
    for s in seen:
        start = 5 + s.step
        # the context is what the model saw: the last block_size (8) tokens before this step
        assert torch.equal(s.context, traced[:, max(0, start - 8) : start])
        with torch.no_grad():  # the trace's tensors come from inference mode
            torch.testing.assert_close(s.logits, model(s.context)[:, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(s.processed, process_logits(s.logits, traced[:, :start], SampleConfig(**kw)))
        assert torch.equal(s.token, traced[:, start])
        assert torch.all(torch.isfinite(s.processed.gather(1, s.token.unsqueeze(1))))  # never a filtered token


def test_observer_greedy_choice_is_the_top_processed_logit(model):
    seen = []
    generate(model, torch.randint(0, 29, (1, 3)), 6, greedy=True, repetition_penalty=1.5, observer=seen.append)
    assert len(seen) == 6
    for s in seen:
        assert int(s.token[0]) == int(s.processed[0].argmax())


def test_static_cache_path_matches_the_trimmed_one(any_model, monkeypatch):
    # Under torch.compile (and on accelerators) attention reads the whole cache buffer behind a
    # mask instead of the positions written so far: both must give the same logits.
    idx = torch.randint(0, 29, (2, 6))
    trimmed_cache, static_cache = KVCache.for_model(any_model, 2), KVCache.for_model(any_model, 2)
    trimmed = [prefill(any_model, idx[:, :3], trimmed_cache)]
    trimmed += [decode_step(any_model, idx[:, p], trimmed_cache, p) for p in range(3, 6)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert static_cache.span(torch.tensor([3]))[0] == static_cache.max_len
    static = [prefill(any_model, idx[:, :3], static_cache)]
    static += [decode_step(any_model, idx[:, p], static_cache, p) for p in range(3, 6)]
    for a, b in zip(trimmed, static):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


class PaddingLover(GPT):
    """A GPT whose padded ids (28 and up, past a 28-character tokenizer) get the largest logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out[..., 28:] += 100.0
        return out


def test_ids_past_the_tokenizers_vocabulary_are_never_generated():
    torch.manual_seed(0)
    model = PaddingLover(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, init="torch")).eval()
    idx = torch.randint(0, 28, (2, 3))
    assert int(generate(model, idx, 5, greedy=True)[:, 3:].min()) >= 28  # unmasked, padding wins
    for use_cache in (True, False):
        greedy = generate(model, idx, 20, greedy=True, vocab_size=28, use_cache=use_cache)
        hot = generate(model, idx, 20, temperature=1.5, generator=torch.Generator().manual_seed(0), vocab_size=28,
                       use_cache=use_cache)
        assert int(greedy.max()) < 28 and int(hot.max()) < 28
    streamed = list(generate_stream(model, idx, 20, temperature=1.5, top_k=40, vocab_size=28))
    assert int(torch.stack(streamed).max()) < 28
    with pytest.raises(ConfigError, match="vocab_size"):
        generate(model, idx, 2, vocab_size=0)


def _whole_step_in_one_call(fmt) -> bool:
    # quantize's float32 formats and the plain float32 model on tinygpt's kernels: one DecodePlan call
    return kernels.lowbit() is not None and (fmt is None or activation_dtype(fmt, "cpu") is torch.float32)


# GPT-2's block, and the llama family's as SmolLM2 (grouped-query), Llama 3 (rope scaling, untied), Qwen2 (q/k/v
# biases), Qwen3 (qk-norm, heads wider than n_embd / n_head) and the modern block's ReLU squared have it
LAYOUTS = [
    dict(), dict(bias=False, activation="gelu", tie_weights=False, scale_embeddings=True),
    dict(arch="llama", n_head=4, n_kv_head=2),
    dict(arch="llama", n_head=4, n_kv_head=1, tie_weights=False, rope_theta=5e5, rope_scaling="llama3", rope_factor=8.0,
         rope_original_context=4),
    dict(arch="llama", n_kv_head=1, qkv_bias=True, intermediate_size=96),
    dict(arch="llama", n_head=4, n_kv_head=2, head_size=32, qk_norm=True),
    dict(arch="llama", mlp="relu2", qk_norm=True, layer_norm_eps=1e-6),
]


@pytest.mark.parametrize("fmt", [None, *FORMATS])  # None: the plain float model, as training leaves it
@pytest.mark.parametrize("arch", LAYOUTS)
def test_the_fast_decode_step_equals_the_model_s_own_path(fmt, arch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**dict(vocab_size=32, block_size=12, n_layer=2, n_head=2, n_embd=64, init="torch"), **arch}))
    model.eval()
    for norm in (m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))):
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)  # not all ones, so a norm left out or misplaced shows
    if fmt is not None:
        model = quantize(model, fmt)
    one_call = _whole_step_in_one_call(fmt)
    assert (fastpath._plan(model) is not None) == one_call
    idx = torch.randint(0, 32, (2, 5))
    fast_cache, model_cache = KVCache.for_model(model, 2), KVCache.for_model(model, 2)
    with torch.inference_mode():
        # the prompt's 10 rows: one call into the plan too (fastpath.prompt), where the step is one; against
        # the model's forward a token at a time (each row on the decoding rows' kernels: a whole prompt's
        # forward multiplies int8 weights by the prompt quantized with one scale, bf16 ones in bfloat16)
        assert (fastpath.prompt(model, idx, fast_cache) is not None) == one_call
        first = prefill(model, idx, fast_cache)
        ours = [model(idx[:, t:t + 1], model_cache, torch.tensor([t]))[:, -1] for t in range(5)][-1]
        if one_call:
            torch.testing.assert_close(first, ours, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fast_cache.k, model_cache.k, rtol=0, atol=1e-6)
            torch.testing.assert_close(fast_cache.v, model_cache.v, rtol=0, atol=1e-6)
        else:  # no plan: prefill is the model's forward, and the steps below start from its cache on both sides
            prefill(model, idx, model_cache)
        for pos in range(5, 8):
            token = torch.randint(0, 32, (2,))
            assert fastpath.applies(model, token, fast_cache, pos)
            fast = fastpath.step(model, token, fast_cache, pos)
            ours = model(token.view(-1, 1), model_cache, torch.tensor([pos]))[:, -1]
            if one_call:  # its own LayerNorm and attention loops: float32 rounding apart
                torch.testing.assert_close(fast, ours, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(fast_cache.k, model_cache.k, rtol=0, atol=1e-6)
                torch.testing.assert_close(fast_cache.v, model_cache.v, rtol=0, atol=1e-6)
            else:  # the same operators from Python: bit for bit
                assert torch.equal(fast, ours)
                assert torch.equal(fast_cache.k, model_cache.k) and torch.equal(fast_cache.v, model_cache.v)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_the_one_call_step_computes_each_row_alone_and_follows_the_model_s_layers(fmt):
    if not _whole_step_in_one_call(fmt):
        pytest.skip("tinygpt's kernels do not run this format here")
    torch.manual_seed(0)
    model = quantize(GPT(GPTConfig(vocab_size=32, block_size=40, n_layer=2, n_head=4, n_embd=64)).eval(), fmt)
    idx = torch.randint(0, 32, (3, 20))
    batch, alone = KVCache.for_model(model, 3), KVCache.for_model(model, 1)
    with torch.inference_mode():
        for row in range(3):  # a row at a time: int8 prompts quantize the whole input with one scale
            prefill(model, idx[row:row + 1], batch.slot(row))
        prefill(model, idx[1:2], alone)
        for pos in range(20, 30):  # a row's logits and cache are the same in a batch of 3 as alone
            token = idx[:, pos - 20]
            both = fastpath.step(model, token, batch, pos), fastpath.step(model, token[1:2].int(), alone, pos)
            assert torch.equal(both[0][1:2], both[1])  # (int32 ids too, as the model's own path takes them)
        assert torch.equal(batch.k[:, 1:2, :, :30], alone.k[:, :, :, :30])
        before = fastpath.step(model, token[1:2], alone, 30)
        # a layer swapped for another one: the next step computes with the new layer
        model.lm_head = FloatLinear(torch.nn.Linear(64, 32, bias=False))
        after = fastpath.step(model, token[1:2], alone, 30)
    assert after.shape == before.shape and not torch.allclose(after, before)
    torch.testing.assert_close(after, model(token[1:2].view(1, 1), alone, torch.tensor([30]))[:, -1])
    twin = copy.deepcopy(model)  # a model that has decoded still copies, and the copy decodes alike
    with torch.inference_mode():
        assert torch.equal(fastpath.step(twin, token[1:2], alone, 30), after)


def test_a_model_in_the_cpu_s_cache_reads_its_float32_weights_four_rows_at_a_time_to_the_same_sums(monkeypatch):
    if not _whole_step_in_one_call(None):
        pytest.skip("tinygpt's kernels cannot be built here")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=12, n_layer=2, n_head=2, n_embd=64)).eval()
    specs = [fastpath._kernel_spec(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(s[2].numel() * 4 + (s[4].numel() * 4 if s[4] is not None else 0) for s in specs)
    steps = []
    for cache, fits in ((2 * weights, True), (2 * weights - 4, False), (None, False)):
        monkeypatch.setattr(fastpath, "last_level_cache", lambda: cache)
        assert fastpath._in_cache(specs) == fits
        plan, kv = fastpath._build(model), KVCache.for_model(model, 1)
        steps.append(plan.step(torch.tensor([3]), 0, kv.k, kv.v))
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[0], steps[2])  # 4 rows or 1: the same sums


def test_decode_step_takes_the_fast_path_only_where_it_applies(model, monkeypatch):
    calls = []
    real = fastpath.step
    monkeypatch.setattr(fastpath, "step", lambda *a: calls.append(a[3] if isinstance(a[3], int) else a[3].tolist())
                        or real(*a))
    idx = torch.randint(0, 29, (2, 4))
    cache = KVCache.for_model(model, 2)
    prefill(model, idx, cache)
    decode_step(model, idx[:, 0], cache, 4)
    decode_step(model, idx[:, 0], cache, torch.tensor([5, 4]))  # a position per row (the server's batch): fine
    decode_step(model, idx[:1, 0], cache.slot(0), 6)  # a one-row view of the cache: fine
    assert calls == [4, [5, 4], 6]
    model.train()
    try:
        decode_step(model, idx[:, 0], cache, 7)  # training mode (dropout): the model's forward
    finally:
        model.eval()
    assert calls == [4, [5, 4], 6]
    assert not fastpath.applies(model, idx[:, 0], cache, 8)  # past block_size: the model raises its error
    assert not fastpath.applies(model, idx[:, 0], cache, torch.tensor([3, 8]))  # one row past it


def test_a_short_prompt_runs_in_one_call_and_a_longer_one_through_the_model():
    if not _whole_step_in_one_call(None):
        pytest.skip("tinygpt's kernels cannot be built here")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=40, n_layer=2, n_head=2, n_embd=16, init="torch")).eval()
    rows = fastpath.PROMPT_ROWS
    for shape, one_call in (((1, rows), True), ((2, rows // 2), True), ((1, rows + 1), False),
                            ((2, rows // 2 + 1), False)):
        idx = torch.randint(0, 29, shape)
        want = model(idx)[:, -1]
        forwards = []
        hook = model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
        with torch.inference_mode():
            logits = prefill(model, idx, KVCache.for_model(model, shape[0]))
        hook.remove()
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert forwards == ([] if one_call else [shape])


def test_a_short_continuation_of_a_cached_text_runs_in_one_call():
    # a prompt cache's continuation, or a draft's reading (tinygpt.speculative): the rows after the cache's, at
    # their positions, seeing what it holds; their last row's logits those of the whole text's forward
    if not _whole_step_in_one_call(None):
        pytest.skip("tinygpt's kernels cannot be built here")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=40, n_layer=2, n_head=2, n_embd=16, init="torch",
                          arch="llama", qk_norm=True)).eval()
    idx = torch.randint(0, 29, (1, 30))
    cache = KVCache.for_model(model, 1)
    forwards = []
    with torch.inference_mode():
        prefill(model, idx[:, :21], cache)
        hook = model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
        logits = prefill(model, idx[:, 21:], cache, start=21)
        hook.remove()
        torch.testing.assert_close(logits, model(idx)[:, -1], rtol=1e-5, atol=1e-5)
    assert forwards == []


def test_a_model_in_training_mode_generates_without_dropout_and_keeps_its_mode():
    # a freshly built GPT is in training mode: with dropout its greedy text changed from call to
    # call and the cache and the reference disagreed
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.5))
    assert model.training
    idx = torch.tensor([[1, 2, 3]])
    runs = [generate(model, idx, 12, greedy=True, use_cache=cache) for cache in (True, True, False)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    seeded = [generate(model, idx, 12, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert torch.equal(*seeded)
    assert model.training  # put back as it was
    stream = generate_stream(model, idx, 5)
    next(stream)
    stream.close()
    assert model.training


def test_a_loaded_model_decodes_on_the_cli_s_fast_path_with_the_plain_path_s_tokens(tmp_path):
    # issue 40: tinygpt.load + tinygpt.generate used to decode on PyTorch's plain kernels, 2-3x slower than
    # the CLI's quantize(model, "fp32"); the loaded model's own float32 weights are now one DecodePlan call
    if kernels.lowbit() is None:
        pytest.skip("tinygpt's kernels do not build here")
    import tinygpt

    torch.manual_seed(0)
    tinygpt.save(GPT(GPTConfig(vocab_size=48, block_size=64, n_layer=2, n_head=4, n_embd=64)), tmp_path / "run")
    model = tinygpt.load(tmp_path / "run")
    idx = torch.randint(0, 48, (1, 16))
    fast = generate(model, idx, 40, greedy=True)
    assert fastpath._plan(model) is not None  # the whole step in one call, on the model's own parameters
    assert torch.equal(fast, generate(model, idx, 40, greedy=True, use_cache=False))  # the plain loop
    cli = quantize(tinygpt.load(tmp_path / "run"), "fp32")  # what sample/serve load
    assert torch.equal(fast, generate(cli, idx, 40, greedy=True))
    assert all(p.requires_grad for p in model.parameters())  # still the trainable model load returns
    with torch.no_grad():  # weights changed in place (a training step) are what the next decode reads
        model.lm_head.weight.mul_(-1)
    assert torch.equal(generate(model, idx, 40, greedy=True), generate(model, idx, 40, greedy=True, use_cache=False))


@pytest.mark.parametrize("prompt,new", [(5, 10), (20, 20), (40, 5)])  # inside block_size, past it, a long prompt
def test_a_call_s_cache_holds_what_it_can_fill_with_the_plain_loop_s_tokens(monkeypatch, prompt, new):
    # issue 40: every call zeroed a block_size cache, 85-95 ms for GPT-2 small's 72 MiB, more than the decode it served
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    sizes, real = [], KVCache.for_model

    def for_model(*args, **kwargs):
        cache = real(*args, **kwargs)
        sizes.append(cache.max_len)
        return cache

    monkeypatch.setattr(KVCache, "for_model", for_model)
    idx = torch.randint(0, 40, (2, prompt))
    out = generate(model, idx, new, greedy=True)
    assert sizes == [min(32, prompt + new)]
    assert torch.equal(out, generate(model, idx, new, greedy=True, use_cache=False))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _timed_steps(choice, seconds_on, n, monkeypatch):
    """The threads each of n steps ran on, each step taking seconds_on[threads] of a clock of the test's."""
    used, clock = [], [0.0]
    monkeypatch.setattr(generate_module.time, "perf_counter", lambda: clock[0])

    def step():
        used.append(torch.get_num_threads())
        clock[0] += seconds_on[torch.get_num_threads()]

    for _ in range(n):
        choice.run(step)
    choice.restore()
    monkeypatch.undo()
    return used


def test_decode_threads_follow_what_the_machine_allows(two_threads, monkeypatch):
    # issue 40: two threads on a 2-core machine with one core taken decoded 10-100x slower than one
    def free(n):
        monkeypatch.setattr(generate_module, "free_cores", lambda: n)

    free(1)  # another program holds a core: one thread, no steps timed on two
    choice = generate_module.ThreadChoice(every=4)
    assert _timed_steps(choice, {1: 0, 2: 0}, 9, monkeypatch) == [1] * 9
    assert torch.get_num_threads() == 2  # put back
    free(2)  # both free: timed, the faster kept until the next look
    choice = generate_module.ThreadChoice(every=8, steps=2)
    assert _timed_steps(choice, {1: 0.004, 2: 0.001}, 10, monkeypatch) == [1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    free(2)
    choice = generate_module.ThreadChoice(every=8, steps=2)
    # two threads slower (a tiny model): one thread decodes, and a look that finds it so again waits twice as long
    assert _timed_steps(choice, {1: 0.001, 2: 0.0015}, 10, monkeypatch) == [1, 1, 2, 2, 1, 1, 1, 1, 1, 1]
    assert choice.look == 4 + 8
    free(2)
    assert _timed_steps(choice, {1: 0.001, 2: 0.0015}, 10, monkeypatch) == [1, 1, 1, 1, 2, 2, 1, 1, 1, 1]
    assert choice.look == 16 + 16
    free(2)
    choice = generate_module.ThreadChoice(every=8, steps=2)
    # a step on two threads that takes more than twice one thread's best ends the look at once
    assert _timed_steps(choice, {1: 0.001, 2: 0.01}, 6, monkeypatch) == [1, 1, 2, 1, 1, 1]


def test_a_timed_verdict_serves_the_next_calls_on_the_same_model_for_a_while(two_threads, monkeypatch):
    # a look's steps on one thread cost a quiet machine 2-5% of a 64-token reply: a chat's next reply takes the verdict
    def free(n):
        monkeypatch.setattr(generate_module, "free_cores", lambda: n)

    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    free(2)
    first = generate_module.ThreadChoice(model, every=8, steps=2)
    assert _timed_steps(first, {1: 0.004, 2: 0.001}, 6, monkeypatch) == [1, 1, 2, 2, 2, 2]
    free(2)
    again = generate_module.ThreadChoice(model, every=8, steps=2)
    assert _timed_steps(again, {1: 0.004, 2: 0.001}, 6, monkeypatch) == [2] * 6  # no step timed on one thread
    free(2)
    elsewhere = generate_module.ThreadChoice(other, every=8, steps=2)  # another model is timed for itself
    assert _timed_steps(elsewhere, {1: 0.004, 2: 0.001}, 4, monkeypatch) == [1, 1, 2, 2]
    free(1)
    busy = generate_module.ThreadChoice(model, every=8, steps=2)  # a core taken: one thread, whatever was kept
    assert _timed_steps(busy, {1: 0.004, 2: 0.001}, 3, monkeypatch) == [1, 1, 1]
    free(2)
    stale = generate_module.ThreadChoice(model, every=8, steps=2, remember=0.0)  # too old: timed again
    assert _timed_steps(stale, {1: 0.004, 2: 0.001}, 4, monkeypatch) == [1, 1, 2, 2]


def test_generate_chooses_decode_threads_and_gives_the_same_tokens(two_threads, monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    idx = torch.randint(0, 32, (1, 5))
    seen, prompts = [], []
    real, real_prefill = generate_module.decode_step, generate_module.prefill
    monkeypatch.setattr(generate_module, "decode_step", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    monkeypatch.setattr(generate_module, "prefill", lambda *a: prompts.append(torch.get_num_threads()) or real_prefill(*a))
    monkeypatch.setattr(generate_module, "free_cores", lambda: 1)
    busy = generate(model, idx, 20, greedy=True)
    # the prompt and every decode step on one thread, then torch's count put back
    assert prompts == [1] and seen == [1] * 19 and torch.get_num_threads() == 2
    monkeypatch.setattr(generate_module, "free_cores", lambda: 2)
    assert torch.equal(generate(model, idx, 20, greedy=True), busy)  # a row's tokens whatever its threads
    assert prompts == [1, 2] and 2 in seen[19:]


def test_free_cores_counts_this_machine_s_cores_less_other_programs():
    from tinygpt.device import free_cores

    free = free_cores()
    if free is None:
        pytest.skip("no Linux /proc here")
    assert 1 <= free <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_verified_rows_are_single_steps_bit_for_bit(arch, fmt):
    # a speculative step's verification: several tokens of one sequence in one call, each row's logits (and keys
    # and values) those of a step that decodes it alone, up to the longest verification (17 rows of float weights)
    if not _whole_step_in_one_call(fmt):
        pytest.skip("tinygpt's kernels cannot be built here")
    torch.manual_seed(0)
    extra = dict(arch="llama", n_kv_head=2, mlp="swiglu") if arch == "llama" else {}
    model = quantize(GPT(GPTConfig(vocab_size=67, block_size=64, n_layer=2, n_head=4, n_embd=64, init="torch",
                                   tie_weights=False, **extra)).eval(), fmt)
    rows = 9 if fmt in ("int8", "int4") else 17
    idx = torch.randint(0, 67, (1, 5 + 2 * rows))
    one, many = KVCache.for_model(model, 1, 64), KVCache.for_model(model, 1, 64)
    with torch.inference_mode():
        prefill(model, idx[:, :5], one)
        prefill(model, idx[:, :5], many)
        steps = torch.cat([decode_step(model, idx[:, p], one, p) for p in range(5, idx.shape[1])])
        verified = torch.cat([fastpath.verify(model, idx[:, s : s + rows], many, s)[0] for s in (5, 5 + rows)])
        # past 8 rows a prompt takes the prompt kernel, whose sums are not a step's: the verification is no prompt
        prompt = prefill(model, idx[:, : 5 + rows], KVCache.for_model(model, 1, 64))
    assert torch.equal(steps, verified)
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)
    if rows > 8 and fmt == "fp32":
        assert not torch.equal(prompt[0], verified[rows - 1])


def test_rows_at_positions_of_their_own_are_single_steps_bit_for_bit():
    # the server's batch: one call into the plan, each row's logits those of a step that decodes it alone
    if not _whole_step_in_one_call(None):
        pytest.skip("tinygpt's kernels cannot be built here")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, block_size=48, n_layer=2, n_head=4, n_embd=64, init="torch")).eval()
    a, b = torch.randint(0, 67, (1, 9)), torch.randint(0, 67, (1, 4))
    alone, batch = [KVCache.for_model(model, 1) for _ in range(2)], KVCache.for_model(model, 2)
    with torch.inference_mode():
        for seq, cache, row in ((a, alone[0], 0), (b, alone[1], 1)):
            prefill(model, seq[:, :-1], cache)
            prefill(model, seq[:, :-1], batch.slot(row))
        want = [decode_step(model, seq[:, -1], cache, seq.shape[1] - 1) for seq, cache in zip((a, b), alone)]
        got = decode_step(model, torch.tensor([a[0, -1], b[0, -1]]), batch, torch.tensor([8, 3]))
    assert torch.equal(got[0], want[0][0]) and torch.equal(got[1], want[1][0])
