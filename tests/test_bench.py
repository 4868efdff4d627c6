"""tinygpt bench: a tiny run yields every row and ratio the report needs, and greedy tokens agree
with transformers on the same weights (speed itself is never asserted); llama.cpp's rows where it is
installed; the CPU's flags at the top of every report."""

import importlib.util
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.lab.bench import GPU, SMOKE, Plan, plan_for, ratios, render, run
from tinygpt.lab.bench import generation, measure, peers, plans, training
from tinygpt.lab.bench.clock import Clock
from tinygpt.lab.bench.generation import bytes_per_token
from tinygpt.lab.bench.machine import cpu_flags, describe_cpu, machine, peak_bandwidth, peak_flops
from tinygpt.lab.bench.peers import llama_available, llama_failure
from tinygpt.lab.bench.plans import bench_config, peer_formats, train_dtypes
from tinygpt.calc.hardware import gpu_peaks
from tinygpt.interop.quantize import quantize
needs_transformers = pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="transformers is not installed")



def test_training_rows_use_a_char_vocabulary_and_short_context():
    cfg = bench_config("gpt2", training=True)
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer) == (77, 256, 12)
    assert bench_config("gpt2", training=False).block_size == 1024
    # a GPU trains GPT-2 as it is: 1,024 positions, its own vocabulary
    cfg = bench_config("gpt2", training=True, vocab=GPU.train_vocab, context=GPU.train_context)
    assert (cfg.vocab_size, cfg.block_size) == (50257, 1024)


def test_the_documented_entry_points_are_the_package_s():
    # docs/tutorials/finetune.md names tinygpt.lab.bench.run, and tinygpt bench calls run and render from
    # the package: they stay there now that the bench is a module a part (issue 56)
    import tinygpt.lab.bench
    from tinygpt.lab.bench import report

    assert tinygpt.lab.bench.run is measure.run and tinygpt.lab.bench.render is report.render


def test_each_device_gets_its_plan_and_a_gpu_its_datasheet_peaks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert plan_for(cuda) is GPU and plan_for(cpu) is plans.FULL and plan_for(cpu, quick=True) is plans.QUICK
    assert plan_for(cuda, smoke=True) is SMOKE is plan_for(cpu, quick=True, smoke=True)
    assert ("gpt2", 16, 10) in GPU.train and ("bfloat16", True) in GPU.train_modes and ("bf16", 1) in GPU.gen_compiled
    assert gpu_peaks("NVIDIA H200") == (989, 4800) and gpu_peaks("NVIDIA H200 NVL") == (835, 4800)
    assert gpu_peaks("NVIDIA H100 80GB HBM3") == (989, 3350) and gpu_peaks("NVIDIA H100 PCIe") == (756, 2000)
    assert gpu_peaks("NVIDIA A100-SXM4-40GB") == (312, 1555) and gpu_peaks("Some New GPU") is None


