"""LoRA adapters (tinygpt.lora), frozen layers (tinygpt.finetune.freeze) and adapter runs: what trains,
what stays bitwise the same, merging, the run format and its checks, and the CLI on adapter runs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from conftest import make_text

import tinygpt
from tinygpt import GPT, CheckpointError, ConfigError, GPTConfig
from tinygpt.calc import trainable_params
from tinygpt.config import LoraConfig
from tinygpt.data import load_data
from tinygpt.finetune import freeze
from tinygpt.checkpoint import read_adapter_config, save_adapter_run
from tinygpt.lora import (
    LoRALinear,
    adapter_state_dict,
    adapters_off,
    apply_lora,
    load_adapter_state_dict,
    merge,
    weights_checksum,
)
from tinygpt.model import lm_loss

TARGETS = ["c_attn", "attn", "mlp", "attn.c_proj,c_fc", "attn,mlp"]


def tiny(**overrides) -> GPT:
    cfg = dict(vocab_size=41, block_size=16, n_layer=3, n_head=2, n_embd=24)
    return GPT(GPTConfig(**{**cfg, **overrides}))


def adamw_steps(model: GPT, n: int = 5, lr: float = 1e-2, seed: int = 0) -> None:
    """A few AdamW steps on random tokens, over what requires grad (as train.make_optimizer picks)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    model.train()
    for _ in range(n):
        idx = torch.randint(0, model.config.vocab_size, (4, model.config.block_size), generator=g)
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


def snapshot(model: GPT) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def randomize_adapters(model: GPT, seed: int = 1) -> None:
    """B starts at zero (the adapted model is the base): give every adapter a visible effect."""
    g = torch.Generator().manual_seed(seed)
    for t in adapter_state_dict(model).values():
        t.copy_(torch.randn(t.shape, generator=g) * 0.2)


# ---- the layer and apply_lora -----------------------------------------------------------------


