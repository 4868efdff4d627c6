"""The GPU check: every CUDA path of tinygpt run for real in one short run, what it measured left in one folder.

    python3 benchmarks/gpu_check.py --device cuda --out gpu-check --wheels .whl   (make gpu-check)
    python3 benchmarks/gpu_check.py --device cpu --out gpu-check                  (make gpu-check DEVICE=cpu: the dry run)
    .venv/bin/python benchmarks/gpu_check.py --download-wheels .whl               (make gpu-wheels)

Its phases, each a process of its own with a time limit, each recorded as passed, failed or out of time
(a phase that fails does not stop the next):

  tests   tests/test_gpu.py on the device (TINYGPT_TEST_DEVICE): each test's outcome and first error line
  bench   `tinygpt bench --device D --no-peers`: on a GPU its plan (GPT-2 at 16 x 1024 in bf16, eager and
          compiled; GPT-2 decoding at batch 1 and 8, CUDA graphs too; MFU and bandwidth use against the
          datasheet's peaks) and the targets it checks
  train   the baby preset (nanoGPT's shakespeare_char sizes) on the characters of the Python standard
          library, bf16 with --compile, for a fixed 3 minutes (the compile inside them); then its val
          loss in bits per character, its speed and MFU, and a sample

then a summary table, printed last. The folder holds seven files and no subfolder (what a lent GPU
machine gives back is at most 8 files): summary.txt (the table), summary.json (the machine, each phase,
each test, the figures), log.txt (every phase's output), tests.xml, bench.json, train-metrics.jsonl and
sample.txt. It takes about 8 minutes on a GPU (--budget), most of it compiling and the 3 minutes of training.

It runs with the Python it is started with and tinygpt from src/, not installed: a GPU machine brings
its own torch. The serve extra and the openai client, which the server's test needs, may not be there:
`--download-wheels DIR` (here, in the project's .venv) saves them as wheels for Python 3.12 on x86-64
Linux, and `--wheels DIR` (there) installs them into a temporary folder first.

The dry run (--device cpu) runs the same phases at the smallest sizes (the tests but the slow ones, the
bench's --smoke plan, a 1-layer model for a few seconds, no compile), in well under a minute: CI runs it
so that the check keeps working while no GPU runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # tinygpt's pure layers (no torch) for the summary's arithmetic

from tinygpt.calc import flops_per_token  # noqa: E402
from tinygpt.calc.hardware import gpu_peaks  # noqa: E402
from tinygpt.config import GPTConfig  # noqa: E402

# The packages the server's test needs beyond what a GPU machine's image holds: the serve extra and the
# openai client, with everything they need (an image's own versions may be too old for them)
WHEEL_ROOTS = ("fastapi", "uvicorn", "openai")
FILES = ("summary.txt", "summary.json", "log.txt", "tests.xml", "bench.json", "train-metrics.jsonl", "sample.txt")


@dataclass(frozen=True)
class Sizes:
    """What each phase runs on a device kind."""

    tests_marks: str
    bench_flags: tuple[str, ...]
    train_flags: tuple[str, ...]
    train_seconds: float  # --max-time
    eval_tokens: int
    sample_tokens: int
    limits: dict[str, float] = field(default_factory=dict)  # the most seconds each phase may take


# nanoGPT's shakespeare_char recipe on the baby preset: batch 64 x 256, lr 1e-3 to 1e-4, beta2 0.99, warmup 100
GPU_SIZES = Sizes(
    tests_marks="gpu", bench_flags=(),
    train_flags=("--preset", "baby", "--dtype", "bfloat16", "--compile", "--batch-size", "64", "--lr", "1e-3",
                 "--min-lr", "1e-4", "--beta2", "0.99", "--warmup", "100", "--eval-interval", "250",
                 "--eval-iters", "20"),
    train_seconds=180, eval_tokens=500_000, sample_tokens=300,
    limits={"tests": 200, "bench": 200},
)
DRY_SIZES = Sizes(
    tests_marks="gpu and not slow", bench_flags=("--smoke",),
    train_flags=("--preset", "baby", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
                 "--batch-size", "4", "--dtype", "float32", "--warmup", "5", "--eval-interval", "20",
                 "--eval-iters", "2"),
    train_seconds=2, eval_tokens=2_000, sample_tokens=20,
    limits={"tests": 120, "bench": 60},
)
RESERVE = {"bench": 60, "train": 40}  # the least a later phase is left: bench's, and train's beside its --max-time


@dataclass
class Phase:
    name: str
    status: str = "not run"  # passed, failed, timed out, skipped
    seconds: float = 0.0
    detail: str = ""


class Check:
    """One run of the check: its folder, the log every phase writes into, the clock of the budget."""

    def __init__(self, out: Path, device: str, budget: float, env: dict[str, str]) -> None:
        self.out, self.device, self.env = out, device, env
        self.deadline = time.monotonic() + budget
        self.log = open(out / "log.txt", "w")
        self.phases: list[Phase] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, args: list[str], timeout: float, stdout: Path | None = None) -> tuple[int | None, str]:
        """A command under `timeout` seconds, its output into the log (and stdout into `stdout`): (exit
        code or None when it ran out of time, its stdout). It runs in a session of its own, so that running
        out of time ends everything it started (a server, torchrun's workers)."""
        self.say(f"$ {' '.join(args)}")
        started = time.monotonic()
        with tempfile.TemporaryFile("w+") as captured:
            p = subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=captured, stderr=self.log, text=True,
                                 start_new_session=True)
            try:
                code = p.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                code = None
            captured.seek(0)
            text = captured.read()
        self.log.write(text)
        self.say(f"({'out of time' if code is None else f'exit {code}'} after {time.monotonic() - started:.1f} s)")
        if stdout is not None:
            stdout.write_text(text)
        return code, text

    def phase(self, name: str) -> Phase:
        phase = Phase(name)
        self.phases.append(phase)
        self.say(f"== {name} ({self.left():.0f} s of the budget left)")
        return phase