def test_a_gpu_run_is_read_against_its_peaks_and_targets():
    lim = {"matmul_float32_gflops": 400e3, "matmul_bfloat16_gflops": 790e3, "memory_read_gbs": 4300.0,
           "peak_bf16_gflops": 989e3, "peak_memory_gbs": 4800.0, "peak_source": "datasheet: NVIDIA H200"}
    assert peak_flops(lim, "float32") == 989e12 and peak_bandwidth(lim) == 4800e9
    cpu_lim = {"matmul_float32_gflops": 200.0, "matmul_bfloat16_gflops": 400.0, "memory_read_gbs": 40.0}
    assert peak_flops(cpu_lim, "float32") == 200e9 and peak_bandwidth(cpu_lim) == 40e9
    train = dict(model="gpt2", dtype="bfloat16", batch=16, seq_len=1024, vocab=50257)
    decode = dict(model="gpt2", format="bf16", kv_cache=True, prompt=64, new_tokens=128, prefill_tokens_per_s=1e5,
                  ttft_s=0.01)
    result = {"quick": False, "seconds": 60.0, "limits": lim, "training": [
        {**train, "impl": "tinygpt", "tokens_per_s": 2e5, "mfu": 0.15},
        {**train, "impl": "tinygpt compiled", "tokens_per_s": 6e5, "mfu": 0.45}], "generation": [
        {**decode, "impl": "tinygpt", "batch": 1, "decode_tokens_per_s": 300.0, "bandwidth_use": 0.02},
        {**decode, "impl": "tinygpt compiled", "batch": 1, "decode_tokens_per_s": 9000.0, "bandwidth_use": 0.45,
         "same_tokens_as_eager": True}],
        "machine": {**machine(torch.device("cpu")), "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8,
                    "gpu_capability": "9.0", "gpu_multiprocessors": 132, "cuda": "13.0"}}
    result["ratios"] = ratios(result)
    got = {r["name"]: (r["ratio"], r["met"]) for r in result["ratios"]}
    assert got["train gpt2 16x1024 bf16 compiled: MFU of the dense bf16 peak"] == (0.45, True)
    assert got["decode gpt2 b1 compiled: bandwidth use of the peak"] == (0.45, False)
    text = render(result)
    assert "gpu: NVIDIA H200, 139.8 GiB, compute capability 9.0" in text
    assert "against 989 TFLOP/s bf16 and 4800 GB/s (datasheet: NVIDIA H200)" in text
    assert "tinygpt compiled" in text and "compiled decoding's greedy tokens equal to eager's (row 0): bf16 batch 1 yes" in text
    assert "45%   target >= 50%: NOT met" in text


def test_bytes_per_token_count_each_format():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    fp32 = bytes_per_token(quantize(GPT(cfg), "fp32", pack=False), 1, 0)
    int8 = bytes_per_token(quantize(GPT(cfg), "int8"), 1, 0)
    matrices = 2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 32 * 64  # the blocks' Linears and the head
    assert fp32 > 4 * matrices and int8 < fp32 / 3


@needs_transformers
def test_a_tiny_run_measures_every_row_and_ratio():
    lines = []
    result = run(plan=SMOKE, log=lines.append)
    json.dumps(result)  # all JSON-ready
    assert result["limits"]["matmul_float32_gflops"] > 0 and result["limits"]["memory_read_gbs"] > 0
    train = {(r["impl"], r["dtype"]) for r in result["training"]}
    assert train == {(i, d) for i in ("tinygpt", "transformers") for d in train_dtypes(torch.device("cpu"))}
    assert all(r["tokens_per_s"] > 0 for r in result["training"])
    gen = {(r["impl"], r["format"], r["batch"], r["kv_cache"]) for r in result["generation"]}
    assert ("tinygpt", "int8", 2, True) in gen and ("transformers", "fp32", 1, False) in gen
    assert (("transformers", "bf16", 1, False) in gen) == ("bf16" in peer_formats(SMOKE, torch.device("cpu")))
    peer = next(r for r in result["generation"] if r["impl"] == "transformers" and r["format"] == "fp32"
                and r["batch"] == 1 and r["kv_cache"])
    assert peer["same_tokens_as_tinygpt"]  # greedy on identical weights: the same tokens
    text = render(result)
    assert "tinygpt bench" in text and "transformers" in text and len(lines) >= 8


def test_bfloat16_training_is_measured_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(plans, "cpu_has_native_bf16", lambda: True)
    assert train_dtypes(torch.device("cpu")) == ("float32", "bfloat16")
    monkeypatch.setattr(plans, "cpu_has_native_bf16", lambda: False)  # emulated: minutes a step
    assert train_dtypes(torch.device("cpu")) == ("float32",)
    assert peer_formats(plans.FULL, torch.device("cpu")) == ("fp32",)  # and transformers decodes in fp32
    assert train_dtypes(torch.device("cuda")) == ("float32", "bfloat16")
    assert peer_formats(plans.FULL, torch.device("cuda")) == ("fp32", "bf16")


