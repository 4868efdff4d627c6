"""The CUDA paths, run for real where there is a GPU: decoding with the cache on the device, bf16 autocast,
float16 with the gradient scaler, torch.compile, low-precision inference, checkpoints between the GPU and
the CPU, the server, and NCCL across two GPUs. `make gpu-check` runs them (benchmarks/gpu_check.py), then
the bench and a 3-minute training run.

Without CUDA every test skips. TINYGPT_TEST_DEVICE names the device (default cuda): cpu runs them on
the CPU, as the CI's dry run does (`make gpu-check DEVICE=cpu`), where the ones that need a GPU skip.

Each test takes its architecture from ARCHS and its optimizer from OPTIMIZERS: an architecture family
is one more ARCHS entry, an optimizer (Muon) one more OPTIMIZERS entry. Decoding runs every architecture
in the dry run too; training and serving run the first there (the logic is the same, the CPU's minutes
are CI's) and every one on a GPU.
"""

import copy
import functools
import importlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from perplexity_util import PERPLEXITY_BOUNDS, perplexity, trained_run
from server_util import CHARS, NAME, running, tiny_tokenizer

import tinygpt
from tinygpt import GPT, GPTConfig, TrainConfig, generate, quantize
from tinygpt.checkpoint import load, load_training
from tinygpt.errors import NonFiniteError
from tinygpt.interop.quantize import on_cpu_kernels
from tinygpt.train import Start, TrainResult, train

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("TINYGPT_TEST_DEVICE", "cuda")
# GPTConfig settings of each architecture the tests build, over TINY
ARCHS = {
    "gpt2": {},
    # the Llama family's choices at once: rotary positions with Llama 3's scaling (acting inside 32
    # positions), grouped-query attention, qk-norm (Qwen3), q/k/v biases (Qwen2), RMSNorm, SwiGLU
    "llama": dict(arch="llama", n_head=4, n_kv_head=2, qk_norm=True, qkv_bias=True, rope_scaling="llama3",
                  rope_factor=4.0, rope_original_context=8, rope_theta=100.0),
}
# the architectures of the tests that train or serve: the first in the dry run, every one on a GPU
ARCHS_ON_GPU = [arch if i == 0 else pytest.param(arch, marks=pytest.mark.slow) for i, arch in enumerate(ARCHS)]
# TrainConfig settings of each optimizer the training tests use
OPTIMIZERS = {"adamw": {}}
# a 2-layer, 64-wide model with PyTorch's default init, whose logits have clear gaps between tokens
TINY = dict(vocab_size=len(CHARS), block_size=32, n_layer=2, n_head=2, n_embd=64, init="torch", tie_weights=False)
# a flat learning rate: a run stopped and resumed equals a straight one whatever --max-iters each part had
FLAT = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--eval-iters", "2",
        "--eval-interval", "10", "--warmup", "0", "--lr", "1e-3", "--min-lr", "1e-3", "--dtype", "float32", "--quiet"]


@pytest.fixture(scope="module")
def device() -> torch.device:
    dev = torch.device(DEVICE)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (TINYGPT_TEST_DEVICE=cpu runs these on the CPU: make gpu-check DEVICE=cpu)")
    return dev


def needs_cuda(device: torch.device, why: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"needs a CUDA device: {why}")


def tiny(arch: str, **overrides) -> GPTConfig:
    return GPTConfig(**{**TINY, **ARCHS[arch], **overrides})


def tiny_model(arch: str, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny(arch)).to(device).eval()


def tie(fmt: str, device: torch.device) -> float:
    """How close (relative to the largest logit) two candidates may be for float rounding to pick either:
    float32 on a GPU multiplies in TF32 (10-bit mantissas), bfloat16 keeps 8 bits."""
    return {"fp32": 1e-2 if device.type == "cuda" else 1e-4, "bf16": 5e-2}[fmt]


