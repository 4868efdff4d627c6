import math

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.config import PRESETS
from tinygpt.model import attention, lm_loss


def tiny(**overrides):
    cfg = dict(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def test_logits_shape():
    model = tiny()
    assert model(torch.randint(0, 37, (3, 11))).shape == (3, 11, 37)


# the llama layout's choices, each alone and together
LLAMA_VARIANTS = [
    dict(arch="llama"),
    dict(arch="llama", n_kv_head=2, qk_norm=True, qkv_bias=True, tie_weights=False),
    dict(arch="llama", n_kv_head=1, head_size=16, rope_scaling="llama3", rope_factor=8.0, rope_original_context=8),
    dict(arch="llama", mlp="gelu", norm="layernorm", bias=True, positions="learned"),
]


@pytest.mark.parametrize("overrides", [{}, dict(bias=False, tie_weights=False, activation="gelu", init="torch"),
                                       *LLAMA_VARIANTS])
def test_fused_and_explicit_attention_agree(overrides):
    model = tiny(**overrides).eval()
    idx = torch.randint(0, 37, (2, 16))
    fast = model(idx)
    slow, weights = model(idx, return_attention=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (2, 4, 16, 16)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 16))
        assert torch.all(torch.triu(w, diagonal=1) == 0)


def test_attention_function_paths_agree_with_a_mask():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    a, _ = attention(q, k, v, mask)
    b, w = attention(q, k, v, mask, explicit=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.all(w[~mask.expand_as(w)] == 0)


@pytest.mark.parametrize("mask_shape", [None, (7, 7), (2, 1, 7, 7)])
def test_bf16_training_attention_matches_the_explicit_path(mask_shape):
    # bf16 with gradients on a CPU takes the baddbmm path (model._matmul_attention): its outputs and
    # gradients are as close to float32's as the lesson's explicit arithmetic in bf16 is
    torch.manual_seed(0)
    mask = None if mask_shape is None else torch.rand(mask_shape) > 0.4
    if mask is not None:
        mask[..., 0] = True
    qkv = [torch.randn(2, 3, 7, 8) for _ in range(3)]

    def run(dtype, explicit):
        q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in qkv)
        out, _ = attention(q, k, v, mask, explicit=explicit)
        out.float().square().sum().backward()
        return [t.float() for t in (out, q.grad, k.grad, v.grad)]

    reference, fast, explicit = run(torch.float32, True), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for want, got, lesson in zip(reference, fast, explicit):
        assert (got - want).abs().max() <= 2 * (lesson - want).abs().max() + 1e-2


