"""benchmarks/gpu_check.py's own pieces, without a GPU: the junit file it reads each test's outcome from,
a phase that runs out of time (ended with everything it started), and the summary table, which must say
what failed and why. Its dry run (`make gpu-check DEVICE=cpu`) runs the whole check in CI."""

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu" name="test_cached_decoding_equals_uncached[fp32-gpt2]" time="0.5"/>
<testcase classname="tests.test_gpu" name="test_the_server_answers_the_openai_client[gpt2]" time="2.0">
<failure message="AssertionError: row 0 differs at new token 3&#10;second line">trace</failure></testcase>
<testcase classname="tests.test_gpu" name="test_two_processes_on_two_gpus[ddp]" time="0.0">
<skipped message="needs 2 CUDA devices, this machine has 1">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_each_test_s_outcome_and_first_error_line_are_read_from_junit(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    tests = gpu_check.read_junit(tmp_path / "tests.xml")
    assert [(t["outcome"], t["why"]) for t in tests] == [
        ("passed", ""), ("failed", "AssertionError: row 0 differs at new token 3"),
        ("skipped", "needs 2 CUDA devices, this machine has 1")]
    (tmp_path / "cut.xml").write_text(JUNIT[:200])  # pytest killed while writing it
    assert gpu_check.read_junit(tmp_path / "cut.xml") == []


def test_a_test_run_killed_before_its_junit_file_still_reports_what_ended(tmp_path):
    # pytest -vv's lines, the last one cut where the phase ran out of time
    text = ("============ test session starts ============\n"
            "tests/test_gpu.py::test_cached_decoding_equals_uncached[fp32-gpt2] PASSED [ 10%]\n"
            "tests/test_gpu.py::test_float16_trains_through_overflow_with_the_gradient_scaler FAILED [ 20%]\n"
            "tests/test_gpu.py::test_two_processes[ddp] SKIPPED (needs 2 CUDA devices) [ 30%]\n"
            "tests/test_gpu.py::test_compiled_training_and_decoding_give_eager_s_tokens[adamw-llama] ")
    tests = gpu_check.read_progress(text)
    assert [(t["name"].split("[")[0], t["outcome"]) for t in tests] == [
        ("test_cached_decoding_equals_uncached", "passed"),
        ("test_float16_trains_through_overflow_with_the_gradient_scaler", "failed"),
        ("test_two_processes", "skipped"), ("test_compiled_training_and_decoding_give_eager_s_tokens", "timed out")]
    summary = {"device": "cuda", "dry_run": False, "out": str(tmp_path), "seconds": 200.0, "bench": None, "train": None,
               "machine": {"python": "3.12.3", "gpus": ["NVIDIA H200"]}, "tests": tests,
               "phases": [{"name": "tests", "status": "timed out", "seconds": 200.0, "detail": ""}]}
    table = gpu_check.render(summary)
    assert "timed out" in table and "the phase ran out of time in it" in table
    assert table.splitlines()[-1].startswith("1 tests failed, the tests ran out of time (1 skipped)")


def test_a_phase_out_of_time_ends_everything_it_started(tmp_path):
    check = gpu_check.Check(tmp_path, "cpu", 60, dict(os.environ))
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    started = time.monotonic()
    code, out = check.run([sys.executable, "-c", script], timeout=2)
    assert code is None and out == "started\n" and time.monotonic() - started < 20
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the grandchild went with it
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)
    check.log.close()
    assert "started" in (tmp_path / "log.txt").read_text()


def test_the_summary_names_each_failure_and_the_figures(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    lim = {"matmul_bfloat16_gflops": 790e3, "memory_read_gbs": 4300.0, "peak_bf16_gflops": 989e3,
           "peak_memory_gbs": 4800.0, "peak_source": "datasheet: NVIDIA H200"}
    bench = {"limits": lim,
             "training": [{"model": "gpt2", "batch": 16, "seq_len": 1024, "dtype": "bfloat16", "impl": "tinygpt compiled",
                           "tokens_per_s": 450_000.0, "mfu": 0.41}],
             "generation": [{"model": "gpt2", "batch": 1, "format": "bf16", "impl": "tinygpt compiled", "kv_cache": True,
                             "decode_tokens_per_s": 9000.0, "bandwidth_use": 0.48, "same_tokens_as_eager": True}],
             "ratios": [{"name": "decode gpt2 b1 compiled: bandwidth use of the peak", "ratio": 0.48, "target": 0.5,
                         "met": False, "unit": "%"}]}
    summary = {"device": "cuda", "dry_run": False, "out": str(tmp_path), "seconds": 455.0,
               "machine": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "gpus": ["NVIDIA H200"]},
               "phases": [{"name": "tests", "status": "failed", "seconds": 80.0, "detail": "1 passed, 1 failed"},
                          {"name": "bench", "status": "timed out", "seconds": 200.0, "detail": "its figures so far"},
                          {"name": "train", "status": "passed", "seconds": 170.0, "detail": "..."}],
               "tests": gpu_check.read_junit(tmp_path / "tests.xml"), "bench": bench,
               "train": {"steps": 9000, "tokens_per_s": 900_000.0, "mfu": 0.18, "first_step_s": 41.0,
                         "loss": 0.95, "bits_per_char": 1.37, "tokens": 499_999}}
    table = gpu_check.render(summary)
    lines = table.splitlines()
    assert lines[0].startswith("tinygpt gpu-check --device cuda: NVIDIA H200; torch 2.11.0 (CUDA 13.0)")
    assert any(line.startswith("bench") and "timed out" in line for line in lines)
    assert any("failed" in line and "row 0 differs at new token 3" in line for line in lines)
    assert "790 TFLOP/s, 4,300.0 GB/s" in table and "989 TFLOP/s, 4,800 GB/s (datasheet: NVIDIA H200)" in table
    assert "450,000 tokens/s, MFU 41.0%" in table and "9,000 tokens/s, bandwidth 48.0%, eager's tokens" in table
    assert "48.0% (>= 50%: NOT met)" in table
    assert "9000 steps, 900,000 tokens/s, MFU 18.0%, first step 41 s" in table and "1.3700 bits/char" in table
    assert lines[-1].startswith("1 tests failed (1 skipped)")