def assert_same_greedy(model: GPT, prompt_len: int, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """got and want: greedy continuations of the same prompts (B, prompt_len) computed two ways. They are
    equal, or each row is equal up to a step where the reference's two best logits were a near-tie (within
    `tolerance` of the largest): rounding may take either there, and what follows depends on that pick."""
    assert got.shape == want.shape
    for row in range(got.shape[0]):
        differ = (got[row] != want[row]).nonzero()
        if not len(differ):
            continue
        at = int(differ[0])
        with torch.inference_mode():
            logits = model(want[row : row + 1, :at][:, -model.config.block_size :])[0, -1].float()
        best = logits.topk(2).values
        gap = float(best[0] - best[1]) / float(logits.abs().max())
        assert gap <= tolerance, f"row {row} differs at new token {at - prompt_len}, where the gap was {gap:.2g}"


def steps(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


# ---- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_cached_decoding_equals_uncached(device, arch, fmt):
    model = quantize(tiny_model(arch, device), fmt)
    prompts = torch.randint(0, len(CHARS), (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    n = 2 * model.config.block_size  # past block_size: the window slides and the cache is rebuilt
    cached = generate(model, prompts, n, greedy=True)
    assert cached.device.type == device.type
    assert_same_greedy(model, 7, cached, generate(model, prompts, n, greedy=True, use_cache=False), tie(fmt, device))
    # sampling with the device's own generator repeats
    a, b = (generate(model, prompts, 20, temperature=0.9, top_k=20,
                     generator=torch.Generator(device=device).manual_seed(3)) for _ in range(2))
    assert torch.equal(a, b)


def test_nonfinite_probabilities_are_an_error_not_the_end_of_the_device(device):
    # CUDA's multinomial asserts on a NaN inside its kernel, which ends every later use of the GPU
    from tinygpt.config import SampleConfig
    from tinygpt.sampling import choose

    logits = torch.full((2, 10), float("nan"), device=device)
    with pytest.raises(ValueError, match="NaN or infinite"):
        choose(logits, SampleConfig(temperature=1.0))
    assert float(torch.ones(3, device=device).sum()) == 3.0  # the device still computes


# ---- training ---------------------------------------------------------------------------------------


def train_tiny(data: Path, out: Path, device: torch.device, arch: str, optimizer: str, **settings) -> TrainResult:
    settings = {**dict(batch_size=16, max_iters=100, warmup=10, lr=3e-3, eval_interval=100, eval_iters=5,
                       device=str(device), dtype="float32"), **OPTIMIZERS[optimizer], **settings}
    return train(data, out, tiny(arch, vocab_size=64), TrainConfig(**settings))


@pytest.mark.parametrize("arch", ARCHS_ON_GPU)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bfloat16_autocast_trains_to_float32_s_loss(device, char_data, tmp_path, arch, optimizer):
    runs = {dtype: train_tiny(char_data, tmp_path / dtype, device, arch, optimizer, dtype=dtype)
            for dtype in ("float32", "bfloat16")}
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    assert fp32.val_loss < 2.5  # it learned: the comparison means something (ln 64 = 4.16 at the start)
    assert abs(bf16.train_loss / fp32.train_loss - 1) < 0.02, (bf16.train_loss, fp32.train_loss)
    assert abs(bf16.val_loss / fp32.val_loss - 1) < 0.02, (bf16.val_loss, fp32.val_loss)


def overflowing_model(config: GPTConfig) -> GPT:
    """A model whose float16 gradients overflow at full scale: embeddings of 1e-9 and blocks whose output
    projections start at zero leave the residual stream at 1e-9, and LayerNorm (eps 1e-20) divides its
    gradient by that spread, so what reaches the blocks' float16 products is far past 65,504. At a loss
    scale of 2**-8 it fits: a gradient scaler finds that scale by halving it from 2**16 over skipped steps."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        model.wte.weight.mul_(1e-9 / model.wte.weight.std())
        model.wpe.weight.mul_(1e-9 / model.wpe.weight.std())
        for block in model.h:
            for linear in (block.attn.c_proj, block.mlp.c_proj):
                linear.weight.zero_()
                linear.bias.zero_()
    return model


def test_float16_trains_through_overflow_with_the_gradient_scaler(device, char_data, tmp_path, monkeypatch):
    train_module = importlib.import_module("tinygpt.train.run")
    if device.type == "cpu":  # tinygpt refuses float16 on a CPU; the dry run lets it through to run this logic
        monkeypatch.setattr(train_module, "resolve_dtype", lambda name, dev: torch.float16)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False,
                       layer_norm_eps=1e-20)
    start = Start(config=config, build=functools.partial(overflowing_model, config), load=load, lr=3e-3)
    settings = TrainConfig(batch_size=8, max_iters=40, warmup=0, eval_interval=40, eval_iters=2,
                           device=str(device), dtype="float16")
    real = torch.amp.GradScaler
    with monkeypatch.context() as m:  # without the scaler: the first step's gradient norm is not finite
        m.setattr(torch.amp, "GradScaler", lambda device_type, enabled=True, **kw: real(device_type, enabled=False))
        with pytest.raises(NonFiniteError, match="step 1: the gradient norm"):
            train(char_data, tmp_path / "plain", start, settings)
    result = train(char_data, tmp_path / "scaled", start, settings)
    assert result.step == 40
    load(tmp_path / "scaled")  # which refuses weights that are not finite
    scale = load_training(tmp_path / "scaled")["scaler"]["scale"]
    assert scale < 1, scale  # it went below 1, where the gradients fit
    losses = steps(tmp_path / "scaled")
    assert losses[40] < losses[1] - 0.3, losses  # and then it trained


# ---- inference, checkpoints, serving ----------------------------------------------------------------


def test_low_precision_inference_keeps_the_perplexity_bounds(device, tmp_path):
    run = trained_run(tmp_path, str(device))
    fp32 = perplexity(run, str(device))
    assert fp32 < 4.5  # it learned (e^1.5)
    for fmt in ("bf16", "fp16", "int8"):  # int4 is a CPU kernel
        if fmt == "fp16" and device.type == "cpu":
            continue  # on a CPU fp16 is fbgemm's kernel: test_quantize's
        assert abs(perplexity(run, str(device), fmt) / fp32 - 1) < PERPLEXITY_BOUNDS[fmt], fmt


def test_a_run_moves_from_the_gpu_to_the_cpu_and_back(device, char_data, tmp_path, cli):
    run, straight = tmp_path / "run", tmp_path / "straight"
    here = ["--data", char_data, "--batch-size", 8, *FLAT]
    assert cli("train", *here, "--out", straight, "--max-iters", 30, "--device", device).returncode == 0
    for part, (iters, where) in enumerate([(10, device), (20, "cpu"), (30, device)]):
        again = ["--resume"] if part else []
        r = cli("train", *here, "--out", run, *again, "--max-iters", iters, "--device", where)
        assert r.returncode == 0, r.stderr
    assert list(steps(run)) == list(range(1, 31))
    for s, loss in steps(straight).items():
        assert steps(run)[s] == pytest.approx(loss, abs=1e-2), s  # TF32 on the GPU, float32 on the CPU
    assert load_training(run)["step"] == 30
    for where in ("cpu", device):
        r = cli("sample", run, "--max-new-tokens", 20, "--seed", 1, "--device", where)
        assert r.returncode == 0 and len(r.stdout) >= 20, r.stderr


@pytest.fixture
def full_float32():
    """float32 matmuls in float32, not TF32 (which tinygpt.quantize turns on for a GPU's process): the
    server decodes several rows in one batch, whose products may round otherwise than one row's."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("arch", ARCHS_ON_GPU)
def test_the_server_answers_the_openai_client(device, arch, full_float32):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tinygpt.server import create_app

    model, tok = tiny_model(arch, device), tiny_tokenizer()

    def reference(prompt: str, n: int) -> str:
        ids = torch.tensor([tok.encode(prompt)[-model.config.block_size :]], device=device)
        return tok.decode(generate(model, ids, n, greedy=True)[0, ids.shape[1] :].tolist())

    with running(create_app(model, tok, model_name=NAME, max_tokens=64)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=NAME, prompt="hello world", max_tokens=40, temperature=0)
        assert r.choices[0].text == reference("hello world", 40)  # 40 > block_size: the window slides
        streamed = client.completions.create(model=NAME, prompt="hello world", max_tokens=40, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=20, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        seeded = [client.completions.create(model=NAME, prompt="abc", max_tokens=20, n=3, seed=7, temperature=1.0)
                  for _ in range(2)]
        assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
        # requests decoded together: rows at different positions in one batch, each its own answer
        prompts = ["the cat", "a dog sees", "x", "my friend likes the moon"]
        answers: dict[str, str] = {}

        def ask(prompt: str) -> None:
            answers[prompt] = client.completions.create(model=NAME, prompt=prompt, max_tokens=30,
                                                        temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == {p: reference(p, 30) for p in prompts}


# ---- several GPUs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_on_two_gpus_train_as_one_process_with_twice_the_batch(device, char_data, tmp_path, cli, fsdp):
    needs_cuda(device, "NCCL runs on GPUs (tests/test_distributed runs gloo on the CPU)")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    here = ["--data", char_data, "--max-iters", 10, "--device", "cuda", *FLAT]
    assert cli("train", *here, "--out", tmp_path / "one", "--batch-size", 8).returncode == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tinygpt", "train",
           *map(str, here), "--out", str(tmp_path / "two"), "--batch-size", "4", *(["--fsdp"] if fsdp else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("max_iters: 10 steps on 2 processes"), r.stdout
    one, two = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert list(two) == list(one)
    for s in one:
        assert two[s] == pytest.approx(one[s], abs=2e-3), s
    a, b = load(tmp_path / "one").state_dict(), load(tmp_path / "two").state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3


# ---- torch.compile: last, since its compiles take the longest (a phase out of time loses only them) ---


@pytest.mark.slow  # on a CPU torch.compile takes tens of seconds a graph: the dry run leaves this to the GPU
@pytest.mark.parametrize("arch", ARCHS_ON_GPU)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_compiled_training_and_decoding_give_eager_s_tokens(device, char_data, tmp_path, arch, optimizer):
    runs = {c: train_tiny(char_data, tmp_path / str(c), device, arch, optimizer, max_iters=20, eval_interval=20,
                          compile=c) for c in (False, True)}
    eager, compiled = steps(tmp_path / "False"), steps(tmp_path / "True")
    assert list(compiled) == list(range(1, 21))
    for s in eager:
        assert compiled[s] == pytest.approx(eager[s], rel=1e-3), s
    models = {c: load(tmp_path / str(c), device=device).eval() for c in (False, True)}
    prompts = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(2)).to(device)
    want = generate(models[False], prompts, 40, greedy=True)
    assert_same_greedy(models[False], 5, generate(models[True], prompts, 40, greedy=True), want, tie("fp32", device))
    # decoding through torch.compile (CUDA graphs on a GPU): eager's tokens, at one row and at two
    for fmt in ("fp32", "bf16"):
        model = quantize(copy.deepcopy(models[False]), fmt, pack=False)  # pack: CPU kernels, which compile refuses
        if on_cpu_kernels(model):
            continue  # bf16 on a CPU where tinygpt's kernels build: its layers are theirs
        for rows in (1, 2):
            eager_tokens = generate(model, prompts[:rows], 40, greedy=True)
            assert_same_greedy(model, 5, generate(model, prompts[:rows], 40, greedy=True, compile=True), eager_tokens,
                               tie(fmt, device))
