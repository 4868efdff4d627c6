"""The modern block's training kernels (csrc/modern.cpp, and grouped-query attention on training.cpp's kernel)
against PyTorch, forward and backward, in float32 and bfloat16, on odd shapes; a training run of the default
recipe with them against one without."""

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPT, GPTConfig, kernels
from tinygpt.config import RECIPE_MODEL, TrainConfig
from tinygpt.model import RMSNorm, rotate
from tinygpt.optim import make_optimizer

ops = kernels.lowbit()
needs_kernels = pytest.mark.skipif(ops is None, reason="tinygpt's CPU kernels cannot be built here")
WIDTHS = [8, 16] if ops is not None and ops.simd_width(0) == 16 else [8]  # the AVX-512 path where the CPU has it


@pytest.fixture(params=WIDTHS, ids=lambda w: f"simd{w}")
def width(request):
    """Each test once a vector width this CPU runs (AVX2's 8 floats; AVX-512's 16 where it has it)."""
    if ops is None:
        pytest.skip("tinygpt's CPU kernels cannot be built here")
    was = ops.simd_width(0)
    ops.simd_width(request.param)
    yield request.param
    ops.simd_width(was)


def exact(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """float64 leaves of the same values, for the reference's gradients."""
    return [t.detach().double().requires_grad_() for t in tensors]


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got.double(), want.detach().double(), atol=tol, rtol=tol)


def angles(T: int, D: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as GPT.rotary gives them: (T, D), or (rows, 1, T, D) with every row's positions shifted."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.arange(T)[None] + torch.arange(rows)[:, None] * 3
    a = pos[..., None].float() * inv
    a = torch.cat((a, a), dim=-1)
    a = a[0] if rows == 1 else a[:, None]
    return a.cos(), a.sin()


@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 513, 128), (1, 1, 200)])
def test_rms_norm_and_its_gradients(width, shape):
    g = torch.Generator().manual_seed(shape[-1])
    C = shape[-1]
    x = torch.randn(shape, generator=g, requires_grad=True)
    w = (torch.rand(C, generator=g) + 0.5).requires_grad_()
    grad = torch.randn(shape, generator=g)
    xr, wr = exact(x, w)
    want = F.rms_norm(xr, (C,), wr, 1e-5)
    want.backward(grad.double())
    assert kernels.trains_rms_norm(x, w)
    got = kernels.rms_norm(x, w, 1e-5)
    got.backward(grad)
    assert_close(got, want)
    assert_close(x.grad, xr.grad)
    assert_close(w.grad, wr.grad, 2e-5 * shape[0] * shape[1] ** 0.5)  # a sum over every row


