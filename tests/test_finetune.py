"""Fine-tuning (tinygpt.finetune) on the one training loop: it beats the base and training from scratch
on a related text, LoRA trains the adapters alone and leaves the base bitwise, frozen parts stay
bitwise, keep best keeps the lowest validation loss, resume is bitwise, data prepared with another
tokenizer is refused with the prepare command to run; the learning-rate schedules; the settings."""

import hashlib
import json
import math
import os
import re
import shutil
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_text
from safetensors.torch import save_file

import tinygpt
from tinygpt import ConfigError, DataError, FinetuneConfig, GPTConfig, TrainConfig
from tinygpt import checkpoint
from tinygpt.calc import trainable_params
from tinygpt.config import LoraConfig
from tinygpt.data import load_data, prepare
from tinygpt.report import read_report
from tinygpt.optim import BudgetSchedule, lr_at
from tinygpt.train import TrainCallback, evaluate, has_checkpoint
from tinygpt.weights import read_weights

BASE = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=32)


def related_text(n_lines: int, seed: int) -> str:
    """make_text's words in another order ("the moon sees the cat."): the same characters, a related grammar."""
    lines = make_text(n_lines, seed).splitlines()
    return "".join(f"{line.split(' ', 2)[2].rstrip('.')} {line.split(' ', 2)[0]} {line.split(' ', 2)[1]}.\n"
                   for line in lines)


def quick(**overrides) -> TrainConfig:
    base = dict(max_iters=20, batch_size=8, eval_interval=10, eval_iters=2, lr=2e-3, warmup=2,
                lr_schedule="constant", weight_decay=0.0)
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A base pretrained for a few seconds on one text, its Hugging Face export, and a related text
    prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("finetune")
    (root / "a.txt").write_text(make_text(1500, seed=0))
    (root / "b.txt").write_text(related_text(1500, seed=1))
    prepare([str(root / "a.txt")], root / "data-a")
    tinygpt.train(root / "data-a", root / "base", BASE, quick(max_iters=150, lr=3e-3, eval_interval=150,
                                                               lr_schedule="cosine", warmup=10))
    from tinygpt.interop.hf_gpt2 import export_hf

    export_hf(checkpoint.load(root / "base"), checkpoint.folder_tokenizer(root / "base"), root / "hf")
    prepare([str(root / "b.txt")], root / "data-b", tokenizer=None, tokenizer_file=root / "hf")
    return root


@pytest.fixture(scope="module")
def bf16_base(world):
    """The base with its weights stored in bfloat16, as SmolLM2's and Qwen's are published."""
    shutil.copytree(world / "base", world / "base-bf16")
    weights, meta = read_weights(world / "base-bf16" / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, world / "base-bf16" / "model.safetensors",
              metadata=meta)
    return world / "base-bf16"


def tensors(folder, name="model.safetensors"):
    return read_weights(folder / name)[0]


