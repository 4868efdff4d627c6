"""The lesson's worked examples reproduce exactly through tinygpt's API (the reference is the oracle)."""

import math

import pytest
import torch
import torch.nn.functional as F
from lesson_reference import RefTinyGPT, ref_greedy, tinygpt_name

from tinygpt import GPT, GPTConfig, generate
from tinygpt.lab import lesson
from tinygpt.model import attention


def build_pair(seed, vocab=50, d=64, heads=4, layers=2, context=8):
    torch.manual_seed(seed)
    ref = RefTinyGPT(vocab, d, heads, layers, context)
    torch.manual_seed(seed)
    ours = GPT(GPTConfig.from_preset("lesson", vocab_size=vocab, n_embd=d, n_head=heads, n_layer=layers, block_size=context))
    return ref, ours


def test_parameter_count_is_107008():
    assert lesson.lesson_model().num_params() == 107_008
    ref, _ = build_pair(42)
    assert sum(p.numel() for p in ref.parameters()) == 107_008


SIZES = [
    dict(seed=42),
    dict(seed=0, vocab=17, d=32, heads=2, layers=1, context=5),
    dict(seed=123, vocab=97, d=48, heads=6, layers=3, context=12),
]


@pytest.mark.parametrize("size", SIZES)
def test_same_seed_same_parameters_and_logits(size):
    ref, ours = build_pair(**size)
    theirs = {tinygpt_name(k): v for k, v in ref.state_dict().items()}
    mine = ours.state_dict()
    assert set(theirs) == set(mine)
    for name, value in theirs.items():
        assert torch.equal(value, mine[name]), name
    idx = torch.randint(0, ours.config.vocab_size, (3, ours.config.block_size))
    torch.testing.assert_close(ours(idx), ref(idx), atol=1e-5, rtol=0)


def test_attention_trace_matches_the_lesson():
    torch.manual_seed(7)
    Q, K, V = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    scores = Q @ K.T / math.sqrt(4)
    scores = scores.masked_fill(torch.tril(torch.ones(4, 4)) == 0, float("-inf"))
    attn = F.softmax(scores, dim=-1)
    trace = lesson.attention_trace(seed=7, d_k=4, T=4)
    assert torch.equal(trace.weights, attn)
    assert torch.equal(trace.out, attn @ V)
    assert trace.weights[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(trace.out[0], V[0])
    # the fused path computes the same output
    fast, none = attention(Q, K, V)
    assert none is None
    torch.testing.assert_close(fast, trace.out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("size", SIZES)
def test_greedy_generation_matches_the_lesson(size):
    ref, ours = build_pair(**size)
    start = torch.tensor([[5, 12, 3]]) % ours.config.vocab_size
    n = 2 * ours.config.block_size  # run past the context so the sliding window is exercised
    expected = ref_greedy(ref, start, n)
    assert torch.equal(generate(ours, start, n, greedy=True), expected)
    assert torch.equal(generate(ours, start, n, greedy=True, use_cache=False), expected)


def test_lesson_greedy_steps():
    ref, _ = build_pair(42)
    expected = ref_greedy(ref, torch.tensor([[5, 12, 3]]), 5)[0].tolist()
    steps = lesson.greedy_steps()
    assert [s.token for s in steps] == expected[3:]
    assert steps[-1].context == expected[:7]


@pytest.mark.parametrize("size", SIZES)
def test_clm_losses_match_the_lesson(size):
    ref, ours = build_pair(**size)
    vocab, context = ours.config.vocab_size, ours.config.block_size

    def run(model):
        torch.manual_seed(99)
        data = torch.randint(0, vocab, (8, context))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = F.cross_entropy(model(data[:, :-1]).reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    theirs, mine = run(ref), run(ours)
    for step in (1, 5, 10, 20):
        assert mine[step - 1] == pytest.approx(theirs[step - 1], abs=1e-5), step


def test_lesson_clm_training_matches_reference_loop():
    torch.manual_seed(42)
    ref = RefTinyGPT(50, 64, 4, 2, 8)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    data = torch.randint(0, 50, (8, 8))  # drawn after the model, as in the lesson
    expected = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(ref(data[:, :-1]).reshape(-1, 50), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        expected.append(loss.item())
    losses = lesson.clm_training()
    assert losses[0] == pytest.approx(expected[0], abs=1e-5)
    for step in (1, 5, 10, 20):
        assert losses[step - 1] == pytest.approx(expected[step - 1], abs=1e-5)
    assert abs(losses[0] - math.log(50)) < 0.5 and losses[-1] < losses[0]


def test_zen_of_python_is_read_not_imported(capsys):
    text = lesson.zen_of_python()
    assert text.startswith("The Zen of Python, by Tim Peters") and "Beautiful is better than ugly." in text
    assert capsys.readouterr().out == ""  # importing `this` would have printed it


@pytest.fixture(scope="module")
def pitfall():
    return lesson.causal_mask_pitfall(steps=150)


def test_without_the_causal_mask_the_loss_collapses_and_generation_fails(pitfall):
    masked, unmasked = pitfall.train_loss["masked"], pitfall.train_loss["unmasked"]
    assert unmasked < 0.5 * masked  # it copies its targets from the future
    # where nothing is ahead to copy, as in generation, it is far worse than the masked model
    assert pitfall.last_loss["unmasked"] > 1.5 * pitfall.last_loss["masked"]
    assert pitfall.last_loss["unmasked"] > 3 * unmasked
    assert len(pitfall.samples["masked"]) == len(pitfall.samples["unmasked"]) == 60
    assert pitfall.runs["unmasked"].model.causal is False and pitfall.runs["masked"].model.causal is True
    # same start, same batches: the first step's loss is the same; the mask is the only difference
    assert pitfall.runs["masked"].losses[0] == pytest.approx(pitfall.runs["unmasked"].losses[0], abs=0.05)


def test_decoding_settings_trade_repetition_for_noise(pitfall):
    samples = {s.label: s for s in lesson.decoding_pitfall(pitfall.runs["masked"])}
    assert list(samples) == ["greedy", "temperature 0.8", "top-p 0.9", "temperature 2.0"]
    assert all(len(s.text) == 200 for s in samples.values())
    assert samples["greedy"].distinct4 == min(s.distinct4 for s in samples.values())  # greedy repeats itself
    assert samples["temperature 2.0"].loss == max(s.loss for s in samples.values())  # too hot: implausible
    assert samples["temperature 2.0"].loss > 2 * samples["greedy"].loss


def test_distinct_ngrams():
    assert lesson.distinct_ngrams("abcdabcd", 4) == 4 / 5
    assert lesson.distinct_ngrams("abc", 4) == 1.0


def test_the_tour_is_the_lessons_text():
    # the first sections only (the later ones train small models): the mask and token 0's attention
    items = lesson.tour()
    text = "\n".join(next(items) for _ in range(7))
    assert "== 1. The causal mask (T=5)" in text and str(lesson.causal_mask(5)) in text
    assert "attn[0]:   [1.0000, 0.0000, 0.0000, 0.0000]" in text and "out[0]:    [" in text
