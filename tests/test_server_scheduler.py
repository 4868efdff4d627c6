"""The batching scheduler on its own: batched rows decode exactly what generate() decodes alone."""

import threading

import pytest
import torch
from server_util import POISON_TOP_K, poison_sampler

import tinygpt
from tinygpt.config import SampleConfig
from tinygpt.server.scheduler import Draining, ModelDown, QueueFull, Scheduler, Sequence


class Collector:
    """Gathers each choice's text and finish reason from the model thread's events."""

    def __init__(self, count: int) -> None:
        self.text = [""] * count
        self.finish = [None] * count
        self.tokens = [0] * count
        self.first = threading.Event()
        self._left = count
        self.done = threading.Event()

    def __call__(self, event) -> None:
        assert event.error is None, event.error
        self.text[event.index] += event.text
        self.first.set()
        if event.finish_reason:
            self.finish[event.index] = event.finish_reason
            self.tokens[event.index] = event.completion_tokens
            self._left -= 1
            if not self._left:
                self.done.set()


def seq(tok, prompt: str, max_tokens: int, emit, index: int = 0, **kw) -> Sequence:
    kw.setdefault("sampling", SampleConfig(temperature=0))
    return Sequence(prompt=tok.encode(prompt)[-32:], max_tokens=max_tokens, emit=emit, index=index, **kw)


def reference(model, tok, prompt: str, max_tokens: int, **kw) -> str:
    ids = torch.tensor([tok.encode(prompt)[-model.config.block_size :]])
    return tok.decode(tinygpt.generate(model, ids, max_tokens, **kw)[0, ids.shape[1] :].tolist())


def test_rows_joining_and_leaving_decode_what_generate_decodes_alone(model, tok):
    # 5 sequences for 3 rows: two wait and join as others finish; prompts of different lengths,
    # one longer than the context (cut) and lengths that slide past block_size.
    prompts = ["a", "hello", "the quick brown fox", "x" * 45, "def main():\n    return 1"]
    lengths = [10, 50, 33, 70, 5]
    out = Collector(len(prompts))
    sched = Scheduler(model, tok, max_concurrency=3, max_queue=8)
    try:
        sched.submit([seq(tok, p, n, out, i) for i, (p, n) in enumerate(zip(prompts, lengths))])
        assert out.done.wait(60)
    finally:
        sched.stop()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert out.text[i] == reference(model, tok, p, n, greedy=True), i
        assert out.finish[i] == "length" and out.tokens[i] == n
    assert sched.counters["peak_batch"] == 3 and sched.counters["completed"] == 5


def test_each_row_keeps_its_own_sampling_settings_and_seed(model, tok):
    settings = [
        dict(sampling=SampleConfig(temperature=0.9, top_k=5), seed=11),
        dict(sampling=SampleConfig(temperature=0, repetition_penalty=1.5)),
        dict(sampling=SampleConfig(temperature=1.2, top_p=0.8), seed=12),
    ]
    alone = []
    for s in settings:
        out = Collector(1)
        sched = Scheduler(model, tok, max_concurrency=1)
        sched.submit([seq(tok, "abc", 40, out, **s)])
        assert out.done.wait(30)
        sched.stop()
        alone.append(out.text[0])
    together = Collector(3)
    sched = Scheduler(model, tok, max_concurrency=3)
    sched.submit([seq(tok, "abc", 40, together, i, **s) for i, s in enumerate(settings)])
    assert together.done.wait(30)
    sched.stop()
    assert together.text == alone
    # the same draws generate() makes with a generator seeded alike
    gen = torch.Generator().manual_seed(11)
    assert alone[0] == reference(model, tok, "abc", 40, temperature=0.9, top_k=5, generator=gen)
    assert alone[1] == reference(model, tok, "abc", 40, greedy=True, repetition_penalty=1.5)


def test_stop_strings_and_stop_tokens(model, tok):
    greedy = reference(model, tok, "hello", 30, greedy=True)
    stop = greedy[10:12]
    out = Collector(3)
    sched = Scheduler(model, tok, max_concurrency=3)
    first = tok.encode(greedy[0])[0]
    sched.submit([
        seq(tok, "hello", 30, out, 0, stop=(stop,)),
        seq(tok, "hello", 30, out, 1, stop_tokens=frozenset({first})),  # the very first token stops
        seq(tok, "hello", 30, out, 2, stop_tokens=frozenset({first}), logit_bias={first: -100.0}),
    ])
    assert out.done.wait(30)
    sched.stop()
    assert out.text[0] == greedy[: greedy.index(stop)] and out.finish[0] == "stop"
    assert out.text[1] == "" and out.finish[1] == "stop" and out.tokens[1] == 1
    assert out.text[2] and out.text[2][0] != greedy[0]