def python() -> list[str]:
    return [sys.executable]


def tests_phase(check: Check, sizes: Sizes, timeout: float) -> tuple[Phase, list[dict]]:
    phase = check.phase("tests")
    started = time.monotonic()
    xml = check.out / "tests.xml"
    # -vv (over the project's -q): a line per test as it ends, what is left of a run killed before its junit file
    code, text = check.run([*python(), "-m", "pytest", "tests/test_gpu.py", "-m", sizes.tests_marks, "-vv", "-rfEs",
                            "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_family=xunit1"], timeout)
    phase.seconds = time.monotonic() - started
    tests = (read_junit(xml) if xml.exists() else []) or read_progress(text)
    counts = {s: sum(t["outcome"] == s for t in tests) for s in ("passed", "failed", "skipped", "timed out")}
    phase.detail = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no test ran"
    phase.status = "timed out" if code is None else "passed" if code == 0 else "failed"
    return phase, tests


OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped", "XFAIL": "skipped",
            "XPASS": "passed"}


def read_progress(text: str) -> list[dict]:
    """Each test of pytest -vv's output, for a run ended before it wrote its junit file: those that ended
    with their outcome (no seconds, no error line: log.txt has them), and the one it was running when it
    ran out of time, "timed out"."""
    tests = []
    for line in text.splitlines():
        if not line.startswith("tests/test_gpu.py::"):
            continue
        name, _, rest = line.removeprefix("tests/test_gpu.py::").partition(" ")
        word = rest.split()[0] if rest.split() else ""
        outcome = OUTCOMES.get(word, "timed out")
        why = "" if word in OUTCOMES else "the phase ran out of time in it"
        tests.append({"name": name, "outcome": outcome, "seconds": 0.0, "why": why})
    return tests