def test_lora_linear_follows_peft_conventions():
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 72)
    weight, bias = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoRALinear(base, rank=4, alpha=16.0, dropout=0.0)
    assert layer.lora_A.shape == (4, 24) and layer.lora_B.shape == (72, 4)
    assert layer.scaling == 4.0
    assert layer.weight is base.weight and not layer.weight.requires_grad and not layer.bias.requires_grad
    assert bool((layer.lora_B == 0).all())  # the update starts at zero ...
    bound = 1 / 24**0.5  # ... and A is nn.Linear's Kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))
    top = float(layer.lora_A.detach().abs().max())
    assert 0.8 * bound < top <= bound
    x = torch.randn(5, 24)
    torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
    want = x @ weight.t() + bias + 4.0 * (x @ layer.lora_A.t() @ layer.lora_B.t())
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    # dropout acts on the adapter path's input only (the frozen path sees x whole), in training only
    drop = LoRALinear(torch.nn.Linear(24, 72), rank=4, alpha=2.0, dropout=0.5)
    with torch.no_grad():
        drop.lora_B.normal_()
    frozen = torch.nn.functional.linear(x, drop.weight, drop.bias)
    delta = (drop.lora_B @ drop.lora_A).detach() * 0.5  # scaling * B A
    torch.testing.assert_close(drop.eval()(x), frozen + x @ delta.t(), atol=1e-5, rtol=1e-5)
    torch.manual_seed(3)
    out = drop.train()(x)
    torch.manual_seed(3)  # the same draw of the mask
    dropped = torch.nn.functional.dropout(x, 0.5, training=True)
    torch.testing.assert_close(out, frozen + dropped @ delta.t(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, drop.eval()(x), atol=1e-3)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("targets", TARGETS)
def test_only_adapters_get_gradients_and_their_count_is_the_calculators(tie, targets):
    model = apply_lora(tiny(tie_weights=tie), rank=3, alpha=6.0, targets=targets)
    idx = torch.randint(0, 41, (2, 16))
    lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    for name, p in model.named_parameters():
        is_adapter = name.endswith((".lora_A", ".lora_B"))
        assert p.requires_grad is is_adapter, name
        assert (p.grad is not None) is is_adapter, name
    lora = LoraConfig(rank=3, alpha=6.0, targets=targets).resolved_for(model.config)  # the model's own names
    counts = trainable_params(model.config, lora=lora)
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.adapters == counts.trainable == sum(t.numel() for t in adapter_state_dict(model).values())
    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped == {f"h.{i}.{t}" for i in range(3) for t in lora.targets}
    assert model.lora_config == lora


def test_training_moves_the_adapters_only():
    model = tiny()
    base = snapshot(model)
    idx = torch.randint(0, 41, (2, 16))
    with torch.no_grad():
        before = model(idx)
    apply_lora(model, rank=4, alpha=8.0, targets="attn,mlp")
    with torch.no_grad():
        torch.testing.assert_close(model(idx), before, atol=0, rtol=0)  # B = 0: exactly the base at first
    adamw_steps(model)
    after = snapshot(model)
    for name, t in base.items():
        assert torch.equal(after[name], t), f"{name} changed"
    with torch.no_grad():
        assert (model(idx) - before).abs().max() > 1e-3
    assert any(float(t.abs().max()) > 0 for k, t in after.items() if k.endswith(".lora_B"))


def test_apply_lora_refusals():
    with pytest.raises(ConfigError, match="rank"):
        apply_lora(tiny(), rank=0)
    with pytest.raises(ConfigError, match="alpha"):
        apply_lora(tiny(), alpha=-1)
    with pytest.raises(ConfigError, match="in float32, where 1.25e[+]307 is infinite"):  # once NaN at step 1
        LoraConfig(rank=8, alpha=1e308)
    with pytest.raises(ConfigError, match="ambiguous"):
        apply_lora(tiny(), targets="c_proj")
    with pytest.raises(ConfigError, match="attn.q_proj is not a projection of this model's blocks .gpt2 layout"):
        apply_lora(tiny(), targets="c_attn,q_proj")
    with pytest.raises(ConfigError, match="at least one"):
        LoraConfig(targets=" , ")
    with pytest.raises(ConfigError, match="dropout"):
        LoraConfig(dropout=1.0)
    # a rank above min(in, out) of a target (24 wide here) adds parameters, not capacity
    apply_lora(tiny(), rank=24, targets="attn,mlp")
    with pytest.raises(ConfigError, match=r"lora rank: 25 is more than 24, min\(in, out\) of the adapted attn.c_attn "
                                          r"\(24 in, 72 out\)"):
        apply_lora(tiny(), rank=25)
    gqa = GPTConfig(arch="llama", vocab_size=41, block_size=16, n_layer=1, n_head=4, n_kv_head=1, n_embd=32)
    with pytest.raises(ConfigError, match=r"9 is more than 8, min\(in, out\) of the adapted attn.k_proj \(32 in, 8 out"):
        apply_lora(GPT(gqa), rank=9, targets="attn")  # grouped-query attention's keys: one head of 8
    model = apply_lora(tiny())
    with pytest.raises(ConfigError, match="already has LoRA"):
        apply_lora(model)
    quantized = tinygpt.quantize(tiny(), "int8")
    with pytest.raises(ConfigError, match="quantize"):
        apply_lora(quantized)
    with pytest.raises(CheckpointError, match="LoRA adapters"):
        tinygpt.save(model, "/nonexistent/never-written")  # a plain run cannot hold adapters
    assert LoraConfig(targets="mlp,c_attn").resolved_for(tiny().config).targets == ("attn.c_attn", "mlp.c_fc",
                                                                                     "mlp.c_proj")
    # PEFT's defaults: rank 8, alpha 8, and the layout's target modules
    assert LoraConfig().resolved_for(tiny().config) == LoraConfig(rank=8, alpha=8.0, targets=("attn.c_attn",))


def test_adapter_state_dict_round_trip_and_refusals():
    model = apply_lora(tiny(), rank=2, targets="attn")
    randomize_adapters(model)
    state = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    assert sorted(state)[:2] == ["h.0.attn.c_attn.lora_A", "h.0.attn.c_attn.lora_B"]
    assert len(state) == 3 * 2 * 2
    other = apply_lora(tiny(), rank=2, targets="attn")
    load_adapter_state_dict(other, state)
    assert all(torch.equal(adapter_state_dict(other)[k], v) for k, v in state.items())

    target = apply_lora(tiny(), rank=2, targets="attn")
    fresh = {k: v.clone() for k, v in adapter_state_dict(target).items()}
    cases = [
        ({k: v for k, v in state.items() if k != "h.1.attn.c_proj.lora_B"}, "missing h.1.attn.c_proj.lora_B"),
        ({**state, "h.0.mlp.c_fc.lora_A": torch.zeros(2, 24)}, "unexpected h.0.mlp.c_fc.lora_A"),
        ({**state, "h.2.attn.c_attn.lora_A": torch.zeros(3, 24)}, r"h.2.attn.c_attn.lora_A has shape \(3, 24\)"),
        ({**state, "h.0.attn.c_attn.lora_B": torch.zeros(72, 2, dtype=torch.int32)}, "dtype"),
        ({**state, "h.0.attn.c_attn.lora_B": torch.full((72, 2), float("nan"))}, "NaN"),
    ]
    for tensors, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_adapter_state_dict(target, tensors, "adapter.safetensors")
    # a refused load copies nothing, not even the tensors before the bad one
    assert all(torch.equal(adapter_state_dict(target)[k], v) for k, v in fresh.items())


# ---- merge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_merged_logits_equal_the_adapted_models(tmp_path, tie):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from tinygpt.interop.hf_gpt2 import export_hf

    model = apply_lora(tiny(tie_weights=tie), rank=4, alpha=8.0, targets="attn,mlp")
    adamw_steps(model, n=3)
    randomize_adapters(model)  # far larger updates than three steps make: the merge must carry them exactly
    idx = torch.randint(0, 41, (3, 16))
    with torch.no_grad():
        adapted = model(idx)
        merged = merge(model)(idx)
    assert (merged - adapted).abs().max() < 1e-5
    assert not any(isinstance(m, LoRALinear) for m in model.modules()) and not hasattr(model, "lora_config")
    assert all(type(m) is torch.nn.Linear for name, m in model.named_modules() if name.endswith(("c_attn", "c_fc")))
    assert all(p.requires_grad for p in model.parameters())
    assert (model.lm_head.weight is model.wte.weight) is tie

    run = tinygpt.save(model, tmp_path / "merged")
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "model.safetensors"]
    with torch.no_grad():
        assert (tinygpt.load(run)(idx) - adapted).abs().max() < 1e-5
    export_hf(tinygpt.load(run), None, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(idx).logits - adapted).abs().max() < 1e-4
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        merge(model)