def test_attention_without_a_mask_is_causal_aligned_at_the_end():
    # mask None: T_q == T_k is plain causal self-attention; one query (a decode step) sees every key
    q, k, v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    a, _ = attention(q, k, v)
    b, w = attention(q, k, v, explicit=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert bool((w > 0).all())
    full, _ = attention(q, k, v, torch.ones(1, 1, 1, 7, dtype=torch.bool))
    torch.testing.assert_close(a, full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides", LLAMA_VARIANTS)
def test_the_llama_layout_is_causal_and_packs_documents_as_if_alone(overrides):
    torch.manual_seed(0)
    model = tiny(**overrides).eval()
    idx = torch.randint(0, 37, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 37
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
    # two documents in one row: the second computed as it is alone (its positions start at 0 again)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    packed = model(idx, documents=docs)
    torch.testing.assert_close(packed[:, 7:], model(idx[:, 7:]), atol=1e-5, rtol=0)


def test_rotary_frequencies_follow_the_scaling_kind():
    from tinygpt.model import rope_frequencies

    base = GPTConfig(arch="llama", n_embd=64, n_head=1, rope_theta=10000.0)
    plain = rope_frequencies(base)
    assert plain.shape == (32,) and plain[0] == 1.0
    torch.testing.assert_close(plain, 10000.0 ** (-torch.arange(0, 64, 2) / 64))
    linear = rope_frequencies(GPTConfig(**{**base.to_dict(), "rope_scaling": "linear", "rope_factor": 4.0}))
    torch.testing.assert_close(linear, plain / 4)
    llama3 = rope_frequencies(GPTConfig(**{**base.to_dict(), "rope_scaling": "llama3", "rope_factor": 8.0,
                                           "rope_original_context": 256}))
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 256 / 4, wavelength > 256 / 1
    assert torch.equal(llama3[short], plain[short]) and torch.equal(llama3[long], plain[long] / 8)
    between = ~short & ~long
    assert bool(((llama3[between] < plain[between]) & (llama3[between] > plain[between] / 8)).all())


def test_causality():
    model = tiny().eval()
    idx = torch.randint(0, 37, (1, 16))
    base = model(idx)
    for j in (0, 5, 15):
        changed = idx.clone()
        changed[0, j] = (changed[0, j] + 1) % 37
        out = model(changed)
        assert torch.equal(out[:, :j], base[:, :j]), j
        assert not torch.allclose(out[:, j], base[:, j])


def test_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def test_gpt2_init_loss_is_log_vocab():
    torch.manual_seed(1)
    model = tiny(vocab_size=500, n_layer=4, n_embd=64, block_size=32)
    idx = torch.randint(0, 500, (8, 33))
    with torch.no_grad():
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:]).item()
    assert abs(loss - math.log(500)) < 0.1


def test_gpt2_init_statistics():
    torch.manual_seed(0)
    model = tiny(n_layer=8, n_embd=128)
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert model.h[0].attn.c_attn.bias.abs().max().item() == 0


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = tiny(n_embd=64)
    idx = torch.randint(0, 37, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


EXPECTED = {"lesson": 107_008, "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
            "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts(name):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset(name))
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    positions = model.wpe.weight.numel() if model.wpe is not None else 0  # rotary positions: no table
    assert model.num_params(exclude_positions=True) == total - positions
    if name in EXPECTED:
        assert total == EXPECTED[name]


def test_untied_head_counted_separately():
    tied, untied = tiny(), tiny(tie_weights=False)
    assert untied.num_params() - tied.num_params() == 37 * 32


def test_causal_switch_lets_the_past_see_the_future():
    model = tiny().eval()
    model.causal = False
    idx = torch.randint(0, 37, (1, 16))
    base = model(idx)
    changed = idx.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 37
    assert not torch.allclose(model(changed)[:, 0], base[:, 0])  # position 0 reads position 15
    fast = model(idx)
    slow, weights = model(idx, return_attention=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)  # both attention paths drop the mask
    assert torch.all(weights[0] > 0)
    from tinygpt import KVCache

    with pytest.raises(ValueError, match="non-causal"):
        model(idx[:, :4], KVCache.for_model(model, 1), torch.arange(4))
    model.causal = True  # and back: the past no longer depends on the future
    torch.testing.assert_close(model(changed)[:, :15], model(idx)[:, :15])


def test_scale_embeddings_multiplies_the_token_embeddings(tmp_path, capsys):
    """GPTConfig.scale_embeddings: wte(idx) * sqrt(n_embd) before the position embedding is added; kept
    in config.json (an old one without the key loads with it off); GPT-2 export refuses it."""
    import json

    import tinygpt
    from tinygpt.checkpoint import load_config
    from tinygpt.cli import main
    from tinygpt.tokenizer import CharTokenizer

    idx = torch.randint(0, 37, (2, 16))
    plain = tiny(tie_weights=False).eval()
    scaled = GPT(GPTConfig(**{**plain.config.to_dict(), "scale_embeddings": True})).eval()
    scaled.load_state_dict(plain.state_dict())
    assert not torch.allclose(scaled(idx), plain(idx), atol=1e-3)
    with torch.no_grad():  # an untied wte feeds the input only: scaling its weights is the same model
        plain.wte.weight.mul_(math.sqrt(32))
    torch.testing.assert_close(scaled(idx), plain(idx), atol=1e-5, rtol=0)

    run = tinygpt.save(scaled, tmp_path / "run", CharTokenizer(sorted(set("abcdefghijklmnopqrstuvwxyz .,\n"))))
    assert json.loads((run / "config.json").read_text())["scale_embeddings"] is True
    assert load_config(run).scale_embeddings is True
    torch.testing.assert_close(tinygpt.load(run)(idx), scaled(idx), atol=0, rtol=0)
    old = {k: v for k, v in scaled.config.to_dict().items() if k != "scale_embeddings"}
    (run / "config.json").write_text(json.dumps(old))
    assert load_config(run).scale_embeddings is False
    (run / "config.json").write_text(json.dumps(scaled.config.to_dict()))

    for fmt, out in (("hf", tmp_path / "hf"), ("gguf", tmp_path / "m.gguf")):
        code = main(["export", str(run), "--format", fmt, "--out", str(out)])
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "scale_embeddings" in err and "GPT-2 does not" in err
        assert not out.exists()
    with pytest.raises(ValueError, match="scale_embeddings"):
        GPTConfig(scale_embeddings=1)


def test_the_fused_loss_takes_targets_that_are_not_contiguous():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16))
    idx, every_other = torch.randint(0, 50, (1, 8)), torch.randint(0, 50, (1, 16))
    targets = every_other[:, ::2]  # a (1, 8) view whose flattening is a strided view, not a copy
    torch.testing.assert_close(model(idx, targets=targets), lm_loss(model(idx), targets.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kernels_on", [True, False])
def test_the_fused_loss_equals_cross_entropy_on_the_logits(dtype, masked, kernels_on, monkeypatch):
    # GPT.forward(idx, targets=) computes the head and the loss a chunk of rows at a time (here 7
    # rows a chunk, the last one short) with the gradients in the same pass: the loss and every
    # gradient equal those of cross-entropy on the whole batch's logits, on tinygpt's CPU kernel for
    # the softmax and without it; the float32 head's product a slice of 16 vocabulary rows at a time
    # (the last one short), as GPT-2's is in slices of 512
    from tinygpt import kernels
    from tinygpt import model as model_module
    from tinygpt.model import masked_lm_loss

    if not kernels_on:
        monkeypatch.setattr(kernels, "lowbit", lambda: None)
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
    monkeypatch.setattr(model_module, "LOSS_CHUNK", 7 * cfg.vocab_size)
    monkeypatch.setattr(model_module, "HEAD_SLICE", 16)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 2, 13))
    weights = (torch.rand(2, 13) > 0.4).float() if masked else None
    results = []
    for fused in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            if fused:
                loss = model(idx, targets=targets, loss_weights=weights)
            else:
                logits = model(idx)
                loss = lm_loss(logits, targets) if weights is None else masked_lm_loss(logits, targets, weights)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (fused_loss, fused_grads), (loss, grads) = results
    tol = dict(rtol=1e-5, atol=1e-6) if dtype is torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fused_loss, loss, **tol)
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], **tol, msg=name)
    with pytest.raises(ValueError, match="targets"):
        model(idx, targets=targets, last_only=True)


