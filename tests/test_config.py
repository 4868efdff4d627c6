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
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


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