def test_adapters_off_computes_the_base_exactly_and_only_within_the_block():
    """A LoRA run's reference is its own base: with the adapters off the model's logits are the base's, bit for
    bit, and depend on nothing that trains; the adapters come back on when the block ends, even by an error."""
    base = tiny()
    model = apply_lora(tiny(), rank=4, alpha=8.0, targets="attn,mlp")
    model.load_state_dict(base.state_dict(), strict=False)
    randomize_adapters(model)
    idx = torch.randint(0, 41, (2, 16))
    with torch.no_grad():
        adapted, plain = model(idx), base(idx)
    assert not torch.equal(adapted, plain)
    with adapters_off(model):
        off = model(idx)
    assert torch.equal(off, plain) and not off.requires_grad
    with pytest.raises(RuntimeError), adapters_off(model):
        raise RuntimeError("mid-block")
    with torch.no_grad():
        assert torch.equal(model(idx), adapted)
    with torch.no_grad(), adapters_off(base):  # no adapters: the model as it is
        assert torch.equal(base(idx), plain)


# ---- frozen embeddings and layers -------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("embeddings, layers", [(True, 0), (False, 2), (True, 1), (True, 3)])
def test_frozen_parts_stay_bitwise_and_the_rest_trains(tie, embeddings, layers):
    model = freeze(tiny(tie_weights=tie), embeddings=embeddings, layers=layers)
    frozen_prefixes = (("wte.", "wpe.") if embeddings else ()) + tuple(f"h.{i}." for i in range(layers))
    if embeddings and tie:
        frozen_prefixes += ("lm_head.",)  # the same tensor as wte
    counts = trainable_params(model.config, freeze_embeddings=embeddings, freeze_layers=layers)
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts.total == model.num_params() and counts.adapters == 0
    before = snapshot(model)
    adamw_steps(model, n=3)
    after = snapshot(model)
    for name, t in before.items():
        if name.startswith(frozen_prefixes):
            assert torch.equal(after[name], t), f"{name} changed"
        else:
            assert not torch.equal(after[name], t), f"{name} did not train"


def test_freeze_refusals():
    with pytest.raises(ConfigError, match="0..3"):
        freeze(tiny(), layers=4)
    with pytest.raises(ConfigError, match="0..3"):
        freeze(tiny(), layers=-1)
    model = freeze(tiny(), layers=0)
    assert all(p.requires_grad for p in model.parameters())


# ---- the checksum of a base ------------------------------------------------------------------


