"""The modern training recipe: Muon beside AdamW (which parameters each trains, its state in a
checkpoint, an exact resume) and the refusals around it; the warmup-stable-decay schedule and the
continuation of a WSD run from before its decay; the modern block's options for a new run (ReLU
squared, zero-initialised output projections, QK-norm, an untied head) and what export says of them."""

import copy
import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.optim._muon import _zeropower_via_newtonschulz

from tinygpt import GPTConfig
from tinygpt.checkpoint import load
from tinygpt.config import MUON_LR, RECIPE_MODEL, TrainConfig, with_arch
from tinygpt.errors import ConfigError, TrainingError
from tinygpt.model import GPT
from tinygpt.optim import (BudgetSchedule, Muon, MuonAdamW, decay_start, lr_at, make_optimizer, orthogonalized,
                           warmup_steps)
from tinygpt.train import train

LLAMA = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, arch="llama",
                  qk_norm=True, tie_weights=False, dropout=0.1)
GPT2 = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def cfg(**kw):
    base = dict(batch_size=4, max_iters=12, eval_interval=4, eval_iters=2, warmup=3, device="cpu", dtype="float32",
                grad_accum=2, optimizer="muon")
    return TrainConfig(**{**base, **kw})


def trained_by(model: GPT, config: TrainConfig) -> dict[str, str]:
    """Each parameter's name -> "muon" or "adamw", from the optimizer make_optimizer builds."""
    opt = make_optimizer(model, config, torch.device("cpu"))
    names = {p: n for n, p in model.named_parameters()}
    groups = opt.optimizers if isinstance(opt, MuonAdamW) else (opt,)
    return {names[p]: type(o).__name__.lower() for o in groups for g in o.param_groups for p in g["params"]}


def test_muon_trains_the_block_matrices_and_adamw_everything_else():
    config = TrainConfig(lr=1e-3, optimizer="muon")
    by = trained_by(GPT(LLAMA), config)
    block = [f"h.{i}.{m}.weight" for i in range(2) for m in
             ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj")]
    rest = ["wte.weight", "lm_head.weight", "ln_f.weight",
            *[f"h.{i}.{m}.weight" for i in range(2) for m in ("ln_1", "ln_2", "attn.q_norm", "attn.k_norm")]]
    assert by == {**{n: "muon" for n in block}, **{n: "adamw" for n in rest}}
    # GPT-2's block: the fused c_attn and both c_proj and c_fc; its biases, norms, wte and wpe (the head is wte)
    by = trained_by(GPT(GPT2), config)
    assert sorted(n for n, o in by.items() if o == "muon") == sorted(
        f"h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert {"wte.weight", "wpe.weight", "h.0.attn.c_attn.bias", "h.1.ln_2.weight", "ln_f.bias"} <= {
        n for n, o in by.items() if o == "adamw"}
    assert len(by) == len(list(GPT(GPT2).parameters()))
    # adamw: one AdamW for everything, as before
    assert set(trained_by(GPT(LLAMA), TrainConfig(lr=1e-3)).values()) == {"adamw"}


def test_muon_leaves_out_what_does_not_train():
    model = GPT(LLAMA)
    for p in model.h[0].parameters():
        p.requires_grad_(False)
    by = trained_by(model, TrainConfig(lr=1e-3, optimizer="muon"))
    assert not [n for n in by if n.startswith("h.0.")] and by["h.1.attn.q_proj.weight"] == "muon"


def test_each_group_follows_the_schedule_at_its_own_rate(char_data, tmp_path):
    train(char_data, tmp_path / "run", LLAMA, cfg(lr=2e-3, muon_lr=0.03, max_iters=4, eval_interval=4))
    groups = torch.load(tmp_path / "run" / "train_state.pt", weights_only=True)["optimizer"]["param_groups"]
    lr = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
          if '"lr"' in line][-1]
    assert [g["lr"] for g in groups] == pytest.approx([lr * 15, lr, lr])
    assert groups[0]["momentum"] == 0.95 and groups[0]["weight_decay"] == 0.0 and groups[1]["weight_decay"] == 0.1


