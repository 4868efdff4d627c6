"""choose_model: the one path that picks a model when none is given (time budget or data)."""

import pytest

from tinygpt.calc import PowerLaw, ScalingLaw, compute_optimal, count_params, flops_per_token
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.errors import ConfigError
from tinygpt.sizing import (
    MIN_SIZED_CONTEXT,
    MIN_SIZED_STEPS,
    SIZED_STEPS,
    choose_model,
    default_model_config,
    eval_overhead,
    sized_lr,
)

BIG_DATA = dict(vocab_size=443, train_tokens=20_000_000, val_tokens=2_000_000)


def test_without_a_budget_it_is_the_data_default():
    choice = choose_model(**BIG_DATA)
    assert choice.rule == "data" and choice.plan is None
    assert choice.config == default_model_config(443, 20_000_000, 2_000_000)
    fixed = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=60), fixed={"n_layer": 2, "dropout": 0.1})
    assert fixed.rule == "given" and fixed.config.n_layer == 2 and fixed.config.dropout == 0.1


def test_budget_sizing_follows_chinchillas_rule():
    cfg = TrainConfig(max_time=600, batch_size=12)
    choice = choose_model(**BIG_DATA, train_config=cfg, flops_per_second=1e11)
    flops = 1e11 * 600 / (1 + eval_overhead(cfg))
    assert choice.rule == "chinchilla" and choice.plan["flops"] == pytest.approx(flops)
    assert count_params(choice.config).total == pytest.approx(compute_optimal(flops=flops).params, rel=0.15)
    # the tokens it plans are what the budget buys at this model's FLOPs per token, in steps of batch x block
    T = choice.config.block_size
    assert choice.plan["tokens"] == pytest.approx(flops / flops_per_token(choice.config).training)
    assert choice.plan["steps"] == int(choice.plan["tokens"] // (12 * T))
    assert "Chinchilla" in choice.reason and "\n" not in choice.reason
    assert "layers" in choice.reason and f"{choice.plan['steps']:,} steps" in choice.reason


def test_a_muon_budget_buys_a_larger_model_on_fewer_tokens_each():
    from tinygpt.config import RECIPE_MODEL
    from tinygpt.sizing import MUON_TOKENS_PER_PARAM

    for optimizer, per_param, law in (("adamw", 20, "Chinchilla"),
                                      ("muon", MUON_TOKENS_PER_PARAM, "Chinchilla's rule at Muon's 2 tokens")):
        cfg = TrainConfig(max_time=600, batch_size=12, optimizer=optimizer)
        choice = choose_model(**BIG_DATA, train_config=cfg, fixed=RECIPE_MODEL, flops_per_second=1e11)
        flops = 1e11 * 600 / (1 + eval_overhead(cfg))
        target = compute_optimal(flops=flops, tokens_per_param=per_param).params
        assert count_params(choice.config).total == pytest.approx(target, rel=0.15) and law in choice.reason
        assert choice.config.arch == "llama" and choice.config.qk_norm


def test_budget_sizing_keeps_fixed_settings_and_uses_the_block_size():
    short = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=600), flops_per_second=1e11,
                         fixed={"block_size": 64, "bias": False})
    assert short.config.block_size == 64 and short.config.bias is False
    long = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=600), flops_per_second=1e11,
                        fixed={"block_size": 1024})
    # the longer context costs more FLOPs per token, so the same budget buys fewer tokens
    assert long.plan["tokens"] < short.plan["tokens"]


def test_budget_sizing_by_a_sweeps_fit():
    law = ScalingLaw(params=PowerLaw(coef=0.5, exponent=0.45), tokens=None, loss=None, flops_range=(1e12, 1e14),
                     source="sweeps/quick")
    choice = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=300), sweep=law, flops_per_second=1e11)
    assert choice.rule == "sweep" and "sweeps/quick" in choice.reason
    assert count_params(choice.config).total == pytest.approx(law.optimal_params(choice.plan["flops"]), rel=0.15)
    far = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=3600 * 24), sweep=law, flops_per_second=1e11)
    assert "extrapolated" in far.reason