def test_checksum_is_of_the_tensors_not_the_files(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from tinygpt.interop.hf_gpt2 import export_hf

    model = tiny(tie_weights=False).eval()
    checksum = weights_checksum(model)
    assert checksum.startswith("sha256:") and len(checksum) == 7 + 64
    run = tinygpt.save(model, tmp_path / "run")
    export_hf(model, None, tmp_path / "hf")
    transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "shards",
                                                                                   max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    for folder in (run, tmp_path / "hf", tmp_path / "shards"):
        assert weights_checksum(tinygpt.load(folder)) == checksum, folder
    assert weights_checksum(apply_lora(tinygpt.load(run))) == checksum  # adapters are not the base
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight[3, 5] += 1e-6
    assert weights_checksum(model) != checksum
    assert weights_checksum(model.to(torch.bfloat16)) != weights_checksum(model.float())  # dtype counts


# ---- adapter runs -----------------------------------------------------------------------------


@pytest.fixture
def base_run(tmp_path, char_data, monkeypatch):
    """runs/base, relative to the working directory (tmp_path): a plain run with the char data's
    tokenizer (an untrained model: the tests compare logits)."""
    monkeypatch.chdir(tmp_path)
    tokenizer = load_data(char_data).tokenizer
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32))
    return tinygpt.save(model, Path("runs") / "base", tokenizer)


def adapted(base, targets="attn,mlp"):
    model = apply_lora(tinygpt.load(base), rank=4, alpha=8.0, targets=targets)
    adamw_steps(model, n=3)
    randomize_adapters(model)
    return model


def test_adapter_run_round_trip(base_run, tmp_path):
    model = adapted(base_run)
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        want = model(idx)
    run = save_adapter_run(model, Path("runs") / "lora", base_run, step=7)
    assert sorted(p.name for p in run.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "config.json",
                                                     "tinygpt_adapter.json", "tokenizer.json"]
    saved = json.loads((run / "tinygpt_adapter.json").read_text())
    assert saved["base"]["path"] == "../base"  # relative to the adapter run: the two move together
    assert saved["base"]["checksum"] == weights_checksum(tinygpt.load(base_run))
    peft = json.loads((run / "adapter_config.json").read_text())  # PEFT's: Hugging Face's module names
    assert {k: peft[k] for k in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "fan_in_fan_out",
                                 "base_model_name_or_path")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "fan_in_fan_out": True,
        "target_modules": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], "base_model_name_or_path": "runs/base"}
    keys = set(load_file(run / "adapter_model.safetensors"))
    assert "base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight" in keys and len(keys) == 2 * 2 * 4
    assert tinygpt.checkpoint.weights_step(run) == 7
    assert (run / "adapter_model.safetensors").stat().st_size < (base_run / "model.safetensors").stat().st_size / 3
    assert (run / "tokenizer.json").read_text() == (base_run / "tokenizer.json").read_text()
    info = read_adapter_config(run)
    assert info.base == run / "../base" and info.lora == model.lora_config

    loaded = tinygpt.load(run)
    assert loaded.lora_config == model.lora_config and not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), want, atol=0, rtol=0)
        assert (tinygpt.load(run, merge=True)(idx) - want).abs().max() < 1e-5
    assert not any(isinstance(m, LoRALinear) for m in tinygpt.load(run, merge=True).modules())
    assert tinygpt.checkpoint.load_config(run) == model.config
    assert tinygpt.load_tokenizer(run).encode("the cat") == tinygpt.load_tokenizer(base_run).encode("the cat")

    # the pair moves together; an absolute base path is kept as it is
    shutil.copytree(tmp_path / "runs", tmp_path / "moved")
    with torch.no_grad():
        torch.testing.assert_close(tinygpt.load(tmp_path / "moved" / "lora")(idx), want, atol=0, rtol=0)
    absolute = save_adapter_run(model, tmp_path / "elsewhere" / "lora", base_run.resolve())
    assert json.loads((absolute / "tinygpt_adapter.json").read_text())["base"]["path"] == str(base_run.resolve())
    with torch.no_grad():
        torch.testing.assert_close(tinygpt.load(absolute)(idx), want, atol=0, rtol=0)


