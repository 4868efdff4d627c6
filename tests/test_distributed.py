"""Multi-process training through torchrun on CPU (gloo), 2 processes: DDP and FSDP2 against one
process with twice the batch, checkpoints across process counts, signals and dead processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinygpt import GPT, GPTConfig, cli
from traced_train import trace_cli
from tinygpt.checkpoint import load, load_training, weights_step
from tinygpt.distributed import Dist, _state_by_index, _state_by_name, process_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ddp_agreement import differences  # noqa: E402

# a flat learning rate, so that a run stopped at step 10 and resumed matches a straight 20-step run
# whatever --max-iters each part was given; two micro-steps per step, so accumulation is covered;
# GPT-2's block and AdamW, which the flags after FLAT change where a test is about another
FLAT = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--eval-iters", "2", "--grad-accum", "2",
        "--eval-interval", "5", "--warmup", "0", "--lr", "1e-3", "--min-lr", "1e-3", "--dtype", "float32",
        "--device", "cpu", "--quiet", "--arch", "gpt2", "--optimizer", "adamw", "--lr-schedule", "cosine"]


TRACED = Path(__file__).with_name("traced_train.py")


def torchrun(*args, trace: Path | None = None, popen: bool = False, script: Path | None = None):
    """`torchrun --standalone --nproc_per_node=2 -m tinygpt ...` as a subprocess; with `trace`, each
    process writes what it trained on there (tests/traced_train.py); with `script`, that script runs
    instead of `-m tinygpt`."""
    exe = Path(sys.executable).with_name("torchrun")
    entry = [str(script)] if script else ["-m", "tinygpt"] if trace is None else [str(TRACED), str(trace)]
    cmd = [str(exe), "--standalone", "--nproc_per_node=2", *entry, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:  # in a session of its own, so that the test can clean up everything it started
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def single(*args, trace: Path | None = None) -> None:
    """`tinygpt ...` in this process (one process, no torchrun; one thread, as conftest sets and as
    torchrun's workers run); with `trace`, what it trained on is written there (tests/traced_train.py)."""
    with pytest.MonkeyPatch.context() as mp:
        tracers = trace_cli(trace, mp.setattr) if trace is not None else None
        assert cli.main([*map(str, args)]) == 0
        assert tracers is None or len(tracers) == 1


def steps(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def trace(debug: Path, rank: int) -> list[dict]:
    """What process `rank` wrote: its pid first, then a line per step, then how it ended."""
    file = debug / f"rank{rank}.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load(a).state_dict(), load(b).state_dict()
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def runs(char_data, tmp_path_factory):
    """The runs the tests compare, made once: one process x batch 8 for 10 and 20 steps, and
    2 processes x batch 4 for 10 steps with DDP and with FSDP."""
    root = tmp_path_factory.mktemp("dist")
    data = ["--data", char_data]
    single("train", *data, "--out", root / "s10", "--batch-size", 8, "--max-iters", 10, *FLAT, trace=root / "s10-debug")
    shutil.copytree(root / "s10", root / "s20")
    single("train", *data, "--out", root / "s20", "--resume", "--max-iters", 20, "--quiet")  # = a straight 20-step run
    torchrun("train", *data, "--out", root / "d10", "--batch-size", 4, "--max-iters", 10, *FLAT,
             trace=root / "d10-debug")
    torchrun("train", *data, "--out", root / "f10", "--batch-size", 4, "--max-iters", 10, "--fsdp", *FLAT)
    muon = [*FLAT, "--optimizer", "muon", "--max-iters", 10]
    single("train", *data, "--out", root / "m10", "--batch-size", 8, *muon)
    torchrun("train", *data, "--out", root / "dm10", "--batch-size", 4, *muon)
    return root


def test_two_processes_train_the_model_one_process_trains_with_twice_the_batch(runs):
    one, two = steps(runs / "s10"), steps(runs / "d10")
    assert list(two) == list(range(1, 11))
    for s in one:
        assert two[s] == pytest.approx(one[s], abs=1e-5), s
    # what the multiprocess page says (benchmarks/ddp_agreement.py prints its figures): with AdamW every weight
    # agrees to float32's rounding but attention's key bias, which drifts (below); 2.5e-6 here, 5.4e-6 in 10
    # steps on the page's model
    outside, where, key_bias = differences(load(runs / "s10").state_dict(), load(runs / "d10").state_dict())
    assert outside < 1e-5, where
    assert key_bias < 1e-2  # AdamW moves a weight by about lr (1e-3) a step at most
    # the evaluations agree too: every process evaluates its slice and the results are averaged
    evals = [[json.loads(line)["val_loss"] for line in (runs / r / "metrics.jsonl").read_text().splitlines()
              if "val_loss" in line] for r in ("s10", "d10")]
    assert evals[1] == pytest.approx(evals[0], abs=1e-4)
    # only rank 0 wrote: one metrics line per step and per evaluation
    assert len((runs / "d10" / "metrics.jsonl").read_text().splitlines()) == 12


def test_each_process_sees_its_own_slice_and_ends_with_the_same_weights(runs):
    whole = trace(runs / "s10-debug", 0)
    ranks = [trace(runs / "d10-debug", r) for r in (0, 1)]
    assert [t[0]["rank"] for t in ranks] == [0, 1] and {t[0]["world_size"] for t in ranks} == {2}
    batches = [[r["offsets"] for r in t if "offsets" in r] for t in (whole, *ranks)]
    assert len(batches[1]) == len(batches[2]) == 10
    for step, (everything, mine, yours) in enumerate(zip(*batches), start=1):
        # rank 0 trains on the first half of the global batch, rank 1 on the second half
        assert mine[0] == everything[0][:4] and yours[0] == everything[0][4:], step
    params = [load_file(runs / "d10-debug" / f"rank{r}.safetensors") for r in (0, 1)]
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name
    saved = load(runs / "d10").state_dict()
    assert torch.equal(saved["wte.weight"], params[0]["wte.weight"])


def test_ddp_with_muon_matches_one_process_with_twice_the_batch(runs):
    one, two = steps(runs / "m10"), steps(runs / "dm10")
    assert list(two) == list(one) == list(range(1, 11))
    for s in one:
        assert two[s] == pytest.approx(one[s], abs=1e-3), s
    # torch.optim.Muon's Newton-Schulz iteration runs in bfloat16: the processes' float32 gradients,
    # summed in another order, round there to updates a bfloat16 step apart (4e-3 at most in these
    # 10 steps), where Muon and AdamW end 0.1 apart
    apart = max_weight_diff(runs / "m10", runs / "dm10")
    assert apart < 1e-2 and max_weight_diff(runs / "m10", runs / "s10") > 10 * apart
    state = torch.load(runs / "dm10" / "train_state.pt", weights_only=True)
    assert state["optimizer_kind"] == "muon" and len(state["optimizer"]["param_groups"]) == 3


def test_fsdp_matches_ddp(runs):
    ddp, fsdp = steps(runs / "d10"), steps(runs / "f10")
    assert list(fsdp) == list(ddp)
    for s in ddp:
        assert fsdp[s] == pytest.approx(ddp[s], abs=1e-4), s
    assert max_weight_diff(runs / "d10", runs / "f10") < 1e-4
    # gathered to a normal run folder: full optimizer state in the single-process layout
    a, b = (torch.load(runs / r / "train_state.pt", weights_only=True)["optimizer"] for r in ("d10", "f10"))
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert torch.allclose(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"], rtol=1e-3, atol=1e-9)


# DDP replicates whatever module it is given, so its llama run (10 s) is a slow variant; FSDP wraps the blocks
@pytest.mark.parametrize("sharding", [pytest.param([], marks=pytest.mark.slow), ["--fsdp"]], ids=["ddp", "fsdp"])
def test_the_llama_layout_trains_in_two_processes_as_one_process_with_twice_the_batch(char_data, tmp_path, sharding):
    # rotary positions, grouped-query attention, qk-norm, SwiGLU and an untied head; FSDP shards it block by block
    llama = [*FLAT, "--arch", "llama", "--n-kv-head", 1, "--qk-norm", "--no-tie-weights", "--max-iters", 5]
    single("train", "--data", char_data, "--out", tmp_path / "one", "--batch-size", 8, *llama)
    torchrun("train", "--data", char_data, "--out", tmp_path / "two", "--batch-size", 4, *sharding, *llama)
    one, two = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert list(two) == list(one) == list(range(1, 6))
    for s in one:
        assert two[s] == pytest.approx(one[s], abs=1e-5), s
    assert max_weight_diff(tmp_path / "one", tmp_path / "two") < 1e-5  # no key bias to drift
    assert json.loads((tmp_path / "two" / "config.json").read_text())["arch"] == "llama"


def test_attention_s_key_bias_has_no_gradient_but_float_rounding():
    """Why two processes' key bias drifts from one process's under AdamW (the multiprocess page): the bias adds
    q . b to every score of a query alike, which softmax ignores, so its gradient is zero in theory; in float32
    it is rounding, different in each order of summing, and AdamW scales each gradient by its own size."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128))
    idx = torch.randint(0, 65, (8, 65))
    model(idx[:, :-1], targets=idx[:, 1:]).backward()
    for block in model.h:
        query, key, value = block.attn.c_attn.bias.grad.split(128)
        assert key.abs().max() < 1e-6 * value.abs().max() and query.abs().max() > 1e-3 * value.abs().max()


@pytest.mark.parametrize("source", ["d10", "f10"])
def test_a_two_process_checkpoint_resumes_in_one_process(runs, char_data, tmp_path, source, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / source, run)
    single("train", "--data", char_data, "--out", run, "--resume", "--batch-size", 8, "--max-iters", 20, "--quiet")
    assert list(steps(run)) == list(range(1, 21))
    straight = steps(runs / "s20")
    for s, loss in steps(run).items():
        assert loss == pytest.approx(straight[s], abs=1e-3), s
    assert max_weight_diff(run, runs / "s20") < 1e-4
    assert cli.main(["sample", str(runs / source), "--max-new-tokens", "20", "--seed", "1", "--device", "cpu"]) == 0
    assert len(capsys.readouterr().out) >= 20


def test_a_one_process_checkpoint_resumes_in_two_processes(runs, char_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "s10", run)
    r = torchrun("train", "--data", char_data, "--out", run, "--resume", "--batch-size", 4, "--max-iters", 20,
                 "--fsdp", "--quiet")
    assert r.stdout.startswith("max_iters: 20 steps on 2 processes"), r.stdout
    straight = steps(runs / "s20")
    for s, loss in steps(run).items():
        assert loss == pytest.approx(straight[s], abs=1e-3), s
    assert max_weight_diff(run, runs / "s20") < 1e-4


def test_a_time_budget_under_torchrun_says_it_does_not_size_the_model(char_data, tmp_path):
    # it used to train the data's default model without a word, where one process sizes one
    r = torchrun("train", "--data", char_data, "--out", tmp_path / "run", "--max-time", "3s", "--batch-size", 2,
                 "--eval-iters", 1, "--quiet")
    assert r.stderr.count("--max-time does not size the model") == 1, r.stderr  # rank 0 only
    notes = json.loads((tmp_path / "run" / "train_config.json").read_text())["notes"]
    assert notes["model_choice"]["rule"] == "data"


def test_finetune_in_two_processes_matches_one_process_with_twice_the_batch(runs, char_data, tmp_path):
    """LoRA fine-tuning under torchrun: the adapters one process trains with batch 8, the report
    printed and written once, by rank 0, and --merge's run written by rank 0 alone."""
    flags = ["--data", char_data, "--method", "lora", "--lora-targets", "attn,mlp", "--max-iters", 6,
             "--eval-iters", 2, "--lr", "1e-3", "--dtype", "float32", "--device", "cpu", "--quiet"]
    single("finetune", runs / "s10", "--out", tmp_path / "one", "--batch-size", 8, *flags)
    r = torchrun("finetune", runs / "s10", "--out", tmp_path / "two", "--batch-size", 4, "--merge",
                 tmp_path / "merged", *flags)
    assert r.stdout.startswith("max_iters: 6 steps on 2 processes"), r.stdout
    assert r.stdout.count("fine-tuned from") == 1 and r.stdout.count("merged: ") == 1, r.stdout
    one, two = (load_file(tmp_path / run / "adapter_model.safetensors") for run in ("one", "two"))
    assert one.keys() == two.keys() and len(one) == 16  # A and B on 2 blocks x 4 layers
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4
    reports = [json.loads((tmp_path / run / "finetune_report.json").read_text()) for run in ("one", "two")]
    assert reports[1]["before"] == reports[0]["before"]
    assert reports[1]["after"]["data"]["loss"] == pytest.approx(reports[0]["after"]["data"]["loss"], abs=1e-4)
    merged, folded = load(tmp_path / "merged").state_dict(), load(tmp_path / "one", merge=True).state_dict()
    assert merged.keys() == folded.keys()
    assert max((merged[k] - folded[k]).abs().max().item() for k in merged) < 1e-4


@contextmanager
def _job(char_data, run: Path, debug: Path, timeout: str = "30s"):
    """A long 2-process run, yielded once both processes have trained a few steps; whatever the
    test does, nothing it started is left running."""
    p = torchrun("train", "--data", char_data, "--out", run, *FLAT, "--batch-size", 4, "--max-iters", 100000,
                 "--eval-interval", 100000, "--dist-timeout", timeout, trace=debug, popen=True)
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and min(len(trace(debug, 0)), len(trace(debug, 1))) < 4:
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.1)
        pids = [trace(debug, r)[0]["pid"] for r in (0, 1)]
        yield p, pids
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and any worker of its session still there
        except ProcessLookupError:
            pass
        p.wait()
        p.stdout.close()
        p.stderr.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_to_one_process_stops_both_at_the_same_step_with_one_checkpoint(char_data, tmp_path):
    run, debug = tmp_path / "run", tmp_path / "debug"
    with _job(char_data, run, debug) as (p, pids):
        sent = time.time()
        os.kill(pids[1], signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert time.time() - sent < 60
        assert all(_gone(pid) for pid in pids)
    ends = [trace(debug, r)[-1] for r in (0, 1)]
    assert ends[0] == ends[1] and ends[0]["stopped"] == "SIGTERM", (ends, err[-3000:])
    step = ends[0]["end"]
    assert out.startswith(f"SIGTERM: {step} steps on 2 processes"), out
    assert p.returncode != 0  # the processes exit 143, which torchrun reports as a failure
    # one complete checkpoint at that step: the weights and the training state agree
    assert weights_step(run) == step and load_training(run)["step"] == step
    assert not list(run.glob("*.tmp"))
    assert max(steps(run)) == step


def test_a_dead_process_ends_the_job(char_data, tmp_path):
    run, debug = tmp_path / "run", tmp_path / "debug"
    with _job(char_data, run, debug) as (p, pids):
        sent = time.time()
        os.kill(pids[1], signal.SIGKILL)
        p.communicate(timeout=60)
        assert time.time() - sent < 60
        assert p.returncode != 0
        assert all(_gone(pid) for pid in pids)


# `tinygpt train ...`, then 500 more collectives on the job's gloo group, which outlives the run (as
# DDP leaves it), their tensors dropped at once, so that the worker threads let go of them while the
# process leaves; an atexit handler tells whether the interpreter's teardown ran.
LATE_COLLECTIVES = """
import atexit, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from tinygpt import cli, distributed

groups = []
last_barrier = distributed.Dist.barrier


def barrier(self):
    groups.append(dist.group.WORLD)
    last_barrier(self)


distributed.Dist.barrier = barrier
atexit.register(Path(__file__).with_name(f"teardown{os.environ['RANK']}").touch)
code = cli.main(sys.argv[1:])
for _ in range(500):
    groups[-1].allreduce([torch.ones(4)])
cli.leave(code)
"""


def test_collectives_finishing_as_the_processes_exit_do_not_abort_them(char_data, tmp_path):
    """PyTorch keeps the gloo group's threads past destroy_process_group once DDP has used it; one
    that let go of a collective's tensors during the interpreter's teardown aborted the process
    (SIGABRT, "terminate called without an active exception") after the run had been saved. The
    processes now leave without that teardown (the abort is a race: before the fix this script
    aborted in 2 to 9 tries of 10 on the Xeon with AMX)."""
    script = tmp_path / "late_collectives.py"
    script.write_text(LATE_COLLECTIVES)
    run = tmp_path / "run"
    r = torchrun("train", "--data", char_data, "--out", run, "--batch-size", 4, "--max-iters", 2, *FLAT, script=script)
    assert "terminate called" not in r.stderr
    assert r.stdout.startswith("max_iters: 2 steps on 2 processes"), r.stdout  # flushed before leaving
    assert not list(tmp_path.glob("teardown*"))
    assert weights_step(run) == 2 and max(steps(run)) == 2


@pytest.mark.slow
def test_a_hung_process_ends_the_job_after_the_timeout(char_data, tmp_path):
    run, debug = tmp_path / "run", tmp_path / "debug"
    with _job(char_data, run, debug, timeout="5s") as (p, pids):
        os.kill(pids[1], signal.SIGSTOP)  # alive but silent: only the timeout can tell
        _, err = p.communicate(timeout=120)  # 5 s, then torchrun's 30 s grace before SIGKILL
        assert p.returncode != 0
        assert "process 0: lost contact with the other processes" in err, err[-3000:]
        assert all(_gone(pid) for pid in pids)


def test_accumulation_reduces_gradients_once_per_step(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tinygpt.distributed import gradient_sync

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 4))
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, hook)
        for micro in range(3):
            with gradient_sync(model, micro == 2):
                model(torch.randn(2, 4)).sum().backward()
            assert len(calls) == (1 if micro == 2 else 0)
    finally:
        dist.destroy_process_group()


def test_optimizer_state_layouts_round_trip():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = [{"params": [model[0].weight]}, {"params": [model[0].bias, *model[1].parameters()]}]
    opt = torch.optim.AdamW(groups, lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    by_index = opt.state_dict()
    fqns = ["0.weight", "0.bias", "1.weight", "1.bias"]
    by_name = _state_by_name(by_index, fqns)
    assert by_name["param_groups"][1]["params"] == ["0.bias", "1.weight", "1.bias"]
    assert torch.equal(by_name["state"]["1.weight"]["exp_avg"], by_index["state"][2]["exp_avg"])
    back = _state_by_index(by_name)
    assert back["param_groups"] == by_index["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], by_index["state"][i]["exp_avg"]) for i in range(4))


def test_one_process_needs_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with process_group(torch.device("cpu")) as ctx:
        assert ctx == Dist(torch.device("cpu")) and not ctx.enabled and ctx.is_main
        assert ctx.mean(torch.tensor(2.5)) == 2.5 and ctx.max([0.0, 1.0]) == [0.0, 1.0]
        assert ctx.main_first(lambda: 7) == 7


def test_dist_timeout_flag(char_data, tmp_path, capsys):
    assert cli.main(["train", "--data", str(char_data), "--out", str(tmp_path / "r"), "--dist-timeout", "0s",
                     *FLAT]) == 2
    assert "dist" in capsys.readouterr().err