@pytest.mark.parametrize("shape", [(2, 9, 3, 12), (2, 513, 2, 64), (3, 1, 4, 128), (1, 13, 1, 10)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("per_row", [False, True], ids=["positions", "documents"])
def test_rotary_positions_after_the_qk_norm_and_their_gradients(width, shape, qk_norm, per_row):
    B, T, H, D = shape
    g = torch.Generator().manual_seed(T * D)
    x = torch.randn(shape, generator=g, requires_grad=True)
    norm = RMSNorm(D, eps=1e-6) if qk_norm else None
    if qk_norm:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    rope = angles(T, D, B if per_row else 1)
    grad = torch.randn(B, H, T, D, generator=g)
    xr = exact(x)[0]
    wr = exact(norm.weight)[0] if qk_norm else None
    normed = F.rms_norm(xr, (D,), wr, 1e-6) if qk_norm else xr
    want = rotate(normed.transpose(1, 2), tuple(t.double() for t in rope))
    want.backward(grad.double())
    assert kernels.trains_rotary(x, norm)
    got = kernels.rotary(x, norm, kernels.rotary_angles(rope))
    assert got.shape == shape and got.is_contiguous()
    got.transpose(1, 2).backward(grad)  # the gradient comes back as attention gives it: (B, H, T, D), transposed
    assert_close(got.transpose(1, 2), want)
    assert_close(x.grad, xr.grad)
    if qk_norm:
        assert_close(norm.weight.grad, wr.grad, 2e-5 * (B * T * H) ** 0.5)


@pytest.mark.parametrize("shape", [(3, 7, 100), (2, 5, 384), (1, 1, 9)])
def test_swiglu_and_its_gradients(width, shape):
    g = torch.Generator().manual_seed(shape[-1])
    a = (torch.randn(shape, generator=g) * 4).requires_grad_()  # past the sigmoid's flat ends
    b = torch.randn(shape, generator=g, requires_grad=True)
    grad = torch.randn(shape, generator=g)
    ar, br = exact(a, b)
    want = F.silu(ar) * br
    want.backward(grad.double())
    assert kernels.trains_swiglu(a, b)
    got = kernels.swiglu(a, b)
    got.backward(grad)
    assert_close(got, want)
    assert_close(a.grad, ar.grad)
    assert_close(b.grad, br.grad)


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 4, 2, 13, 64), (1, 6, 1, 40, 128), (2, 3, 3, 1, 12), (1, 2, 1, 513, 64)])
def test_grouped_query_attention_and_its_gradients_on_the_kernel(shape):
    B, H, H_kv, T, D = shape
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2).requires_grad_()  # as the rotary kernel gives it
    k, v = (torch.randn(B, H_kv, T, D, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, T, H * D, generator=g)
    qr, kr, vr = exact(q, k, v)
    want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    want = want.transpose(1, 2).reshape(B, T, H * D)
    want.backward(grad.double())
    assert kernels.trains_heads_attention(q, k, v) == (T <= kernels.ATTENTION_MAX_T)
    got = kernels.heads_attention(q, k, v)
    got.backward(grad)
    assert_close(got, want)
    for t, r in ((q, qr), (k, kr), (v, vr)):
        assert t.grad.shape == t.shape
        assert_close(t.grad, r.grad)


@needs_kernels
def test_in_bfloat16_each_kernel_is_its_float32_value_rounded_once(width):
    """What autocast gives the kernels: bfloat16 in and out, computed in float32 in between (PyTorch rounds
    after each operation; the kernels once, at the end)."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(2, 9, 70, generator=g).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(2, 9, 70, generator=g).bfloat16()
    assert kernels.trains_swiglu(a, b)
    h = kernels.swiglu(a, b)
    h.backward(grad)
    af, bf = exact(a, b)
    want = F.silu(af) * bf
    want.backward(grad.double())
    assert h.dtype == a.grad.dtype == torch.bfloat16
    # the exact value rounded to the nearest bfloat16, or (float32's error at a tie) the next one
    assert ((h.double() - want).abs() <= want.abs() * 2**-8 + 1e-30).all()
    for got, ref in ((h, want), (a.grad, af.grad), (b.grad, bf.grad)):
        torch.testing.assert_close(got.double(), ref.detach(), atol=1e-2, rtol=8e-3)
    x = torch.randn(2, 9, 3, 64, generator=g).bfloat16().requires_grad_()
    norm = RMSNorm(64, eps=1e-6)
    rope = angles(9, 64)
    y = kernels.rotary(x, norm, kernels.rotary_angles(rope))
    y.backward(torch.ones_like(y))
    xf = exact(x)[0]
    want = rotate(F.rms_norm(xf, (64,), norm.weight.double(), 1e-6).transpose(1, 2),
                  tuple(t.double() for t in rope)).transpose(1, 2)
    want.backward(torch.ones_like(want))
    assert y.dtype == x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want.detach(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(x.grad.double(), xf.grad, atol=2e-2, rtol=2e-2)


def test_the_kernels_take_only_what_they_are_for():
    x = torch.randn(2, 4, 3, 8, requires_grad=True)
    if ops is None:
        assert not kernels.trains_rotary(x, None) and not kernels.trains_rms_norm(x, torch.ones(8))
        return
    w = torch.ones(8, requires_grad=True)
    assert kernels.trains_rotary(x, None) and kernels.trains_rms_norm(x, w)
    assert not kernels.trains_rotary(x.detach(), None)  # inference keeps PyTorch's
    assert not kernels.trains_rotary(x.double(), None)
    assert not kernels.trains_rotary(x, torch.nn.LayerNorm(8))
    assert not kernels.trains_rms_norm(x.bfloat16(), w)  # an RMSNorm takes float32 (autocast keeps it so)
    assert not kernels.trains_rms_norm(x.transpose(1, 2), w)
    assert not kernels.trains_swiglu(x, x.bfloat16())
    with torch.no_grad():
        assert not kernels.trains_swiglu(x, x) and not kernels.trains_rms_norm(x, w)
    q, kv = torch.randn(1, 4, 8, 16, requires_grad=True), torch.randn(1, 3, 8, 16)
    assert not kernels.trains_heads_attention(q, kv, kv)  # 3 key/value heads cannot serve 4 query heads


@needs_kernels
def test_the_simd_width_is_the_cpu_s():
    from tinygpt.device import cpu_flag_set

    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= (cpu_flag_set() or set())
    assert ops.simd_width(0) == (16 if avx512 else 8)
    if not avx512:
        with pytest.raises(RuntimeError, match="simd_width takes 8 here"):
            ops.simd_width(16)


def modern_run(steps: int, use_kernels: bool, monkeypatch) -> tuple[list[float], GPT]:
    """`steps` steps of the default recipe's block with Muon + AdamW, on the kernels or on PyTorch's operations."""
    if not use_kernels:
        for name in ("trains_rms_norm", "trains_rotary", "trains_swiglu", "trains_heads_attention"):
            monkeypatch.setattr(kernels, name, lambda *a: False)
    torch.manual_seed(0)
    config = GPTConfig(**{**RECIPE_MODEL, "n_kv_head": 2}, vocab_size=37, block_size=24, n_layer=2, n_head=4,
                       n_embd=48)
    model = GPT(config).train()
    opt = make_optimizer(model, TrainConfig(lr=3e-3, optimizer="muon"), torch.device("cpu"))
    # rows counting up from a random start: something to learn
    data = (torch.randint(0, 37, (steps, 4, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(25)) % 37
    losses = []
    for batch in data:
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    monkeypatch.undo()
    return losses, model


@needs_kernels
def test_twenty_steps_of_the_default_recipe_on_the_kernels_are_pytorch_s(monkeypatch):
    calls = []
    for name in ("rms_norm", "rotary", "swiglu", "heads_attention"):
        monkeypatch.setattr(kernels, name, lambda *a, f=getattr(kernels, name), n=name: calls.append(n) or f(*a))
    fast_losses, fast = modern_run(20, True, monkeypatch)
    # a block's two norms and the final one, its queries' and keys' rotary positions, its gate and its attention
    assert sorted(set(calls)) == ["heads_attention", "rms_norm", "rotary", "swiglu"]
    assert len(calls) == 20 * (5 + 2 * 4)
    slow_losses, slow = modern_run(20, False, monkeypatch)
    assert fast_losses[-1] < fast_losses[0] - 0.2  # it trains
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(slow_losses), atol=2e-5, rtol=2e-5)
    for (name, a), b in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4, msg=name)


def test_twenty_steps_of_the_default_recipe_with_muon_on_the_gram_side_are_x_side_s(monkeypatch):
    from tinygpt import optim

    calls = []
    monkeypatch.setattr(optim, "cpu_has_native_bf16", lambda: False)  # Muon's float32 iteration, tinygpt's
    monkeypatch.setattr(optim, "gram_side_iteration",
                        lambda *a, f=optim.gram_side_iteration: calls.append(a[0].shape) or f(*a))
    gram_losses, gram = modern_run(20, True, monkeypatch)
    assert calls and all(c > 1.5 * r for _, r, c in calls)  # SwiGLU's gate, up and down projections (48 x 128)
    monkeypatch.setattr(optim, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(optim, "gram_side_iteration", optim.x_side_iteration)
    x_losses, x = modern_run(20, True, monkeypatch)
    assert gram_losses[-1] < gram_losses[0] - 0.2  # it trains
    torch.testing.assert_close(torch.tensor(gram_losses), torch.tensor(x_losses), atol=2e-5, rtol=2e-5)
    for (name, p), q in zip(gram.named_parameters(), x.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=2e-4, msg=name)


@needs_kernels
def test_checking_the_kernels_draws_nothing_from_torch_s_generator():
    # the first call comes in a run's first forward pass, after its seed: its dropout masks must not move
    kernels.lowbit.cache_clear()
    try:
        torch.manual_seed(0)
        assert kernels.lowbit() is not None
        after = torch.rand(3)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(3))
    finally:
        kernels.lowbit.cache_clear()
        kernels.lowbit()