def test_tiny_budgets_get_the_smallest_model_and_big_batches_a_smaller_one():
    tiny = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=1), flops_per_second=1e6)
    assert (tiny.config.n_layer, tiny.config.n_embd) == (1, 16) and "smallest" in tiny.reason
    # a huge batch leaves few steps for the Chinchilla size: the model is made smaller to get enough
    cfg = TrainConfig(max_time=60, batch_size=4096)
    capped = choose_model(**BIG_DATA, train_config=cfg, flops_per_second=1e11)
    assert capped.plan["steps"] >= MIN_SIZED_STEPS or capped.config.n_embd == 16
    assert count_params(capped.config).total < compute_optimal(flops=capped.plan["flops"]).params


def test_a_sweep_needs_a_time_budget_and_no_size_fields():
    law = ScalingLaw(params=PowerLaw(1.0, 0.5), tokens=None, loss=None, flops_range=(1e12, 1e13))
    with pytest.raises(ConfigError, match="time budget"):
        choose_model(**BIG_DATA, sweep=law)
    with pytest.raises(ConfigError, match="n_embd"):
        choose_model(**BIG_DATA, train_config=TrainConfig(max_time=60), sweep=law, fixed={"n_embd": 64})


def test_measured_speed_when_none_is_given():
    # small data, a short budget: two short measurements, then the plan
    choice = choose_model(vocab_size=30, train_tokens=20_000, val_tokens=2_000,
                          train_config=TrainConfig(max_time=2, device="cpu", batch_size=4))
    assert choice.plan["measured"] and choice.plan["flops_per_second"] > 0
    assert "measured here" in choice.reason


def test_small_budgets_train_on_shorter_contexts_and_the_lr_follows_the_width():
    # 600 s at 1e11 FLOP/s plans thousands of steps at the data's context: it is kept
    roomy = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=600), flops_per_second=1e11)
    assert roomy.config.block_size == 256 and roomy.plan["steps"] >= SIZED_STEPS
    # 40 s would get a few hundred steps of 12 x 256: the context halves until the plan has enough
    small = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=40), flops_per_second=1e11)
    assert small.config.block_size < 256 and small.plan["tokens_per_step"] == 12 * small.config.block_size
    assert small.plan["steps"] >= SIZED_STEPS or small.config.block_size == MIN_SIZED_CONTEXT
    assert f"12 x {small.config.block_size} tokens" in small.reason
    # a context that is given is kept
    kept = choose_model(**BIG_DATA, train_config=TrainConfig(max_time=40), flops_per_second=1e11,
                        fixed={"block_size": 256})
    assert kept.config.block_size == 256 and kept.plan["steps"] < SIZED_STEPS
    for choice in (roomy, small, kept):
        assert choice.lr == choice.plan["lr"] == sized_lr(choice.config) and f"lr {choice.lr:.2g}" in choice.reason
    assert sized_lr(GPTConfig(n_embd=64, n_head=4)) == 3e-3 and sized_lr(GPTConfig(n_embd=384, n_head=6)) == 1e-3
    assert choose_model(**BIG_DATA).lr is None  # without a budget the training settings decide


def test_budget_sizing_sizes_the_llama_layout_too():
    cfg = TrainConfig(max_time=600, batch_size=12)
    choice = choose_model(**BIG_DATA, train_config=cfg, flops_per_second=1e11, fixed={"arch": "llama"})
    c = choice.config
    assert (c.arch, c.positions, c.norm, c.mlp, c.bias) == ("llama", "rope", "rmsnorm", "swiglu", False)
    # counted exactly (SwiGLU's three matrices, no position table), so the rule's N is met as for GPT-2
    assert count_params(c).total == pytest.approx(compute_optimal(flops=choice.plan["flops"]).params, rel=0.15)
    assert choice.plan["tokens"] == pytest.approx(choice.plan["flops"] / flops_per_token(c).training)
    given = choose_model(**BIG_DATA, fixed={"arch": "llama", "n_layer": 2, "n_kv_head": 1})
    assert (given.config.arch, given.config.n_kv_head, given.config.n_layer) == ("llama", 1, 2)