def test_cancel_frees_the_row_and_the_queue(model, tok):
    out = Collector(2)
    sched = Scheduler(model, tok, max_concurrency=1, max_queue=1)
    try:
        running = seq(tok, "a", 100_000, out, 0)
        waiting = seq(tok, "b", 100_000, out, 1)
        sched.submit([running, waiting])
        assert out.first.wait(30)
        with pytest.raises(QueueFull):
            sched.submit([seq(tok, "c", 5, out)])
        sched.cancel([waiting])
        assert sched.stats()["queued"] == 0
        sched.cancel([running])
        assert sched.wait_idle(10)
        stats = sched.stats()
        assert stats["active"] == 0 and stats["cancelled"] == 2 and stats["completed"] == 0
        sched.start_draining()
        with pytest.raises(Draining):
            sched.submit([seq(tok, "c", 5, out)])
    finally:
        sched.stop()


def test_the_model_thread_survives_a_failing_step(model, tok):
    events = []
    done = threading.Event()

    def emit(event):
        events.append(event)
        if event.error or event.finish_reason:
            done.set()

    sched = Scheduler(model, tok, max_concurrency=2)
    try:
        bad = Sequence(prompt=[len(tok.encode("a")) * 10_000], max_tokens=5, sampling=SampleConfig(), emit=emit)
        sched.submit([bad])  # an id outside the embedding table: the step raises
        assert done.wait(10) and events[-1].error
        out = Collector(1)
        sched.submit([seq(tok, "abc", 5, out)])
        assert out.done.wait(10) and out.finish[0] == "length"
        assert sched.counters["failed"] == 1
    finally:
        sched.stop()


def test_a_sequence_whose_choice_raises_ends_alone(model, tok, monkeypatch):
    poison_sampler(monkeypatch.setattr)
    out = Collector(2)
    failed = []
    done = threading.Event()

    def poisoned_emit(event):
        failed.append(event)
        done.set()

    sched = Scheduler(model, tok, max_concurrency=3)
    try:
        sched.submit([seq(tok, "abc", 60, out, 0)])
        assert out.first.wait(30)
        sched.submit([seq(tok, "xyz", 60, poisoned_emit, sampling=SampleConfig(temperature=1.0, top_k=POISON_TOP_K))])
        sched.submit([seq(tok, "hello", 40, out, 1)])  # joins after the failure
        assert done.wait(30) and out.done.wait(60)
    finally:
        sched.stop()
    assert [e.error is not None for e in failed] == [True] and failed[0].status == 500
    assert out.text == [reference(model, tok, "abc", 60, greedy=True), reference(model, tok, "hello", 40, greedy=True)]
    assert out.finish == ["length", "length"]
    assert sched.counters["failed"] == 1 and sched.counters["completed"] == 2


class Fault(BaseException):
    """Not an Exception: nothing on the model thread catches it, so the thread dies."""


def test_a_dead_model_thread_fails_what_waits_and_refuses_new_work(model, tok):
    events = []
    done = threading.Event()

    def emit(event):
        events.append(event)
        if event.error or event.finish_reason:
            done.set()

    sched = Scheduler(model, tok, max_concurrency=1)

    def die(admit):
        raise Fault("injected")

    try:
        sched._step = die
        sched.submit([seq(tok, "abc", 5, emit)])
        assert done.wait(10)
        assert events[-1].error and events[-1].status == 503 and "model thread stopped" in events[-1].error
        assert sched.failure is not None and "Fault" in sched.failure
        with pytest.raises(ModelDown):
            sched.submit([seq(tok, "abc", 5, emit)])
        with pytest.raises(ModelDown):
            sched.call(lambda: 1)
    finally:
        sched.stop()


def test_a_kv_cache_too_large_for_the_machine_is_refused_before_allocating(model, tok):
    sched = Scheduler(model, tok, max_concurrency=20_000_000)
    with pytest.raises(tinygpt.ConfigError, match=r"needs [\d.]+ [GT]iB .*lower --max-concurrency"):
        sched.allocate()
    assert sched._cache is None
    small = Scheduler(model, tok, max_concurrency=2)
    small.allocate()
    assert small._cache.batch_size == 2


def test_decode_steps_and_prompts_run_on_one_thread_when_another_program_holds_a_core(model, tok, monkeypatch):
    # issue 40: every step on two threads ran many times slower with a core taken; the server chooses as generate does
    import importlib

    from tinygpt.server import scheduler as scheduler_module

    generate_module = importlib.import_module("tinygpt.generate")
    seen = {"decode": [], "prefill": []}
    for name in seen:
        real = getattr(scheduler_module, f"{name}_step" if name == "decode" else name)
        monkeypatch.setattr(scheduler_module, f"{name}_step" if name == "decode" else name,
                            lambda *a, _real=real, _name=name: seen[_name].append(torch.get_num_threads()) or _real(*a))
    monkeypatch.setattr(generate_module, "free_cores", lambda: 1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = Collector(2)
        sched = Scheduler(model, tok, max_concurrency=2)
        try:
            sched.submit([seq(tok, "hello", 12, out, 0), seq(tok, "x" * 40, 12, out, 1)])
            assert out.done.wait(60)
        finally:
            sched.stop()
    finally:
        torch.set_num_threads(before)
    assert seen["prefill"] and set(seen["prefill"]) == {1} and seen["decode"] and set(seen["decode"]) == {1}
    assert out.text[0] == reference(model, tok, "hello", 12, greedy=True)
