"""calc.shape_for_params: a shape for a parameter count, checked against count_params and a built model."""

import pytest

from tinygpt import GPT
from tinygpt.calc import count_params, heads_for, shape_for_params, smallest_shape
from tinygpt.config import GPTConfig
from tinygpt.errors import ConfigError


@pytest.mark.parametrize("vocab, block", [(65, 256), (443, 128), (4096, 512), (50257, 1024)])
@pytest.mark.parametrize("target", [1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 1e9])
def test_shape_count_is_near_the_target(vocab, block, target):
    smallest = count_params(smallest_shape(vocab_size=vocab, block_size=block)).total
    if target < 2 * smallest:
        pytest.skip("the embeddings alone are about this size")
    cfg = shape_for_params(target, vocab_size=vocab, block_size=block)
    assert cfg.vocab_size == vocab and cfg.block_size == block
    assert cfg.n_embd % cfg.n_head == 0
    # a width step of 16 moves the embeddings alone by 16 x (vocab + block): coarse where they dominate
    assert count_params(cfg).total == pytest.approx(target, rel=0.1 + 16 * (vocab + block) / target)
    if target >= 1e6 and count_params(cfg).non_embedding > 0.5 * target:  # blocks big enough to keep the ratio
        assert 16 <= cfg.n_embd / cfg.n_layer <= 64


def test_gpt2_small_comes_back_from_its_count():
    cfg = shape_for_params(124_439_808, vocab_size=50257, block_size=1024, aspect_ratio=64)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (12, 12, 768)


def test_shape_matches_a_built_model_and_keeps_base_settings():
    base = GPTConfig(bias=False, tie_weights=False, dropout=0.1)
    cfg = shape_for_params(2e5, vocab_size=100, block_size=64, base=base)
    assert (cfg.bias, cfg.tie_weights, cfg.dropout) == (False, False, 0.1)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
    assert count_params(cfg).total == pytest.approx(2e5, rel=0.15)


def test_heads_divide_the_width():
    for width in (16, 48, 64, 96, 160, 240, 256, 368, 384, 768, 1216):
        heads = heads_for(width)
        assert width % heads == 0 and 16 <= width // heads <= 96, (width, heads)
    assert heads_for(768) == 12 and heads_for(128) == 4 and heads_for(1600) == 25


@pytest.mark.parametrize("target", [0, -5, float("nan"), float("inf"), True])
def test_shape_refuses_a_bad_target(target):
    with pytest.raises(ConfigError, match="params"):
        shape_for_params(target, vocab_size=100, block_size=64)


def test_shape_refuses_a_target_below_the_smallest_model():
    with pytest.raises(ConfigError, match="smallest has"):
        shape_for_params(1e4, vocab_size=50257, block_size=1024)
