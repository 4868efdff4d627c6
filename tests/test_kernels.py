"""tinygpt's own float32/float16/bfloat16/int8/int4 CPU kernels (tinygpt.kernels, csrc/lowbit.cpp): the exact products they
stand for, rows independent of their batch and of the thread count, clear errors on bad shapes,
and PyTorch's kernels wherever these cannot be built."""

import copy
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from tinygpt import kernels
from tinygpt.device import cpu_flag_set
from tinygpt.interop import quantize as quantize_module
from tinygpt import GPT, GPTConfig, quantize
from tinygpt.interop.quantize import (FloatLinear, Fp16Linear, Int4Linear, Int8Linear, PackedLinear, activation_dtype,
                                      weight_format)

ops = kernels.lowbit()
needs_kernels = pytest.mark.skipif(ops is None, reason="tinygpt's CPU kernels cannot be built here")


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    # every test of the kernels skips where they cannot be built: a C++ error in them must fail here, not
    # turn the suite's kernel tests into skips (a DecodePlan that did not compile passed every test that way)
    import shutil

    from torch.utils import cpp_extension

    if not kernels.cpu_supports() or shutil.which("c++") is None or not cpp_extension.is_ninja_available():
        pytest.skip("no AVX2 CPU, C++ compiler or ninja here")
    assert ops is not None
