"""Low-precision weights: int8, int4 and fp16 layers against the products they stand for, each
format's kernel chosen from what the CPU can do, generation on quantized models, and perplexity of
a trained model through `tinygpt eval --quantize`."""

import copy
import importlib
import json
import math

import pytest
import torch
from perplexity_util import PERPLEXITY_BOUNDS, perplexity, trained_run

import tinygpt
from tinygpt import GPT, CheckpointError, ConfigError, GPTConfig, cli, generate, kernels, quantize
from tinygpt.interop.quantize import (
    INT4_GROUP, INT8_KERNEL_ROWS, FORMATS, Fp16Linear, Int4Linear, Int8Linear, activation_dtype, fbgemm_works,
    int4_quantize, weight_format,
)

quantize_module = importlib.import_module("tinygpt.interop.quantize")
needs_fbgemm = pytest.mark.skipif(not fbgemm_works(), reason="this PyTorch has no fbgemm kernels (not x86)")


def small_model(n_embd: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=n_embd, init="torch")).eval()


@pytest.mark.parametrize("in_features", [64, 24])  # 24 is not a multiple of 16: the kernel cannot take it
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_ROWS + 5])  # the int8 kernel, then the dequantized matmul
def test_int8_linear_matches_its_dequantized_weights(in_features, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 40)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (40,)
    assert q.use_kernel == (in_features % 16 == 0)
    # per-channel symmetric rounding: every weight within half a step of its row's scale
    err = (q.dequantized() - linear.weight).abs()
    assert bool((err <= q.scales.float().unsqueeze(1) / 2 + 1e-6).all())
    x = torch.randn(rows, in_features)
    want = x.bfloat16().float() @ q.dequantized().t() + linear.bias.bfloat16().float()
    got = q(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.02)
    # and close to the float layer it came from
    torch.testing.assert_close(got.float(), linear(x), atol=0.05, rtol=0.05)


@pytest.fixture(params=["tinygpt", "aten"])
def kernel(request, monkeypatch):
    """Each CPU kernel for int8 decoding rows and int4 in turn: tinygpt's own (where it builds) and PyTorch's."""
    if request.param == "aten":
        monkeypatch.setattr(kernels, "lowbit", lambda: None)
    elif kernels.lowbit() is None:
        pytest.skip("tinygpt's CPU kernels cannot be built here")
    return request.param


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_ROWS, 2 * INT8_KERNEL_ROWS])  # decoding rows, then a prompt's
def test_int8_linear_with_float32_inputs_multiplies_int8_by_int8(rows, kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40)
    q = Int8Linear(linear, torch.float32)
    assert q.packed is not None and not q.use_kernel and q.scales.dtype == torch.float32
    assert q.lowbit == (kernel == "tinygpt")  # decoding rows; fbgemm takes longer inputs either way
    # no (out, in) copy of its own beside fbgemm's: dequantized() reads the codes back from the pack
    assert q.weight is None and "weight" not in q.state_dict()
    codes = torch.round(linear.weight.detach() / q.scales[:, None]).clamp(-127, 127)
    assert torch.equal(q.dequantized(), codes * q.scales[:, None])
    x = torch.randn(rows, 64)
    got = q(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    # the inputs are quantized on the fly (8 bits a block of 32, or 7 bits a row): close to the
    # dequantized product, not equal
    want = x @ q.dequantized().t() + linear.bias.detach()
    torch.testing.assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0)
    if rows <= INT8_KERNEL_ROWS:  # a decoding row's result does not depend on the other rows of its batch
        assert torch.equal(q(x[-1:]), got[-1:])


@needs_fbgemm
def test_fp16_linear_computes_with_float16_weights_in_float32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    layer = Fp16Linear(linear)
    x = torch.randn(5, 3, 48)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, 3, 40)
    want = x @ linear.weight.detach().half().float().t() + linear.bias.detach()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    assert layer.nbytes == 48 * 40 * 2


def test_int4_codes_and_layer_match_their_dequantized_weights(kernel):
    if kernel == "tinygpt":
        return _check_lowbit_int4_layer()
    torch.manual_seed(0)
    linear = torch.nn.Linear(2 * INT4_GROUP, 32)
    q, scales_and_zeros = int4_quantize(linear.weight)
    assert q.shape == (32, 64) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales_and_zeros.shape == (2, 32, 2)
    scale, zero = (scales_and_zeros[..., i].float().t().repeat_interleave(INT4_GROUP, dim=1) for i in (0, 1))
    dequantized = (q - 8) * scale + zero
    # asymmetric rounding: every weight within half a step (and bfloat16's rounding of the offset)
    err = (dequantized - linear.weight).abs()
    assert bool((err <= scale * 0.51 + zero.abs() / 128).all())
    layer = Int4Linear(linear)
    x = torch.randn(7, 64)
    for inputs in (x, x.bfloat16()):  # outputs come back in the input's dtype
        got = layer(inputs)
        assert got.dtype == inputs.dtype
        want = inputs.bfloat16().float() @ dequantized.t() + linear.bias.detach()
        torch.testing.assert_close(got.float(), want, atol=0.02 * float(want.abs().max()), rtol=0)