def test_ratios_read_the_best_format_against_each_target():
    row = dict(batch=1, kv_cache=True)
    result = {"generation": [
        {**row, "model": "baby", "impl": "transformers", "format": "fp32", "decode_tokens_per_s": 100.0},
        {**row, "model": "baby", "impl": "tinygpt", "format": "fp32", "decode_tokens_per_s": 250.0},
        {**row, "model": "baby", "impl": "tinygpt", "format": "int8", "decode_tokens_per_s": 400.0},
    ], "training": [{"model": "char", "impl": "tinygpt", "dtype": "bfloat16", "tokens_per_s": 40_000.0}]}
    got = {r["name"]: (round(r["ratio"], 2), r["met"]) for r in ratios(result)}
    assert got["decode baby b1: tinygpt fp32 / transformers fp32"] == (2.5, True)
    assert got["decode baby b1: tinygpt int8 / transformers fp32"] == (4.0, False)
    assert got["train char 12x64: tinygpt best tokens/s / 32,000 (2x the peer's)"] == (1.25, True)


def test_ratios_against_llama_cpp_pair_each_format_with_tinygpt_s_best():
    row = dict(batch=1, kv_cache=True, model="baby")
    speeds = {("tinygpt", "fp32"): 100.0, ("tinygpt", "bf16"): 150.0, ("tinygpt", "int8"): 200.0,
              ("llama.cpp", "f32"): 100.0, ("llama.cpp", "f16"): 200.0, ("llama.cpp", "q8_0"): 100.0,
              ("llama.cpp", "q4_0"): 300.0}
    result = {"generation": [{**row, "impl": i, "format": f, "decode_tokens_per_s": v} for (i, f), v in speeds.items()]}
    got = {r["name"]: (round(r["ratio"], 2), r["met"]) for r in ratios(result)}
    assert got["decode baby b1: tinygpt fp32 / llama.cpp f32"] == (1.0, True)
    assert got["decode baby b1: tinygpt bf16 / llama.cpp f16"] == (0.75, False)  # fp16 not measured: not named
    result["generation"].append({**row, "impl": "tinygpt", "format": "fp16", "decode_tokens_per_s": 180.0})
    got = {r["name"]: (round(r["ratio"], 2), r["met"]) for r in ratios(result)}
    # both 16-bit formats measured: the ratio says which one it read
    assert got["decode baby b1: tinygpt fp16 (the faster of bf16, fp16) / llama.cpp f16"] == (0.9, False)
    assert got["decode baby b1: tinygpt int8 / llama.cpp q8_0"] == (2.0, True)
    assert not any("q4_0" in name for name in got)  # no tinygpt int4 row to compare with


def test_busy_rows_have_ratios_of_their_own_and_leave_the_quiet_ones_alone():
    # issue 40: decoding beside a process that takes a core is a condition of its own, never mixed with quiet rows
    quiet, busy = dict(batch=1, kv_cache=True, model="baby"), dict(batch=1, kv_cache=True, model="baby", condition="busy")
    result = {"generation": [{**quiet, "impl": "tinygpt", "format": "fp32", "decode_tokens_per_s": 100.0},
                             {**quiet, "impl": "llama.cpp", "format": "f32", "decode_tokens_per_s": 80.0},
                             {**busy, "impl": "tinygpt", "format": "fp32", "decode_tokens_per_s": 30.0},
                             {**busy, "impl": "llama.cpp", "format": "f32", "decode_tokens_per_s": 60.0}]}
    got = {r["name"]: (round(r["ratio"], 2), r["met"]) for r in ratios(result)}
    assert got == {"decode baby b1: tinygpt fp32 / llama.cpp f32": (1.25, True),
                   "decode baby b1 busy: tinygpt fp32 / llama.cpp f32": (0.5, False)}


def test_the_python_api_s_model_is_measured_against_the_cli_s_layout():
    # issue 40: tinygpt.load + generate within 10% of the CLI's decode speed, read from the bench's rows
    row = dict(batch=1, kv_cache=True, model="baby", format="fp32")
    result = {"generation": [{**row, "impl": "tinygpt.load", "decode_tokens_per_s": 95.0},
                             {**row, "impl": "tinygpt", "decode_tokens_per_s": 100.0}]}
    got = {r["name"]: (round(r["ratio"], 2), r["met"]) for r in ratios(result)}
    assert got == {"decode baby b1: tinygpt.load's fp32 model / the CLI's fp32 layout": (0.95, True)}
    smoke = run(smoke=True, sections=("generate",), peers=False, log=lambda line: None)
    assert {(r["impl"], r["format"]) for r in smoke["generation"] if r["impl"] == "tinygpt.load"} == {("tinygpt.load", "fp32")}
    assert any(r["name"].endswith("the CLI's fp32 layout") for r in smoke["ratios"])