SHAPES = [(1, 40, 64), (2, 50, 320), (3, 96, 768), (17, 130, 3072)]  # (rows, out, in); 320: 8 blocks and a tail


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ w.T + bias in float64, with x quantized as the kernels quantize it."""
    codes, scales = kernels.quantize_activations(x)
    xq = (codes.double().reshape(x.shape[0], -1, kernels.BLOCK) * scales.double()[..., None]).reshape(x.shape)
    return xq @ w.double().T + bias.double()


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1) / 127
    return torch.round(w / scales[:, None]).to(torch.int8), scales


@needs_kernels
@pytest.mark.parametrize("rows,out,inp", SHAPES)
def test_kernels_compute_the_quantized_products_exactly(rows, out, inp):
    g = torch.Generator().manual_seed(rows)
    x, w, bias = torch.randn(rows, inp, generator=g), torch.randn(out, inp, generator=g) * 0.02, torch.randn(out, generator=g)
    x[0, :32] = 0.0  # a block of zeros has no scale to divide by
    q8, s8 = int8_weights(w)
    got = ops.int8_linear(x, kernels.int8_group(q8), s8, bias, out)
    torch.testing.assert_close(got.double(), exact(x, q8.double() * s8.double()[:, None], bias), atol=1e-5, rtol=1e-5)
    codes, params = kernels.int4_codes(w)
    got = ops.int4_linear(x, *kernels.int4_pack(codes, params), None, out)
    torch.testing.assert_close(got.double(), exact(x, kernels.int4_dequantize(codes, params), torch.zeros(out)),
                               atol=1e-5, rtol=1e-5)
    # and near the float product they approximate (int8 within 2%, 4 bits within 10%)
    full = x @ w.T
    assert float((ops.int8_linear(x, kernels.int8_group(q8), s8, None, out) - full).norm() / full.norm()) < 0.02
    assert float((got - full).norm() / full.norm()) < 0.1


@needs_kernels
@pytest.mark.parametrize("rows,out,inp", SHAPES + [(2, 24, 40)])  # 40: a multiple of 8 with a tail
def test_the_float_kernel_is_the_float_product(rows, out, inp):
    g = torch.Generator().manual_seed(rows)
    x, w, bias = torch.randn(rows, inp, generator=g), torch.randn(out, inp, generator=g), torch.randn(out, generator=g)
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(ops.float_linear(x, w, bias).double(), want, atol=1e-4, rtol=1e-5)
    for dtype in (torch.float16, torch.bfloat16):  # 16-bit weights, widened exactly
        want16 = x.double() @ w.to(dtype).double().T
        torch.testing.assert_close(ops.float_linear(x, w.to(dtype), None).double(), want16, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_a_row_computes_alike_in_any_batch_and_on_any_number_of_threads():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 256, generator=g), torch.randn(300, 256, generator=g)
    q8, s8 = int8_weights(w)
    packed, params = kernels.int4_pack(*kernels.int4_codes(w))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            calls = (lambda r: ops.int8_linear(r, kernels.int8_group(q8), s8, None, 300), lambda r: ops.int4_linear(r, packed, params, None, 300),
                     lambda r: ops.float_linear(r, w, None), lambda r: ops.float_linear(r, w.half(), None),
                     lambda r: ops.float_linear(r, w.bfloat16(), None))
            runs.append([call(x) for call in calls])
            for i in (0, 5):
                for call, whole in zip(calls, runs[-1]):
                    assert torch.equal(call(x[i:i + 1]), whole[i:i + 1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@needs_kernels
@pytest.mark.parametrize("rows_at_once", [1, 4])
def test_float32_at_one_row_sums_as_a_batch_does_with_a_tail_and_a_bias(rows_at_once):
    # one row of activations takes float32 weights one or four rows at a time (each CPU kind its
    # faster), a batch one row at a time: the same sums bit for bit, with inputs not a multiple of 16
    # and outputs not a multiple of 4
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 264, generator=g), torch.randn(302, 264, generator=g), torch.randn(302, generator=g)
    before = ops.float_rows(rows_at_once)
    try:
        assert ops.float_rows(0) == rows_at_once
        whole = ops.float_linear(x, w, b)
        torch.testing.assert_close(whole.double(), x.double() @ w.double().T + b.double(), atol=1e-4, rtol=1e-5)
        for i in range(3):
            assert torch.equal(ops.float_linear(x[i:i + 1], w, b), whole[i:i + 1])
    finally:
        ops.float_rows(before)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_prompt_s_rows_compute_alike_in_any_number_of_them(dtype):
    # more than eight rows (a prompt) multiply three weight rows by four activation rows at a time: each
    # row's sums the same bit for bit with however many rows come with it, the weight rows' tail (301 =
    # 3 x 100 + 1) and the activation rows' (9, 10, 11 after tiles of four) included
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(20, 264, generator=g), torch.randn(301, generator=g)
    w = torch.randn(301, 264, generator=g).to(dtype)
    whole = ops.float_linear(x, w, b)
    torch.testing.assert_close(whole.double(), x.double() @ w.double().T + b.double(), atol=1e-4, rtol=1e-5)
    for rows in (9, 10, 11, 16):
        assert torch.equal(ops.float_linear(x[:rows], w, b), whole[:rows])
        assert torch.equal(ops.float_linear(x[20 - rows:], w, b), whole[20 - rows:])


@needs_kernels
def test_a_short_prompt_multiplies_on_the_kernel_and_a_longer_one_on_pytorch_s(monkeypatch):
    # up to FLOAT_KERNEL_ROWS rows float32 and float16 weights take tinygpt's kernel (faster there than
    # PyTorch's matmul, and float16 weights are not widened for it); past it PyTorch's matmul
    layer, limit = torch.nn.Linear(64, 48), quantize_module.FLOAT_KERNEL_ROWS
    x = torch.randn(1, limit, 64)
    want = layer(x).detach()
    calls = []  # F is torch.nn.functional: every F.linear from here on
    monkeypatch.setattr(quantize_module.F, "linear",
                        lambda *a: calls.append(a[0].shape[0]) or torch.zeros(a[0].shape[0], 48))
    monkeypatch.setattr(quantize_module, "cpu_has_native_bf16", lambda: False)
    for dtype in (torch.float32, torch.float16):
        q = FloatLinear(layer, dtype)
        torch.testing.assert_close(q(x), want, atol=0.01, rtol=0.01)
        assert calls == []
        q(torch.randn(1, limit + 1, 64))
        assert calls == [limit + 1]
        calls.clear()


@needs_kernels
def test_the_float32_rows_at_once_follow_the_cpu_kind():
    # four where the CPU lacks AVX-512 (the Zen 3's faster), one where it has it (the Zen 4's)
    flags = cpu_flag_set() or set()
    assert ops.float_rows(0) == (1 if "avx512f" in flags else 4)
    with pytest.raises(RuntimeError, match="1 or 4"):
        ops.float_rows(2)


def test_int4_pack_lays_out_eight_rows_a_block_with_their_scales():
    codes = torch.arange(9 * 64).remainder(16).reshape(9, 64)  # 9 rows: two groups, the second padded
    params = torch.arange(9 * 2 * 2, dtype=torch.float16).reshape(9, 2, 2)
    packed, p = kernels.int4_pack(codes, params)
    assert packed.shape == (2, 2, 128) and packed.dtype == torch.uint8 and p.shape == (2, 2, 16)
    # group 0, block 1, chunk 2, row 3, byte 1: inputs 32 + 16 + 1 (low half) and 32 + 16 + 4 + 1 (high)
    assert packed[0, 1, 2 * 32 + 4 * 3 + 1] == codes[3, 49] | codes[3, 53] << 4
    assert p[0, 1, 3] == params[3, 0, 1] and p[0, 1, 8 + 3] == params[3, 1, 1]  # row 3's block-1 scale, minimum
    assert packed[1, :, 4:32].eq(0).all() and p[1, :, 1:8].eq(0).all()  # row 8 is group 1's only row


def test_int8_group_lays_out_eight_rows_four_inputs_at_a_time():
    q = torch.arange(9 * 64).remainder(255).sub(127).to(torch.int8).reshape(9, 64)
    grouped = kernels.int8_group(q)
    assert grouped.shape == (2, 2, 256) and grouped.dtype == torch.int8
    # group 0, block 1, chunk 5, row 3: inputs 32 + 20 .. 32 + 23
    assert torch.equal(grouped[0, 1, 5 * 32 + 4 * 3:5 * 32 + 4 * 3 + 4], q[3, 52:56])
    assert torch.equal(grouped[1, 0, :4], q[8, :4]) and grouped[1, :, :].reshape(2, 8, 8, 4)[:, :, 1:].eq(0).all()


@needs_kernels
def test_bad_shapes_are_refused_with_a_message():
    q8, s8 = int8_weights(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match=r"weight must be \(1, 1, 256\)"):  # 32 inputs for a weight of 64
        ops.int8_linear(torch.randn(2, 32), kernels.int8_group(q8), s8, None, 8)
    with pytest.raises(RuntimeError, match="as kernels.py lays it out"):  # the plain (out, in) layout
        ops.int8_linear(torch.randn(2, 64), q8, s8, None, 8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_linear(torch.randn(2, 64, dtype=torch.float64), kernels.int8_group(q8), s8, None, 8)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=r"k must be \(B, H_kv, T, D\) .* H_kv dividing q's heads"):
        ops.causal_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(RuntimeError, match="k must be"):  # 2 query heads are not served by 3
        ops.causal_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(RuntimeError, match="rotary positions need an even head_dim"):
        ops.rotary(torch.randn(1, 2, 3, 5), None, 1e-6, torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \(T, D\)"):
        ops.rotary(torch.randn(1, 2, 3, 4), None, 1e-6, torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="w must be 16 contiguous float32"):
        ops.rms_norm(q, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="last dimension contiguous"):
        ops.causal_attention(q, q, q.transpose(2, 3))
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        ops.gelu(q.double(), True)


def test_without_the_kernels_quantize_keeps_pytorch_s(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def failed_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'tinygpt_lowbit': lowbit.cpp: internal compiler error\nmore")

    monkeypatch.setattr(kernels, "cpu_supports", lambda: True)
    monkeypatch.setattr(kernels, "_missing_compiler", lambda: None)  # one is found, and the build fails all the same
    monkeypatch.setattr(cpp_extension, "load", failed_build)
    monkeypatch.setenv("TINYGPT_KERNELS_DIR", str(tmp_path))
    kernels.lowbit.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tinygpt.kernels"):
            assert kernels.lowbit() is None
        assert "compiling its CPU kernels, once" in caplog.text
        assert ("could not be built (Error building extension 'tinygpt_lowbit': lowbit.cpp: internal compiler error); "
                "using PyTorch's") in caplog.text
        torch.manual_seed(0)
        linear = torch.nn.Linear(64, 48)
        layer8, layer4 = Int8Linear(linear, torch.float32), Int4Linear(linear)
        assert not layer8.lowbit and not layer4.lowbit and not FloatLinear.fits(linear)
        model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=64))
        fp32, fp16 = (quantize(GPT(model.config), fmt) for fmt in ("fp32", "fp16"))
        assert isinstance(fp32.h[0].mlp.c_fc, PackedLinear) and isinstance(fp16.h[0].mlp.c_fc, Fp16Linear)
        x = torch.randn(1, 64)
        torch.testing.assert_close(layer8(x), linear(x), atol=0.05, rtol=0.05)
        torch.testing.assert_close(layer4(x), linear(x), atol=0.2, rtol=0.2)
    finally:
        kernels.lowbit.cache_clear()
    monkeypatch.setenv("TINYGPT_KERNELS", "0")
    assert kernels.lowbit() is None  # and the switch that asks for PyTorch's
    kernels.lowbit.cache_clear()


# A process of its own, since the kernels are asked for once a process: they are asked for twice, then a
# tiny GPT-2 takes a training step and decodes greedily, and the default recipe's block (RMSNorm, QK-norm,
# rotary positions, SwiGLU, grouped-query attention) a training step; the losses, gradients and tokens are printed
NO_COMPILER_RUN = """
import json
import torch
from tinygpt import GPT, GPTConfig, generate, kernels, quantize
from tinygpt.config import RECIPE_MODEL
kernels.cpu_supports = lambda: True  # whatever this CPU is, the compiler is looked for first
assert kernels.lowbit() is None and kernels.lowbit() is None
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=64))
idx = torch.randint(0, 37, (2, 16))
loss = model(idx[:, :-1], targets=idx[:, 1:])
loss.backward()
grad = model.h[0].mlp.c_fc.weight.grad.abs().sum().item()
tokens = generate(quantize(model.eval(), "fp32"), idx[:1, :4], 8, greedy=True)
modern = GPT(GPTConfig(**RECIPE_MODEL, vocab_size=37, block_size=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=64))
modern_loss = modern(idx[:, :-1], targets=idx[:, 1:])
modern_loss.backward()
modern_grad = [p.grad.abs().sum().item() for p in modern.parameters()]
print(json.dumps({"loss": loss.item(), "grad": grad, "tokens": tokens.tolist(), "modern_loss": modern_loss.item(),
                  "modern_grad": modern_grad}))