def read_junit(path: Path) -> list[dict]:
    """Each test case of a junit XML file: name, outcome (passed, failed, skipped), seconds and the first
    line of its error or skip reason."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    tests = []
    for case in root.iter("testcase"):
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or node.text or "").strip().splitlines()
                why = why[0][:200] if why else ""
                break
        tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "why": why})
    return tests


def bench_phase(check: Check, sizes: Sizes, timeout: float) -> tuple[Phase, dict | None]:
    phase = check.phase("bench")
    started = time.monotonic()
    out = check.out / "bench.json"
    code, _ = check.run([*python(), "-m", "tinygpt", "bench", "--device", check.device, "--no-peers",
                         "--json", str(out), *sizes.bench_flags], timeout)
    phase.seconds = time.monotonic() - started
    result = json.loads(out.read_text()) if out.exists() and code == 0 else None
    phase.status = "timed out" if code is None else "passed" if result is not None else "failed"
    if result is not None:
        met = [r for r in result.get("ratios", []) if r.get("met") is not None]
        phase.detail = f"{sum(r['met'] for r in met)} of {len(met)} targets met" if met else "no target applies"
    else:
        phase.detail = "its figures so far are in log.txt"
    return phase, result


def train_phase(check: Check, sizes: Sizes, timeout: float, peak_flops: float | None) -> tuple[Phase, dict]:
    phase = check.phase("train")
    started = time.monotonic()
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        tinygpt = [*python(), "-m", "tinygpt"]
        steps = [
            ("prepare", [*tinygpt, "prepare", "python-stdlib", "--out", str(data)], None),
            ("train", [*tinygpt, "train", "--data", str(data), "--out", str(run), *sizes.train_flags,
                       "--max-time", f"{sizes.train_seconds:g}s", "--device", check.device, "--quiet"], None),
            ("eval", [*tinygpt, "eval", str(run), "--device", check.device, "--json", "--batch-size", "32",
                      "--max-tokens", str(sizes.eval_tokens)], None),
            ("sample", [*tinygpt, "sample", str(run), "--device", check.device, "--prompt", "def ",
                        "--max-new-tokens", str(sizes.sample_tokens), "--seed", "1"], check.out / "sample.txt"),
        ]
        code: int | None = 0
        for name, args, stdout in steps:
            code, text = check.run(args, started + timeout - time.monotonic(), stdout)
            if code != 0:
                phase.detail = f"{name} {'ran out of time' if code is None else f'exited with {code}'}"
                break
            if name == "eval":
                figures.update(json.loads(text.strip().splitlines()[-1]))
            if name == "train":
                figures["result"] = text.strip().splitlines()[-1] if text.strip() else ""
        if (run / "metrics.jsonl").exists():
            shutil.copy(run / "metrics.jsonl", check.out / "train-metrics.jsonl")
            figures.update(train_figures(run, peak_flops))
    phase.seconds = time.monotonic() - started
    phase.status = "timed out" if code is None else "passed" if code == 0 else "failed"
    if code == 0:
        phase.detail = (f"{figures.get('steps', 0)} steps, {figures.get('tokens_per_s', 0):,.0f} tokens/s, "
                        f"val {figures.get('val_loss', math.nan):.3f} nats, {figures.get('bits_per_char', math.nan):.3f} "
                        "bits/char")
    return phase, figures


def train_figures(run: Path, peak_flops: float | None) -> dict:
    """Steps, median tokens/s of the steps after the first ten (compiling, warming up), MFU, last val loss."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in lines if r.get("tokens_per_s")]
    evals = [r for r in lines if "val_loss" in r]
    config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
    out: dict = {"steps": max((r["step"] for r in lines if "loss" in r), default=0)}
    if rates:
        out["tokens_per_s"] = statistics.median(rates[10:] or rates)
        out["first_step_s"] = next(r["time"] for r in lines if "loss" in r)  # the compile, where there is one
    if evals:
        out["val_loss"] = evals[-1]["val_loss"]
    if config is not None and rates:
        cfg = GPTConfig.from_dict(config["model"] if "model" in config else config)
        out["flops_per_token"] = flops_per_token(cfg, cfg.block_size).training
        if peak_flops:
            out["mfu"] = out["tokens_per_s"] * out["flops_per_token"] / peak_flops
    return out


def machine(check: Check) -> dict:
    """What the run ran on: the Python and torch it used, the GPU as torch and nvidia-smi see it."""
    probe = ("import json, torch; d = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'gpus': [torch.cuda.get_device_name(i) for i in "
             "range(torch.cuda.device_count())] if d else [], 'gpu_memory_gib': round(torch.cuda.get_device_properties(0)"
             ".total_memory / 2**30, 1) if d else None}))")
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
                  "cpus": os.cpu_count()}
    code, text = check.run([*python(), "-c", probe], 120)
    if code == 0:
        info.update(json.loads(text.strip().splitlines()[-1]))
    if shutil.which("nvidia-smi"):
        code, text = check.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                "--format=csv,noheader"], 30)
        if code == 0:
            info["nvidia_smi"] = text.strip()
    if (ROOT / ".git").exists() and shutil.which("git"):
        code, text = check.run(["git", "rev-parse", "HEAD"], 10)
        info["commit"] = text.strip() if code == 0 else None
    return info