def test_busy_core_spins_a_process_while_its_block_runs():
    import os
    import time

    def cpu_seconds(pid: int) -> float:  # user + system time, from /proc/PID/stat's fields 14 and 15
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    with generation.busy_core() as busy:
        start = cpu_seconds(busy.spinner.pid)
        time.sleep(1.0)
        assert cpu_seconds(busy.spinner.pid) - start > 0.1  # working, not asleep (a loaded machine shares its core)
    assert busy.spinner.poll() is not None  # gone with the block


def test_decode_speed_is_the_whole_call_s_wall_clock_as_a_user_times_it():
    # issue 40: the median step hid what a user's clock sees (the prompt, a cache zeroed at every call, stalls)
    clock = Clock()
    clock.times = [0.5, 0.6, 0.7, 2.0]  # the first token after the prompt, then a step that stalled
    r = clock.result(16, 1, [1, 2, 3, 4])
    assert r["decode_tokens_per_s"] == 4 / 2.0 and r["wall_s"] == 2.0 and r["ttft_s"] == 0.5
    assert clock.result(16, 8, [1, 2, 3, 4])["decode_tokens_per_s"] == 8 * 4 / 2.0  # every row's tokens
    assert plans.FULL.prompt == plans.QUICK.prompt == 16  # the harness's prompt


def test_cpu_flags_and_torch_s_view_of_them_head_every_report():
    cpuinfo = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni\n"
    flags = cpu_flags(cpuinfo)
    assert flags["AVX2"] and flags["AVX-512"] and flags["AVX-512 VNNI"]
    assert not flags["AVX-512 BF16"] and not flags["AMX"]
    assert cpu_flags("processor\t: 0\n") == {}  # nothing to read (not x86 Linux): no flags claimed
    line = describe_cpu({"processor": "Some CPU", "cpu_flags": flags, "cpu_capability": "AVX512", "native_bf16": False,
                         "tinygpt_kernels": True})
    assert "AVX-512 BF16 no" in line and "AVX-512 VNNI yes" in line and "torch kernels AVX512" in line
    assert "tinygpt's CPU kernels yes" in line
    m = machine(torch.device("cpu"))  # this machine's own flags, whatever they are
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    result = {"quick": False, "seconds": 1.0, "machine": m,
              "limits": {"matmul_float32_gflops": 1.0, "matmul_bfloat16_gflops": 1.0, "memory_read_gbs": 1.0}}
    head = render(result).splitlines()[:2]
    assert head[1] == describe_cpu(m) and head[1].startswith("cpu: ")


def test_a_llama_cpp_file_is_tried_in_a_child_so_a_crash_there_is_reported_not_suffered(monkeypatch, tmp_path):
    # llama.cpp 0.3.36's AMX kernels fault on some virtual Xeons: it took the whole bench down with them
    path = tmp_path / "q8_0.gguf"
    monkeypatch.setattr(peers, "LLAMA_PROBE", "import os, signal, sys; assert sys.argv[1:3] == [%r, '64']; "
                        "os.kill(os.getpid(), signal.SIGSEGV)" % str(path))
    assert llama_failure(path, 64) == f"it crashed with signal {signal.SIGSEGV.value}"
    monkeypatch.setattr(peers, "LLAMA_PROBE", "raise ValueError('not a GGUF file')")
    assert llama_failure(path, 64) == "it failed: ValueError: not a GGUF file"
    monkeypatch.setattr(peers, "LLAMA_PROBE", "import sys; sys.exit(0)")
    assert llama_failure(path, 64) is None


