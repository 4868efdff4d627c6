"""Speculative decoding (tinygpt.speculative): greedy output is plain greedy output token for token (drafts of
several sizes, prompt lookup, every weight format, k = 1, 4, 8, across the context limit), sampled tokens are
distributed as the target's (chi-square, fixed seed), the schedule steps aside where it loses, bad input is one
line (the library's and the command line's), sample and chat say what it did, the server's greedy
completions are its own beside other requests, a grammar's mask applies at each verified position (the
constrained reply is the plain one), and the prompt cache keeps what plain decoding keeps. The verification's
rows are one-row steps bit for bit: test_generate.py."""

import concurrent.futures
import copy
import statistics
import time

import httpx
import pytest
import torch
from server_util import CHARS, NAME, running, tiny_tokenizer

from tinygpt import GPT, ConfigError, GPTConfig, generate, quantize, speculative
from tinygpt.config import SampleConfig
from tinygpt.interop.quantize import FORMATS
from tinygpt.kv_cache import KVCache
from tinygpt.sampling import choose, choose_with, noise, process_logits
from tinygpt.server import create_app
from tinygpt.tokenizer import CharTokenizer

V = 67


def _gpt(n_layer: int, n_embd: int, seed: int, vocab: int = V, block: int = 48, **extra) -> GPT:
    torch.manual_seed(seed)
    n_head = extra.pop("n_head", 4 if n_embd >= 64 else 2)
    # an untied head: a random model with a tied one mostly repeats its last token, and every draft agrees with it
    return GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                         init="torch", tie_weights=False, **extra)).eval()


def _near(model: GPT, scale: float, seed: int) -> GPT:
    """A copy of model with noise on its weights: a draft the target mostly agrees with, and not always."""
    near = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return near


@pytest.fixture
def always(monkeypatch):
    """Speculate from the first step and never step aside, a draft reading the whole text (no glance while the
    rounds have not shown that speculation pays): the schedule out of the way."""
    monkeypatch.setattr(speculative, "PLAIN_PROBES", 0)
    monkeypatch.setattr(speculative, "TRIAL_ROUNDS", 10**9)
    monkeypatch.setattr(speculative, "EMPTY_ROUNDS", 10**9)
    monkeypatch.setattr(speculative, "GLANCE", 10**9)
    monkeypatch.setattr(speculative, "PLAIN_EVERY", 10**9)
    monkeypatch.setattr(speculative, "STAKE", 10**9)  # the ledger: its figures are microseconds here, and vary


def _figures(model, idx, n, **kw):
    """generate's tokens and the speculation's figures."""
    seen = []
    out = generate(model, idx, n, observer=lambda s: seen.append(s.speculation), **kw)
    return out, seen[-1]


# -- greedy: the target's own text -------------------------------------------------------------------------

TARGET = dict(n_layer=3, n_embd=64, seed=0, block=64)
SOURCES = {
    "small draft": dict(draft=lambda t: _gpt(1, 32, 1)),
    "medium draft": dict(draft=lambda t: _gpt(2, 64, 2)),
    "near draft": dict(draft=lambda t: _near(t, 0.3, 3)),
    "prompt lookup": dict(prompt_lookup=2),
}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_is_plain_greedy_token_for_token(fmt, source, k, always):
    target = _gpt(**TARGET)
    kw = dict(SOURCES[source])
    if "draft" in kw:
        kw["draft"] = quantize(kw["draft"](target), fmt)
    target = quantize(target, fmt)
    # 80 new tokens after 12: past block_size (64), where the window slides and rounds give way to plain steps
    idx = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    plain = generate(target, idx, 80, greedy=True)
    fast, stats = _figures(target, idx, 80, greedy=True, speculate=k, **kw)
    assert torch.equal(fast, plain)
    assert stats.rounds > 0 and stats.drafted > stats.accepted  # rounds ran, and refusals rolled the caches back
    if source == "near draft":
        assert stats.accepted > 0


def test_greedy_llama_layout_and_a_padded_vocabulary(always):
    target = _gpt(2, 64, 0, arch="llama", n_kv_head=2, mlp="swiglu")
    draft = _near(target, 0.3, 1)
    idx = torch.randint(0, V, (1, 9))
    for kw in (dict(draft=draft), dict(prompt_lookup=1)):
        assert torch.equal(generate(target, idx, 60, greedy=True, vocab_size=60, **kw),
                           generate(target, idx, 60, greedy=True, vocab_size=60))


def test_stop_tokens_and_max_new_tokens_hold_inside_a_round(always):
    target = _gpt(**TARGET)
    draft = _near(target, 0.05, 4)  # almost always agrees: rounds of several tokens
    idx = torch.randint(0, V, (1, 6))
    plain = generate(target, idx, 30, greedy=True)
    stop = int(plain[0, 6 + 11])
    for n in (1, 2, 7, 30):
        assert torch.equal(generate(target, idx, n, greedy=True, draft=draft), plain[:, : 6 + n])
    stopped = generate(target, idx, 30, greedy=True, stop_tokens=[stop], draft=draft)
    assert torch.equal(stopped, generate(target, idx, 30, greedy=True, stop_tokens=[stop]))