def bench_rows(result: dict | None) -> list[tuple[str, str]]:
    """The bench's lines worth a summary: the limits, each training row, the tinygpt decode rows with the cache."""
    if not result:
        return []
    lim = result.get("limits", {})
    rows = [("matmul bf16, memory: measured", f"{flops(lim.get('matmul_bfloat16_gflops', 0))}, "
                                               f"{lim.get('memory_read_gbs', 0):,.1f} GB/s")]
    if "peak_source" in lim:
        rows.append(("MFU and bandwidth use of", f"{flops(lim['peak_bf16_gflops'])}, {lim['peak_memory_gbs']:,.0f} GB/s "
                                                 f"({lim['peak_source']})"))
    for r in result.get("training", []):
        rows.append((f"train {r['model']} {r['batch']}x{r['seq_len']} {r['dtype']} {r['impl']}",
                     f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}"))
    for r in result.get("generation", []):
        if r["impl"].startswith("tinygpt") and r["kv_cache"]:
            same = {True: ", eager's tokens", False: ", NOT eager's tokens"}.get(r.get("same_tokens_as_eager"), "")
            rows.append((f"decode {r['model']} b{r['batch']} {r['format']} {r['impl']}",
                         f"{r['decode_tokens_per_s']:,.0f} tokens/s, bandwidth {r.get('bandwidth_use', 0):.1%}{same}"))
    for r in result.get("ratios", []):
        if r.get("target") is not None:
            value = f"{r['ratio']:.1%}" if r.get("unit") == "%" else f"{r['ratio']:.2f}x"
            goal = f"{r['target']:.0%}" if r.get("unit") == "%" else f"{r['target']:g}x"
            rows.append((f"target: {r['name']}", f"{value} (>= {goal}: {'met' if r['met'] else 'NOT met'})"))
    return rows


def flops(gflops: float) -> str:
    return f"{gflops / 1e3:,.0f} TFLOP/s" if gflops >= 1e4 else f"{gflops:,.1f} GFLOP/s"


def render(summary: dict) -> str:
    """The summary table: the machine, each phase, each test that did not pass, the figures."""
    m = summary["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    lines = [f"tinygpt gpu-check --device {summary['device']}{' (dry run)' if summary['dry_run'] else ''}: {gpus}; "
             f"torch {m.get('torch')} (CUDA {m.get('cuda')}), Python {m['python']}, {summary['seconds']:.0f} s"]
    width = 48
    lines += ["", f"{'phase':<{width}} {'status':<10} {'seconds':>8}  detail"]
    for p in summary["phases"]:
        lines.append(f"{p['name']:<{width}} {p['status']:<10} {p['seconds']:>8.0f}  {p['detail']}")
    if summary["tests"]:
        lines += ["", f"{'test':<{width}} {'outcome':<10} {'seconds':>8}  why"]
        for t in summary["tests"]:
            lines.append(f"{t['name'][:width]:<{width}} {t['outcome']:<10} {t['seconds']:>8.1f}  {t['why'][:110]}")
    rows = bench_rows(summary.get("bench"))
    train = summary.get("train") or {}
    if train.get("steps"):
        rows.append(("train baby: steps, tokens/s, MFU",
                     f"{train['steps']} steps, {train.get('tokens_per_s', 0):,.0f} tokens/s"
                     + (f", MFU {train['mfu']:.1%}" if "mfu" in train else "")
                     + (f", first step {train['first_step_s']:.0f} s" if "first_step_s" in train else "")))
    if "bits_per_char" in train:
        rows.append(("train baby: val loss, bits/char", f"{train['loss']:.4f} nats, {train['bits_per_char']:.4f} "
                                                        f"bits/char ({train['tokens']:,} tokens)"))
    if rows:
        heading = "figure (a dry run's: the smallest sizes, nothing to read)" if summary["dry_run"] else "figure"
        lines += ["", f"{heading:<{width + 20}} value"]
        lines += [f"{name[: width + 19]:<{width + 20}} {value}" for name, value in rows]
    count = {o: sum(t["outcome"] == o for t in summary["tests"]) for o in ("failed", "timed out", "skipped")}
    finished = all(p["status"] != "timed out" for p in summary["phases"] if p["name"] == "tests")
    if count["failed"] or count["timed out"] or not finished:
        verdict = f"{count['failed']} tests failed" + ("" if finished else ", the tests ran out of time")
    else:
        verdict = "every test passed" if summary["tests"] else "no test ran"
    skipped = count["skipped"]
    written = [f for f in FILES if f == "summary.txt" or (Path(summary["out"]) / f).exists()]
    lines += ["", f"{verdict}{f' ({skipped} skipped)' if skipped else ''}; in {summary['out']}: {', '.join(written)}"]
    return "\n".join(lines)


def install_wheels(folder: Path, check: Check) -> str | None:
    """pip-install every wheel in `folder` into a temporary folder (to go first on PYTHONPATH); returns it,
    or None when they do not install here (another Python: the server's test then skips, saying why)."""
    site = tempfile.mkdtemp(prefix="tinygpt-wheels-")
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    code, _ = check.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--disable-pip-version-check", "--target", site, *wheels], 300)
    check.say(f"{len(wheels)} wheels from {folder} {'installed' if code == 0 else 'did NOT install'}")
    return site if code == 0 and wheels else None


def download_wheels(folder: Path) -> int:
    """Save, into `folder`, wheels for Python 3.12 on x86-64 Linux of WHEEL_ROOTS and everything they
    need, at the versions installed here (the project's .venv, where the tests pass with them)."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    pins, todo = {}, list(WHEEL_ROOTS)
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in pins:
            continue
        pins[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12",
                                                          "sys_platform": "linux", "platform_system": "Linux"}):
                todo.append(req.name)
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                              "manylinux2014_x86_64", "manylinux1_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "-d", str(folder), *(f"{n}=={v}" for n, v in sorted(pins.items()))]
    code = subprocess.run(cmd).returncode
    if code == 0:
        size = sum(w.stat().st_size for w in folder.glob("*.whl"))
        print(f"{len(pins)} wheels in {folder} ({size / 2**20:.1f} MiB): {', '.join(sorted(pins))}")
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu (the dry run, at the smallest sizes)")
    p.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="the folder for everything (emptied first)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole check (8 minutes)")
    p.add_argument("--only", action="append", choices=("tests", "bench", "train"), help="run only this phase")
    p.add_argument("--train-time", type=float, help="seconds of training (3 minutes on a GPU, 2 s in the dry run)")
    p.add_argument("--wheels", type=Path, help="a folder of wheels to install first (make gpu-wheels)")
    p.add_argument("--download-wheels", type=Path, metavar="DIR", help="save the server test's wheels in DIR and stop")
    args = p.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    started = time.monotonic()
    dry = not args.device.startswith("cuda")
    sizes = DRY_SIZES if dry else GPU_SIZES
    if args.train_time:
        sizes = Sizes(**{**sizes.__dict__, "train_seconds": args.train_time})
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TINYGPT_TEST_DEVICE": args.device,
           # tinygpt's CPU kernels take 20-60 s to build, for nothing on a GPU; the dry run computes without them too
           "TINYGPT_KERNELS": "0"}
    check = Check(args.out, args.device, args.budget, env)
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    site = install_wheels(args.wheels, check) if args.wheels else None
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, [site]), *paths])
    phases = set(args.only or ("tests", "bench", "train"))
    summary: dict = {"device": args.device, "dry_run": dry, "out": str(args.out), "machine": machine(check),
                     "phases": [], "tests": [], "bench": None, "train": None}
    train_need = sizes.train_seconds + RESERVE["train"] if "train" in phases else 0
    bench_need = RESERVE["bench"] if "bench" in phases else 0
    if "tests" in phases:
        timeout = min(sizes.limits["tests"], check.left() - bench_need - train_need)
        _, summary["tests"] = tests_phase(check, sizes, timeout)
    if "bench" in phases:
        _, summary["bench"] = bench_phase(check, sizes, min(sizes.limits["bench"], check.left() - train_need))
    if "train" in phases:
        lim = (summary["bench"] or {}).get("limits", {})
        gpus = summary["machine"].get("gpus") or []
        datasheet = gpu_peaks(gpus[0]) if gpus else None
        peak = lim.get("peak_bf16_gflops", datasheet[0] * 1e3 if datasheet else None)
        _, summary["train"] = train_phase(check, sizes, max(check.left(), train_need), peak * 1e9 if peak else None)
    summary["phases"] = [p.__dict__ for p in check.phases]
    summary["seconds"] = time.monotonic() - started
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = render(summary)
    (args.out / "summary.txt").write_text(table + "\n")
    check.say("")
    check.say(table)
    check.log.close()
    return 0 if all(p.status in ("passed", "skipped") for p in check.phases) else 1


if __name__ == "__main__":
    sys.exit(main())