@pytest.mark.skipif(not llama_available(), reason="llama-cpp-python (the llama extra) or gguf is not installed")
def test_llama_cpp_decodes_tinygpt_s_gguf_export_beside_tinygpt():
    plan = Plan(matmul_n=64, memory_mib=4, repeats=1, repeats_gen=1, repeats_train=1, train=(), prompt=4,
                new_tokens=3, no_cache_tokens=2, gen_models=(), gen_batches=(1,), peer_formats=(),
                llama_models=("lesson",))
    result = run(plan=plan, sections=("generate",), log=lambda line: None)
    json.dumps(result)
    assert result["llama"]
    gen = {(r["impl"], r["format"], r["batch"], r["kv_cache"]) for r in result["generation"]}
    # a model measured only against llama.cpp: batch 1 with the cache, every format of both
    assert {("llama.cpp", f, 1, True) for f in ("f32", "f16", "q8_0", "q4_0")} <= gen
    assert ("tinygpt", "int8", 1, True) in gen and not any(impl == "transformers" for impl, *_ in gen)
    assert all(r["decode_tokens_per_s"] > 0 for r in result["generation"])
    names = {r["name"] for r in result["ratios"]}
    assert {"decode lesson b1: tinygpt fp32 / llama.cpp f32", "decode lesson b1: tinygpt int8 / llama.cpp q8_0"} <= names
    assert re.search(r"^lesson +llama\.cpp +q4_0 ", render(result), re.M)  # its row in the table


def test_the_llama_cpp_comparison_gets_its_own_rounds_quiet_and_busy(monkeypatch, tmp_path):
    # repeats_llama rounds of tinygpt's and llama.cpp's batch-1 rows, quiet (after the repeats_gen every
    # engine takes) and busy; a fake llama.cpp counts them, so this runs without it
    class Llama:
        def close(self):
            pass

    measured = []

    def generate_llama(llm, idx, new_tokens, use_cache=True):
        measured.append((generation.busy_core.active, new_tokens))
        clock = Clock()
        for _ in range(new_tokens):
            clock.tick()
        return clock.result(idx.shape[1], 1, [0] * new_tokens)

    class Quiet:  # no spinning process: what the test counts is the rounds
        active = False

        def __enter__(self):
            Quiet.active = True

        def __exit__(self, *exc):
            Quiet.active = False

    monkeypatch.setattr(measure, "llama_available", lambda: True)
    monkeypatch.setattr(generation, "llama_files", lambda model, folder, formats: {"f32": tmp_path / "f32.gguf"})
    monkeypatch.setattr(generation, "llama_failure", lambda path, n_ctx: None)
    monkeypatch.setattr(generation, "load_llama", lambda path, n_ctx: Llama())
    monkeypatch.setattr(generation, "generate_llama", generate_llama)
    monkeypatch.setattr(generation, "busy_core", Quiet)
    plan = Plan(matmul_n=64, memory_mib=4, repeats=1, repeats_gen=1, repeats_train=1, train=(), prompt=4,
                new_tokens=3, no_cache_tokens=2, gen_models=(), gen_batches=(1,), peer_formats=(),
                llama_models=("lesson",), llama_formats=("f32",), formats=("fp32",), busy=True, repeats_llama=3)
    result = run(plan=plan, sections=("generate",), log=lambda line: None)
    # each round a warm-up of 2 tokens and the measured 3: three rounds quiet, three busy
    assert measured == [(False, 2), (False, 3)] * 3 + [(True, 2), (True, 3)] * 3
    rows = {(r["impl"], r["condition"]) for r in result["generation"]}
    both = {(impl, c) for impl in ("llama.cpp", "tinygpt") for c in ("quiet", "busy")}
    assert rows == both | {("tinygpt.load", "quiet")}