# -- sampling: the target's distribution --------------------------------------------------------------------


def _exact(model, prompt: list[int], steps: int, cfg: SampleConfig) -> list[torch.Tensor]:
    """The target's own marginal distribution of each of the first `steps` new tokens, summed over every path."""
    paths, weights, out = [prompt], torch.ones(1, dtype=torch.float64), []
    with torch.inference_mode():
        for _ in range(steps):
            x = torch.tensor(paths)
            probs = process_logits(model(x)[:, -1], x, cfg).softmax(-1).double()  # (paths, V)
            joint = weights[:, None] * probs
            out.append(joint.sum(0))
            paths = [p + [t] for p in paths for t in range(probs.shape[1])]
            weights = joint.reshape(-1)
    return out


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The chi-square test's p-value of counts against the expected probabilities (categories >= 5 expected)."""
    n = counts.sum()
    keep = expected * n >= 5
    e = expected[keep] * n
    x2 = float(((counts[keep] - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(x2 / 2, dtype=torch.float64)))


SMALL_V = 6
SAMPLING = dict(temperature=0.9, top_k=5, repetition_penalty=1.3)


def _sampled(target, n: int, **kw) -> torch.Tensor:
    """n samples of the first four new tokens after the prompt (n, 4), from one seeded generator."""
    g = torch.Generator().manual_seed(1234)
    idx = torch.tensor([[0, 1, 2]])
    return torch.stack([generate(target, idx, 4, generator=g, **SAMPLING, **kw)[0, 3:] for _ in range(n)])


@pytest.fixture(scope="module")
def small_models():
    target = _gpt(2, 32, 10, vocab=SMALL_V, block=16, n_head=2)
    draft = _gpt(1, 32, 11, vocab=SMALL_V, block=16, n_head=2)  # another distribution: many refusals
    return target, draft, _exact(target, [0, 1, 2], 4, SampleConfig(**SAMPLING))


@pytest.mark.parametrize("source", ["draft", "prompt lookup"])
def test_sampled_tokens_are_distributed_as_the_target_s(small_models, source, always):
    target, draft, exact = small_models
    kw = dict(draft=draft) if source == "draft" else dict(prompt_lookup=1)
    samples = _sampled(target, 1500, speculate=2, **kw)
    # the second token is the first a round decides (the first comes from the prompt's pass), the fourth a later one
    for position in (1, 3):
        counts = torch.bincount(samples[:, position], minlength=SMALL_V).double()
        assert _chi_square_p(counts, exact[position]) > 1e-3, (position, counts.tolist(), exact[position].tolist())


def test_the_chi_square_test_sees_a_rule_that_keeps_every_proposal(small_models, always, monkeypatch):
    target, draft, exact = small_models
    monkeypatch.setattr(speculative, "judge", lambda p, drafted, draws: (
        len(drafted), int(choose_with(p[-1:], draws.row(len(drafted))))))
    samples = _sampled(target, 1500, draft=draft, speculate=2)
    counts = torch.bincount(samples[:, 1], minlength=SMALL_V).double()
    assert _chi_square_p(counts, exact[1]) < 1e-3  # the draft's distribution, not the target's



# -- sampling with a seed: plain sampling's tokens ----------------------------------------------------------


def test_a_draw_with_its_random_numbers_given_is_choose_s_draw():
    cfg = SampleConfig(temperature=1.0)
    for width in (6, 67, 50257):
        logits = torch.randn(1, width, generator=torch.Generator().manual_seed(width)) * 3
        for seed in range(5):
            a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            assert [int(choose(logits, cfg, a)) for _ in range(4)] == \
                [int(choose_with(logits, noise(width, b))) for _ in range(4)]
            assert torch.equal(a.get_state(), b.get_state())  # the same numbers taken


def _random_schedule(monkeypatch, seed: int) -> None:
    """Rounds of random sizes with plain steps between them: what the rounds' timing may decide."""
    import random

    rng = random.Random(seed)
    monkeypatch.setattr(speculative.Speculator, "budget",
                        lambda self, room: rng.choice([0, *range(1, min(self.most, room) + 1)]) if room > 0 else 0)


SAMPLERS = [dict(temperature=0.9), dict(temperature=1.2, top_k=8, top_p=0.9, repetition_penalty=1.2)]


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_seeded_sampling_gives_plain_sampling_s_tokens_whenever_speculation_steps_aside(fmt, source, monkeypatch):
    target = _gpt(**TARGET)
    kw = dict(SOURCES[source]) if source != "prompt lookup" else dict(prompt_lookup=1)  # sampled text repeats less
    if "draft" in kw:
        kw["draft"] = quantize(kw["draft"](target), fmt)
    target = quantize(target, fmt)
    idx = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    for sampler in SAMPLERS:
        left = torch.Generator().manual_seed(7)
        plain = generate(target, idx, 80, generator=left, **sampler)
        for schedule in range(3):
            _random_schedule(monkeypatch, schedule)
            g = torch.Generator().manual_seed(7)
            fast, stats = _figures(target, idx, 80, generator=g, speculate=8, **sampler, **kw)
            assert torch.equal(fast, plain), (sampler, schedule)
            assert stats.rounds > 0 and stats.plain > 0 and stats.drafted > stats.accepted
            assert torch.equal(g.get_state(), left.get_state())  # and the generator left as plain sampling leaves it


# -- the schedule ------------------------------------------------------------------------------------------


def _probe(spec, seconds: float) -> None:
    """The plain steps a Speculator times before its first round, each taking `seconds`."""
    for _ in range(speculative.PLAIN_PROBES):
        spec.plain(seconds)


def _lookup(seconds: float) -> speculative.Speculator:
    """A prompt lookup's Speculator (up to 8 proposals) past the plain steps it times first, each `seconds`."""
    spec = speculative.Speculator(speculative.PromptLookup(2), most=8)
    _probe(spec, seconds)
    return spec


def test_k_follows_the_measured_acceptance_and_costs():
    spec = speculative.Speculator(speculative.PromptLookup(2), most=8)
    assert spec.budget(100) == 0  # plain steps first: what a round is weighed against
    _probe(spec, 0.010)
    assert spec.budget(100) == speculative.START_TOKENS and spec.budget(1) == 1
    for _ in range(5):  # every proposal stands, and a row costs a twentieth of a step: as many as it may
        spec.settle(spec.k, spec.k, 0.010 * (1 + 0.05 * spec.k))
    assert spec.k == 8
    for _ in range(8):  # the first proposal stands half the time, and a row costs a third of a step
        spec.settle(spec.k, spec.stats.rounds % 2, 0.010 * (1 + 0.33 * spec.k))
    assert spec.k == 1
    cheap = speculative.Speculator(speculative.PromptLookup(2), most=8)
    _probe(cheap, 0.010)
    for _ in range(8):  # the same acceptance with rows that cost little: longer rounds pay
        cheap.settle(cheap.k, cheap.stats.rounds % 2, 0.010 * (1 + 0.01 * cheap.k))
    assert cheap.k > 1


def test_k_doubles_while_every_proposal_stands():
    # a verification's time is mostly fixed here (15 ms whatever its rows, a step 10): charged to one proposal it
    # reads as half a step a row, where k = 1 looks best; every proposal standing doubles k all the same
    spec = _lookup(0.010)
    ks = []
    for _ in range(4):
        ks.append(spec.k)
        spec.settle(spec.k, spec.k, 0.015)
    assert ks == [1, 2, 4, 8] and spec.k == 8


def test_k_does_not_grow_where_rounds_whose_proposals_all_stood_did_not_pay():
    # int8 weights: a verified row costs 0.6 of a step, so a round of one proposal that stood (2 tokens) takes 2.5
    # steps; a longer round costs more, not less, and k stays at the costs' choice until the trial sets it aside
    spec = _lookup(0.010)
    for _ in range(speculative.TRIAL_ROUNDS):
        assert spec.k == 1 and spec.pause == 0
        spec.settle(1, 1, 0.025)
    assert spec.pause == speculative.FIRST_PAUSE


def test_a_retry_whose_rounds_pay_by_the_clock_goes_on():
    # benchmarks/speculative.py's float32 target with its int4 copy as draft (a draft step 0.4 of a target step): a
    # hard spot after the prompt, then a retry whose rounds give 2 tokens in 2.8 ms and 3 in 3.5 ms against 1.6 ms
    # steps. The costs measured at one proposal expected no k to pay and set it aside for 32 tokens
    spec = _lookup(0.00162)
    spec.settle(1, 0, 0.00288, drafting=0.00060)
    spec.settle(1, 0, 0.00269, drafting=0.00055)
    assert spec.pause == speculative.FIRST_PAUSE
    for _ in range(speculative.FIRST_PAUSE):
        spec.plain(0.00160)
    spec.settle(1, 1, 0.00281, drafting=0.00063)
    spec.settle(2, 2, 0.00348, drafting=0.00117)
    assert spec.pause == 0 and spec.budget(100) == 4


def test_speculation_steps_aside_where_it_loses_and_tries_again_later():
    spec = _lookup(0.010)
    for _ in range(4):
        spec.settle(4, 4, 0.011)  # five tokens for about a step's time: it pays, it goes on
    for _ in range(2):
        spec.settle(4, 0, 0.014)  # one token for more than a step's time
        assert spec.budget(100) > 0  # the last four rounds' median still pays
    spec.settle(4, 0, 0.014)  # three of the last four lose: set aside
    assert spec.budget(100) == 0 and spec.pause == speculative.FIRST_PAUSE
    for _ in range(speculative.FIRST_PAUSE):
        assert spec.budget(100) == 0
        spec.plain(0.010)
    assert spec.budget(100) > 0  # tried again, for fewer rounds
    spec.settle(1, 0, 0.014)  # nothing stood in the three rounds before the pause, nor now: one round decides
    assert spec.pause == 4 * speculative.FIRST_PAUSE  # lost again: four times as long
    assert spec.stats.plain == speculative.PLAIN_PROBES + speculative.FIRST_PAUSE and spec.stats.rounds == 8
    for _ in range(4 * speculative.FIRST_PAUSE):
        spec.plain(0.010)
    spec.settle(2, 1, 0.030)  # a proposal stood: the retry takes its rounds, slower than plain steps
    assert spec.pause == 0 and spec.budget(100) > 0
    spec.settle(2, 0, 0.030)
    assert spec.pause == 16 * speculative.FIRST_PAUSE


def test_rounds_are_weighed_against_plain_steps_timed_as_they_go():
    # the first plain steps after the prompt's pass are slow (10 ms here, where a step costs 4): rounds of nine
    # tokens in 50 ms look like paying against them, and lose against the steps timed among the rounds
    spec = _lookup(0.010)
    for _ in range(speculative.PLAIN_EVERY):
        assert spec.budget(100) > 0
        spec.settle(8, 8, 0.050)
    assert spec.pause == 0 and spec.budget(100) == 0  # plain steps are due: timed among the rounds
    spec.plain(0.007)  # the first after a round is slow too
    assert spec.budget(100) == 0  # a timing is of PLAIN_RUN steps in a row
    spec.plain(0.004)
    assert spec.budget(100) > 0
    for _ in range(speculative.TRIAL_ROUNDS):  # the latest rounds' median turns: 9 tokens in 50 ms lose to 4 ms steps
        if spec.budget(100):
            spec.settle(8, 8, 0.050)
    assert spec.pause == speculative.FIRST_PAUSE


def test_a_round_slowed_by_another_program_does_not_set_speculation_aside():
    spec = speculative.Speculator(speculative.PromptLookup(2), most=8)
    for seconds in (0.010, 0.011, 0.150, 0.010, 0.012, 0.010):  # a step the machine held up
        spec.plain(seconds)
    for seconds in (0.012, 0.300, 0.012, 0.012):  # and a round
        spec.settle(4, 4, seconds)
    assert spec.pause == 0 and spec.budget(100) > 0


def _contrary(model: GPT) -> GPT:
    """A draft of the model's own weights whose every proposal is the token after the model's choice (its head's
    rows turned by one): nothing it proposes ever stands."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.lm_head.parameters():
            p.copy_(p.roll(1, dims=0))
    return draft


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_a_draft_that_is_never_right_costs_at_most_four_short_rounds_in_160_tokens(fmt, monkeypatch):
    # what the schedule spends finding out: two rounds of one proposal, 8 plain tokens, a retry of one round, 32
    # plain tokens, another, and 128 plain tokens before the next (where four rounds, some of two proposals, and a
    # retry of two were spent), or fewer where the ledger has lost what the reply may (this draft is the target's
    # size: its glance costs what the target's steps do); the draft reads the last GLANCE tokens of the 80-token
    # prompt and of the 32-token pause, not all of them
    target = quantize(_gpt(1, 32, 0, block=256), fmt)
    draft = quantize(_contrary(_gpt(1, 32, 0, block=256)), fmt)
    rows, read = [], []
    real, catch_up = speculative.verify, speculative.DraftModel._catch_up
    monkeypatch.setattr(speculative, "verify", lambda model, r, *a: rows.append(r.shape[1]) or real(model, r, *a))
    monkeypatch.setattr(speculative.DraftModel, "_catch_up",
                        lambda self, tokens: read.append(len(tokens) - self.filled) or catch_up(self, tokens))
    idx = torch.randint(0, V, (1, 80), generator=torch.Generator().manual_seed(0))
    out, stats = _figures(target, idx, 160, greedy=True, draft=draft)
    assert torch.equal(out, generate(target, idx, 160, greedy=True))
    assert stats.accepted == 0 and 1 <= stats.rounds <= 4 and stats.drafted == stats.rounds
    assert rows == [2] * stats.rounds
    assert stats.plain == 160 - stats.rounds - 1  # the prompt's pass gives the first token
    # a glance at the prompt and the trial's two rounds (15 + 1, 1), the 8-token pause's tokens and the retry (8 + 1),
    # a glance after the 32-token pause and the retry (15 + 1)
    assert sum(read) <= 3 * speculative.GLANCE + 1, read


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    lookup = speculative.PromptLookup(2)
    propose = lambda ids, k: lookup.propose(torch.tensor(ids), k, None, None).tolist()  # noqa: E731
    assert propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose([1, 2, 3, 4, 1, 2, 9, 9, 1, 2], 2) == [9, 9]  # the latest occurrence wins
    assert propose([1, 2, 3, 4, 1, 2, 9, 9, 1, 2, 5], 4) == []  # (2, 5) never came before
    again = speculative.PromptLookup(1)
    assert again.propose(torch.tensor([7, 7, 7]), 4, None, None).tolist() == [7, 7, 7, 7]  # a run repeats


# -- bad input ---------------------------------------------------------------------------------------------


def test_bad_arguments_are_config_errors_in_one_line(caplog):
    target = _gpt(**TARGET)
    idx = torch.randint(0, V, (1, 4))
    cases = [
        (dict(prompt_lookup=0), "prompt_lookup: the n-gram"),
        (dict(prompt_lookup=2, speculate=0), "speculate: a round proposes 1 to 16"),
        (dict(prompt_lookup=2, speculate=17), "speculate: a round proposes 1 to 16"),
        (dict(speculate=4), "neither is given"),
        (dict(prompt_lookup=2, draft=_gpt(1, 32, 1)), "one source of proposals"),
        (dict(draft=_gpt(1, 32, 1, vocab=V + 3)), "not the target's"),
        (dict(draft="runs/draft"), "expected a tinygpt model"),
        (dict(prompt_lookup=2, use_cache=False), "use_cache=False"),
    ]
    for kw, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            generate(target, idx, 4, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="8 for this int8 model|1 to 8"):
        generate(quantize(_gpt(**TARGET), "int8"), idx, 4, prompt_lookup=2, speculate=9)
    with pytest.raises(ConfigError, match="one sequence at a time"):
        generate(target, idx.repeat(2, 1), 4, prompt_lookup=2)
    large = _gpt(4, 64, 5)
    with caplog.at_level("WARNING"):
        generate(target, idx, 2, draft=large)  # larger than the target: said once, with the figures
        generate(target, idx, 2, draft=large)
        generate(target, idx, 2, draft=quantize(copy.deepcopy(target), "int4"))  # the target in 4 bits: smaller
    warnings = [r.getMessage() for r in caplog.records if "the draft reads" in r.getMessage()]
    assert len(warnings) == 1 and "MB of weights a step (" in warnings[0] and "parameters), the target" in warnings[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import tinygpt

    root = tmp_path_factory.mktemp("speculative_runs")
    tinygpt.save(_gpt(2, 32, 0, vocab=len(CHARS), block=64), root / "target", tiny_tokenizer())
    tinygpt.save(_gpt(1, 32, 1, vocab=len(CHARS), block=64), root / "draft", tiny_tokenizer())
    tinygpt.save(_gpt(1, 32, 1, vocab=len(CHARS), block=64), root / "reversed", CharTokenizer(CHARS[::-1]))
    tinygpt.save(_gpt(4, 64, 2, vocab=len(CHARS), block=64), root / "large", tiny_tokenizer())
    return root


def test_cli_speculates_and_refuses_bad_input_in_one_line(cli, runs):
    target = runs / "target"
    base = ["sample", target, "--prompt", "abcabcabc", "--greedy", "--max-new-tokens", "40"]
    plain = cli(*base)
    for extra in (["--draft", runs / "draft", "--speculate", "4"], ["--prompt-lookup", "3"]):
        r = cli(*base, *extra)
        assert r.returncode == 0 and r.stdout == plain.stdout
        assert r.stderr.startswith("speculation: ") and r.stderr.count("\n") == 1
    traced = cli(*base, "--prompt-lookup", "1", "--trace")
    assert "speculation: " in traced.stdout
    bad = [
        (["--draft", runs / "reversed"], "its tokenizer is not the model's"),
        (["--speculate", "0", "--prompt-lookup", "2"], "--speculate: expected an integer from 1"),
        (["--speculate", "17", "--prompt-lookup", "2"], "a round proposes 1 to 16"),
        (["--quantize", "int8", "--speculate", "9", "--draft", runs / "draft"], "a round proposes 1 to 8"),
        (["--prompt-lookup", "0"], "--prompt-lookup: expected an integer from 1"),
        (["--speculate", "4"], "give --draft RUN or --prompt-lookup N"),
    ]
    for extra, words in bad:
        r = cli(*base, *extra)
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, (extra, r.stderr)
    r = cli(*base, "--draft", runs / "large")
    assert r.returncode == 0 and "tinygpt: warning: --draft " in r.stderr, r.stderr
    assert "MB of weights a step" in r.stderr and "parameters), the target" in r.stderr


def test_chat_speculates_and_says_so_on_stats(tmp_path, capsys, monkeypatch):
    import io

    import tinygpt
    from tinygpt.cli import main
    from tinygpt.tokenizer import with_chat_template

    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(_gpt(2, 32, 0, vocab=tok.vocab_size, block=64), tmp_path / "run", tok)
    monkeypatch.setattr("sys.stdin", io.StringIO("/stats\nabcabcabc\n/stats\nagain\n/stats\n"))
    assert main(["chat", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "12",
                 "--prompt-lookup", "1"]) == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("(no reply") or "last" in line]
    assert stats[0] == "(no reply yet)" and len(stats) == 3
    assert stats[1].startswith("(last reply: ") and "this conversation: " in stats[1]
    monkeypatch.setattr("sys.stdin", io.StringIO("/stats\n"))
    assert main(["chat", str(tmp_path / "run")]) == 0
    assert "speculative decoding is off" in capsys.readouterr().err


# -- the server --------------------------------------------------------------------------------------------


def _complete(base: str, prompt: str, n: int) -> dict:
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": n,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("speculation", [dict(prompt_lookup=2, speculate=4), "draft"])
def test_server_gives_the_same_greedy_completions_with_speculation_beside_other_requests(speculation, always):
    model, tok = _gpt(2, 32, 0, vocab=len(CHARS), block=64), tiny_tokenizer()
    if speculation == "draft":
        speculation = dict(draft=_near(model, 0.2, 1), speculate=8)
    prompts = ["abcabcabcabc", "hello hello", "the cat the cat the", "xyz"]
    with running(create_app(model, tok, model_name=NAME)) as base:
        want = [_complete(base, p, 90)["choices"][0]["text"] for p in prompts]  # 90: past the context of 64
    with running(create_app(model, tok, model_name=NAME, speculation=speculation)) as base:
        alone = _complete(base, prompts[0], 90)
        assert alone["choices"][0]["text"] == want[0]
        assert alone["usage"]["speculation"]["rounds"] > 0
        details = alone["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == \
            alone["usage"]["speculation"]["drafted_tokens"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _complete(base, p, 90)["choices"][0]["text"], prompts))
    assert got == want


def test_the_server_s_seeded_sampled_completions_are_its_own_with_speculation(always):
    model, tok = _gpt(2, 32, 0, vocab=len(CHARS), block=64), tiny_tokenizer()
    prompts = ["abcabcabcabc", "hello hello", "the cat the cat the"]

    def complete(base: str, prompt: str, seed: int) -> dict:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 60, "temperature": 0.8, "top_p": 0.95, "seed": seed}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with running(create_app(model, tok, model_name=NAME)) as base:
        want = [complete(base, p, seed)["choices"][0]["text"] for seed, p in enumerate(prompts)]
    with running(create_app(model, tok, model_name=NAME, speculation=dict(draft=_near(model, 0.1, 1)))) as base:
        alone = complete(base, prompts[0], 0)
        assert alone["choices"][0]["text"] == want[0] and alone["usage"]["speculation"]["accepted_tokens"] > 0
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda a: complete(base, a[1], a[0])["choices"][0]["text"], enumerate(prompts)))
    assert got == want


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_a_small_draft_reads_the_whole_text_once_the_reply_can_afford_it(fmt):
    # reading the text again costs a draft of the target's parameters (the target in fewer bits) what the target's
    # prompt pass cost; a draft of an eighth of them or fewer, an eighth of it, which the reply must afford (what
    # speculation saved and may still lose: Speculator.headroom): the read's cost is estimated by the glance's time
    target = _gpt(4, 64, 0, block=256)
    tokens = torch.randint(0, V, (120,), generator=torch.Generator().manual_seed(0))
    for draft, rereads in ((_gpt(1, 32, 1, block=256), True), (quantize(copy.deepcopy(target), fmt), False)):
        drafter = speculative.DraftModel(draft, target, V, 256)
        read = []
        catch_up = drafter._catch_up
        drafter._catch_up = lambda t: read.append(len(t) - drafter.filled) or catch_up(t)
        drafter.prepare(tokens[:80], 0.0)  # a trial: the last GLANCE tokens
        assert read == [speculative.GLANCE - 1] and drafter.rate > 0
        drafter.propose(tokens[:80], 2, lambda logits, drafted: logits, None)
        drafter.rollback(82)
        drafter.prepare(tokens[:82], drafter.rate * 81)  # it pays, but cannot afford reading 82 tokens
        assert read[2:] == []
        drafter.prepare(tokens[:82], drafter.rate * 83)  # it has
        assert read[2:] == ([81] if rereads else []), read
        assert drafter.rereads is rereads
    # a text longer than the draft's context: it glances at its end whatever it saved
    drafter = speculative.DraftModel(_gpt(1, 32, 1, block=64), target, V, 256)
    read = []
    catch_up = drafter._catch_up
    drafter._catch_up = lambda t: read.append((drafter.start, len(t) - drafter.filled)) or catch_up(t)
    drafter.prepare(tokens[:100], 1.0)
    assert read == [(100 - speculative.GLANCE, speculative.GLANCE - 1)]


def test_rounds_whose_median_pays_are_set_aside_once_the_reply_has_lost_more_than_it_may():
    # three rounds in four give 2 tokens in 1.85 steps' time, the fourth 1 token in 3 (a round of one proposal whose
    # draft step and verified row cost a step each): the latest rounds' median pays, the reply loses 1.55 steps every
    # four rounds; after the STAKE and the LOSS_SHARE of the reply's time, speculation is set aside
    spec = _lookup(0.010)
    for i in range(200):
        if spec.pause:
            break
        spec.settle(1, int(i % 4 != 3), 0.0185 if i % 4 != 3 else 0.030)
        assert spec.pause or statistics.median(spec.trial[-speculative.TRIAL_ROUNDS:]) >= 1.0
    assert spec.pause == speculative.FIRST_PAUSE, spec.saved
    allowed = (speculative.STAKE + speculative.LOSS_SHARE * spec.stats.tokens) * 0.010
    assert -allowed - 0.020 < spec.saved < -allowed  # at once
    for _ in range(speculative.FIRST_PAUSE):
        spec.plain(0.010)
    assert spec.pause == 0 and spec.headroom < 0 and spec.budget(100) == 0  # the reply cannot afford a retry yet


def test_a_retry_after_a_trial_that_kept_nothing_waits_until_the_reply_may_lose_as_much_again():
    # plain steps of 10 ms; the first trial's two rounds keep nothing and take 30 ms each: 40 ms lost, within the
    # STAKE. After the pause the reply has lost no more than it may, but a retry like that trial would lose more
    spec = _lookup(0.010)
    for _ in range(speculative.EMPTY_ROUNDS):
        assert spec.budget(100) > 0
        spec.settle(1, 0, 0.030)
    assert spec.pause == speculative.FIRST_PAUSE and spec.ante == pytest.approx(0.040)
    for _ in range(speculative.FIRST_PAUSE):
        spec.plain(0.010)
    assert spec.pause == 0 and 0 <= spec.headroom < spec.ante and spec.budget(100) == 0
    while spec.headroom < spec.ante:
        spec.plain(0.010)
    assert spec.budget(100) > 0  # the reply has grown enough: a retry, whose trial goes on once it began
    spec.settle(1, 1, 0.025)
    assert spec.headroom < spec.ante and spec.budget(100) > 0
    # a trial whose proposals stood but paid too little says less: its retry comes within the allowance
    spec = _lookup(0.010)
    for _ in range(speculative.TRIAL_ROUNDS):
        spec.settle(2, 1, 0.0275)  # 2 tokens for 2.75 steps' time: 30 ms lost in four rounds
    assert spec.pause == speculative.FIRST_PAUSE and spec.ante == 0 and spec.saved < 0
    for _ in range(speculative.FIRST_PAUSE):
        spec.plain(0.010)
    assert 0 <= spec.headroom < 0.030 and spec.budget(100) > 0


def test_the_draft_s_reading_counts_against_speculation(monkeypatch):
    model = _gpt(1, 32, 1)
    spec = speculative.Speculator(speculative.DraftModel(_gpt(1, 32, 2), model, V, 48), most=2)
    _probe(spec, 0.001)
    prepare = speculative.DraftModel.prepare
    monkeypatch.setattr(speculative.DraftModel, "prepare",
                        lambda self, tokens, spend=0.0: time.sleep(0.05) or prepare(self, tokens, spend))
    tokens = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model, 1, 48)
    with torch.no_grad():
        model(tokens[None, :-1], cache, torch.arange(19))
    speculative.speculate(model, spec, tokens, cache, 19, 1, lambda logits, drafted: logits, True, None)
    assert spec.stats.rounds == 1 and spec.saved < -0.05 + 0.003  # the read, less at most 3 steps a round saves


def test_plain_steps_timed_slow_do_not_hide_a_draft_that_is_never_right():
    # the first plain steps run on one thread while ThreadChoice looks, the rounds on two: 20 ms against the
    # 11 ms a two-row verification takes; nothing stands, so no round can pay, and it is set aside
    model = _gpt(1, 32, 1)
    spec = speculative.Speculator(speculative.DraftModel(model, model, V, 48), most=8)
    _probe(spec, 0.020)
    for _ in range(speculative.EMPTY_ROUNDS):
        spec.settle(spec.k, 0, 0.012, drafting=0.001)
    assert spec.pause == speculative.FIRST_PAUSE


# -- the prompt cache --------------------------------------------------------------------------------------


def _entries(cache) -> dict:
    """A prompt cache's entries: tokens -> (keys, values)."""
    return {key: (keys, values) for key, (_, keys, values) in cache._entries.items()}


def _same_entries(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key][i], b[key][i]) for key in a for i in (0, 1))