"""


def test_without_a_compiler_one_line_says_so_and_pytorch_s_kernels_give_their_results(tmp_path):
    """Without a C++ compiler every command said it was compiling, then printed PyTorch's banner about the
    compiler and the failed build's log (1.4 KB of stderr a process); now one line, once a process, says
    what it costs and how to install one, before anything is built."""
    import subprocess
    import sys

    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", NO_COMPILER_RUN], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TINYGPT_KERNELS_DIR": str(tmp_path / "kernels"), **env})

    pytorch_s = run(TINYGPT_KERNELS="0")
    assert pytorch_s.returncode == 0 and pytorch_s.stderr == "", pytorch_s.stderr
    missing = run(CXX=str(tmp_path / "no" / "c++"))
    assert missing.returncode == 0, missing.stderr
    (line,) = missing.stderr.splitlines()
    said = f"tinygpt: no C++ compiler (CXX='{tmp_path / 'no' / 'c++'}' is not on PATH): PyTorch's kernels do "
    assert line.startswith(said) and "slower" in line and "apt install g++" in line
    assert len(line) - len(said) < 200 and not (tmp_path / "kernels").exists()  # and no build was tried
    assert missing.stdout == pytorch_s.stdout


def test_the_compiler_is_looked_for_as_pytorch_s_builder_runs_it(monkeypatch, tmp_path):
    # CXX, else c++; a wrapper in CXX runs its compiler as written, so only the wrapper must be found
    monkeypatch.setenv("PATH", str(_fake_tool(tmp_path / "bin", "ccache", "ccache version 4.8")))
    monkeypatch.delenv("CXX", raising=False)
    assert kernels._missing_compiler() == "c++"
    monkeypatch.setenv("CXX", "ccache g++")
    assert kernels._missing_compiler() is None
    monkeypatch.setenv("CXX", "")
    assert kernels._missing_compiler() == "CXX=''"
    monkeypatch.setenv("PATH", str(_fake_tool(tmp_path / "gcc", "c++", "c++ (Debian 12.2.0) 12.2.0")))
    monkeypatch.delenv("CXX")
    assert kernels._missing_compiler() is None


@needs_kernels
def test_the_kernels_are_checked_alike_when_first_asked_for_without_autograd():
    # a library user's first call is often tinygpt.generate, which runs under no_grad
    try:
        for mode in (torch.no_grad, torch.inference_mode):
            kernels.lowbit.cache_clear()
            with mode():
                assert kernels.lowbit() is not None
    finally:
        kernels.lowbit.cache_clear()


def test_a_build_killed_midway_does_not_hold_later_ones_and_checkouts_share_one(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TINYGPT_KERNELS_DIR", str(tmp_path))
    folder = kernels.build_directory()
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # PyTorch's lock, left by a build killed by a signal: it waits on it forever
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append((kw, (folder / "lock").exists())))
    kernels._build(folder)
    (kw, stale), = calls
    assert not stale and kw["build_directory"] == str(folder)
    # the build reads copies in its folder: the same paths from any checkout, so ninja need not rebuild
    assert kw["sources"] == [str(folder / "src" / s.name) for s in kernels.SOURCES]
    assert [Path(s).read_bytes() for s in kw["sources"]] == [s.read_bytes() for s in kernels.SOURCES]
    # and other sources build in a folder of their own
    other = tmp_path / "lowbit.cpp"
    other.write_text("// another version")
    monkeypatch.setattr(kernels, "SOURCES", [other])
    theirs = kernels.build_directory()
    assert theirs != folder and theirs.parent == folder.parent
    # as does another torch installation (ninja would rebuild: its headers' path is in the commands)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py"))
    assert kernels.build_directory() != theirs and kernels.build_directory().parent == folder.parent


def _fake_tool(folder: Path, name: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\necho '{version}'\n")
    (folder / name).chmod(0o755)
    return folder


def test_each_ninja_and_compiler_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """A system ninja 1.11 and a venv's 1.13 alternating on PATH: each finds its own build again, where
    they shared one folder and each rebuilt it (36-45 s) after the other, since a ninja of another
    version discards the build log. The compiler (CXX, or c++ on PATH) likewise."""
    monkeypatch.setenv("TINYGPT_KERNELS_DIR", str(tmp_path / "cache"))
    path = os.environ["PATH"]
    system = _fake_tool(tmp_path / "system", "ninja", "1.11.1")
    venv = _fake_tool(tmp_path / "venv", "ninja", "1.13.2.git.kitware.jobserver-pipe-1")
    folders = []
    for tools in (system, venv, system, venv):
        monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{path}")
        folders.append(kernels.build_directory())
    assert folders[0] != folders[1] and folders[2:] == folders[:2]
    assert folders[0].parent == folders[1].parent == tmp_path / "cache"
    # the same version at another path is another build too (what ninja runs could differ)
    monkeypatch.setenv("PATH", f"{_fake_tool(tmp_path / 'other', 'ninja', '1.11.1')}{os.pathsep}{path}")
    assert kernels.build_directory() not in folders
    monkeypatch.setenv("PATH", f"{system}{os.pathsep}{path}")
    gcc12, gcc13 = (_fake_tool(tmp_path / f"gcc{v}", "g++", f"g++ (Debian {v}.2.0) {v}.2.0") for v in (12, 13))
    compilers = []
    for compiler in (gcc12, gcc13, gcc12):
        monkeypatch.setenv("CXX", str(compiler / "g++"))
        compilers.append(kernels.build_directory())
    assert compilers[0] != compilers[1] and compilers[2] == compilers[0] and folders[0] not in compilers


@pytest.mark.skipif(kernels.fcntl is None, reason="builds are serialized with flock (POSIX)")
def test_waiting_for_another_process_s_build_says_so(monkeypatch, tmp_path, caplog):
    """A first `tinygpt serve` waited two minutes on another job's build without a word and looked hung."""
    import threading

    from torch.utils import cpp_extension

    folder = tmp_path / "kernels"
    folder.mkdir()
    loaded = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: loaded.append(kw["build_directory"]))
    other = open(folder / "build.lock", "a")  # another process's build: flock holds per open file
    kernels.fcntl.flock(other, kernels.fcntl.LOCK_EX)
    waiting = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if "waiting for another process compiling its CPU kernels" in record.getMessage():
                waiting.set()

    watch = Watch()
    kernels.log.addHandler(watch)
    builder = threading.Thread(target=kernels._build, args=(folder,))
    try:
        with caplog.at_level(logging.WARNING, logger="tinygpt.kernels"):
            builder.start()
            said = waiting.wait(timeout=60)
            assert not loaded  # it waits for the lock before building
            other.close()
            builder.join(timeout=60)
        assert said, "no line while waiting for the lock"
        assert f"tinygpt: waiting for another process compiling its CPU kernels in {folder}" in caplog.text
        assert loaded == [str(folder)]
    finally:
        other.close()
        builder.join()
        kernels.log.removeHandler(watch)


