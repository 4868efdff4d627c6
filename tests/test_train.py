import dataclasses
import functools
import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import tinygpt
from tinygpt import GPTConfig
from tinygpt.checkpoint import load
from tinygpt.config import DEFAULT_LR, TrainConfig
from tinygpt.errors import ConfigError, NonFiniteError, TrainingError
from tinygpt.optim import lr_at
from tinygpt.sizing import ModelChoice
from tinygpt.train import TrainCallback, train

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def cfg(**kw):
    base = dict(batch_size=4, max_iters=20, eval_interval=5, eval_iters=2, warmup=3, device="cpu", dtype="float32")
    return TrainConfig(**{**base, **kw})


def test_lr_schedule():
    c = TrainConfig(lr=1.0, min_lr=0.1, warmup=10)
    assert lr_at(0, c, 110) == pytest.approx(0.1)
    assert lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.55)
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    assert lr_at(500, c, 110) == pytest.approx(0.1)
    assert TrainConfig(lr=1e-3).final_lr == pytest.approx(1e-4)
    # a time budget's estimated length keeps the warmup to a tenth of it
    timed = TrainConfig(lr=1.0, min_lr=0.0, warmup=100, max_time=60)
    assert lr_at(2, timed, None) == pytest.approx(0.03)  # not timed yet: the warmup as given
    assert lr_at(4, timed, 50) == pytest.approx(1.0)
    assert lr_at(50, timed, 50) == pytest.approx(0.0)


def test_train_writes_a_run_and_metrics(char_data, tmp_path):
    result = train(char_data, tmp_path / "run", MODEL, cfg(), progress=False)
    assert result.step == 20 and result.stopped == "max_iters"
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "train_state.pt", "metrics.jsonl"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(steps[0])
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert load(tmp_path / "run").config == MODEL


@pytest.mark.parametrize("stop_at", [1, 7, 10])
def test_resume_is_bitwise_equal(char_data, tmp_path, stop_at):
    c = cfg(grad_accum=2)
    train(char_data, tmp_path / "straight", MODEL, c, progress=False)
    first = train(char_data, tmp_path / "resumed", MODEL, c, progress=False, should_stop=lambda s: s == stop_at)
    assert first.step == stop_at and first.stopped == "requested"
    second = train(char_data, tmp_path / "resumed", None, c, resume=True, progress=False)
    assert second.step == 20
    a, b = load(tmp_path / "straight").state_dict(), load(tmp_path / "resumed").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    metrics = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics if "loss" in json.loads(m)] == list(range(1, 21))


def _kl_from(teacher, student, x: torch.Tensor) -> float:
    """The mean KL divergence from the teacher's next-token distributions on x (B, T) to the student's."""
    with torch.no_grad():
        logp = [torch.log_softmax(m.eval()(x), dim=-1) for m in (teacher, student)]
    return torch.nn.functional.kl_div(logp[1], logp[0], log_target=True, reduction="sum").item() / x.numel()