def test_an_adapter_run_of_the_first_format_still_loads_and_is_rewritten_in_peft_format(base_run):
    model = adapted(base_run)
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        want = model(idx)
    run = Path("runs") / "old"  # as tinygpt wrote adapter runs before PEFT's format: its own names and config
    run.mkdir()
    save_file({k: v.contiguous() for k, v in adapter_state_dict(model).items()}, run / "adapter.safetensors",
              metadata={"format": "pt", "step": "3"})
    (run / "adapter_config.json").write_text(json.dumps({
        "format": "tinygpt-lora", "version": 1, "lora": model.lora_config.to_dict(),
        "base": {"path": "../base", "checksum": weights_checksum(model)}}))
    (run / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert read_adapter_config(run).lora == model.lora_config and tinygpt.checkpoint.weights_step(run) == 3
    with torch.no_grad():
        torch.testing.assert_close(tinygpt.load(run)(idx), want, atol=0, rtol=0)
    save_adapter_run(tinygpt.load(run), run, base_run)  # its next save is in PEFT's format
    assert sorted(p.name for p in run.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "config.json",
                                                     "tinygpt_adapter.json", "tokenizer.json"]
    with torch.no_grad():
        torch.testing.assert_close(tinygpt.load(run)(idx), want, atol=0, rtol=0)


def test_a_missing_or_changed_base_is_refused_by_path(base_run, tmp_path):
    model = adapted(base_run)
    run = save_adapter_run(model, "lora", base_run)
    base = "runs/base"  # the adapter run names it as ../runs/base, relative to itself (lora/)

    # one weight edited and the base saved again: same files, other weights
    edited = tinygpt.load(base_run)
    with torch.no_grad():
        edited.h[0].attn.c_proj.weight[0, 0] += 0.01
    tinygpt.save(edited, base_run, tinygpt.load_tokenizer(base_run))
    with pytest.raises(CheckpointError, match="has changed") as e:
        tinygpt.load(run)
    assert str(base) in str(e.value) and "\n" not in str(e.value)

    shutil.rmtree(base_run)
    with pytest.raises(CheckpointError, match="missing") as e:
        tinygpt.load(run)
    assert str(base) in str(e.value)
    # the checks hold for every way in: load_run (sample, eval, serve, export) and merge_run
    with pytest.raises(CheckpointError, match="missing"):
        tinygpt.checkpoint.load_run(run, "cpu")


def test_adapter_run_refusals(base_run, tmp_path):
    model = adapted(base_run, targets="c_attn")
    run = save_adapter_run(model, tmp_path / "lora", base_run)
    with pytest.raises(CheckpointError, match="adapter run"):
        save_adapter_run(model, tmp_path / "lora2", run)  # adapters on adapters
    with pytest.raises(CheckpointError, match="no such base"):
        save_adapter_run(model, tmp_path / "lora3", tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="full model"):
        save_adapter_run(model, base_run, base_run)  # a plain run's folder is not mixed with adapters
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        save_adapter_run(tinygpt.load(base_run), tmp_path / "lora5", base_run)

    # a damaged adapter_config.json, tinygpt_adapter.json or adapter file is a one-line CheckpointError
    config = json.loads((run / "adapter_config.json").read_text())
    bookkeeping = json.loads((run / "tinygpt_adapter.json").read_text())
    for file, broken, message in [
        ("tinygpt_adapter.json", {**bookkeeping, "format": "peft"}, "not tinygpt's adapter bookkeeping"),
        ("tinygpt_adapter.json", {**bookkeeping, "version": 9}, "version 9"),
        ("tinygpt_adapter.json", {**bookkeeping, "base": {"path": bookkeeping["base"]["path"]}}, "checksum"),
        ("adapter_config.json", {**config, "r": 0}, "rank"),
        ("adapter_config.json", {**config, "peft_type": "IA3"}, "IA3 adapter"),
        ("adapter_config.json", {**config, "use_dora": True}, "use_dora"),
        ("adapter_config.json", {**config, "r": 5}, "shape"),
    ]:
        (run / file).write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=message) as e:
            tinygpt.load(run)
        assert "\n" not in str(e.value)
        (run / "adapter_config.json").write_text(json.dumps(config))
        (run / "tinygpt_adapter.json").write_text(json.dumps(bookkeeping))
    (run / "adapter_model.safetensors").write_bytes((run / "adapter_model.safetensors").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        tinygpt.load(run)

    # the base's architecture must still be the one in the run's config.json (an edit the checksum cannot see)
    run = save_adapter_run(model, tmp_path / "lora6", base_run)
    base_config = json.loads((base_run / "config.json").read_text())
    (base_run / "config.json").write_text(json.dumps({**base_config, "activation": "gelu"}))
    with pytest.raises(CheckpointError, match="activation") as e:
        tinygpt.load(run)
    assert "runs/base is not the architecture" in str(e.value)


# ---- the CLI on adapter runs -------------------------------------------------------------------


def test_cli_sample_eval_export_and_merge_take_an_adapter_run(base_run, tmp_path, cli):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    model = adapted(base_run)
    run = save_adapter_run(model, tmp_path / "lora", base_run)
    merged = tinygpt.load(run, merge=True)
    text = tmp_path / "t.txt"
    text.write_text(make_text(40, seed=5))

    sample = ["--prompt", "the cat", "--greedy", "--max-new-tokens", "25", "--device", "cpu"]
    r = cli("sample", run, *sample)
    assert r.returncode == 0, r.stderr
    tokenizer = tinygpt.load_tokenizer(run)
    prompt = torch.tensor([tokenizer.encode("the cat")])
    want = tinygpt.generate(merged, prompt, 25, greedy=True)[0].tolist()
    assert r.stdout == tokenizer.decode(want) + "\n"
    assert r.stdout != cli("sample", base_run, *sample).stdout  # the adapters change what it writes

    r = cli("eval", run, "--text", text, "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    ids = torch.tensor(tokenizer.encode(text.read_text()))
    loss = json.loads(r.stdout.splitlines()[-1])["loss"]
    base_loss = json.loads(cli("eval", base_run, "--text", text, "--json", "--device", "cpu").stdout.splitlines()[-1])
    assert loss != pytest.approx(base_loss["loss"], abs=1e-3)
    with torch.no_grad():  # the same loss as the adapted model's on the same windows
        from tinygpt.train import evaluate

        assert loss == pytest.approx(evaluate(tinygpt.load(run), ids.numpy(), batch_size=8)["loss"], abs=1e-4)

    r = cli("params", run, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["total"] == merged.num_params()

    # export writes the merged model: transformers computes the adapted model's logits
    r = cli("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert (hf(idx).logits - model(idx)).abs().max() < 1e-4

    # merge: a plain run, which needs neither the adapters nor the base
    r = cli("merge", run, "--out", tmp_path / "merged")
    assert r.returncode == 0, r.stderr
    assert "merged" in r.stdout and "LoRA r=4" in r.stdout
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["config.json", "model.safetensors",
                                                                       "tokenizer.json"]
    shutil.rmtree(base_run)
    with torch.no_grad():
        assert (tinygpt.load(tmp_path / "merged")(idx) - model(idx)).abs().max() < 1e-5
    assert cli("sample", tmp_path / "merged", *sample).stdout == tokenizer.decode(want) + "\n"


def test_cli_merge_and_sample_refusals(base_run, tmp_path, cli):
    run = save_adapter_run(adapted(base_run), tmp_path / "lora", base_run)

    def clean_error(r, *fragments):
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert all(f in r.stderr for f in fragments), r.stderr

    clean_error(cli("merge", base_run, "--out", tmp_path / "m"), "not an adapter run")
    clean_error(cli("merge", run, "--out", base_run), "already exists")
    assert not (tmp_path / "m").exists()
    shutil.rmtree(base_run)
    base = str(base_run)
    clean_error(cli("merge", run, "--out", tmp_path / "m"), "missing", base)
    clean_error(cli("sample", run, "--device", "cpu"), "missing", base)
    clean_error(cli("eval", run, "--text", run / "config.json", "--device", "cpu"), "missing", base)
    clean_error(cli("export", run, "--format", "hf", "--out", tmp_path / "hf"), "missing", base)
    assert not (tmp_path / "m").exists() and not (tmp_path / "hf").exists()


KILLED_MERGE = """
import os, signal, sys
import tinygpt.checkpoint as c
real = c.save_file
def killed(tensors, path, metadata=None):  # half the weights on disk, then the kill a user gives
    real(tensors, path, metadata=metadata)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
c.save_file = killed
c.merge_run(sys.argv[1], sys.argv[2])
"""


def test_a_merge_killed_while_writing_leaves_nothing_that_blocks_the_rerun(base_run, tmp_path, cli):
    import subprocess
    import sys

    run = save_adapter_run(adapted(base_run), tmp_path / "lora", base_run)
    out = tmp_path / "merged"
    killed = subprocess.run([sys.executable, "-c", KILLED_MERGE, str(run), str(out)], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists()  # not a folder with config.json that is "not a tinygpt run" and "already exists"
    r = cli("merge", run, "--out", out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the killed one's temp folder went
    idx = torch.randint(0, 20, (2, 16))
    with torch.no_grad():
        assert (tinygpt.load(out)(idx) - tinygpt.load(run)(idx)).abs().max() < 1e-5
