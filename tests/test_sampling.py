import torch

from tinygpt import SampleConfig
from tinygpt.sampling import apply_repetition_penalty, process_logits, sample, top_k_filter, top_p_filter


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 1]]), 2.0)
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5]]


def test_top_k_keeps_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = top_k_filter(logits, 2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_top_p_keeps_smallest_nucleus_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(top_p_filter(logits, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(top_p_filter(logits, 1e-6)).tolist() == [[True, False, False, False]]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(top_p_filter(shuffled, 0.8)).tolist() == [[False, True, False, True]]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0]])
    assert torch.allclose(process_logits(logits, None, SampleConfig(temperature=0.5)), logits * 2)


def test_greedy_and_zero_temperature_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 1.0]])
    assert sample(logits, None, SampleConfig(greedy=True)).tolist() == [1, 0]
    assert sample(logits, None, SampleConfig(temperature=0)).tolist() == [1, 0]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    g = torch.Generator().manual_seed(3)
    a = sample(logits, None, SampleConfig(), g)
    b = sample(logits, None, SampleConfig(), torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / a.numel()
    assert torch.allclose(freq, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0), atol=0.02)


def test_top_k_one_is_greedy():
    logits = torch.randn(16, 50)
    got = sample(logits, None, SampleConfig(top_k=1), torch.Generator().manual_seed(0))
    assert torch.equal(got, logits.argmax(-1))


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    logits = torch.randn(4, 50) * 30
    for t in (1e-284, 1e-9):
        assert torch.equal(sample(logits, None, SampleConfig(temperature=t)), logits.argmax(-1))


def test_extreme_repetition_penalties_still_sample():
    logits = torch.tensor([[-2.0, -1.0, 0.0, 3.0]])
    seen = torch.tensor([[0, 1, 2, 3]])  # every token seen: nothing escapes the penalty
    for alpha in (1e-40, 1e-7, 1e7, 1e39, 1e300):
        token = sample(logits, seen, SampleConfig(repetition_penalty=alpha), torch.Generator().manual_seed(0))
        assert 0 <= int(token) < 4


def test_top_p_keeps_the_most_likely_token_however_small_p():
    # 1e-300 and 5e-324 pass validation but round to 0 in float32: the filter once dropped every token
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [1.0, 1.0, 0.0, -2.0]])
    for p in (1e-300, 5e-324, 1e-45, 1e-12):
        kept = torch.isfinite(top_p_filter(logits, p))
        assert kept.sum(-1).tolist() == [1, 1], p
        assert kept[0].tolist() == [False, True, False, False]
        token = sample(logits, None, SampleConfig(top_p=p), torch.Generator().manual_seed(0))
        assert token[0] == 1 and token[1] in (0, 1)


def test_ids_past_the_tokenizers_vocabulary_are_never_chosen():
    from tinygpt.sampling import mask_vocab

    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # ids 2 and 3 are padding the tokenizer lacks
    assert torch.isinf(mask_vocab(logits, 2)).tolist() == [[False, False, True, True]]
    assert torch.equal(mask_vocab(logits, 4), logits) and torch.equal(mask_vocab(logits, None), logits)
    assert sample(logits, None, SampleConfig(greedy=True), vocab_size=2).tolist() == [1]
    draws = sample(logits.expand(2000, 4), None, SampleConfig(temperature=2.0), torch.Generator().manual_seed(0),
                   vocab_size=2)
    assert set(draws.tolist()) == {0, 1}
