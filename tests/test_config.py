import json

import pytest

from tinygpt import ConfigError, GPTConfig, SampleConfig
from tinygpt.config import PRESETS, TrainConfig, parse_duration


def test_defaults_are_gpt2():
    cfg = GPTConfig()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size) == (12, 12, 768, 50257, 1024)
    assert cfg.bias and cfg.tie_weights and cfg.activation == "gelu_tanh" and cfg.init == "gpt2"


def test_presets():
    lesson = GPTConfig.from_preset("lesson")
    assert (lesson.vocab_size, lesson.n_embd, lesson.n_head, lesson.n_layer, lesson.block_size) == (50, 64, 4, 2, 8)
    assert not lesson.tie_weights and lesson.activation == "gelu" and lesson.init == "torch"
    assert GPTConfig.from_preset("stretch").n_layer == 6 and GPTConfig.from_preset("stretch").n_embd == 256
    assert GPTConfig.from_preset("gpt2-xl", vocab_size=10).vocab_size == 10
    assert set(PRESETS) >= {"lesson", "stretch", "baby", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}
    with pytest.raises(ConfigError, match="unknown preset"):
        GPTConfig.from_preset("gpt5")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_embd=65, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(n_head=0), "n_head"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(activation="relu"), "activation"),
        (dict(init="xavier"), "init"),
        (dict(layer_norm_eps=0), "layer_norm_eps"),
        # GPT-2's layout holds none of the family's choices: each names itself and the arch it needs
        (dict(n_kv_head=4), "n_kv_head: 4 needs arch llama"),
        (dict(positions="rope"), "positions: 'rope' needs arch llama"),
        (dict(norm="rmsnorm"), "norm: 'rmsnorm' needs arch llama"),
        (dict(mlp="swiglu"), "mlp: 'swiglu' needs arch llama"),
        (dict(mlp="relu2"), "mlp: 'relu2' needs arch llama"),
        (dict(arch="llama", mlp="relu2", activation="gelu"), "activation: a relu2 MLP's is relu2"),
        (dict(zero_init=1), "zero_init: must be true or false"),
        (dict(qk_norm=True), "qk_norm: True needs arch llama"),
        (dict(qkv_bias=True), "qkv_bias"),
        (dict(head_size=32), "head_size"),
        (dict(arch="mamba"), "arch"),
        (dict(arch="llama", n_head=4, n_kv_head=3), "n_kv_head"),
        (dict(arch="llama", positions="sinusoidal"), "positions"),
        (dict(arch="llama", mlp="swiglu", activation="gelu"), "activation"),
        (dict(arch="llama", mlp="gelu", activation="silu"), "activation"),
        (dict(arch="llama", rope_scaling="yarn"), "rope_scaling"),
        (dict(arch="llama", positions="learned", rope_scaling="linear", rope_factor=2.0), "rope_scaling"),
        (dict(arch="llama", rope_scaling="llama3", rope_low_freq_factor=4.0), "rope_low_freq_factor"),
        (dict(arch="llama", rope_theta=float("inf")), "rope_theta"),
        (dict(arch="llama", n_head=4, n_embd=36), "n_head"),  # a head 9 wide: rotary positions turn pairs
        (dict(arch="llama", intermediate_size=0), "intermediate_size"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_the_llama_layout_defaults_to_the_family_and_gpt2_to_itself():
    llama = GPTConfig(arch="llama", n_embd=576, n_head=9)
    assert (llama.positions, llama.norm, llama.mlp, llama.bias, llama.activation) == ("rope", "rmsnorm", "swiglu",
                                                                                      False, "silu")
    # 8/3 of the width rounded up to 64: SmolLM2-135M's 1,536 at width 576
    assert (llama.mlp_width, llama.kv_heads, llama.head_dim) == (1536, 9, 64)
    assert GPTConfig(arch="llama", n_embd=64, n_head=4, mlp="gelu").mlp_width == 256
    assert GPTConfig(arch="llama", n_embd=64, n_head=4, head_size=32, n_kv_head=2).head_dim == 32
    gpt2 = GPTConfig()
    assert (gpt2.arch, gpt2.positions, gpt2.norm, gpt2.mlp, gpt2.bias, gpt2.mlp_width) == ("gpt2", "learned",
                                                                                         "layernorm", "gelu", True, 3072)
    # a config.json written before the family existed is GPT-2's, and reads back as it was
    old = {k: v for k, v in GPTConfig.from_preset("lesson").to_dict().items()
           if k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_weights",
                    "activation", "init", "layer_norm_eps")}
    assert GPTConfig.from_dict(old) == GPTConfig.from_preset("lesson")
    family = GPTConfig.from_preset("llama-3.2-1b")
    assert GPTConfig.from_dict(json.loads(json.dumps(family.to_dict()))) == family