@pytest.mark.skipif(shutil.which("ninja") is None, reason="needs ninja")
def test_compiling_says_so_even_where_the_library_is_already_there(monkeypatch, tmp_path, caplog):
    """The line goes by what ninja will do: a ninja of another version (here: its build log gone, as such
    a ninja discards it) recompiles next to the library in place, where no line was written before."""
    import subprocess

    from torch.utils import cpp_extension

    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "build.ninja").write_text("rule cp\n  command = cp $in $out\nbuild tinygpt_lowbit.so: cp src/lowbit.cpp\n")
    # what PyTorch's builder does once it has written build.ninja
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: subprocess.run(["ninja"], cwd=kw["build_directory"],
                                                                          check=True, capture_output=True))
    line = "tinygpt: compiling its CPU kernels, once for this compiler, ninja and torch"
    said = []
    for change in (None, None, ".ninja_log"):
        if change:
            (folder / change).unlink()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tinygpt.kernels"):
            kernels._build(folder)
        said.append(line in caplog.text)
        assert (folder / "tinygpt_lowbit.so").exists()
    assert said == [True, False, True]


def test_the_cpu_check_reads_the_flags_it_needs(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    flags = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
    monkeypatch.setattr(kernels, "cpu_flag_set", lambda: flags)
    assert kernels.cpu_supports()
    flags -= {"avx2", "fma"}  # an older x86 CPU
    assert not kernels.cpu_supports()
    monkeypatch.setattr(kernels.platform, "machine", lambda: "arm64")
    assert not kernels.cpu_supports()


@needs_kernels
def test_fp32_fp16_and_bf16_models_decode_with_the_float_kernel(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=64)).eval()
    idx = torch.randint(0, 37, (2, 9))
    ref = model(idx).detach()
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    # bf16 takes the kernel whether the CPU multiplies bfloat16 natively or not; where it does, longer
    # inputs multiply in bfloat16 (elsewhere in float32, the weights widened)
    for fmt, tol, native in (("fp32", 1e-5, False), ("fp16", 0.01, False), ("bf16", 0.05, False), ("bf16", 0.05, True)):
        monkeypatch.setattr(quantize_module, "cpu_has_native_bf16", lambda: native)
        assert activation_dtype(fmt, "cpu") is torch.float32
        q = quantize(copy.deepcopy(model), fmt)
        layer = q.h[0].mlp.c_fc
        assert isinstance(layer, FloatLinear) and weight_format(q) == fmt and layer.native_bf16 == native
        assert layer.weight.dtype == dtypes[fmt] and q.wte.weight.dtype == torch.float32
        assert layer.nbytes == 256 * 64 * layer.weight.element_size() + 256 * 4
        # 18 rows take PyTorch's matmul, one row and nine tinygpt's kernel: the same logits each way
        torch.testing.assert_close(q(idx), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(q(idx[:1, :1]), ref[:1, :1], atol=tol, rtol=tol)
        torch.testing.assert_close(q(idx[:1]), ref[:1], atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("approximate", ["tanh", "none"])
# (5, 1003) is one thread's work; (5, 8003) is 5,002 blocks of eight that two threads split at 2,501, not a
# multiple of four, so single blocks follow blocks of four inside the range too
@pytest.mark.parametrize("size", [1003, 8003])
def test_gelu_and_its_gradient_on_the_kernel(approximate, size):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, size, generator=g) * 4).requires_grad_()  # the last block of eight partial
    grad = torch.randn(5, size, generator=g)
    exact = x.detach().double().requires_grad_()
    want = torch.nn.functional.gelu(exact, approximate=approximate)
    want.backward(grad.double())
    got = kernels.gelu(x, approximate)
    got.backward(grad)
    torch.testing.assert_close(got.double(), want.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), exact.grad, atol=1e-5, rtol=1e-5)
    # as close as PyTorch's own float32 GELU is
    ours = (got.double() - want).abs().max()
    assert ours <= 2 * (torch.nn.functional.gelu(x.detach(), approximate=approximate).double() - want).abs().max()
    # only where autograd records: inference keeps PyTorch's GELU, as the decode steps do
    assert kernels.trains_gelu(x, approximate) and not kernels.trains_gelu(x.detach(), approximate)
    assert not kernels.trains_gelu(x.double(), approximate)
    with torch.no_grad():
        assert not kernels.trains_gelu(x, approximate)