def test_the_fused_loss_keeps_the_head_gradient_finite_under_float16_autocast():
    # The head's gradient is computed in forward at unit scale (backward only multiplies it by the loss's
    # scale), so a GradScaler cannot shrink it. Its weight gradient for a token sums the rows that predict
    # it: 4,096 rows of hidden states of 20 all predicting token 0 make about -82,000 there, past float16's
    # 65,504 (what a float16 GPU run meets with a big batch on a small vocabulary). Computed in float32 it
    # stays finite and equals float32's gradient.
    from tinygpt.model import head_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 8, bias=False)
    hidden = torch.full((4096, 16), 20.0) + torch.randn(4096, 16)
    targets = torch.zeros(4096, dtype=torch.long)
    grads = []
    for fp16 in (True, False):
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = head_loss(h, head, targets) * 4096  # the sum over rows: a mean hides nothing that overflows
        loss.backward()
        grads.append((head.weight.grad.clone(), h.grad.clone()))
    (w16, h16), (w32, h32) = grads
    assert torch.isfinite(w16).all() and torch.isfinite(h16).all()
    torch.testing.assert_close(w16, w32, rtol=1e-2, atol=1e-2 * float(w32.abs().max()))
    torch.testing.assert_close(h16, h32, rtol=2e-2, atol=1e-3)