def _check_lowbit_int4_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(2 * INT4_GROUP, 40)
    codes, params = kernels.int4_codes(linear.weight)
    assert codes.shape == (40, 64) and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert params.shape == (40, 2, 2) and params.dtype == torch.float16
    dequantized = kernels.int4_dequantize(codes, params)
    scale = params[:, 0].float().repeat_interleave(INT4_GROUP, dim=1)
    # every weight within half a step, and float16's rounding of the minimum
    assert bool(((dequantized - linear.weight).abs() <= scale * 0.5 + linear.weight.abs().amax() / 1024).all())
    layer = Int4Linear(linear)
    assert layer.lowbit and layer.nbytes == 40 * 32 + 40 * 2 * 2 * 2
    x = torch.randn(7, 64)
    # exactly the product of the codes with the activations quantized as the kernel does
    q, s = kernels.quantize_activations(x)
    xq = (q.double().reshape(7, 2, INT4_GROUP) * s.double()[..., None]).reshape(7, 64)
    want = (xq @ dequantized.double().t() + linear.bias.detach().double()).float()
    for inputs in (x, x.bfloat16()):  # outputs come back in the input's dtype
        got = layer(inputs)
        assert got.dtype == inputs.dtype
        if inputs.dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.float(), inputs.float() @ dequantized.t() + linear.bias.detach(),
                                   atol=0.02 * float(want.abs().max()), rtol=0)


def test_int4_keeps_layers_its_kernel_cannot_take_in_int8(kernel):
    torch.manual_seed(0)
    model = quantize(GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=64)), "int4")
    assert weight_format(model) == "int4"
    assert isinstance(model.h[0].mlp.c_fc, Int4Linear) and isinstance(model.h[0].attn.c_attn, Int4Linear)
    assert model.h[0].mlp.c_fc.lowbit == (kernel == "tinygpt")
    # 37 output channels: PyTorch's kernel packs 16 at a time, tinygpt's takes any number
    assert isinstance(model.lm_head, Int4Linear if kernel == "tinygpt" else Int8Linear)
    assert model(torch.randint(0, 37, (1, 5))).shape == (1, 5, 37)
    narrow = quantize(GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=48)), "int4")
    assert isinstance(narrow.h[0].attn.c_attn, Int8Linear)  # 48 inputs: not a multiple of 32 for either kernel


def test_each_format_computes_in_the_dtype_the_cpu_multiplies_fastest(monkeypatch):
    f32, bf16 = torch.float32, torch.bfloat16
    int8 = f32 if fbgemm_works() else bf16  # float32 int8 needs fbgemm for inputs longer than decoding's
    # (native bfloat16, tinygpt's kernels build) -> bf16, int8, int4: float32 around the kernels wherever
    # they build, native bfloat16 or not (they decode faster); without them bfloat16 unless emulated
    expected = {(True, True): (f32, int8, f32), (False, True): (f32, int8, f32),
                (True, False): (bf16, bf16, bf16), (False, False): (bf16, int8, f32)}
    for (native, kernel), want in expected.items():
        monkeypatch.setattr(quantize_module, "cpu_has_native_bf16", lambda: native)
        monkeypatch.setattr(quantize_module.kernels, "lowbit", lambda: object() if kernel else None)
        assert tuple(activation_dtype(fmt, "cpu") for fmt in ("bf16", "int8", "int4")) == want, (native, kernel)
    monkeypatch.setattr(quantize_module, "fbgemm_works", lambda: False)
    assert activation_dtype("int8", "cpu") == torch.bfloat16  # no fbgemm: the bf16 kernel is all there is
    assert activation_dtype("fp16", "cpu") == torch.float16
    assert activation_dtype("bf16", "cuda") == torch.bfloat16 and activation_dtype("int8", "cuda") == torch.bfloat16
    model = quantize(small_model(), "int8")  # and the model follows it
    assert model.wte.weight.dtype == torch.bfloat16 and model.h[0].attn.c_attn.packed is None


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "fp32"])
def test_quantized_model_generates_with_and_without_cache_alike(fmt):
    model = quantize(small_model(), fmt)
    assert weight_format(model) == fmt
    idx = torch.randint(0, 37, (2, 5))
    a = generate(model, idx, 20, greedy=True)
    b = generate(model, idx, 20, greedy=True, use_cache=False)
    assert a.shape == (2, 25) and torch.equal(a, b)
    sampled = generate(model, idx, 8, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(1))
    assert sampled.shape == (2, 13)


def test_quantized_logits_stay_close_to_float():
    model = small_model()
    idx = torch.randint(0, 37, (3, 16))
    ref = model(idx).detach()
    for fmt, tol in (("bf16", 0.05), ("fp16", 0.01), ("int8", 0.1), ("int4", 0.2)):
        out = quantize(copy.deepcopy(model), fmt)(idx)
        assert out.dtype == activation_dtype(fmt, "cpu")
        assert float((out.float() - ref).abs().max()) < tol * float(ref.abs().max())


def test_int8_unties_the_head_and_keeps_the_embedding_for_lookups():
    torch.manual_seed(0)
    model = quantize(GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=32)), "int8")
    assert isinstance(model.lm_head, Int8Linear)
    assert model.wte.weight.dtype == activation_dtype("int8", "cpu")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 5  # c_attn, c_proj, c_fc, c_proj, lm_head


def test_unknown_format_and_saving_an_int8_model(tmp_path):
    with pytest.raises(ConfigError, match="fp32, bf16, fp16, int8, int4"):
        quantize(small_model(), "int3")
    with pytest.raises(CheckpointError, match="quantiz"):
        tinygpt.save(quantize(small_model(), "int8"), tmp_path / "run")
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_eval_and_sample_with_quantize_on_a_trained_model(tmp_path, capsys):
    run = trained_run(tmp_path)
    fp32 = perplexity(run)
    assert fp32 < math.exp(1.5)  # the model learned something, so the comparison means something
    for fmt, bound in PERPLEXITY_BOUNDS.items():
        assert abs(perplexity(run, fmt=fmt) / fp32 - 1) < bound, fmt
    args = ["sample", str(run), "--quantize", "int8", "--prompt", "the cat", "--greedy",
            "--max-new-tokens", "30", "--device", "cpu"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out) > 30
    assert cli.main(["eval", str(run), "--quantize", "int3"]) == 2
    assert "invalid choice" in capsys.readouterr().err
