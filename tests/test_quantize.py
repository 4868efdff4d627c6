"""Low-precision weights: int8 layers against their dequantized product, generation on quantized
models, and perplexity of a trained model through `tinygpt eval --quantize`."""

import copy
import json
import math

import pytest
import torch
from conftest import make_text

import tinygpt
from tinygpt import GPT, CheckpointError, ConfigError, GPTConfig, cli, generate, quantize
from tinygpt.interop.quantize import INT8_KERNEL_ROWS, Int8Linear, weight_format


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


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
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
    for fmt, tol in (("bf16", 0.05), ("int8", 0.1)):
        out = quantize(copy.deepcopy(model), fmt)(idx)
        assert out.dtype == torch.bfloat16
        assert float((out.float() - ref).abs().max()) < tol * float(ref.abs().max())


def test_int8_unties_the_head_and_keeps_the_embedding_for_lookups():
    torch.manual_seed(0)
    model = quantize(GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=32)), "int8")
    assert isinstance(model.lm_head, Int8Linear)
    assert model.wte.weight.dtype == torch.bfloat16
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 5  # c_attn, c_proj, c_fc, c_proj, lm_head


def test_unknown_format_and_saving_an_int8_model(tmp_path):
    with pytest.raises(ConfigError, match="fp32, bf16, int8"):
        quantize(small_model(), "int4")
    with pytest.raises(CheckpointError, match="quantiz"):
        tinygpt.save(quantize(small_model(), "int8"), tmp_path / "run")
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_eval_and_sample_with_quantize_on_a_trained_model(tmp_path, capsys):
    root = tmp_path
    (root / "text.txt").write_text(make_text(1500))
    tinygpt.prepare([str(root / "text.txt")], root / "data", tokenizer="char")
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    tc = tinygpt.TrainConfig(batch_size=16, max_iters=120, warmup=10, lr=3e-3, eval_interval=120, eval_iters=2,
                             device="cpu", dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one core than on two that others share
    try:
        tinygpt.train(root / "data", root / "run", cfg, tc, progress=False)
    finally:
        torch.set_num_threads(threads)

    def perplexity(*flags):
        assert cli.main(["eval", str(root / "run"), "--json", "--device", "cpu", *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]

    fp32, bf16, int8 = perplexity(), perplexity("--quantize", "bf16"), perplexity("--quantize", "int8")
    assert fp32 < math.exp(1.5)  # the model learned something, so the comparison means something
    assert abs(bf16 / fp32 - 1) < 0.01
    assert abs(int8 / fp32 - 1) < 0.03
    args = ["sample", str(root / "run"), "--quantize", "int8", "--prompt", "the cat", "--greedy",
            "--max-new-tokens", "30", "--device", "cpu"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out) > 30
    assert cli.main(["eval", str(root / "run"), "--quantize", "int4"]) == 2
    assert "invalid choice" in capsys.readouterr().err