def file_hash(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- what it must show ------------------------------------------------------------------------


def test_finetuned_beats_the_base_and_a_model_trained_from_scratch(world, tmp_path):
    # from the Hugging Face export, on data prepared with that folder's tokenizer
    result = tinygpt.finetune(world / "hf", world / "data-b", tmp_path / "ft", FinetuneConfig(), quick(max_iters=40))
    report = result.report
    assert report == read_report(tmp_path / "ft")
    assert report["after"]["data"]["loss"] < report["before"]["data"]["loss"] - 0.1
    tinygpt.train(world / "data-b", tmp_path / "scratch", BASE, quick(max_iters=40))
    val = np.asarray(load_data(world / "data-b").val[: FinetuneConfig().report_tokens + 1])
    scratch = evaluate(checkpoint.load(tmp_path / "scratch"), val)["loss"]
    assert report["after"]["data"]["loss"] < scratch - 0.1
    # the rest of the report: the same prompt before and after, parameters, memory, time
    assert [s["prompt"] for s in report["before"]["samples"]] == [s["prompt"] for s in report["after"]["samples"]]
    assert report["params"]["trainable"] == report["params"]["total"] == tinygpt.load(world / "hf").num_params()
    assert report["memory"]["peak_rss_bytes"] > 10 * 2**20 and report["seconds"] > 0
    assert "reference" not in report["before"]  # a Hugging Face base names no data of its own


def test_lora_trains_the_adapters_alone_and_merges(world, tmp_path):
    pytest.importorskip("transformers")
    base = world / "base"
    before = file_hash(base / "model.safetensors")
    cfg = FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets=("attn", "mlp"), block_size=16)
    grads = {}

    class Grads(TrainCallback):
        def on_end(self, result, model):
            grads.update({n: p.numel() for n, p in model.named_parameters() if p.requires_grad})

    result = tinygpt.finetune(base, world / "data-b", tmp_path / "lora", cfg, quick(), merge=tmp_path / "merged",
                              callbacks=[Grads()])
    lora = LoraConfig(rank=4, alpha=8, targets=("attn", "mlp"))
    figure = trainable_params(BASE, lora=lora).trainable
    assert all(n.endswith((".lora_A", ".lora_B")) for n in grads) and sum(grads.values()) == figure
    assert result.report["params"]["trainable"] == figure
    assert file_hash(base / "model.safetensors") == before  # the base is untouched
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == sorted([
        "adapter_config.json", "adapter_model.safetensors", "config.json", "finetune_report.json", "metrics.jsonl",
        "tinygpt_adapter.json", "tokenizer.json", "train_config.json", "train_state.pt"])
    adapted = checkpoint.load(tmp_path / "lora")  # adapters kept apart
    merged = checkpoint.load(tmp_path / "merged")
    # block_size bounded the training window alone: the run and its merge keep the base's context (once cropped to 16)
    assert adapted.config.block_size == merged.config.block_size == BASE.block_size
    assert json.loads((tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()[0])["tokens"] == 8 * 16
    assert adapted.lora_config is not None and not hasattr(merged, "lora_config")
    base_model = checkpoint.load(base)
    for name, t in base_model.state_dict().items():  # the adapted model's frozen weights are the base's, whole
        assert torch.equal(adapted.state_dict()[name], t), name
    idx = torch.randint(0, BASE.vocab_size, (2, BASE.block_size))
    with torch.no_grad():
        torch.testing.assert_close(merged(idx), adapted(idx), atol=1e-5, rtol=0)
    assert not torch.allclose(merged(idx), base_model(idx), atol=1e-4)  # the adapters did learn something
    # the merged run, exported to Hugging Face, loads in transformers with the same logits
    from transformers import GPT2LMHeadModel

    from tinygpt.interop.hf_gpt2 import export_hf

    export_hf(merged, None, tmp_path / "merged-hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, merged(idx), atol=1e-4, rtol=0)
    # a base that has moved is refused, naming where it was
    base.rename(base.parent / "base-moved")
    try:
        with pytest.raises(tinygpt.CheckpointError, match=f"base model {base} is missing"):
            checkpoint.load(tmp_path / "lora")
    finally:
        (base.parent / "base-moved").rename(base)


def test_frozen_parts_stay_bitwise(world, tmp_path):
    cfg = FinetuneConfig(freeze_embeddings=True, freeze_layers=1)
    result = tinygpt.finetune(world / "base", world / "data-b", tmp_path / "frozen", cfg, quick(max_iters=10))
    old, new = tensors(world / "base"), tensors(tmp_path / "frozen")
    frozen = [n for n in old if n.startswith(("wte.", "wpe.", "h.0."))]
    assert frozen and all(torch.equal(old[n], new[n]) for n in frozen)
    assert all(not torch.equal(old[n], new[n]) for n in old if n not in frozen and n.endswith(".weight"))
    assert result.report["params"]["trainable"] == trainable_params(BASE, freeze_embeddings=True,
                                                                     freeze_layers=1).trainable


def test_block_size_is_the_training_window_and_the_position_table_stays_whole(world, tmp_path):
    # once: block_size cropped the position table to the window, and the run's context with it, for good
    result = tinygpt.finetune(world / "base", world / "data-b", tmp_path / "ft", FinetuneConfig(block_size=16),
                              quick(max_iters=10))
    old, new = tensors(world / "base"), tensors(tmp_path / "ft")
    assert checkpoint.load_config(tmp_path / "ft").block_size == BASE.block_size
    assert new["wpe.weight"].shape == old["wpe.weight"].shape
    assert torch.equal(new["wpe.weight"][16:], old["wpe.weight"][16:])  # rows past the window get no gradient
    assert not torch.equal(new["wpe.weight"][:16], old["wpe.weight"][:16])
    # the report measures on windows of 16, as the training evaluates
    data = np.asarray(load_data(world / "data-b").val[: FinetuneConfig().report_tokens + 1])
    after = evaluate(checkpoint.load(tmp_path / "ft"), data, block_size=16)["loss"]
    assert result.report["after"]["data"]["loss"] == pytest.approx(after)


def test_keep_best_keeps_the_lowest_validation_loss(world, tmp_path):
    # trained on text written backwards, validated on the base's own: the validation loss rises as it forgets
    backwards = "".join(line[::-1] + "\n" for line in make_text(1500, seed=2).splitlines())
    (tmp_path / "mix.txt").write_text(backwards + make_text(150, seed=3))
    prepare([str(tmp_path / "mix.txt")], tmp_path / "mix", tokenizer=None, tokenizer_file=world / "base",
            val_fraction=0.1)
    cfg = FinetuneConfig(keep="best")
    tinygpt.finetune(world / "base", tmp_path / "mix", tmp_path / "best", cfg, quick(max_iters=30, eval_interval=5,
                                                                                    lr=3e-3))
    evals = [r for r in map(json.loads, (tmp_path / "best" / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r]
    best = min(evals, key=lambda r: r["val_loss"])
    assert evals[-1]["val_loss"] > best["val_loss"] and best["step"] < 30  # it did rise
    assert checkpoint.weights_step(tmp_path / "best") == best["step"]
    assert [r["kept"] for r in evals] == [r["val_loss"] <= min(e["val_loss"] for e in evals[: i + 1])
                                          for i, r in enumerate(evals)]
    report = read_report(tmp_path / "best")
    data = np.asarray(load_data(tmp_path / "mix").val[: cfg.report_tokens + 1])
    assert report["after"]["data"]["loss"] == pytest.approx(evaluate(checkpoint.load(tmp_path / "best"), data)["loss"])


@pytest.mark.parametrize("method", ["full", "lora"])
def test_keep_best_keeps_from_when_no_step_beats_it(world, tmp_path, method):
    # once: the first evaluation after step 0 was the best there was, so a run that only got worse kept
    # a model worse than FROM (base val 3.50, kept step 10 at 4.20)
    from tinygpt.cli.finetune import format_report

    run, merged = tmp_path / "best", tmp_path / "merged"
    cfg = FinetuneConfig(method=method, keep="best", lora_targets=("attn", "mlp"))
    result = tinygpt.finetune(world / "base", world / "data-b", run, cfg, quick(max_iters=10, eval_interval=5, lr=0.3),
                              merge=merged if method == "lora" else None)  # a rate that only harms
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [(r["step"], r["kept"]) for r in evals] == [(0, True), (5, False), (10, False)]
    assert min(r["val_loss"] for r in evals[1:]) > evals[0]["val_loss"]
    # the run holds FROM, as a run folder of its kind: a full run FROM's weights, an adapter run its adapters at zero
    assert checkpoint.weights_step(run) == 0 and has_checkpoint(run)
    assert checkpoint.is_adapter_run(run) == (method == "lora")
    base = tensors(world / "base")
    if method == "full":
        kept = tensors(run)
        assert kept.keys() == base.keys() and all(torch.equal(kept[k], base[k]) for k in base)
    else:
        adapters = tensors(run, "adapter_model.safetensors")
        assert all(not t.any() for k, t in adapters.items() if "lora_B" in k)
        assert all(torch.equal(t, base[k]) for k, t in tensors(merged).items())
    report = result.report
    assert report["kept_step"] == 0 and report["steps"] == 10
    assert report["after"]["data"]["loss"] == report["before"]["data"]["loss"]
    assert any("kept step 0" in line and "no step's validation loss went below FROM's" in line
               for line in format_report(report))
    # the kept FROM resumes as any checkpoint does, from step 0
    resumed = tinygpt.finetune(world / "base", world / "data-b", run, cfg, quick(max_iters=2, eval_interval=1),
                               resume=True)
    assert resumed.train.step == 2


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_resume_is_bitwise(world, bf16_base, tmp_path, method, stored):
    # a bfloat16 base trains in float32: a full run saved in bfloat16 resumes from the float32 weights its state
    # keeps, LoRA's float32 adapters come back unrounded onto it
    base = bf16_base if stored == "bfloat16" else world / "base"
    cfg = FinetuneConfig(method=method, dropout=0.1, lora_dropout=0.1 if method == "lora" else 0.0, block_size=24)
    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    whole = tmp_path / "whole"
    tinygpt.finetune(base, world / "data-b", whole, cfg, quick(eval_interval=5))
    cut = tmp_path / "cut"
    tinygpt.finetune(base, world / "data-b", cut, cfg, quick(eval_interval=5), should_stop=lambda s: s == 7)
    assert checkpoint.weights_step(cut) == 7 and checkpoint.is_adapter_run(cut) == (method == "lora")
    assert has_checkpoint(cut)
    result = tinygpt.finetune(base, world / "data-b", cut, cfg, quick(eval_interval=5), resume=True)
    assert result.train.step == 20
    a, b = tensors(whole, name), tensors(cut, name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {str(t.dtype) for t in a.values()} == {"torch.float32" if method == "lora" else f"torch.{stored}"}


def test_runs_fine_tuned_before_the_float32_weights_and_the_whole_context_still_resume(world, bf16_base, tmp_path):
    # a bfloat16 base's run as fine-tuning wrote it then: trained in bfloat16, its AdamW moments too, no float32 weights
    run = tmp_path / "bf16"
    tinygpt.finetune(bf16_base, world / "data-b", run, FinetuneConfig(), quick(max_iters=4))
    state = torch.load(run / "train_state.pt", weights_only=True)
    del state["master"]
    for moments in state["optimizer"]["state"].values():
        moments.update({k: v.to(torch.bfloat16) for k, v in moments.items() if k != "step"})
    torch.save(state, run / "train_state.pt")
    result = tinygpt.finetune(bf16_base, world / "data-b", run, FinetuneConfig(), quick(max_iters=8), resume=True)
    assert result.train.step == 8 and {t.dtype for t in tensors(run).values()} == {torch.bfloat16}
    assert "master" in torch.load(run / "train_state.pt", weights_only=True)
    # a run whose context block_size cropped: config.json's and the position table's
    run = tmp_path / "cropped"
    tinygpt.finetune(world / "base", world / "data-b", run, FinetuneConfig(block_size=16), quick(max_iters=4))
    weights, meta = read_weights(run / "model.safetensors")
    save_file({**weights, "wpe.weight": weights["wpe.weight"][:16].clone()}, run / "model.safetensors", metadata=meta)
    (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), "block_size": 16}))
    state = torch.load(run / "train_state.pt", weights_only=True)
    wpe = [n for n, p in tinygpt.GPT(BASE).named_parameters() if p.dim() >= 2].index("wpe.weight")  # AdamW's order
    state["optimizer"]["state"][wpe].update({k: v[:16].clone() for k, v in state["optimizer"]["state"][wpe].items()
                                             if k != "step"})
    torch.save(state, run / "train_state.pt")
    result = tinygpt.finetune(world / "base", world / "data-b", run, FinetuneConfig(block_size=16), quick(max_iters=8),
                              resume=True)
    assert result.train.step == 8 and checkpoint.load(run).config.block_size == 16


def test_train_resume_of_a_fine_tune_run_is_refused_naming_finetune(world, tmp_path, cli):
    # train --resume knows neither the base nor the window: it would train at the model's whole context
    run = tmp_path / "ft"
    tinygpt.finetune(world / "base", world / "data-b", run, FinetuneConfig(block_size=16), quick(max_iters=2))
    kept = {f.name: f.read_bytes() for f in run.iterdir()}
    r = cli("train", "--data", world / "data-b", "--out", run, "--resume", "--max-iters", 4)
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert f"is a fine-tune run: continue it with tinygpt finetune {(world / 'base').resolve()}" in r.stderr
    assert {f.name: f.read_bytes() for f in run.iterdir()} == kept


class Counting(TrainCallback):
    def __init__(self):
        self.steps = 0

    def on_step(self, record, total):
        self.steps += 1


def test_another_objective_trains_from_a_base_through_the_one_seam(world, tmp_path, cli):
    """A Tuning is what another objective's command brings (its name, settings, objective, measure): tune()
    trains FROM with it as finetune() does, records its name and settings, reports its own section of
    numbers beside the reference text's loss, and only its own command resumes the run."""
    from tinygpt.cli.finetune import format_report
    from tinygpt.finetune import Tuning, tune
    from tinygpt.train.objectives import NextToken

    counter = Counting()

    class Toy(Tuning):
        name, title, sampled = "toy", "trained on toys", "greedy"

        def begin(self, base, dataset, cfg):
            self.val = np.asarray(dataset.val[:65])

        def measure(self, model):
            return {"toy": {"val_loss": evaluate(model, self.val)["loss"], "one": 1.0},
                    "samples": [{"prompt": "the", "text": "cat"}]}

        def trains_on(self, data):  # a DataSet of its own, held in memory
            return load_data(data)

        def objective(self):
            return NextToken

        def settings(self):
            return {"knob": 3}

    cfg = FinetuneConfig(reference=str(world / "a.txt"))
    result = tune(world / "base", world / "data-b", tmp_path / "toy", Toy(), cfg, quick(max_iters=4),
                  callbacks=[counter])
    record = json.loads((tmp_path / "toy" / "train_config.json").read_text())
    assert record["objective"] == "toy" and record["toy"] == {"knob": 3} and counter.steps == 4
    assert record["data"] == str(world / "data-b")  # the DataSet's own path
    report = read_report(tmp_path / "toy")
    assert report == result.report and report["objective"] == "toy" and report["toy"] == {"knob": 3}
    assert list(report["before"]) == ["toy", "reference", "samples"]
    assert report["after"]["toy"]["val_loss"] < report["before"]["toy"]["val_loss"]
    assert report["forgetting"] == report["after"]["reference"]["loss"] - report["before"]["reference"]["loss"]
    lines = format_report(report)
    assert lines[0].startswith(f"trained on toys from {world / 'base'} (full, keep last): 4 steps")
    assert any(line.split()[:3] == ["toy", "val", "loss"] for line in lines)
    assert "  sample of 'the' (greedy):" in lines and any("reference (forgetting) loss" in line for line in lines)
    kept = {f.name: f.read_bytes() for f in (tmp_path / "toy").iterdir()}
    with pytest.raises(ConfigError, match=r"is a toy run: continue it with tinygpt toy .* --out .* --resume"):
        tinygpt.finetune(world / "base", world / "data-b", tmp_path / "toy", cfg, quick(max_iters=6), resume=True)
    r = cli("train", "--data", world / "data-b", "--out", tmp_path / "toy", "--resume", "--max-iters", 6)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "is a toy run: continue it with tinygpt toy" in r.stderr
    assert {f.name: f.read_bytes() for f in (tmp_path / "toy").iterdir()} == kept
    tinygpt.finetune(world / "base", world / "data-b", tmp_path / "ft", cfg, quick(max_iters=2))
    with pytest.raises(ConfigError, match="is a fine-tune run: continue it with tinygpt finetune .* --data DATA"):
        tune(world / "base", world / "data-b", tmp_path / "ft", Toy(), cfg, quick(max_iters=4), resume=True)
    resumed = tune(world / "base", world / "data-b", tmp_path / "toy", Toy(), cfg, quick(max_iters=6), resume=True)
    assert resumed.train.step == 6 and resumed.report["steps"] == 6


def test_data_of_another_tokenizer_is_refused_with_the_prepare_command(world, tmp_path):
    from tinygpt import cli

    (tmp_path / "mine.txt").write_text("the cat sees the moon.\n" * 300)  # fewer characters than the base knows
    prepare([str(tmp_path / "mine.txt")], tmp_path / "mine")  # its own char vocabulary
    with pytest.raises(DataError, match="another tokenizer") as e:
        tinygpt.finetune(world / "base", tmp_path / "mine", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    message = str(e.value)
    assert "\n" not in message
    command = shlex.split(message.split("prepare it with: ")[1])
    assert command[:2] == ["tinygpt", "prepare"] and command[command.index("--tokenizer-file") + 1] == str(world / "base")
    assert cli.main(command[1:]) == 0  # the command it prints runs, and its data is accepted
    out = command[command.index("--out") + 1]
    tinygpt.finetune(world / "base", out, tmp_path / "run", FinetuneConfig(), quick(max_iters=2))


# ---- settings ---------------------------------------------------------------------------------


def test_finetune_settings_are_checked():
    for bad in (dict(method="qlora"), dict(keep="first"), dict(lora_alpha=math.nan), dict(dropout=math.inf),
                dict(method="lora", freeze_layers=1), dict(block_size=0), dict(lora_targets="c_proj"),
                dict(freeze_layers=-1), dict(lora_rank=0)):
        with pytest.raises(ConfigError):
            FinetuneConfig(**bad)
    assert FinetuneConfig(method="lora", lora_targets="attn,mlp").lora_targets == ("attn", "mlp")
    assert FinetuneConfig(method="lora", lora_targets="attn,mlp").lora.resolved_for(GPTConfig()).targets == (
        "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert FinetuneConfig().default_lr < 1e-4 < FinetuneConfig(method="lora").default_lr < tinygpt.config.DEFAULT_LR
    assert FinetuneConfig.from_dict(FinetuneConfig(method="lora").to_dict()) == FinetuneConfig(method="lora")
    with pytest.raises(ConfigError, match="lr_schedule"):
        TrainConfig(lr_schedule="linear")


@pytest.mark.parametrize("command", ["finetune", "grpo"])
def test_a_time_budget_replaces_the_default_step_count(command, tmp_path):
    """`--max-time` alone trains for the time given, as the help says (200 steps unless --max-time is given):
    the recipe's 200 steps stopped a run of --max-time 60s after 11 s. Both given, the first reached stops."""
    from tinygpt.cli import build_parser
    from tinygpt.cli.finetune import tuning_configs
    from tinygpt.config.grpo import DEFAULT_TRAIN as GRPO_TRAIN
    from tinygpt.finetune import DEFAULT_TRAIN as FINETUNE_TRAIN

    args = {"finetune": ["finetune", "base", "--data", "d", "--out", str(tmp_path / "r")],
            "grpo": ["grpo", "base", "--task", "addition", "--out", str(tmp_path / "r")]}[command]
    recipe = FINETUNE_TRAIN if command == "finetune" else GRPO_TRAIN
    parse = build_parser().parse_args
    _, train = tuning_configs(parse(args), False, recipe)
    assert (train.max_iters, train.max_time) == (200, None)
    _, train = tuning_configs(parse([*args, "--max-time", "60s"]), False, recipe)
    assert (train.max_iters, train.max_time) == (None, 60.0)
    _, train = tuning_configs(parse([*args, "--max-time", "60s", "--max-iters", "50"]), False, recipe)
    assert (train.max_iters, train.max_time) == (50, 60.0)


def test_longer_context_and_merge_with_full_are_refused(world, tmp_path):
    with pytest.raises(ConfigError, match="longer than"):
        tinygpt.finetune(world / "base", world / "data-b", tmp_path / "r", FinetuneConfig(block_size=64), quick())
    with pytest.raises(ConfigError, match="merge goes with method lora"):
        tinygpt.finetune(world / "base", world / "data-b", tmp_path / "r", FinetuneConfig(), quick(),
                         merge=tmp_path / "m")
    # a merge target that is taken is refused before any training, not after it
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    lora = FinetuneConfig(method="lora", lora_rank=2)
    # (the run's own folder, not there yet, was once said to exist already)
    for target, why in ((tmp_path / "taken", "already exists"), (tmp_path / "r", "a folder this job reads or writes"),
                        (world / "base", "a folder this job reads or writes")):
        with pytest.raises(tinygpt.CheckpointError, match=f"{why}.*; merge into a new folder"):
            tinygpt.finetune(world / "base", world / "data-b", tmp_path / "r", lora, quick(), merge=target)
    assert not (tmp_path / "r").exists() and (tmp_path / "taken" / "x").read_text() == "mine"


def test_lr_schedules():
    constant = TrainConfig(lr=1e-3, warmup=4, lr_schedule="constant", max_iters=100)
    assert [lr_at(s, constant, 100) for s in (0, 3, 4, 99)] == [2.5e-4, 1e-3, 1e-3, 1e-3]
    inv = TrainConfig(lr=1e-3, warmup=4, lr_schedule="inverse-sqrt", max_iters=100)
    assert lr_at(3, inv, 100) == 1e-3 and lr_at(15, inv, 100) == pytest.approx(1e-3 * 0.5)
    assert lr_at(99, inv, 100) == pytest.approx(1e-3 * math.sqrt(4 / 100))
    # a time budget: the lengthless schedules do not depend on the estimated length
    budget = BudgetSchedule(TrainConfig(lr=1e-3, warmup=2, lr_schedule="inverse-sqrt", max_time=60))
    rates = [budget.next_lr(s) for s in range(8)]
    assert rates[1] == 1e-3 and rates[7] == pytest.approx(1e-3 * math.sqrt(2 / 8))


def test_grad_checkpoint_gives_the_same_gradients():
    torch.manual_seed(0)
    model = tinygpt.GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)).train()
    idx = torch.randint(0, 32, (2, 16))

    def grads(recompute: bool):
        model.grad_checkpoint = recompute
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(idx).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's VmHWM")
def test_measured_peak_memory_is_within_15_percent_of_the_estimate():
    # full, LoRA r=8, frozen-but-the-last, full with recomputation: each method's peak RSS in a fresh
    # process against `params`' figure
    methods = [{}, {"lora": {"rank": 8}}, {"freeze_embeddings": True, "freeze_layers": 3}, {"grad_checkpoint": True}]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join([str(Path(tinygpt.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_rss.py")), *map(json.dumps, methods)],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == 4
    for method, r in zip(methods, results):
        assert r["peak"] == pytest.approx(r["estimate"], rel=0.15), method
    assert results[1]["estimate"] < 0.75 * results[0]["estimate"]  # LoRA's saving is real, and measured
    assert results[3]["peak"] < 0.8 * results[0]["peak"]  # and recomputation's


# ---- the command line -------------------------------------------------------------------------


def test_cli_finetune_lora_merge_report_and_resume(world, tmp_path, capsys):
    from tinygpt import cli

    run, merged = tmp_path / "run", tmp_path / "merged"
    flags = ["--data", str(world / "data-b"), "--out", str(run), "--max-iters", "4", "--eval-interval", "2",
             "--eval-iters", "1", "--batch-size", "4", "--quiet"]
    code = cli.main(["finetune", str(world / "base"), *flags, "--method", "lora", "--lora-rank", "2",
                     "--lora-targets", "attn,mlp", "--lr", "1e-3", "--lr-schedule", "inverse-sqrt", "--keep", "best",
                     "--block-size", "16", "--prompt", "the cat", "--merge", str(merged)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "max_iters: 4 steps" in out and "validation loss" in out and "sample of 'the cat'" in out
    assert checkpoint.is_adapter_run(run) and (merged / "model.safetensors").is_file()
    assert read_report(run)["method"] == "lora"
    assert cli.main(["report", str(run)]) == 0 and "reference (forgetting) loss" in capsys.readouterr().out
    assert cli.main(["report", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == read_report(run)["params"]
    # resume takes the run's own settings (LoRA, its rank) and goes on to the new --max-iters
    flags[flags.index("--max-iters") + 1] = "6"
    assert cli.main(["finetune", str(world / "base"), *flags, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "max_iters: 6 steps" in out and read_report(run)["method"] == "lora"
    # the time of the whole run, the checkpoint's before the resume included (once this invocation's alone)
    whole, this = map(float, re.search(r"tokens in ([0-9.]+)s \(([0-9.]+)s of it this time\)", out).groups())
    assert whole > this and read_report(run)["train_seconds"] == pytest.approx(whole, abs=0.05)


@pytest.mark.parametrize("extra, message", [
    (["--lora-rank", "4"], "--lora-rank goes with --method lora"),
    (["--method", "lora", "--freeze-layers", "1"], "--freeze-layers goes with --method full"),
    (["--block-size", "64"], "longer than"),
    (["--method", "qlora"], "invalid choice"),
    (["--lr-schedule", "linear"], "invalid choice"),
    (["--lr", "nan"], "--lr"),
    (["--merge", "m"], "merge goes with method lora"),
    (["--reference", "/nonexistent.txt"], "cannot read the reference text"),
    # once accepted without a word (and 10**12 ran out of memory): B A has no higher rank than min(in, out)
    (["--method", "lora", "--lora-rank", "33"], "--lora-rank: 33 is more than 32, min(in, out) of the adapted "
                                                 "attn.c_attn (32 in, 96 out)"),
    (["--method", "lora", "--lora-rank", str(10**12)], "--lora-rank: 1000000000000 is more than 32"),
])
def test_cli_finetune_errors_are_one_line(world, tmp_path, capsys, extra, message):
    from tinygpt import cli

    code = cli.main(["finetune", str(world / "base"), "--data", str(world / "data-b"), "--out", str(tmp_path / "r"),
                     *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_cli_reference_and_prompt_the_vocabulary_cannot_write_are_refused_naming_the_flag(world, tmp_path, capsys,
                                                                                       monkeypatch):
    # once: "1 character not in the tokenizer's vocabulary: 'é' (U+00E9) at position 8", naming neither flag
    from tinygpt import cli

    def measured(*args, **kwargs):
        raise AssertionError("measured the base before refusing the flag")

    monkeypatch.setattr("tinygpt.report.evaluate", measured)  # refused before the report's first measurement
    (tmp_path / "ref.txt").write_text("the cat sees the moon é\n")
    for extra, flag in ((["--reference", str(tmp_path / "ref.txt")], f"--reference {tmp_path / 'ref.txt'}: "),
                        (["--prompt", "the cat", "--prompt", "the é"], "--prompt 'the é': ")):
        code = cli.main(["finetune", str(world / "base"), "--data", str(world / "data-b"), "--out", str(tmp_path / "r"),
                         *extra])
        err = capsys.readouterr().err
        assert code == 2 and flag in err and "'é' (U+00E9)" in err and err.count("\n") == 1, err
        assert not (tmp_path / "r").exists()


def test_finetune_help_example_names_a_folder_it_says_how_to_get(capsys):
    # once: `tinygpt finetune gpt2 ...`, as if GPT-2 were built in; the tutorial downloads it into hf/gpt2
    from tinygpt import cli

    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    example = capsys.readouterr().out.split("example:")[1]
    lines = [line.strip() for line in example.splitlines() if line.strip().startswith(("hf ", "tinygpt "))]
    words = [shlex.split(line) for line in lines]
    downloaded = {w[w.index("--local-dir") + 1] for w in words if w[0] == "hf"}
    prepare = next(w for w in words if w[:2] == ["tinygpt", "prepare"])
    finetune = next(w for w in words if w[:2] == ["tinygpt", "finetune"])
    assert finetune[2] in downloaded and prepare[prepare.index("--tokenizer-file") + 1] in downloaded
    tutorial = (Path(__file__).parent.parent / "docs" / "tutorials" / "finetune.md").read_text()
    assert all(line in tutorial for line in lines if line.startswith("hf "))  # the tutorial's own download


REPORT_EDITS = [
    (lambda r: r.pop("after"), "after is missing"),
    (lambda r: r["before"]["data"].pop("bits_per_char"), "before.data.bits_per_* is missing"),
    (lambda r: r["after"]["samples"][0].pop("text"), "after.samples[0].text is missing"),
    (lambda r: r["after"]["data"].update(loss="low"), "after.data.loss is not a number"),
    (lambda r: r["params"].update(total=None), "params.total is not a whole number"),
    (lambda r: r["after"].pop("reference"), "after.reference is missing"),
    (lambda r: r["after"]["reference"].update(bits_per_byte=r["after"]["reference"].pop("bits_per_char")),
     "count bits in different units"),
    (lambda r: r.update(memory=[]), "memory is not an object"),
]


def test_cli_report_of_an_incomplete_or_edited_report_is_one_line(world, tmp_path, capsys):
    from tinygpt import cli

    run = tmp_path / "ft"
    tinygpt.finetune(world / "base", world / "data-b", run, FinetuneConfig(report_tokens=64),
                     quick(max_iters=1, eval_interval=1, eval_iters=1, batch_size=2))
    assert cli.main(["report", str(run)]) == 0
    capsys.readouterr()
    whole = (run / "finetune_report.json").read_text()
    for edit, message in REPORT_EDITS:
        report = json.loads(whole)
        edit(report)
        (run / "finetune_report.json").write_text(json.dumps(report))
        assert cli.main(["report", str(run)]) == 2, message
        err = capsys.readouterr().err
        assert "incomplete or edited" in err and message in err and err.count("\n") == 1, err


def test_cli_report_and_prepare_refusals(world, tmp_path, capsys):
    from tinygpt import cli

    assert cli.main(["report", str(world / "base")]) == 2
    assert "no finetune_report.json" in capsys.readouterr().err
    assert cli.main(["finetune", str(tmp_path / "nowhere"), "--data", str(world / "data-b"), "--out",
                     str(tmp_path / "r")]) == 2
    assert "no such model folder" in capsys.readouterr().err


def test_resume_keeps_the_method_the_adapters_and_the_base(world, tmp_path):
    lora = FinetuneConfig(method="lora", lora_rank=2)
    tinygpt.finetune(world / "base", world / "data-b", tmp_path / "r", lora, quick(max_iters=2))
    other = tinygpt.finetune(world / "base", world / "data-b", tmp_path / "other", FinetuneConfig(),
                             quick(max_iters=2)).run  # a plain run: other weights
    kept = {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir()}
    for cfg, from_, why in [(FinetuneConfig(), world / "base", "with method 'lora', not 'full'"),
                            (FinetuneConfig(method="lora", lora_rank=4), world / "base", "with lora_rank 2, not 4"),
                            (lora, other, "is not the base")]:
        with pytest.raises(ConfigError, match=why):
            tinygpt.finetune(from_, world / "data-b", tmp_path / "r", cfg, quick(max_iters=4), resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir()} == kept
    # the same settings, from the base's Hugging Face export (the same weights): it resumes
    result = tinygpt.finetune(world / "hf", world / "data-b", tmp_path / "r", lora, quick(max_iters=4), resume=True)
    assert result.train.step == 4
    # a base moved since (the same weights under another name): it resumes from there (once: "base is missing")
    shutil.copytree(world / "base", tmp_path / "base")
    tinygpt.finetune(tmp_path / "base", world / "data-b", tmp_path / "moved", lora, quick(max_iters=2))
    (tmp_path / "base").rename(tmp_path / "base-moved")
    result = tinygpt.finetune(tmp_path / "base-moved", world / "data-b", tmp_path / "moved", lora, quick(max_iters=4),
                              resume=True)
    assert result.train.step == 4


def test_resume_of_a_full_fine_tune_keeps_its_base_and_what_it_freezes_and_a_pretraining_run_is_refused(world,
                                                                                                    tmp_path):
    # once: another FROM went on without a word (and the report's "before" was the other model's); a
    # plain train run as the run was trained on at another rate and its weights replaced
    shutil.copytree(world / "base", tmp_path / "pretrained")
    tinygpt.finetune(world / "base", world / "data-b", tmp_path / "full", FinetuneConfig(), quick(max_iters=2))
    cases = [(tmp_path / "full", tmp_path / "full", FinetuneConfig(), "is not the base"),
             (world / "base", tmp_path / "full", FinetuneConfig(freeze_layers=1), "with freeze_layers 0, not 1"),
             (world / "base", tmp_path / "pretrained", FinetuneConfig(), "is not a fine-tune run")]
    for from_, run, cfg, why in cases:
        kept = {f.name: f.read_bytes() for f in run.iterdir()}
        with pytest.raises(ConfigError, match=why):
            tinygpt.finetune(from_, world / "data-b", run, cfg, quick(max_iters=4), resume=True)
        assert {f.name: f.read_bytes() for f in run.iterdir()} == kept
    # the same base, moved or exported (the same weights): it resumes
    result = tinygpt.finetune(world / "hf", world / "data-b", tmp_path / "full", FinetuneConfig(), quick(max_iters=4),
                              resume=True)
    assert result.train.step == 4