@needs_kernels
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_in_bfloat16_as_autocast_gives_it_is_the_exact_value_rounded_to_bfloat16(approximate):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 8003, generator=g) * 4).bfloat16().requires_grad_()  # a partial last block of eight
    grad = torch.randn(7, 8003, generator=g).bfloat16()
    exact = x.detach().double().requires_grad_()
    want = torch.nn.functional.gelu(exact, approximate=approximate)
    want.backward(grad.double())
    # the kernel takes both forms; training uses it for the tanh one (PyTorch's exact bfloat16 GELU is faster)
    assert kernels.trains_gelu(x, approximate) == (approximate == "tanh")
    got = kernels.gelu(x, approximate)
    got.backward(grad)
    assert got.dtype == x.grad.dtype == torch.bfloat16
    for ours, value in ((got, want.detach()), (x.grad, exact.grad)):
        # computed in float32 and rounded to the nearest even: the exact value's nearest bfloat16, or its
        # neighbour where float32's few ulps cross a rounding boundary; in the far left tail (PyTorch's own
        # float32 tanh form gives 0 there) a tiny value
        nearest = value.bfloat16()
        steps = (ours.view(torch.int16).int() - nearest.view(torch.int16).int()).abs()
        large = value.abs() > 1e-4
        assert steps[large].max() <= 1 and (steps[large] == 0).float().mean() > 0.99
        assert (ours.double() - value)[~large].abs().max() < 2e-6
    with pytest.raises(RuntimeError, match="grad must be shaped and typed as x"):
        ops.gelu_backward(grad.float(), x.detach(), approximate == "tanh")