@pytest.mark.parametrize("stop_at", [1, 7])
def test_a_muon_run_resumes_bitwise(char_data, tmp_path, stop_at):
    c = cfg(muon_weight_decay=0.05)
    train(char_data, tmp_path / "straight", LLAMA, c)
    first = train(char_data, tmp_path / "resumed", LLAMA, c, should_stop=lambda s: s == stop_at)
    assert first.step == stop_at
    state = torch.load(tmp_path / "resumed" / "train_state.pt", weights_only=True)
    assert state["optimizer_kind"] == "muon"
    assert {"momentum_buffer"} in [set(s) for s in state["optimizer"]["state"].values()]
    train(char_data, tmp_path / "resumed", None, c, resume=True)
    a, b = load(tmp_path / "straight").state_dict(), load(tmp_path / "resumed").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_run_resumes_with_the_optimizer_it_trained_with(char_data, tmp_path):
    train(char_data, tmp_path / "run", GPT2, cfg(max_iters=2, optimizer="adamw"))
    with pytest.raises(TrainingError, match="trained with --optimizer adamw"):
        train(char_data, tmp_path / "run", None, cfg(max_iters=4), resume=True)


def test_refusals():
    with pytest.raises(ConfigError, match="FSDP2 shards each weight matrix"):
        TrainConfig(optimizer="muon", fsdp=True)
    with pytest.raises(ConfigError, match="optimizer: must be one of adamw, muon"):
        TrainConfig(optimizer="sgd")
    for field in ("muon_lr", "muon_momentum", "muon_weight_decay"):
        with pytest.raises(ConfigError, match=field):
            TrainConfig(**{field: -1.0})
    assert TrainConfig().matrix_lr == MUON_LR


