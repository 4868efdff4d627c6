"""tinygpt bench: a tiny run yields every row and ratio the report needs, and greedy tokens agree
with transformers on the same weights (speed itself is never asserted); llama.cpp's rows where it is
installed; the CPU's flags at the top of every report."""

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.lab.bench import (
    Plan, bench_config, bytes_per_token, cpu_flags, describe_cpu, llama_available, llama_failure, machine, ratios, render,
    run, peer_formats, train_dtypes,
)
from tinygpt.interop.quantize import quantize

bench_module = importlib.import_module("tinygpt.lab.bench")
needs_transformers = pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="transformers is not installed")

TINY = Plan(
    matmul_n=64, memory_mib=4, repeats=1, repeats_gen=1, repeats_train=1, train=(("lesson", 4, 2),), prompt=4, new_tokens=3,
    no_cache_tokens=2, gen_models=("lesson",), gen_batches=(1, 2), peer_formats=("fp32", "bf16"),
)


def test_training_rows_use_a_char_vocabulary_and_short_context():
    cfg = bench_config("gpt2", training=True)
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer) == (77, 256, 12)
    assert bench_config("gpt2", training=False).block_size == 1024


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
    result = run(plan=TINY, log=lines.append)
    json.dumps(result)  # all JSON-ready
    assert result["limits"]["matmul_float32_gflops"] > 0 and result["limits"]["memory_read_gbs"] > 0
    train = {(r["impl"], r["dtype"]) for r in result["training"]}
    assert train == {(i, d) for i in ("tinygpt", "transformers") for d in train_dtypes(torch.device("cpu"))}
    assert all(r["tokens_per_s"] > 0 for r in result["training"])
    gen = {(r["impl"], r["format"], r["batch"], r["kv_cache"]) for r in result["generation"]}
    assert ("tinygpt", "int8", 2, True) in gen and ("transformers", "fp32", 1, False) in gen
    assert (("transformers", "bf16", 1, False) in gen) == ("bf16" in peer_formats(TINY, torch.device("cpu")))
    peer = next(r for r in result["generation"] if r["impl"] == "transformers" and r["format"] == "fp32"
                and r["batch"] == 1 and r["kv_cache"])
    assert peer["same_tokens_as_tinygpt"]  # greedy on identical weights: the same tokens
    text = render(result)
    assert "tinygpt bench" in text and "transformers" in text and len(lines) >= 8


def test_bfloat16_training_is_measured_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(bench_module, "cpu_has_native_bf16", lambda: True)
    assert train_dtypes(torch.device("cpu")) == ("float32", "bfloat16")
    monkeypatch.setattr(bench_module, "cpu_has_native_bf16", lambda: False)  # emulated: minutes a step
    assert train_dtypes(torch.device("cpu")) == ("float32",)
    assert peer_formats(bench_module.FULL, torch.device("cpu")) == ("fp32",)  # and transformers decodes in fp32
    assert train_dtypes(torch.device("cuda")) == ("float32", "bfloat16")
    assert peer_formats(bench_module.FULL, torch.device("cuda")) == ("fp32", "bf16")


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
    assert got["decode baby b1: tinygpt int8 / llama.cpp q8_0"] == (2.0, True)
    assert not any("q4_0" in name for name in got)  # no tinygpt int4 row to compare with


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
    from tinygpt.lab import bench

    path = tmp_path / "q8_0.gguf"
    monkeypatch.setattr(bench, "LLAMA_PROBE", "import os, signal, sys; assert sys.argv[1:3] == [%r, '64']; "
                        "os.kill(os.getpid(), signal.SIGSEGV)" % str(path))
    assert llama_failure(path, 64) == f"it crashed with signal {signal.SIGSEGV.value}"
    monkeypatch.setattr(bench, "LLAMA_PROBE", "raise ValueError('not a GGUF file')")
    assert llama_failure(path, 64) == "it failed: ValueError: not a GGUF file"
    monkeypatch.setattr(bench, "LLAMA_PROBE", "import sys; sys.exit(0)")
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
    assert "llama.cpp    q4_0" in render(result)


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