@needs_kernels
def test_the_first_call_checks_the_kernels_in_float32_even_under_autocast():
    # a bfloat16 training step's GELU may be the first to ask: the check's references then ran in bfloat16,
    # disagreed, and the process lost every kernel
    kernels.lowbit.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert kernels.lowbit() is not None
    finally:
        kernels.lowbit.cache_clear()


@needs_kernels
@pytest.mark.parametrize("vocab", [8, 77, 1027])
def test_cross_entropy_rows_gives_each_loss_and_turns_the_logits_into_its_gradient(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(37, vocab, generator=g) * 5  # rows of whole blocks of eight, and with a tail
    targets = torch.randint(0, vocab, (37,), generator=g)
    weights = (torch.rand(37, generator=g) > 0.3).float() * 2
    exact = logits.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(exact, targets, reduction="none")
    (want * weights.double()).sum().backward()
    grads = logits.clone()
    got = ops.cross_entropy_rows_(grads, targets, weights, True)
    torch.testing.assert_close(got.double(), want.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(grads.double(), exact.grad, atol=1e-6, rtol=1e-5)
    # without grad the logits stay as they were, and the losses are the same
    kept = logits.clone()
    assert torch.equal(ops.cross_entropy_rows_(kept, targets, weights, False), got) and torch.equal(kept, logits)


@needs_kernels
def test_cross_entropy_rows_keeps_a_nan_and_refuses_a_target_out_of_range():
    logits = torch.zeros(3, 20)
    logits[1, 5] = float("nan")  # not the target, nor the maximum: the row's loss is still NaN
    logits[1, 6] = 3.0
    ce = ops.cross_entropy_rows_(logits.clone(), torch.tensor([0, 6, 19]), torch.ones(3), True)
    assert ce[1].isnan() and ce[[0, 2]].isfinite().all()
    with pytest.raises(RuntimeError, match="target 20 is out of range for 20 classes"):
        ops.cross_entropy_rows_(logits.clone(), torch.tensor([0, 20, 1]), torch.ones(3), True)


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 3, 13, 44), (1, 1, 1, 8), (3, 2, 40, 37), (1, 2, 64, 32)])
def test_causal_attention_and_its_gradients_on_the_kernel(shape):
    B, H, T, D = shape  # partial tiles of positions and of dimensions, one position, whole tiles
    g = torch.Generator().manual_seed(T)
    qkv = torch.randn(B, T, 3 * H * D, generator=g, requires_grad=True)  # c_attn's output
    grad = torch.randn(B, T, H * D, generator=g)
    exact = qkv.detach().double().requires_grad_()
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(B, T, H, D).transpose(1, 2) for t in exact.split(H * D, dim=-1)), is_causal=True)
    want = want.transpose(1, 2).reshape(B, T, H * D)
    want.backward(grad.double())
    assert kernels.trains_attention(qkv, H)
    got = kernels.causal_attention(qkv, H)
    got.backward(grad[:, :, None].expand(B, T, 2, H * D)[:, :, 0])  # a gradient that is not contiguous
    torch.testing.assert_close(got.double(), want.detach(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(qkv.grad.double(), exact.grad, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous()


def test_causal_attention_takes_only_what_it_is_for():
    qkv = torch.randn(1, 8, 3 * 32, requires_grad=True)  # 2 heads of 16
    if kernels.lowbit() is None:
        assert not kernels.trains_attention(qkv, 2)
        return
    assert kernels.trains_attention(qkv, 2)
    assert not kernels.trains_attention(qkv.detach(), 2)  # inference keeps PyTorch's
    assert not kernels.trains_attention(qkv.double(), 2)
    assert not kernels.trains_attention(qkv, 5)  # 96 columns are not 3 x 5 heads
    assert not kernels.trains_attention(torch.randn(1, 96, 8, requires_grad=True).transpose(1, 2), 2)  # strided
    long = torch.randn(1, kernels.ATTENTION_MAX_T + 1, 24, requires_grad=True)
    assert not kernels.trains_attention(long, 1)
    with torch.no_grad():
        assert not kernels.trains_attention(qkv, 2)


def step_gradients(activation: str, autocast: bool):
    """A small model's training step, float32 or under bfloat16 autocast: a function that takes it and
    returns every parameter's gradient."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, activation=activation)).train()
    idx = torch.randint(0, 37, (3, 17))

    def grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx[:, :-1], targets=idx[:, 1:])
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    return grads


@needs_kernels
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_a_training_step_on_the_kernels_matches_pytorchs_gelu_and_attention(monkeypatch, activation):
    grads = step_gradients(activation, autocast=False)
    calls = []
    monkeypatch.setattr(kernels, "gelu", lambda x, a, f=kernels.gelu: calls.append("gelu") or f(x, a))
    monkeypatch.setattr(kernels, "causal_attention",
                        lambda qkv, h, f=kernels.causal_attention: calls.append("attention") or f(qkv, h))
    fast = grads()
    assert sorted(calls) == ["attention"] * 2 + ["gelu"] * 2  # each block's
    monkeypatch.setattr(kernels, "trains_gelu", lambda x, approximate: False)
    monkeypatch.setattr(kernels, "trains_attention", lambda qkv, h: False)
    for a, b in zip(fast, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert len(calls) == 4  # PyTorch's, the second time


@needs_kernels
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_a_bfloat16_autocast_step_takes_the_tanh_gelu_kernel_and_matches_pytorchs(monkeypatch, activation):
    grads = step_gradients(activation, autocast=True)
    calls = []
    monkeypatch.setattr(kernels, "gelu", lambda x, a, f=kernels.gelu: calls.append(x.dtype) or f(x, a))
    fast = grads()
    assert calls == ([torch.bfloat16] * 2 if activation == "gelu_tanh" else [])  # each block's, the tanh form only
    monkeypatch.setattr(kernels, "trains_gelu", lambda x, approximate: False)
    for a, b in zip(fast, grads()):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=2e-2)