def test_distill_learns_the_teacher_s_distributions_where_the_text_s_tokens_do_not(char_data, tmp_path):
    from conftest import make_text

    from tinygpt import GPT
    from tinygpt.train import Start
    from tinygpt.train.objectives import Distill

    torch.manual_seed(0)  # a teacher of random weights: its distributions are nothing like the text's
    teacher = GPT(dataclasses.replace(MODEL, init="torch", tie_weights=False, dropout=0.0))
    small = dataclasses.replace(MODEL, n_layer=1, n_embd=16, dropout=0.0)
    start = Start(small, lambda: GPT(small), load, DEFAULT_LR, objective=functools.partial(Distill, teacher=teacher))
    torch.manual_seed(0)
    train(char_data, tmp_path / "distilled", start, cfg(max_iters=60, eval_interval=60, lr=3e-3), progress=False)
    torch.manual_seed(0)
    train(char_data, tmp_path / "text", small, cfg(max_iters=60, eval_interval=60, lr=3e-3), progress=False)
    ids = tinygpt.load_tokenizer(char_data).encode(make_text(40, seed=1))
    x = torch.tensor(ids[: 16 * (len(ids) // 16)]).view(-1, 16)  # text neither saw, in windows of block_size
    kl = {name: _kl_from(teacher, load(tmp_path / name), x) for name in ("distilled", "text")}
    untrained = _kl_from(teacher, GPT(small), x)
    assert kl["distilled"] < 0.5 * untrained and kl["distilled"] < 0.25 * kl["text"], (kl, untrained)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())  # never trained
    narrow = GPT(dataclasses.replace(MODEL, vocab_size=8))
    refused = Start(small, lambda: GPT(small), load, DEFAULT_LR, objective=functools.partial(Distill, teacher=narrow))
    with pytest.raises(TrainingError, match="the teacher reads 8 ids"):
        train(char_data, tmp_path / "refused", refused, cfg(max_iters=2), progress=False)
    assert not (tmp_path / "refused").exists()


def test_nonfinite_loss_stops_before_the_update(char_data, tmp_path, monkeypatch):
    train_module = importlib.import_module("tinygpt.train.objectives")

    run = tmp_path / "run"
    train(char_data, run, MODEL, cfg(max_iters=5), progress=False)
    before = load(run).state_dict()
    real = train_module.batch_loss
    calls = {"n": 0}

    def poisoned(model, batch, device):
        calls["n"] += 1
        loss = real(model, batch, device)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(train_module, "batch_loss", poisoned)
    with pytest.raises(NonFiniteError, match="step 8") as info:
        train(char_data, run, None, cfg(max_iters=20), resume=True, progress=False)
    assert info.value.step == 8
    after = load(run).state_dict()  # the last good checkpoint is untouched and finite
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_learning_rate_left_to_choose(char_data, tmp_path):
    # TrainConfig.lr None: DEFAULT_LR for a given model, a ModelChoice's own rate (what a model sized
    # for a time budget carries), and on resume the run's; a given lr always wins
    def saved(run):
        record = json.loads((run / "train_config.json").read_text())
        return record["train"]["lr"], record.get("notes", {})

    short = cfg(max_iters=2, eval_interval=2)
    assert short.lr is None
    train(char_data, tmp_path / "given", MODEL, short, progress=False)
    assert saved(tmp_path / "given") == (DEFAULT_LR, {})
    choice = ModelChoice(MODEL, "chinchilla", "model: sized for a test", plan={"lr": 4e-3}, lr=4e-3)
    train(char_data, tmp_path / "chosen", choice, short, progress=False)
    lr, notes = saved(tmp_path / "chosen")
    assert lr == 4e-3 and notes["model_choice"]["reason"] == "model: sized for a test"
    train(char_data, tmp_path / "chosen", None, cfg(max_iters=4, eval_interval=2), resume=True, progress=False)
    assert saved(tmp_path / "chosen")[0] == 4e-3
    train(char_data, tmp_path / "mine", choice, cfg(max_iters=2, eval_interval=2, lr=7e-4), progress=False)
    assert saved(tmp_path / "mine")[0] == 7e-4
    with pytest.raises(ConfigError, match="min_lr"):
        train(char_data, tmp_path / "low", choice, cfg(max_iters=2, min_lr=5e-3), progress=False)
    assert not (tmp_path / "low").exists()


def test_max_time_stops_and_saves(char_data, tmp_path):
    result = train(char_data, tmp_path / "run", MODEL, cfg(max_iters=None, max_time=1.5, eval_interval=1000),
                   progress=False)
    assert result.stopped == "max_time" and result.step >= 1  # the horizon it reached is the budget's
    assert load(tmp_path / "run") is not None
    assert result.elapsed < 10


def test_refuses_existing_run_and_short_data(char_data, tmp_path):
    train(char_data, tmp_path / "run", MODEL, cfg(max_iters=1), progress=False)
    with pytest.raises(TrainingError, match="already holds a run"):
        train(char_data, tmp_path / "run", MODEL, cfg(max_iters=1), progress=False)
    # a run whose weights were lost is not started over, resumed or not: its state and metrics stay
    (tmp_path / "run" / "model.safetensors").unlink()
    kept = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(TrainingError, match="holds a training state but not its weights"):
        train(char_data, tmp_path / "run", MODEL, cfg(max_iters=1), progress=False)
    from tinygpt.cli import main

    assert main(["train", "--data", str(char_data), "--out", str(tmp_path / "run"), "--resume", "--quiet"]) == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == kept
    big = GPTConfig(**{**MODEL.to_dict(), "block_size": 100_000})
    with pytest.raises(TrainingError, match="fewer than block_size"):
        train(char_data, tmp_path / "other", big, cfg(), progress=False)
    small_vocab = GPTConfig(**{**MODEL.to_dict(), "vocab_size": 3})
    with pytest.raises(TrainingError, match="vocab"):
        train(char_data, tmp_path / "other", small_vocab, cfg(), progress=False)


def test_gradient_clipping_logs_norm_before_clipping(char_data, tmp_path):
    train(char_data, tmp_path / "run", MODEL, cfg(max_iters=3, grad_clip=1e-6, lr=1e-2), progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in lines if "grad_norm" in r]
    assert all(n > 1e-3 for n in norms)  # the logged norm is the one before clipping
    assert all(math.isfinite(n) for n in norms)


def test_bfloat16_training_stays_within_two_percent_of_float32(char_data, tmp_path):
    # the numerics bound behind dtype "auto" picking bfloat16 on CPUs that compute it natively
    model = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    losses = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs faster on one core than on two that others share
    try:
        for dtype in ("float32", "bfloat16"):
            c = cfg(dtype=dtype, batch_size=8, max_iters=200, eval_interval=200, warmup=20, lr=3e-3)
            losses[dtype] = train(char_data, tmp_path / dtype, model, c, progress=False)
    finally:
        torch.set_num_threads(threads)
    fp32, bf16 = losses["float32"], losses["bfloat16"]
    assert fp32.train_loss < 2.5  # it learned: the comparison is not between two random models
    assert bf16.train_loss == pytest.approx(fp32.train_loss, rel=0.02)
    assert bf16.val_loss == pytest.approx(fp32.val_loss, rel=0.02)


def test_auto_dtype_is_bfloat16_only_where_the_hardware_has_it(monkeypatch):
    from tinygpt import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert device.resolve_dtype("float32", torch.device("cpu")) is torch.float32


def test_resume_refuses_data_prepared_with_another_tokenizer(char_data, tmp_path):
    import shutil

    from conftest import make_text

    from tinygpt.data import load_data, prepare
    from tinygpt.errors import DataError

    (tmp_path / "upper.txt").write_text(make_text().upper())
    upper = tmp_path / "upper"
    prepare([str(tmp_path / "upper.txt")], upper)
    own = load_data(char_data)
    other = load_data(upper)  # the same kind and size of vocabulary: only the characters differ
    assert (other.meta["tokenizer"], other.vocab_size) == (own.meta["tokenizer"], own.vocab_size)
    assert own.meta["tokenizer_fingerprint"] == own.tokenizer.fingerprint() != other.fingerprint

    run = tmp_path / "run"
    train(char_data, run, MODEL, cfg(max_iters=2, eval_interval=2), progress=False)
    assert json.loads((run / "train_config.json").read_text())["tokenizer_fingerprint"] == own.fingerprint
    before = {name: (run / name).read_bytes() for name in ("tokenizer.json", "train_config.json", "train_state.pt")}
    with pytest.raises(DataError, match="another tokenizer") as info:
        train(upper, run, None, cfg(max_iters=4, eval_interval=2), resume=True, progress=False)
    message = str(info.value)
    assert "\n" not in message and own.fingerprint[:19] in message and other.fingerprint[:19] in message
    assert {name: (run / name).read_bytes() for name in before} == before  # the run's tokenizer is not replaced

    # folders written before fingerprints existed: computed from their tokenizer.json
    old_data, old_upper = tmp_path / "old_data", tmp_path / "old_upper"
    for src, dst in ((char_data, old_data), (upper, old_upper)):
        shutil.copytree(src, dst)
        meta = json.loads((dst / "meta.json").read_text())
        del meta["tokenizer_fingerprint"]
        (dst / "meta.json").write_text(json.dumps(meta))
    record = json.loads((run / "train_config.json").read_text())
    del record["tokenizer_fingerprint"]
    (run / "train_config.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match="another tokenizer"):
        train(old_upper, run, None, cfg(max_iters=4, eval_interval=2), resume=True, progress=False)
    assert train(old_data, run, None, cfg(max_iters=4, eval_interval=2), resume=True, progress=False).step == 4


class FakeMachine:
    """A clock for train(clock=...) that moves only when the model works: a training step costs the
    current phase's seconds, an evaluation batch (no gradients) a third of that. `phases` is a list of
    (until, seconds per step): the machine gets busier or quieter at those times."""

    def __init__(self, monkeypatch, phases):
        train_module = importlib.import_module("tinygpt.train.objectives")
        self.now, self.phases, real = 0.0, phases, train_module.batch_loss

        def timed_loss(model, batch, device):
            per_step = next(seconds for until, seconds in phases if self.now < until)
            self.now += per_step if torch.is_grad_enabled() else per_step / 3
            return real(model, batch, device)

        monkeypatch.setattr(train_module, "batch_loss", timed_loss)

    def __call__(self) -> float:
        return self.now


def lrs(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in lines if "lr" in r]


def assert_never_rises_after_warmup(rates):
    peak = rates.index(max(rates))
    assert all(b >= a for a, b in zip(rates[:peak], rates[1 : peak + 1]))  # the warmup climbs
    assert all(b <= a for a, b in zip(rates[peak:], rates[peak + 1 :])), rates


@pytest.mark.parametrize("phases", [[(60, 7.7), (math.inf, 2.0)], [(150, 2.0), (math.inf, 7.7)]],
                         ids=["slow-then-fast", "fast-then-slow"])
def test_a_time_budget_is_used_as_the_speed_changes(char_data, tmp_path, monkeypatch, phases):
    # `make demo` on a busy machine: 7.7 s steps while it was timed, ~2 s after, and the schedule fixed
    # from the first steps ended at 221 s of 300. The length is re-estimated every step instead.
    clock = FakeMachine(monkeypatch, phases)
    c = cfg(max_iters=None, max_time=300, eval_interval=25, warmup=10, lr=1e-3, min_lr=1e-4)
    result = train(char_data, tmp_path / "run", MODEL, c, progress=False, clock=clock)
    assert result.stopped == "max_time"
    assert 0.95 * 300 <= result.elapsed <= 1.05 * 300, result.elapsed
    rates = lrs(tmp_path / "run")
    assert len(rates) == result.step
    assert_never_rises_after_warmup(rates)
    assert max(rates) == pytest.approx(1e-3)
    assert rates[-1] < 1e-4 + 0.1 * (1e-3 - 1e-4)  # the decay was spread over the run, and used


def test_a_budget_shorter_than_an_evaluation_ends_on_time(char_data, tmp_path, monkeypatch):
    # `train --preset stretch --max-time 15s` on a loaded 2-core machine: 20 + 20 evaluation batches at
    # a third of a step each cost more than the whole budget, and ran after it was spent (the run ended
    # at 74 s). The last evaluation takes the batches the budget still affords instead.
    clock = FakeMachine(monkeypatch, [(math.inf, 1.5)])
    c = cfg(max_iters=None, max_time=15, eval_interval=250, eval_iters=20, warmup=2, lr=1e-3)
    result = train(char_data, tmp_path / "run", MODEL, c, progress=False, clock=clock)
    assert result.stopped == "max_time" and result.step >= 1
    assert result.elapsed <= 1.05 * 15, result.elapsed
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 1 <= last["eval_iters"] < 20 and math.isfinite(last["val_loss"])


def test_max_iters_wins_over_a_time_budget_when_it_comes_first(char_data, tmp_path, monkeypatch):
    clock = FakeMachine(monkeypatch, [(math.inf, 2.0)])
    c = cfg(max_iters=12, max_time=300, warmup=3, lr=1e-3)
    result = train(char_data, tmp_path / "run", MODEL, c, progress=False, clock=clock)
    assert result.stopped == "max_iters" and result.step == 12 and result.elapsed < 100
    assert lrs(tmp_path / "run") == [lr_at(s, c, 12) for s in range(12)]  # the cosine over max_iters
    result = train(char_data, tmp_path / "late", MODEL, cfg(max_iters=1000, max_time=60, eval_interval=1000),
                   progress=False, clock=FakeMachine(monkeypatch, [(math.inf, 2.0)]))
    assert result.stopped == "max_time" and result.step < 1000 and 0.95 * 60 <= result.elapsed <= 60


def test_a_time_budget_run_resumes(char_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    c = cfg(max_iters=None, max_time=200, eval_interval=10, warmup=5, lr=1e-3, min_lr=1e-4)
    first = train(char_data, run, MODEL, c, progress=False, clock=FakeMachine(monkeypatch, [(math.inf, 2.0)]),
                  should_stop=lambda s: s == 40)
    assert first.stopped == "requested" and first.step == 40
    before = lrs(run)
    second = train(char_data, run, None, c, resume=True, progress=False,
                   clock=FakeMachine(monkeypatch, [(math.inf, 4.0)]))  # a busier machine this time
    assert second.stopped == "max_time" and 0.95 * 200 <= second.elapsed <= 1.05 * 200
    rates = lrs(run)
    assert rates[:40] == before and len(rates) == second.step
    assert_never_rises_after_warmup(rates)  # the decay goes on from where it was
    assert rates[-1] < 1e-4 + 0.1 * (1e-3 - 1e-4)


def test_a_resumed_run_counts_the_time_of_the_whole_run(char_data, tmp_path, monkeypatch, capsys):
    # once: after a resume the summary's time (and the fine-tune report's) was the last invocation's alone
    run = tmp_path / "run"
    c = cfg(max_iters=20, eval_interval=10)
    first = train(char_data, run, MODEL, c, progress=False, clock=FakeMachine(monkeypatch, [(math.inf, 2.0)]),
                  should_stop=lambda s: s == 10)
    assert first.step == 10 and first.total_elapsed == first.elapsed > 20
    second = train(char_data, run, None, c, resume=True, progress=False,
                   clock=FakeMachine(monkeypatch, [(math.inf, 3.0)]))
    assert second.step == 20 and second.elapsed > 30
    assert second.total_elapsed == pytest.approx(first.elapsed + second.elapsed)
    # the summary line says both
    from tinygpt.cli.common import time_trained

    assert time_trained(second) == f"{second.total_elapsed:.1f}s ({second.elapsed:.1f}s of it this time)"
    assert time_trained(first) == f"{first.elapsed:.1f}s"
    # a checkpoint saved before the time was kept resumes, its time before unknown (counted from the resume)
    state = torch.load(run / "train_state.pt", weights_only=True)
    del state["elapsed"]
    torch.save(state, run / "train_state.pt")
    third = train(char_data, run, None, cfg(max_iters=22, eval_interval=10), resume=True, progress=False,
                  clock=FakeMachine(monkeypatch, [(math.inf, 1.0)]))
    assert third.step == 22 and third.total_elapsed == third.elapsed
    # and one with a time that is no time is refused, naming it
    state["elapsed"], state["step"] = -1.0, 22
    torch.save(state, run / "train_state.pt")
    with pytest.raises(tinygpt.CheckpointError, match="elapsed is missing or of the wrong type"):
        train(char_data, run, None, cfg(max_iters=24), resume=True, progress=False)


def test_eval_report_is_bits_per_char_and_byte_of_the_predicted_share():
    from tinygpt.train import eval_report

    # 10 tokens, 9 predicted (the first has no context), holding 20 characters in 30 bytes
    result = {"loss": 2.0, "tokens": 9, "nll": 18.0}
    char = eval_report(result, 10, chars=20, nbytes=30, kind="char")
    assert char == {"loss": 2.0, "perplexity": pytest.approx(math.exp(2.0)), "tokens": 9,
                    "bits_per_char": pytest.approx(18.0 / math.log(2) / (20 * 9 / 10))}
    byte = eval_report(result, 10, chars=20, nbytes=30, kind="bpe")
    assert set(byte) == {"loss", "perplexity", "tokens", "bits_per_char", "bits_per_byte"}
    assert byte["bits_per_byte"] == pytest.approx(18.0 / math.log(2) / (30 * 9 / 10))
    assert byte["bits_per_char"] == char["bits_per_char"]  # per character whatever the tokenizer


def test_a_new_run_needs_a_model(char_data, tmp_path, capsys):
    # train() trains what it is given: choosing (and saying why) is the CLI's, or choose_model's
    with pytest.raises(ConfigError, match="needs a model"):
        train(char_data, tmp_path / "run", None, cfg(max_iters=2))
    assert not (tmp_path / "run").exists()
    train(char_data, tmp_path / "run", MODEL, cfg(max_iters=2, eval_interval=2))
    assert capsys.readouterr() == ("", "")  # no progress unless asked for: the library prints nothing


class Recorder(TrainCallback):
    def __init__(self):
        self.calls = []

    def on_start(self, start):
        self.calls.append(("start", start.rank, start.world_size, start.step, start.total))

    def on_batch(self, offsets):
        self.calls.append(("batch", len(offsets)))

    def on_step(self, record, total):
        self.calls.append(("step", record["step"], total, sorted(record)))

    def on_eval(self, record):
        self.calls.append(("eval", record["step"], round(record["val_loss"], 6)))

    def on_end(self, result, model):
        self.calls.append(("end", result.step, result.stopped, type(model).__name__))

    def close(self):
        self.calls.append(("close",))


def test_callbacks_see_every_batch_step_and_evaluation(char_data, tmp_path):
    recorder = Recorder()
    result = train(char_data, tmp_path / "run", MODEL, cfg(max_iters=4, eval_interval=3, grad_accum=2),
                   callbacks=[recorder])
    keys = sorted(["step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "time"])
    step = [("batch", 4), ("batch", 4)]
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert recorder.calls == [
        ("start", 0, 1, 0, 4),
        *step, ("step", 1, 4, keys), *step, ("step", 2, 4, keys),
        *step, ("eval", 3, round(evals[0]["val_loss"], 6)), ("step", 3, 4, keys),
        *step, ("step", 4, 4, keys), ("eval", 4, round(evals[1]["val_loss"], 6)),  # the last evaluation
        ("end", 4, "max_iters", "GPT"),
        ("close",),
    ]
    assert result.val_loss == evals[1]["val_loss"]
    # a resumed run starts where it was; a run that raises still closes its callbacks
    resumed = Recorder()
    train(char_data, tmp_path / "run", None, cfg(max_iters=6, eval_interval=3), resume=True, callbacks=[resumed])
    assert resumed.calls[0] == ("start", 0, 1, 4, 6) and resumed.calls[-2][:2] == ("end", 6)
    failing = Recorder()
    with pytest.raises(TrainingError, match="already holds a run"):
        train(char_data, tmp_path / "run", MODEL, cfg(), callbacks=[failing])
    assert failing.calls == [("close",)]


def test_the_progress_bar_shows_steps_and_evaluations(char_data, tmp_path, capsys):
    train(char_data, tmp_path / "run", MODEL, cfg(max_iters=4, eval_interval=2), progress=True)
    out, err = capsys.readouterr()
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert out == "".join(f"step {e['step']}: train loss {e['train_loss']:.4f}, val loss {e['val_loss']:.4f}\n"
                          for e in evals)  # above the bar, as tqdm writes
    assert "4/4" in err and "loss=" in err


# Trains the default block at a size whose activations glibc would map afresh each step (16 x 128 x 384 floats,
# 3 MiB) and prints the page faults counted after each step, in a process of its own: the allocator's settings
# are the process's.
FAULTS_SCRIPT = """
import json, resource, sys
from tinygpt import GPTConfig
from tinygpt.config import RECIPE_MODEL, TrainConfig, with_arch
from tinygpt.train import TrainCallback, train

class Faults(TrainCallback):
    seen = []

    def on_step(self, record, total):
        self.seen.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

shape = dict(vocab_size=64, block_size=128, n_layer=2, n_head=2, n_embd=128)
model = GPTConfig(**with_arch(GPTConfig(**shape).to_dict(), RECIPE_MODEL))
settings = TrainConfig(batch_size=16, max_iters=9, eval_interval=100, eval_iters=1, device="cpu", dtype="float32")
train(sys.argv[1], sys.argv[2], model, settings, callbacks=[Faults()])
print(json.dumps(Faults.seen))
"""


@pytest.mark.skipif(not tinygpt.device._glibc(), reason="the allocator's settings are glibc's")
def test_a_cpu_run_steps_in_the_memory_its_last_step_freed(char_data, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in tinygpt.device.GLIBC_MALLOC_ENV}
    done = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, str(char_data), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    # glibc's own settings: 18-29 thousand faults over five such steps, each mapping its activations again
    assert seen[-1] - seen[-6] < 4000
