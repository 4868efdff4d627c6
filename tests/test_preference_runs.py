"""`tinygpt dpo` and `tinygpt reward` end to end, on a small Qwen2-shaped model: a DPO run logs TRL's metrics
for training and for the validation pairs at step 0 (where the loss is log 2 and the margins zero), reports,
evaluates and samples as any run; LoRA DPO trains the adapters alone and PEFT loads them with tinygpt's
logits; a run killed with SIGKILL resumes bitwise; a reward model trains, scores, evaluates and exports as
the sequence classifier transformers scores alike; and what is refused is refused in one line, nothing
written."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import tinygpt
from tinygpt import GPT, GPTConfig
from tinygpt.align.dpo import METRICS, CollapseWatch
from tinygpt.align.reward import scores
from tinygpt.checkpoint import folder_tokenizer
from tinygpt.data.preference import prepare_preference
from tinygpt.data.text import prepare
from tinygpt.run_folder import RunFolder
from tinygpt.tokenizer.bpe import BPETokenizer
from tinygpt.weights import read_weights

TEXT = "the sky is blue and the grass is green, a cat sat on the mat, what colour is the sea? " * 40
WORDS = ["sky", "grass", "cat", "mat", "sea", "blue", "green", "sat", "colour", "what"]
QWEN2 = dict(arch="llama", qkv_bias=True, n_kv_head=1, intermediate_size=64, tie_weights=False)
QUICK = ["--max-iters", "8", "--eval-interval", "4", "--eval-iters", "2", "--batch-size", "4", "--lr", "3e-3",
         "--warmup", "1", "--quiet"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random Qwen2-shaped base with a BPE tokenizer (its Hugging Face export beside it), 32 standard pairs
    prepared with its tokenizer (a quarter held out), and its tokenizer's text as plain data."""
    root = tmp_path_factory.mktemp("prefruns")
    tok = BPETokenizer.train([TEXT], 300)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=2, n_head=2, n_embd=32, **QWEN2))
    tinygpt.save(model, root / "base", tok)
    from tinygpt.interop.hf import export_hf

    export_hf(model, tok, root / "hf")
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(32):
        a, b, c = (WORDS[j] for j in torch.randint(0, len(WORDS), (3,), generator=g).tolist())
        rows.append({"prompt": f"the {a} is", "chosen": f" {b} and {a}", "rejected": f" {c}{'' if c != b else 's'}"})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_preference(root / "pairs.jsonl", root / "pairs", tokenizer_file=root / "base", val_fraction=0.25)
    (root / "text.txt").write_text(TEXT)
    prepare([str(root / "text.txt")], root / "text", tokenizer=None, tokenizer_file=root / "base")
    return root


def records(run):
    return [json.loads(line) for line in RunFolder(run).metrics_file.read_text().splitlines()]


def one_line(r, *fragments):
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert all(f in r.stderr for f in fragments), r.stderr