def test_a_sequence_that_ends_inside_a_round_leaves_the_prompt_cache_what_plain_decoding_leaves(always):
    from tinygpt.prompt_cache import PromptCache

    target = _gpt(**TARGET)
    idx = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    plain = generate(target, idx, 20, greedy=True)
    stop = int(plain[0, 7 + 4])  # inside the second round: its own copy as draft, every proposal stands
    caches = {name: PromptCache(10**8) for name in ("plain", "speculative")}
    ended = generate(target, idx, 20, greedy=True, stop_tokens=[stop], prompt_cache=caches["plain"])
    fast, stats = _figures(target, idx, 20, greedy=True, stop_tokens=[stop], prompt_cache=caches["speculative"],
                           draft=copy.deepcopy(target), speculate=8)
    assert torch.equal(fast, ended)
    assert stats.accepted + stats.rounds + 1 > ended.shape[1] - 7  # the rounds gave more: it ended inside one
    assert _same_entries(*(_entries(c) for c in caches.values()))  # the tokens but the last, bit for bit


def test_the_server_keeps_a_sequence_that_ends_inside_a_round_in_the_prompt_cache(always):
    model, tok = _gpt(2, 32, 0, vocab=len(CHARS), block=64), tiny_tokenizer()
    prompt = "the cat the cat the"
    with running(create_app(model, tok, model_name=NAME)) as base:
        text = _complete(base, prompt, 20)["choices"][0]["text"]
    end = next(i for i in range(4, 10) if text[i] not in text[:i])  # a stop string inside the second round
    body = {"model": NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": [text[end]]}
    kept, second = [], []
    for speculation in (None, dict(draft=copy.deepcopy(model), speculate=8)):
        app = create_app(model, tok, model_name=NAME, speculation=speculation)
        with running(app) as base:
            first = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
            assert first["choices"][0]["text"] == text[:end]
            assert app.state.scheduler.wait_idle(10)  # the entry is kept once the answer is out
            kept.append(_entries(app.state.scheduler.prompt_cache))
            # the next turn reads the first from the cache, speculating or not
            again = _complete(base, prompt + text[:end + 1] + " and", 10)
            second.append((again["choices"][0]["text"], again["usage"]["prompt_tokens_details"]["cached_tokens"]))
    stats = first["usage"]["speculation"]
    assert stats["accepted_tokens"] + stats["rounds"] + 1 > end + 1  # the rounds gave more: it ended inside one
    assert len(kept[0]) == 1 and _same_entries(*kept)
    assert second[0] == second[1] and second[0][1] == len(prompt) + end


# -- a grammar's mask --------------------------------------------------------------------------------------

CONSTRAINTS = {
    "json_schema": dict(json_schema={"type": "object", "additionalProperties": False, "required": ["name", "tags"],
                                     "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                             "maxItems": 4}}}),
    "regex": dict(regex=r"([a-c]{2}-[0-9]{2} ){2,6}"),
    "choices": dict(choices=["the cat sat", "the cat ran", "a dog"]),
}
# a prompt that writes what the grammars allow: prompt lookup's proposals stand where the grammar forces a
# character, and fall (refused by the mask, the grammar's state given back) where it does not
GROUNDED = '{"name": "ab", "tags": ["ab", "cd"]} ab-12 cd-34 the cat sat: '


@pytest.mark.parametrize("source", ["near draft", "prompt lookup"])
@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_constrained_reply_speculates_and_is_the_plain_constrained_reply(constraint, source, always, monkeypatch):
    # a first round of two proposals: the short choices' reply then has one the grammar refuses
    monkeypatch.setattr(speculative, "START_TOKENS", 2)
    tok = tiny_tokenizer()
    target = _gpt(2, 64, 0, vocab=len(CHARS), block=256)
    kw = dict(draft=_near(target, 0.3, 1)) if source == "near draft" else dict(prompt_lookup=2)
    idx = torch.tensor([tok.encode(GROUNDED)])
    total = speculative.SpeculationStats()
    for sampler in (dict(greedy=True), dict(temperature=0.9, top_k=20)):
        plain = generate(target, idx, 80, tokenizer=tok, generator=torch.Generator().manual_seed(5), **sampler,
                         **CONSTRAINTS[constraint])
        fast, stats = _figures(target, idx, 80, tokenizer=tok, generator=torch.Generator().manual_seed(5), **sampler,
                               **CONSTRAINTS[constraint], **kw)
        assert torch.equal(fast, plain), (sampler, tok.decode(fast[0, idx.shape[1]:].tolist()),
                                          tok.decode(plain[0, idx.shape[1]:].tolist()))
        assert stats.rounds > 0 and stats.accepted > 0
        total.add(stats)
    assert total.drafted > total.accepted  # and some fell


def test_the_server_speculates_for_a_constrained_request_and_answers_as_without(always):
    model, tok = _gpt(2, 64, 0, vocab=len(CHARS), block=256), tiny_tokenizer()
    body = {"model": NAME, "prompt": GROUNDED, "max_tokens": 80, "temperature": 0,
            "guided_json": CONSTRAINTS["json_schema"]["json_schema"]}
    answers = []
    for speculation in (None, dict(prompt_lookup=2)):
        with running(create_app(model, tok, model_name=NAME, speculation=speculation)) as base:
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json())
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
    assert answers[1]["choices"][0]["finish_reason"] == answers[0]["choices"][0]["finish_reason"] == "stop"
    assert answers[1]["usage"]["speculation"]["accepted_tokens"] > 0