def test_cli_refuses_an_unknown_section():
    r = subprocess.run([sys.executable, "-m", "tinygpt", "bench", "--only", "nothing"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_json_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys):
    from tinygpt.cli import main

    (tmp_path / "file").write_text("")
    cases = [(tmp_path, "is a folder"), (tmp_path / "file" / "b.json", "is not a folder")]
    if Path("/proc").is_dir():  # a folder where nobody, root included, can make a file
        cases.append((Path("/proc/bench.json"), "cannot write in /proc"))
    for bad, message in cases:
        assert main(["bench", "--quick", "--only", "limits", "--json", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err  # at once: no measurement was logged


def test_atomic_write_names_the_file_asked_for_not_its_temp(tmp_path):
    from tinygpt.fileio import write_json

    with pytest.raises(OSError) as e:
        write_json(tmp_path / "missing" / "x.json", {})
    assert e.value.filename == str(tmp_path / "missing" / "x.json")


def test_a_plan_s_compiled_rows_are_measured_beside_the_eager_ones(monkeypatch):
    # the GPU plan's kinds of row, on the CPU: compiled training and decoding (the compiler itself left out,
    # it takes tens of seconds here; tests/test_gpu.py runs it on a GPU)
    import dataclasses

    asked = []
    real_train, real_stream = training.train_tinygpt, generation.generate_stream

    def train_tinygpt(*args, compile=False, **kwargs):
        asked.append(("train", compile))
        return real_train(*args, compile=False, **kwargs)

    def generate_stream(*args, compile=False, **kwargs):
        asked.append(("decode", compile))
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(training, "train_tinygpt", train_tinygpt)
    monkeypatch.setattr(generation, "generate_stream", generate_stream)
    plan = dataclasses.replace(SMOKE, train_modes=(("float32", False), ("float32", True)), formats=("fp32", "int8"),
                               gen_compiled=(("fp32", 1), ("int8", 2), ("bf16", 1)))
    result = run(plan=plan, peers=False, device="cpu", log=lambda line: None)
    assert {r["impl"] for r in result["training"]} == {"tinygpt", "tinygpt compiled"}
    assert ("train", True) in asked and ("decode", True) in asked
    compiled = {(r["format"], r["batch"]): r for r in result["generation"] if r["impl"] == "tinygpt compiled"}
    assert set(compiled) == {("fp32", 1), ("int8", 2)}  # bf16 is not among the plan's formats
    assert all(r["same_tokens_as_eager"] and r["bandwidth_use"] > 0 for r in compiled.values())
    assert "tinygpt compiled" in render(result)


def test_the_smollm2_rows_are_its_shape_and_its_cache_holds_the_key_value_heads():
    cfg = bench_config("smollm2", training=False)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.block_size) == ("llama", 30, 576, 9, 3, 1024)
    assert bench_config("smollm2", training=True).vocab_size == 77
    torch.manual_seed(0)
    small = GPTConfig(arch="llama", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=1, n_embd=32)
    model = quantize(GPT(small), "fp32", pack=False)
    # a position adds one key and one value per layer for each of the n_kv_head heads, not n_head
    assert bytes_per_token(model, 1, 10) - bytes_per_token(model, 1, 0) == 2 * 2 * 1 * 8 * 10 * 4


@needs_transformers
def test_a_llama_layout_row_measures_against_transformers_llama(monkeypatch):
    tiny = GPTConfig(arch="llama", vocab_size=77, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    for rows in (training, generation):  # the training and the generation rows each build their model
        monkeypatch.setattr(rows, "bench_config", lambda name, **kwargs: GPTConfig(**tiny.to_dict()))
    plan = Plan(matmul_n=64, memory_mib=4, repeats=1, repeats_gen=1, repeats_train=1, train=(("smollm2", 2, 1),),
                prompt=4, new_tokens=3, no_cache_tokens=2, gen_models=("smollm2",), gen_batches=(1,),
                peer_formats=("fp32",), formats=("fp32", "int8"))
    result = run(plan=plan, log=lambda line: None)
    assert {r["impl"] for r in result["training"]} == {"tinygpt", "transformers"}
    peer = next(r for r in result["generation"] if r["impl"] == "transformers" and r["kv_cache"])
    assert peer["same_tokens_as_tinygpt"]  # LlamaForCausalLM on the same weights decodes the same tokens
    assert {r["name"] for r in result["ratios"]} >= {"decode smollm2 b1: tinygpt fp32 / transformers fp32",
                                                      "train smollm2 4x256: tinygpt best / transformers best"}
    # the smollm2 ratios have no target: the report shows them without one (it raised on formatting None)
    shown = render(result)
    assert "decode smollm2 b1: tinygpt fp32 / transformers fp32" in shown
    line = next(x for x in shown.splitlines() if "train smollm2 4x256: tinygpt best / transformers best" in x)
    assert "target" not in line and line.rstrip().endswith("x")


def test_a_cpu_that_emulates_bfloat16_measures_no_bfloat16_matmul(monkeypatch):
    """Its matmul ran at 0.26 GFLOP/s on a Zen 3: 9 minutes of the bench's limits, for a figure no row uses."""
    from tinygpt.lab.bench import machine as machine_module

    monkeypatch.setattr(plans, "cpu_has_native_bf16", lambda: False)
    lim = machine_module.limits(SMOKE, torch.device("cpu"))
    assert "matmul_bfloat16_gflops" not in lim and lim["matmul_float32_gflops"] > 0
    assert "bfloat16 emulated (not measured)" in machine_module.describe_limits(lim)
    monkeypatch.setattr(plans, "cpu_has_native_bf16", lambda: True)
    lim = machine_module.limits(SMOKE, torch.device("cpu"))
    assert lim["matmul_bfloat16_gflops"] > 0 and "GFLOP/s bfloat16" in machine_module.describe_limits(lim)


def test_step_rows_split_each_block_s_step_and_measure_it_against_its_products_limit():
    """Issue 61: the default block's step (Muon + AdamW) beside GPT-2's (AdamW) at the same size, the profiler's
    share of it in matrix products, and the same products timed alone (the limit); their ratio is a target."""
    from tinygpt.lab.bench import step

    lines = []
    rows = step.step_rows(SMOKE, torch.device("cpu"), lines.append)
    assert {(r["block"], r["optimizer"], r["dtype"]) for r in rows} == {
        (b, o, d) for b, o in (("modern", "muon+adamw"), ("gpt2", "adamw")) for d in train_dtypes(torch.device("cpu"))}
    for r in rows:
        assert (r["size"], r["batch"], r["seq_len"]) == ("1x32", SMOKE.step_batch, SMOKE.step_context)
        assert r["step_ms"] > 0 and r["limit_ms"] > 0 and r["gflops"] > 0 and 0 < r["products_share"] < 1
        assert 0 <= r["optimizer_products_share"] <= r["optimizer_share"] < 1
        assert (r["optimizer_products_share"] > 0) == (r["block"] == "modern")  # Muon's iteration; AdamW has none
    assert len(lines) == len(rows) and "outside matrix products" in lines[0]
    result = {"steps": rows}
    ratio, passes, floor = ratios(result)
    assert ratio["name"] == "step 1x32 float32: the default block (Muon + AdamW) / GPT-2's (AdamW)"
    assert ratio["target"] == 1.2 and ratio["at_most"] and ratio["met"] == (ratio["ratio"] <= 1.2)
    # the forward and backward passes alone, and what the ratio would be were the steps their products alone
    modern, gpt2 = (next(r for r in rows if r["block"] == b) for b in ("modern", "gpt2"))
    assert passes["name"] == "step 1x32 float32: their forward and backward alone" and passes["target"] is None
    assert passes["ratio"] == pytest.approx(modern["step_ms"] * (1 - modern["optimizer_share"])
                                            / (gpt2["step_ms"] * (1 - gpt2["optimizer_share"])))
    assert floor["name"] == "step 1x32 float32: their products' FLOPs (the optimizer's too)" and floor["target"] is None
    assert floor["ratio"] == modern["gflop"] / gpt2["gflop"] and modern["gflop"] > gpt2["gflop"]  # Muon's iteration


def test_a_step_s_products_are_timed_again_as_plain_gemms_of_their_shapes():
    from tinygpt.lab.bench import step

    products = [("aten::mm", [[8, 4], [4, 6]], 2), ("aten::addmm", [[6], [8, 4], [4, 6], [], []], 1),
                ("aten::baddbmm", [[3, 8, 8], [3, 8, 4], [3, 4, 8], [], []], 1), ("aten::bmm", [[], []], 1)]
    seconds, flops = step._limit(products, torch.float32, 1, torch.device("cpu"))
    assert seconds > 0 and flops == 3 * 2 * 8 * 4 * 6 + 3 * 2 * 8 * 4 * 8  # a product without shapes is left out