def test_dpo_logs_trls_metrics_from_step_0_reports_and_is_a_run_like_any_other(world, tmp_path, cli):
    run = tmp_path / "dpo"
    r = cli("dpo", world / "base", "--data", world / "pairs", "--out", run, "--sft-weight", "0", *QUICK)
    assert r.returncode == 0, r.stderr
    lines = records(run)
    first = lines[0]  # the validation pairs at step 0: the reference is the policy
    assert first["step"] == 0 and first["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in METRICS:
        assert f"val_{name}" in first
    assert first["val_rewards/margins"] == 0 and first["val_rewards/chosen"] == 0
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 8 and all(name in line for line in steps for name in METRICS)
    assert [line["step"] for line in lines if "val_loss" in line] == [0, 4, 8]
    assert lines[-1]["val_rewards/margins"] > 0  # it learned to prefer the chosen side
    record = json.loads(RunFolder(run).record_file.read_text())
    assert record["objective"] == "dpo" and record["dpo"]["sft_weight"] == 0 and record["dpo"]["loss"] == "sigmoid"
    assert "trained with DPO" in r.stdout and "pairs accuracy" in r.stdout and "(greedy)" in r.stdout
    report = cli("report", run)
    assert report.returncode == 0 and "pairs accuracy" in report.stdout
    ev = cli("eval", run, "--data", world / "pairs", "--json")
    assert ev.returncode == 0 and "pair accuracy" in ev.stdout
    assert json.loads(ev.stdout.splitlines()[-1])["pairs"] == 8
    assert cli("sample", run, "--prompt", "the sky", "--max-new-tokens", "4").returncode == 0
    pytest.importorskip("matplotlib", reason="the viz extra is not installed")
    from tinygpt.lab import viz

    fig = viz.plot_loss([viz.read_metrics(run)], tmp_path / "curves.png")
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 6 and {"margin and accuracy", "the policy's log-probs of the completions"} <= set(titles)
    margins = next(ax for ax in fig.axes if ax.get_title() == "margin and accuracy")
    assert any(line.get_label().endswith("margin (val)") and list(line.get_xdata()) == [0, 4, 8]
               for line in margins.get_lines())


def test_lora_dpo_trains_the_adapters_alone_and_peft_loads_them_with_tinygpts_logits(world, tmp_path, cli):
    peft = pytest.importorskip("peft", reason="peft is not installed (the dev extra)")
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    run = tmp_path / "lora"
    r = cli("dpo", world / "base", "--data", world / "pairs", "--out", run, "--method", "lora", "--lora-rank", "4",
            "--lora-targets", "attn,mlp", *QUICK)
    assert r.returncode == 0, r.stderr
    folder = RunFolder(run)
    assert folder.is_adapter_run() and not (run / "model.safetensors").exists()
    adapters, _ = read_weights(run / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k)  # B left zero: it trained
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = tinygpt.load(run)(idx)
        hf = transformers.AutoModelForCausalLM.from_pretrained(world / "hf").eval()
        theirs = peft.PeftModel.from_pretrained(hf, run).eval()(idx).logits
        bare = transformers.AutoModelForCausalLM.from_pretrained(world / "hf").eval()(idx).logits
    assert (theirs - ours).abs().max() < 1e-5
    assert (bare - ours).abs().max() > 1e-3  # the adapters matter


KILLED = """
import importlib, os, signal, sys
state = importlib.import_module("tinygpt.train.state")  # tinygpt.train is also the function the package gives
from tinygpt.cli import main
real = state.save
def save(run, *args, **kwargs):  # the kill a user gives, right after step 4's checkpoint is on disk
    real(run, *args, **kwargs)
    if run.step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
state.save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_dpo_run_killed_with_sigkill_resumes_bitwise(world, tmp_path, cli, method):
    flags = ["--data", world / "pairs", "--method", method, "--dropout", "0.1", *QUICK]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli("dpo", world / "base", "--out", whole, *flags).returncode == 0
    killed = subprocess.run([sys.executable, "-c", KILLED, "dpo", str(world / "base"), "--out", str(cut),
                             *map(str, flags)], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert RunFolder(cut).weights_step() == 4
    r = cli("dpo", world / "base", "--out", cut, "--resume", *flags)
    assert r.returncode == 0, r.stderr
    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    (a, _), (b, _) = read_weights(whole / name), read_weights(cut / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [line for line in records(whole) if "loss" in line][-1]["loss"] == \
        [line for line in records(cut) if "loss" in line][-1]["loss"]


def test_dpo_refusals_are_one_line_and_write_nothing(world, tmp_path, cli):
    out = tmp_path / "refused"
    base = ["dpo", world / "base", "--out", out, *QUICK]
    one_line(cli(*base, "--data", world / "text"), "holds no preference pairs", "--format preference")
    one_line(cli(*base, "--data", world / "pairs", "--label-smoothing", "0.1"),
             "label_smoothing applies to loss robust")
    other = tmp_path / "other"
    tinygpt.save(GPT(GPTConfig(vocab_size=300, block_size=48, n_layer=1, n_head=2, n_embd=16)), other,
                 BPETokenizer.train(["another text entirely, with other words " * 20], 300))
    one_line(cli(*base, "--data", world / "pairs", "--ref-model", other), "--ref-model", "tokenizer is not FROM's")
    one_line(cli(*base, "--data", world / "pairs", "--max-length", "3"), "no pair whose completions leave room")
    assert not out.exists()
    assert cli(*base, "--data", world / "pairs").returncode == 0
    one_line(cli(*base, "--data", world / "pairs", "--resume", "--beta", "0.5"), "trained with beta 0.1, not 0.5")
    one_line(cli("finetune", world / "base", "--data", world / "text", "--out", out, "--resume", "--quiet"),
             "is a dpo run", "tinygpt dpo")


def test_collapse_is_said_once_when_the_chosen_log_probs_fall_as_the_margin_grows():
    said = []
    watch = CollapseWatch(said.append)
    watch.on_eval({"step": 0, "val_logps/chosen": -5.0, "val_rewards/margins": 0.0})
    watch.on_eval({"step": 10, "val_logps/chosen": -4.0, "val_rewards/margins": 0.5})  # both up: healthy
    assert said == []
    watch.on_eval({"step": 20, "val_logps/chosen": -6.0, "val_rewards/margins": 0.9})
    watch.on_eval({"step": 30, "val_logps/chosen": -8.0, "val_rewards/margins": 1.5})
    assert len(said) == 1 and said[0].startswith("step 20:") and "\n" not in said[0] and "--sft-weight" in said[0]


def test_a_reward_model_trains_scores_evaluates_and_exports_as_transformers_scores_it(world, tmp_path, cli):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    run = tmp_path / "reward"
    r = cli("reward", "train", world / "base", "--data", world / "pairs", "--out", run, *QUICK)
    assert r.returncode == 0, r.stderr
    assert "trained a reward model" in r.stdout and "pairs accuracy" in r.stdout
    assert "reference: none" not in r.stdout  # a score has no loss on a reference text to measure
    model = tinygpt.load(run).eval()
    assert model.config.head == "reward"
    lines = records(run)
    assert lines[0]["step"] == 0 and {"val_accuracy", "val_margin", "val_mean_reward"} <= lines[0].keys()
    assert all({"accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= line.keys()
               for line in lines if "loss" in line)
    ev = cli("eval", run, "--json")  # its own data: the pairs
    assert ev.returncode == 0 and "pair accuracy" in ev.stdout and "(scores)" in ev.stdout
    tok = folder_tokenizer(run)
    ids = tok.encode("the sky is blue and sky")
    with torch.no_grad():
        want = scores(model, torch.tensor([ids]), torch.tensor([len(ids) - 1])).item()
    scored = cli("reward", "score", run, "--prompt", "the sky is", "--completion", " blue and sky", "--json")
    assert scored.returncode == 0 and json.loads(scored.stdout)["score"] == pytest.approx(want, abs=1e-6)
    assert cli("export", run, "--format", "hf", "--out", tmp_path / "hf").returncode == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, 0].item()
    assert abs(theirs - want) < 1e-4
    one_line(cli("sample", run, "--prompt", "the sky"), "is a reward model")
    one_line(cli("serve", run, "--port", "0"), "is a reward model")


def test_reward_refusals_are_one_line_and_write_nothing(world, tmp_path, cli):
    out = tmp_path / "refused"
    one_line(cli("reward", "train", world / "base", "--data", world / "pairs", "--out", out, "--method", "lora",
                 *QUICK), "trains with --method full")
    one_line(cli("reward", "train", world / "base", "--data", world / "text", "--out", out, *QUICK),
             "holds no preference pairs")
    assert not out.exists()
    one_line(cli("reward", "score", world / "base", "--prompt", "the sky", "--completion", " is"),
             "is a language model, not a reward model")


def test_the_bench_times_a_dpo_step_and_prints_its_ratio_to_trls():
    from tinygpt.lab.bench import SMOKE, ratios, render, run

    result = run(plan=SMOKE, sections=("dpo",), peers=False, log=lambda line: None, device="cpu")
    (row,) = result["dpo"]
    assert row["impl"] == "tinygpt" and row["batch"] == SMOKE.dpo[0] and row["ms_per_step"] > 0
    assert "dpo" in render(result) and not [r for r in result["ratios"] if r["name"].startswith("dpo")]
    result["dpo"].append({**row, "impl": "trl", "ms_per_step": 3 * row["ms_per_step"]})  # TRL's, as it would be
    (ratio,) = [r for r in ratios(result) if r["name"].startswith("dpo step")]
    assert ratio["ratio"] == pytest.approx(3.0) and ratio["target"] is None