def test_cli_muon_train_and_lora_refusal(char_data, tmp_path, cli):
    r = cli("train", "--data", char_data, "--out", tmp_path / "run", "--n-layer", 1, "--n-head", 2, "--n-embd", 16,
            "--block-size", 8, "--max-iters", 3, "--eval-iters", 1, "--optimizer", "muon", "--muon-lr", "0.01",
            "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())["train"]
    assert saved["optimizer"] == "muon" and saved["muon_lr"] == 0.01
    r = cli("finetune", tmp_path / "run", "--data", char_data, "--out", tmp_path / "ft", "--method", "lora",
            "--optimizer", "muon", "--max-iters", 1, "--quiet")
    assert r.returncode != 0 and "LoRA's low-rank adapters train with adamw" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_wsd_rate_at_every_step():
    c = TrainConfig(lr=1.0, min_lr=0.1, warmup=2, lr_schedule="wsd", decay_fraction=0.2, max_iters=20)
    rates = [lr_at(s, c, 20) for s in range(22)]
    # warmup 2 steps, held to step 15, then 4 steps down to min_lr in a line, and held there
    assert rates == pytest.approx([0.5] + [1.0] * 15 + [0.775, 0.55, 0.325, 0.1, 0.1, 0.1])
    assert decay_start(c, 20) == 16
    # the decay never starts inside the warmup; a fraction 1 decays from the warmup's end
    assert decay_start(dataclasses.replace(c, decay_fraction=1.0), 20) == 2
    assert [lr_at(s, c, None) for s in (1, 50)] == [1.0, 1.0]  # a time budget not timed yet: held


def test_wsd_on_a_time_budget_decays_over_the_last_share_of_the_steps_it_buys():
    c = TrainConfig(lr=1.0, min_lr=0.0, warmup=1, lr_schedule="wsd", decay_fraction=0.25, max_time=60)
    fixed = dataclasses.replace(c, max_iters=20, max_time=None)
    schedule, rates = BudgetSchedule(c), []
    for step in range(20):  # a steady speed: the time left buys 20 - step steps
        schedule.left = 20 - step
        rates.append(schedule.next_lr(step))
    assert rates == pytest.approx([lr_at(s, fixed, 20) for s in range(20)])
    assert rates[14] == 1.0 and rates[-1] == pytest.approx(0.0)


def test_a_wsd_run_continues_from_before_its_decay_with_a_new_length(char_data, tmp_path):
    # warmup 1: a tenth of 12 steps, and so the same as a 24-step run's
    c = cfg(lr_schedule="wsd", decay_fraction=0.25, max_iters=12, eval_interval=5, optimizer="adamw", warmup=1)
    train(char_data, tmp_path / "short", GPT2, c)  # decays over steps 10-12
    kept = tmp_path / "short" / "before-decay"
    assert torch.load(kept / "train_state.pt", weights_only=True)["step"] == 9
    shutil.copytree(kept, tmp_path / "longer")
    longer = dataclasses.replace(c, max_iters=24)
    result = train(char_data, tmp_path / "longer", None, longer, resume=True)
    assert result.step == 24
    train(char_data, tmp_path / "straight", GPT2, longer)
    a, b = load(tmp_path / "straight").state_dict(), load(tmp_path / "longer").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lines = [json.loads(line) for line in (tmp_path / "longer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 25))
    assert torch.load(tmp_path / "longer" / "before-decay" / "train_state.pt", weights_only=True)["step"] == 18


def lrs(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in lines if "lr" in r]


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_a_short_run_warms_up_over_a_tenth_of_its_steps_and_reaches_its_peak_and_its_decay(schedule):
    # --max-iters at or below --warmup (100) ended a run inside its warmup, a WSD run before its decay
    for n in range(2, 60):
        c = TrainConfig(lr=1.0, min_lr=0.1, lr_schedule=schedule, max_iters=n)
        rates = [lr_at(s, c, n) for s in range(n)]
        w = max(1, n // 10)
        assert warmup_steps(c, n) == w and rates[:w] == pytest.approx([(s + 1) / w for s in range(w)]), n
        if schedule == "wsd":
            assert w <= decay_start(c, n) < n and rates[-1] == pytest.approx(0.1), n
        elif schedule == "cosine" and n > w + 1:
            assert rates[-1] < rates[w] == 1.0, n
    # a run of ten warmups or more warms up over --warmup whole, as before
    for n in (1000, 2000, 10**6):
        assert warmup_steps(TrainConfig(lr_schedule=schedule, max_iters=n), n) == 100


def test_a_ten_step_wsd_run_decays_and_continues_as_the_readme_says(char_data, tmp_path, cli):
    """The README's continuation on a run shorter than its default 100-step warmup: the run decays and keeps
    before-decay/, whose copy continues with another --max-iters; finetune's short runs decay alike."""
    small = ["--n-layer", 1, "--n-head", 2, "--n-embd", 16, "--block-size", 8, "--batch-size", 4, "--eval-iters", 1,
             "--device", "cpu", "--dtype", "float32", "--quiet"]
    r = cli("train", "--data", char_data, "--out", tmp_path / "wsd", "--max-iters", 10, *small)
    assert r.returncode == 0, r.stderr
    # a one-step warmup (a tenth of 10), held to step 8, down to lr / 10 over the last fifth
    assert lrs(tmp_path / "wsd") == pytest.approx([1e-3] * 8 + [5.5e-4, 1e-4])
    assert torch.load(tmp_path / "wsd" / "before-decay" / "train_state.pt", weights_only=True)["step"] == 8
    shutil.copytree(tmp_path / "wsd" / "before-decay", tmp_path / "wsd-20")
    r = cli("train", "--data", char_data, "--out", tmp_path / "wsd-20", "--resume", "--max-iters", 20, "--quiet")
    assert r.returncode == 0, r.stderr
    assert lrs(tmp_path / "wsd-20") == pytest.approx([1e-3] * 16 + [7.75e-4, 5.5e-4, 3.25e-4, 1e-4])
    assert torch.load(tmp_path / "wsd-20" / "before-decay" / "train_state.pt", weights_only=True)["step"] == 16
    # finetune's 10-step warmup in a 10-step run: one step, and the decay
    r = cli("finetune", tmp_path / "wsd", "--data", char_data, "--out", tmp_path / "ft", "--max-iters", 10,
            "--lr-schedule", "wsd", "--lr", "1e-3", "--eval-iters", 1, "--batch-size", 4, "--quiet")
    assert r.returncode == 0, r.stderr
    assert lrs(tmp_path / "ft") == pytest.approx([1e-3] * 8 + [5.5e-4, 1e-4])
    assert (tmp_path / "ft" / "before-decay" / "model.safetensors").is_file()


def test_a_resume_keeps_the_warmup_the_run_began_with(char_data, tmp_path):
    c = cfg(optimizer="adamw", lr=1e-3, warmup=100, max_iters=20, lr_schedule="cosine", eval_interval=100)
    train(char_data, tmp_path / "run", GPT2, c, should_stop=lambda step: step == 1)  # warmup 2, a tenth of 20
    longer = dataclasses.replace(c, max_iters=40)  # whose own warmup would be 4
    train(char_data, tmp_path / "run", None, longer, resume=True)
    assert lrs(tmp_path / "run")[1] == 1e-3
    assert lrs(tmp_path / "run") == pytest.approx([lr_at(s, longer, 40, warmup=2) for s in range(40)])
    # a state saved before tinygpt kept the run's first length resumes on the warmup it had then: --warmup whole
    old = dataclasses.replace(c, warmup=5)
    train(char_data, tmp_path / "old", GPT2, old, should_stop=lambda step: step == 3)
    state = torch.load(tmp_path / "old" / "train_state.pt", weights_only=True)
    del state["begun_max_iters"]
    torch.save(state, tmp_path / "old" / "train_state.pt")
    train(char_data, tmp_path / "old", None, old, resume=True)
    assert lrs(tmp_path / "old")[3:] == pytest.approx([lr_at(s, old, 20, warmup=5) for s in range(3, 20)])


# the modern block (the modded-nanoGPT speedrun's choices): ReLU squared, zero-initialised output projections,
# QK-norm, an untied head
MODERN = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, arch="llama", mlp="relu2",
                   qk_norm=True, zero_init=True, tie_weights=False)


def test_relu2_mlp_computes_down_of_relu_squared_of_up():
    model = GPT(MODERN)
    mlp = model.h[0].mlp
    assert not hasattr(mlp, "gate_proj") and MODERN.activation == "relu2" and MODERN.mlp_width == 4 * 32
    torch.nn.init.normal_(mlp.down_proj.weight)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), F.linear(F.relu(F.linear(x, mlp.up_proj.weight)) ** 2, mlp.down_proj.weight),
                               rtol=0, atol=0)
    # as many weights as SwiGLU's three matrices at 8/3 the width (where that is a multiple of 64)
    wide = {**MODERN.to_dict(), "n_embd": 96, "activation": None}
    assert GPT(GPTConfig(**wide)).num_params() == GPT(GPTConfig(**{**wide, "mlp": "swiglu"})).num_params()
    assert {n for n, o in trained_by(model, TrainConfig(lr=1e-3, optimizer="muon")).items() if o == "muon"} == {
        f"h.{i}.{m}.weight" for i in range(2) for m in
        ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("init", ["gpt2", "torch"])
def test_zero_init_starts_every_block_as_the_identity(init):
    torch.manual_seed(0)
    config = GPTConfig(**{**MODERN.to_dict(), "init": init, "bias": True})
    model = GPT(config)
    for block in model.h:
        for p in (block.attn.o_proj.weight, block.attn.o_proj.bias, block.mlp.down_proj.weight,
                  block.mlp.down_proj.bias):
            assert not p.any()
        assert block.attn.q_proj.weight.any() and block.mlp.up_proj.weight.any()
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(idx), model.lm_head(model.ln_f(model.wte(idx))), rtol=0, atol=0)
    assert model.lm_head.weight is not model.wte.weight  # untied
    # off (the default), the same seed draws the same weights and leaves the projections as drawn
    torch.manual_seed(0)
    plain = GPT(dataclasses.replace(config, zero_init=False))
    assert plain.h[0].attn.o_proj.weight.any()
    assert torch.equal(plain.h[1].attn.q_proj.weight, model.h[1].attn.q_proj.weight)


def test_another_mlp_brings_its_own_activation():
    llama = GPTConfig(vocab_size=64, arch="llama", n_embd=32, n_head=4).to_dict()
    assert GPTConfig(**with_arch(llama, {"mlp": "relu2"})).activation == "relu2"
    assert GPTConfig(**with_arch(GPTConfig().to_dict(), {"arch": "llama", "mlp": "relu2"})).activation == "relu2"
    assert GPTConfig(**with_arch(GPTConfig(activation="gelu").to_dict(), {"arch": "llama", "mlp": "gelu"})
                     ).activation == "gelu"


def test_cli_trains_the_modern_block_and_export_refuses_relu2_in_one_line(char_data, tmp_path, cli):
    run = tmp_path / "run"
    r = cli("train", "--data", char_data, "--out", run, "--arch", "llama", "--mlp", "relu2", "--qk-norm",
            "--zero-init", "--no-tie-weights", "--n-layer", 1, "--n-head", 2, "--n-embd", 16, "--block-size", 8,
            "--max-iters", 3, "--eval-iters", 1, "--optimizer", "muon", "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    config = load(run).config
    assert (config.mlp, config.qk_norm, config.zero_init, config.tie_weights) == ("relu2", True, True, False)
    for fmt, target in (("hf", "a Hugging Face Llama"), ("gguf", "llama.cpp's qwen3")):
        r = cli("export", run, "--format", fmt, "--out", tmp_path / fmt)
        assert r.returncode == 2 and not (tmp_path / fmt).exists()
        assert r.stderr.strip() == (f"tinygpt: error: this model's mlp is 'relu2': {target} has 'swiglu' only, so it "
                                    "cannot be exported")
    r = cli("train", "--data", char_data, "--out", tmp_path / "gpt2", "--arch", "gpt2", "--mlp", "relu2",
            "--max-iters", 1)
    assert r.returncode == 2 and r.stderr.strip() == (
        "tinygpt: error: mlp: 'relu2' needs arch llama (GPT-2's layout has 'gelu' only)")


# ---- the recipe as tinygpt train's default -------------------------------------------------------

SMALL = ("--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 16, "--batch-size", 4, "--max-iters", 12,
         "--eval-interval", 4, "--eval-iters", 2, "--warmup", 3, "--device", "cpu", "--dtype", "float32", "--quiet")


def losses(run) -> list[tuple[int, float, float | None]]:
    """Every step's (step, train loss, val loss) as metrics.jsonl keeps them."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in lines if "loss" in r]


def test_a_new_run_trains_the_recipe_and_each_flag_takes_its_part_back(char_data, tmp_path, cli):
    from tinygpt.config import RECIPE_MODEL
    from tinygpt.train import read_train_config

    def run(name, *flags):
        r = cli("train", "--data", char_data, "--out", tmp_path / name, *SMALL, "--max-iters", 2, *flags)
        assert r.returncode == 0, r.stderr
        config, train_cfg = load(tmp_path / name).config, read_train_config(tmp_path / name)[0]
        return config, train_cfg

    config, train_cfg = run("new")
    assert {k: getattr(config, k) for k in RECIPE_MODEL} == RECIPE_MODEL and config.mlp == "swiglu"
    assert (train_cfg.optimizer, train_cfg.lr_schedule) == ("muon", "wsd")
    config, train_cfg = run("mine", "--tie-weights", "--mlp", "relu2", "--lr-schedule", "cosine")
    assert (config.arch, config.tie_weights, config.mlp, config.qk_norm) == ("llama", True, "relu2", True)
    assert (train_cfg.optimizer, train_cfg.lr_schedule) == ("muon", "cosine")
    config, train_cfg = run("llama", "--arch", "llama", "--optimizer", "adamw")  # llama's own defaults, as before
    assert (config.qk_norm, config.zero_init, config.tie_weights) == (False, False, True)
    assert (train_cfg.optimizer, train_cfg.lr_schedule) == ("adamw", "wsd")
    config, train_cfg = run("preset", "--preset", "baby", "--n-layer", 1)  # the preset's model, the recipe's training
    assert (config.arch, config.tie_weights, config.zero_init) == ("gpt2", True, False)
    assert train_cfg.optimizer == "muon"


def test_gpt2_adamw_cosine_trains_the_run_the_old_defaults_did_bit_for_bit(char_data, tmp_path, cli):
    """--arch gpt2 --optimizer adamw --lr-schedule cosine is the run tinygpt train made before the recipe:
    GPTConfig's and TrainConfig's own defaults (GPT-2's block, AdamW, cosine), every loss bit for bit."""
    r = cli("train", "--data", char_data, "--out", tmp_path / "flags", *SMALL, "--arch", "gpt2", "--optimizer", "adamw",
            "--lr-schedule", "cosine")
    assert r.returncode == 0, r.stderr
    assert TrainConfig().optimizer == "adamw" and TrainConfig().lr_schedule == "cosine" and GPTConfig().arch == "gpt2"
    sizes = dict(n_layer=2, n_head=2, n_embd=32, block_size=16)
    data_vocab = load(tmp_path / "flags").config.vocab_size
    train(char_data, tmp_path / "library", GPTConfig(vocab_size=data_vocab, **sizes),
          TrainConfig(batch_size=4, max_iters=12, eval_interval=4, eval_iters=2, warmup=3, device="cpu",
                      dtype="float32"))
    assert load(tmp_path / "flags").config == load(tmp_path / "library").config
    assert losses(tmp_path / "flags") == losses(tmp_path / "library") and len(losses(tmp_path / "library")) == 12
    r = cli("train", "--data", char_data, "--out", tmp_path / "recipe", *SMALL)
    assert r.returncode == 0, r.stderr
    assert losses(tmp_path / "recipe") != losses(tmp_path / "library")  # the recipe is another run


def test_fsdp_without_an_optimizer_flag_trains_with_adamw():
    from tinygpt.cli.train import with_recipe

    assert with_recipe({}, {"fsdp": True}, None)[1]["optimizer"] == "adamw"
    assert with_recipe({}, {}, None)[1] == {"optimizer": "muon", "lr_schedule": "wsd"}


# ---- the recipe bench (tinygpt bench --recipes) ---------------------------------------------------


def test_crossing_and_at_interpolate_between_evaluations():
    from tinygpt.lab.recipes import at, crossing

    curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert crossing(curve, 1.5) == 25.0
    assert crossing(curve, 3.5) == 10.0  # already below at the first evaluation
    assert crossing(curve, 0.5) is None
    assert at(curve, 15) == 2.5 and at(curve, 5) == 3.0 and at(curve, 40) == 1.0


def test_summary_ratios_are_against_the_reference_from_the_same_seed():
    from tinygpt.lab.recipes import summarize

    def run(recipe, seed, losses, per_step):
        return {"recipe": recipe, "seed": seed, "evals": [
            {"step": 10 * (i + 1), "tokens": 100 * (i + 1), "val_loss": v, "seconds": per_step * 10 * (i + 1)}
            for i, v in enumerate(losses)]}

    # seed 2 ran on a machine 10x slower, for both recipes alike; "fast" reaches 2019's final 2.0 at step 20
    runs = [run("2019", 1, [4.0, 3.0, 2.0], 1.0), run("fast", 1, [3.0, 2.0, 1.0], 2.0),
            run("2019", 2, [4.0, 3.0, 2.0], 10.0), run("fast", 2, [3.0, 2.0, 1.0], 20.0)]
    target, s = summarize(runs, ["2019", "fast"], "2019", bits_per_nat=2.0)
    assert target == 2.0
    assert s["2019"]["steps_to_target"] == 30 and s["2019"]["step_ratio"] == 1.0 and s["2019"]["time_ratio"] == 1.0
    assert s["fast"]["steps_to_target"] == 20 and s["fast"]["tokens_to_target"] == 200
    assert s["fast"]["step_ratio"] == pytest.approx(2 / 3)
    assert s["fast"]["time_ratio"] == pytest.approx(4 / 3)  # two-thirds the steps at twice the time a step
    assert s["fast"]["final_bits"] == 2.0 and s["fast"]["val_loss_at"]["0.5"] == pytest.approx(2.5)  # 150 of 300 tokens


def test_cli_recipe_bench_trains_each_recipe_and_writes_table_json_and_plot(char_data, tmp_path, cli):
    out = tmp_path / "r.json"
    r = cli("bench", "--recipes", "--data", str(char_data), "--recipe", "2019", "--recipe", "modern",
            "--seeds", "1", "--steps", "8", "--evals", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
            "--block-size", "16", "--batch-size", "4", "--eval-iters", "1", "--device", "cpu",
            "--json", str(out), "--plot", str(tmp_path / "r.png"))
    assert r.returncode == 0, r.stderr
    assert "| 2019 |" in r.stdout and "| modern |" in r.stdout and "steps to target" in r.stdout
    result = json.loads(out.read_text())
    assert [(x["recipe"], [e["step"] for e in x["evals"]]) for x in result["runs"]] == [("2019", [4, 8]),
                                                                                    ("modern", [4, 8])]
    assert result["summary"]["2019"]["step_ratio"] == 1.0
    assert result["recipes"]["modern"]["model"]["mlp"] == "swiglu" and result["recipes"]["modern"]["model"]["qk_norm"]
    assert result["recipes"]["modern"]["train"]["optimizer"] == "muon"
    assert result["recipes"]["2019"]["model"]["arch"] == "gpt2"
    assert (tmp_path / "r.png").stat().st_size > 0
    bad = cli("bench", "--recipes")
    assert bad.returncode != 0 and "--recipes needs --data" in bad.stderr and "Traceback" not in bad.stderr


def test_muon_s_float32_iteration_is_the_exact_one_and_near_torch_s_bfloat16():
    """Muon's Newton-Schulz iteration in float32 (a CPU that emulates bfloat16, issue 61): the iteration's
    float64 values within 1e-5, torch's bfloat16 ones within their rounding."""
    g = torch.Generator().manual_seed(0)
    matrices = [torch.randn(s, generator=g) for s in ((48, 48), (144, 48), (48, 144), (48, 48), (10, 7))]
    a, b, c = coefficients = (3.4445, -4.7750, 2.0315)
    for m, got in zip(matrices, orthogonalized(matrices, coefficients, 5, 1e-7)):
        x = m.double().T if m.shape[0] > m.shape[1] else m.double()
        x = x / x.norm()
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        torch.testing.assert_close(got.double(), x.T if m.shape[0] > m.shape[1] else x, atol=1e-5, rtol=1e-5)
        # torch's, in bfloat16
        torch.testing.assert_close(got, _zeropower_via_newtonschulz(m, coefficients, 5, 1e-7).float(), atol=3e-2,
                                   rtol=3e-2)


def test_muon_s_wide_matrices_iterate_on_their_gram_side_to_the_same_values_in_fewer_operations():
    """A matrix over 1.5 times as wide as tall (SwiGLU's, issue 61) iterates on its Gram side: the float64
    iteration's values within 5e-6 on matrices whose singular values span 1 to 1e-5, in 8 r^2 c + 28 r^3
    floating-point operations for Muon's five steps (X made twice; X's side's 20 r^2 c + 10 r^3); a square one
    as before."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    a, b, c = coefficients = (3.4445, -4.7750, 2.0315)
    for rows, columns, tall in ((48, 144, False), (48, 144, True), (40, 64, False), (48, 48, False)):
        u = torch.linalg.qr(torch.randn(rows, rows, generator=g))[0]
        v = torch.linalg.qr(torch.randn(columns, rows, generator=g))[0]
        m = (u * torch.logspace(0, -5, rows)) @ v.T
        with FlopCounterMode(display=False) as counter:
            got = orthogonalized([m.T if tall else m], coefficients, 5, 1e-7)[0]
        x = m.double() / m.norm()
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        torch.testing.assert_close(got.double(), x.T if tall else x, atol=5e-6, rtol=0)
        gram_side = 8 * rows ** 2 * columns + 28 * rows ** 3
        x_side = 5 * (4 * rows ** 2 * columns + 2 * rows ** 3)
        assert counter.get_total_flops() == (gram_side if columns > 1.5 * rows else x_side)


def test_muon_in_float32_steps_as_torch_s_and_keeps_its_state():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((32, 32), (96, 32), (32, 96))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = Muon(params, float32=True, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    torch_s = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    for step in range(3):
        for p, q in zip(params, theirs):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        ours.step()
        torch_s.step()
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p, q, atol=2e-3, rtol=0)  # their bfloat16 iteration, three steps in
    assert ours.state_dict()["state"].keys() == torch_s.state_dict()["state"].keys()
    torch.testing.assert_close(ours.state_dict()["state"][0]["momentum_buffer"],
                               torch_s.state_dict()["state"][0]["momentum_buffer"])
    again = Muon(copy.deepcopy(params), float32=True, lr=0.02)
    again.load_state_dict(ours.state_dict())  # a run moves between CPUs with its state


def test_muon_iterates_in_float32_on_a_cpu_that_emulates_bfloat16(monkeypatch):
    from tinygpt import optim

    model = GPT(GPTConfig(**RECIPE_MODEL, vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    for native in (False, True):
        monkeypatch.setattr(optim, "cpu_has_native_bf16", lambda: native)
        opt = make_optimizer(model, TrainConfig(lr=1e-3, optimizer="muon"), torch.device("cpu"))
        assert isinstance(opt, MuonAdamW) and opt.optimizers[0].float32 is not native