def test_json_round_trip():
    cfg = GPTConfig.from_preset("lesson", dropout=0.1)
    assert GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_from_dict_refuses_unknown_keys_and_wrong_types():
    with pytest.raises(ConfigError, match="n_layers"):
        GPTConfig.from_dict({"n_layers": 3})
    with pytest.raises(ConfigError, match="n_layer: expected int"):
        GPTConfig.from_dict({"n_layer": "3"})
    with pytest.raises(ConfigError, match="bias: expected bool"):
        GPTConfig.from_dict({"bias": 1})
    assert GPTConfig.from_dict({"dropout": 0}).dropout == 0.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        # a bool is not a number here, though Python counts it as an int (top_p=True passed as 1)
        (dict(top_p=True), "top_p"),
        (dict(temperature=True), "temperature"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(greedy="no"), "greedy"),
    ],
)
def test_sample_config_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SampleConfig(**kwargs)
    assert SampleConfig(temperature=0).is_greedy


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("1.5h", 5400), ("90", 90), (" 1h 30m ", 5400),
     ("2d", 172800), ("1h30m15s", 5415), ("10M", 600)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", "-5m", "0s", "0", "1m1h", "1h1h", "m", "1h junk", "inf", "1e3"])
def test_parse_duration_refuses_bad_text(text):
    with pytest.raises(ConfigError, match="--max-time"):
        parse_duration(text, "--max-time")


def _float_fields(cls):
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in (float, float | None)]


@pytest.mark.parametrize("cls", [TrainConfig, GPTConfig])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_field_refuses_nan_and_inf(cls, value):
    # NaN passes no comparison, so a `>= 0` check let it through; inf passed most checks (weight_decay,
    # grad_clip, min_lr, layer_norm_eps) and reached the optimizer, failing at step 2
    fields = _float_fields(cls)
    assert {"lr", "weight_decay", "beta1", "beta2", "grad_clip"} <= set(fields) or cls is GPTConfig
    for name in fields:
        with pytest.raises(ConfigError, match=f"^{name}: "):
            cls(**{name: value})


def test_seed_fits_torch():
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1
    with pytest.raises(ConfigError, match="seed"):
        TrainConfig(seed=2**63)


def test_the_package_gives_the_names_users_import():
    # tinygpt.config is a module a topic since issue 56; the package still gives what users import from it:
    # docs/tutorials/scale.md's RECIPE_MODEL and RECIPE_TRAIN, and the configs the API reference documents
    # under tinygpt.config, each the topic module's own object
    import tinygpt
    import tinygpt.config as config
    from tinygpt.config import model, train

    assert config.RECIPE_MODEL is train.RECIPE_MODEL and config.RECIPE_TRAIN is train.RECIPE_TRAIN
    assert config.GPTConfig is model.GPTConfig is tinygpt.GPTConfig and config.TrainConfig is train.TrainConfig
    documented = [name for name in tinygpt.__all__ if tinygpt._HOME[name] == "config"]
    assert documented == ["GPTConfig", "SampleConfig", "TrainConfig", "FinetuneConfig"]
    assert all(getattr(config, name) is getattr(tinygpt, name) for name in documented)
    assert set(documented) | {"RECIPE_MODEL", "RECIPE_TRAIN"} <= set(config.__all__)
