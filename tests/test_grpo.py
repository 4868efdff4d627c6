"""GRPO's arithmetic against TRL's (advantages, per-token losses and their reduction), the rollouts against
tinygpt's own decoding, and the reward functions' contract."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import tinygpt
from tinygpt import GPT, GPTConfig, TrainConfig, generate
from tinygpt.align import grpo, grpo_run
from tinygpt.align.rewards import Reward, import_reward, read_prompts, score
from tinygpt.align.rollouts import completion_logps, sample_groups
from tinygpt.config.grpo import GRPOConfig
from tinygpt.config.sampling import SampleConfig
from tinygpt.errors import ConfigError, DataError, RewardError
from tinygpt.run_folder import RunFolder
from tinygpt.weights import read_weights


def _batch(seed: int = 0, n: int = 12, width: int = 7):
    """A fixed batch: log-probs of a policy, of the policy that sampled (a step behind), of a reference, a
    completion mask of different lengths, and rewards of two functions with a None and a tied group."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, width, generator=g) * 3
    old = logps + 0.3 * torch.randn(n, width, generator=g)
    ref = logps + 0.2 * torch.randn(n, width, generator=g)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 3, (n, 2), generator=g).float()
    rewards[3, 1] = float("nan")  # a function that said None
    rewards[4:8] = 1.0  # a group whose rewards agree: its advantages are 0
    return logps, old, ref, mask, rewards


def _trl_advantages(rewards, weights, group, scale):
    """TRL 1.16's sum_then_normalize, as GRPOTrainer._generate_and_score_completions computes it."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards).all(dim=1)
    total = (rewards * weights.unsqueeze(0)).nansum(dim=1)
    total[unscorable] = torch.nan
    mean = torch.nanmean(total.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    if scale in ("group", "none"):
        std = nanstd(total.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    else:
        std = nanstd(total).expand_as(total)
    adv = total - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    pytest.importorskip("trl")
    _, _, _, _, rewards = _batch()
    weights = torch.tensor([1.0, 0.5])
    rewards[8:12] = float("nan")  # a group nobody scored
    ours, total, zero = grpo.advantages(rewards, weights, 4, scale)
    theirs, their_zero = _trl_advantages(rewards, weights, 4, scale)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    assert torch.equal(zero, their_zero)
    assert torch.equal(ours[4:8], torch.zeros(4)) and torch.equal(ours[8:], torch.zeros(4))
    assert total[3] == rewards[3, 0]  # a None adds nothing


def _trl_trainer(loss_type, beta, epsilon, epsilon_high, max_completion_length, grad_accum=1):
    """A GRPOTrainer with only what _compute_loss reads, its model's log-probs handed in: TRL's own loss code."""
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                        gather_for_metrics=lambda x: x)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=max_completion_length,
        accelerator=accelerator, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=grad_accum))
    return trainer


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_token_losses_and_loss_equal_trls(loss_type, beta):
    """On a fixed batch of completions and rewards, the per-token loss and the loss are TRL's, and so are
    the KL and the clip ratios it logs; with a second pass's ratios, so that clipping acts."""
    pytest.importorskip("trl")
    logps, old, ref, mask, rewards = _batch()
    adv, _, _ = grpo.advantages(rewards, torch.tensor([1.0, 0.5]), 4)
    epsilon, high, width = 0.2, 0.28, logps.shape[1]
    trainer = _trl_trainer(loss_type, beta, epsilon, high, width)
    policy = logps.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (policy, torch.zeros_like(policy), None)
    inputs = {"prompt_ids": torch.zeros(12, 2, dtype=torch.long), "prompt_mask": torch.ones(12, 2, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(None, inputs)
    their_grad, = torch.autograd.grad(theirs, policy)

    mine = logps.clone().requires_grad_()
    losses, parts = grpo.token_losses(mine, old, adv, epsilon_low=epsilon, epsilon_high=high, beta=beta,
                                      ref_logps=ref)
    ours = grpo.reduce_loss(losses, mask, loss_type, max_completion_length=width, tokens=mask.sum())
    our_grad, = torch.autograd.grad(ours, mine)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=1e-8)
    logged = {k: v[0] for k, v in trainer._metrics["train"].items()}
    assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0  # clipping acted
    assert grpo.masked_mean(parts["clipped_low"], mask).item() == pytest.approx(logged["clip_ratio/low_mean"])
    assert grpo.masked_mean(parts["clipped_high"], mask).item() == pytest.approx(logged["clip_ratio/high_mean"])
    if beta:
        assert grpo.masked_mean(parts["kl"], mask).item() == pytest.approx(logged["kl"], abs=1e-7)


def test_first_pass_gradient_is_the_policy_gradient():
    """With the sampling policy's own log-probs (ratio 1, the default single pass), grpo's gradient on a token
    is -advantage / (the completion's length x completions): REINFORCE with the group as the baseline."""
    logps, _, _, mask, rewards = _batch(1)
    adv, _, _ = grpo.advantages(rewards, torch.ones(2), 4)
    mine = logps.clone().requires_grad_()
    losses, _ = grpo.token_losses(mine, mine.detach(), adv)
    grad, = torch.autograd.grad(grpo.reduce_loss(losses, mask, "grpo"), mine)
    expected = -adv.unsqueeze(1) * mask / mask.sum(1, keepdim=True) / len(adv)
    torch.testing.assert_close(grad, expected.float())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()


def test_rollouts_are_tinygpts_decoding(model):
    """A group's rows decode together, prompts of different lengths in one batch: greedy, each row writes
    what generate writes alone, up to its stop token; the log-probs kept while sampling are those of a
    forward pass over prompt and completion; a seeded rollout repeats."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    greedy = sample_groups(model, prompts, 2, 6, config=SampleConfig(greedy=True), stop_tokens=[3, 5])
    for i, p in enumerate(prompts):
        alone = generate(model, torch.tensor([p]), 6, greedy=True, stop_tokens=[3, 5])[0, len(p):].tolist()
        assert greedy.ids(2 * i) == greedy.ids(2 * i + 1) == alone[: len(greedy.ids(2 * i))]
    runs = [sample_groups(model, prompts, 4, 8, stop_tokens=[0], generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert torch.equal(runs[0].completions, runs[1].completions)
    r = runs[0]
    assert len(r) == 12 and r.completions.shape == (12, r.mask.shape[1])
    ended = torch.isin(r.completions, torch.tensor([0])).any(1)
    assert torch.equal(r.truncated, ~ended)
    forward = completion_logps(model, r)
    torch.testing.assert_close(forward * r.mask, r.logps, rtol=0, atol=1e-5)


def test_rollout_refuses_a_prompt_without_room(model):
    with pytest.raises(ConfigError, match="context of 32"):
        sample_groups(model, [list(range(1, 20)) * 2], 2, 4)


def _rewards(*fns):
    return [Reward(f.__name__, f) for f in fns]


def test_score_takes_trls_signature_and_none():
    def length(prompts, completions, completion_ids, answer, **kw):
        return [len(c) if a != "skip" else None for c, a in zip(completions, answer)]

    out = score(_rewards(length), ["1+1="] * 2, ["2\n", "11\n"], [[1], [2]], {"answer": ["2", "skip"]})
    assert out[0, 0] == 2 and torch.isnan(out[1, 0])


@pytest.mark.parametrize("fn, message", [
    (lambda **kw: 1 / 0, "reward bad raised ZeroDivisionError: division by zero"),
    (lambda prompts, completions, **kw: [1.0], "reward bad returned 1 rewards for 2 completions"),
    (lambda **kw: [1.0, "x"], "reward bad returned 'x' for completion 1"),
    (lambda **kw: [1.0, float("inf")], "reward bad returned inf for completion 1"),
    (lambda **kw: 3, "reward bad returned a int, not a list of 2 numbers"),
])
def test_a_reward_that_fails_is_named(fn, message):
    with pytest.raises(RewardError) as e:
        score([Reward("bad", fn)], ["p", "p"], ["a", "b"], [[1], [2]], {})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_import_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrewards.py").write_text("def short(completions, **kw):\n    return [-len(c) for c in completions]\n"
                                           "NOT_A_FUNCTION = 3\n")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    reward = import_reward("myrewards:short", 0.5)
    assert reward.fn(completions=["ab"]) == [-2] and reward.weight == 0.5 and reward.name == "myrewards:short"
    for spec, message in [("nosuch:fn", "cannot import nosuch (ModuleNotFoundError: No module named 'nosuch')"),
                          ("broken:fn", "cannot import broken (ModuleNotFoundError"),
                          ("myrewards:long", "myrewards has no long"),
                          ("myrewards:NOT_A_FUNCTION", "is a int, not a function"),
                          ("myrewards", "a reward function is named module:function")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            import_reward(spec)


def test_read_prompts(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "1+2=", "answer": "3"}\n\n'
                    '{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}\n')
    assert [r["answer"] for r in read_prompts(good)] == ["3", "x"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n{"answer": 1}\n{"prompt": ""}\n[1]\n{"prompt": 3}\n{"prompt": [1]}\n')
    with pytest.raises(DataError, match=r"6 bad lines: line 2: not JSON \(.*\); line 3: no \"prompt\"; line 4: .*"
                                        r"\(and 1 more\)"):
        read_prompts(bad)
    latin = tmp_path / "latin.jsonl"  # a line that is not UTF-8 is a bad line, as in chat and preference files
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n{"prompt": "ok"}\n')
    with pytest.raises(DataError, match=r"1 bad lines: line 1: not UTF-8"):
        read_prompts(latin)


# ---- GRPO runs: a tiny model of the addition task, trained for a moment (what it answers does not matter) ---


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A 2 x 32 GPT-2 block trained for 40 steps on the addition task's worked examples."""
    from tinygpt.align.tasks import task
    from tinygpt.data import prepare

    root = tmp_path_factory.mktemp("grpo")
    (root / "add.txt").write_text(task("addition").text(3000))
    prepare([str(root / "add.txt")], root / "data")
    tinygpt.train(root / "data", root / "sft", GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2,
                                                          n_embd=32),
                  TrainConfig(max_iters=40, batch_size=16, eval_interval=40, eval_iters=2, lr=3e-3, warmup=2))
    return root / "sft"


def quick(**overrides) -> TrainConfig:
    return TrainConfig(**{**dict(batch_size=16, max_iters=10, eval_interval=4, eval_iters=2, lr=1e-3,
                                 lr_schedule="constant", warmup=0, weight_decay=0.0), **overrides})


GRPO_CFG = dict(task="addition", num_generations=4, eval_size=8, pass_k=2)


def test_a_grpo_run_and_its_report(sft, tmp_path, cli):
    """The run logs TRL's metric names, evaluates the held-out prompts (step 0 included), and its report says
    what changed; `tinygpt report` and `tinygpt plot` read it."""
    result = grpo_run.grpo(sft, tmp_path / "run", GRPOConfig(**GRPO_CFG), train_config=quick())
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert len(steps) == 10 and [r["step"] for r in evals] == [0, 4, 8, 10]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/addition/mean", "completions/mean_length",
                 "completions/clipped_ratio", "clip_ratio/region_mean"):
        assert name in steps[0], name
    assert {"val_accuracy", "val_pass@1", "val_pass@2", "val_reward"} <= evals[0].keys()
    assert 0 < steps[0]["tokens"] <= 16 * 4  # the completions' tokens: 16 of at most "198\n"
    report = result.report
    assert report["before"]["held_out"]["accuracy"] == evals[0]["val_accuracy"]
    assert report["after"]["held_out"]["accuracy"] == evals[-1]["val_accuracy"]
    assert report["steps"] == 10 and report["grpo"]["num_generations"] == 4
    assert "reference" in report["before"]  # the base's own validation data
    r = cli("report", tmp_path / "run")
    assert r.returncode == 0 and "held-out accuracy" in r.stdout and "trained with GRPO" in r.stdout
    pytest.importorskip("matplotlib")
    r = cli("plot", tmp_path / "run", "--out", tmp_path / "p.png")
    assert r.returncode == 0 and "held-out accuracy" in r.stdout and (tmp_path / "p.png").stat().st_size > 0


def test_lora_with_a_kl_to_its_base_and_the_merge(sft, tmp_path, cli):
    """LoRA trains the adapters alone against the rewards, its KL measured to its own base with the adapters off
    (none at the first step, where the adapters are zero; some once they moved), and --merge folds them in."""
    before = {f.name: f.read_bytes() for f in sft.iterdir() if f.is_file()}
    r = cli("grpo", sft, "--task", "addition", "--num-generations", 4, "--batch-size", 16, "--eval-size", 8,
            "--pass-k", 0, "--beta", 0.5, "--method", "lora", "--lora-rank", 4, "--lr", 3e-2, "--max-iters", 6,
            "--eval-interval", 3, "--out", tmp_path / "lora", "--merge", tmp_path / "merged", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "trained with GRPO from" in r.stdout and "held-out accuracy" in r.stdout and "merged:" in r.stdout
    assert RunFolder(tmp_path / "lora").is_adapter_run() and RunFolder(tmp_path / "merged").has_weights()
    steps = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    kl = [x["kl"] for x in steps if "kl" in x]
    assert len(kl) == 6 and kl[0] < 1e-6 < kl[-1]
    assert {f.name: f.read_bytes() for f in sft.iterdir() if f.is_file()} == before
    assert json.loads((tmp_path / "lora" / "train_config.json").read_text())["objective"] == "grpo"


KILLED_RUN = """
import os, signal, sys
import torch
torch.set_num_threads({threads})  # the uninterrupted run's: another count sums in another order
from tinygpt.align.grpo_run import grpo
from tinygpt.config.grpo import GRPOConfig
from tinygpt.config.train import TrainConfig
from tinygpt.train import TrainCallback

class Kill(TrainCallback):
    def on_step(self, record, total):
        if record["step"] == 5:  # after the checkpoint of step 3, before the next
            os.kill(os.getpid(), signal.SIGKILL)

cfg = GRPOConfig(**{cfg!r})
grpo(sys.argv[1], sys.argv[2], cfg, train_config=TrainConfig(**{train!r}), callbacks=[Kill()])
"""


@pytest.mark.parametrize("iterations", [1, 2])
def test_resume_after_kill_is_bitwise(sft, tmp_path, iterations):
    """kill -9 at step 5 leaves the checkpoint of step 3; --resume goes on from it to the same weights, bit for
    bit, as a run that never stopped: the rollouts' generator is kept (and with num_iterations 2 the rollouts
    a step was part way through, since step 3 is the first of a pair)."""
    cfg = {**GRPO_CFG, "num_iterations": iterations, "beta": 0.1}
    train = dict(batch_size=16, max_iters=10, eval_interval=3, eval_iters=2, lr=1e-3, lr_schedule="constant",
                 warmup=0, weight_decay=0.0, grad_accum=2)
    whole = grpo_run.grpo(sft, tmp_path / "whole", GRPOConfig(**cfg), train_config=TrainConfig(**train))
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RUN.format(cfg=cfg, train=train, threads=torch.get_num_threads()))
    p = subprocess.run([sys.executable, str(script), str(sft), str(tmp_path / "cut")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(tinygpt.__file__).parents[1])})
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert RunFolder(tmp_path / "cut").weights_step() == 3
    resumed = grpo_run.grpo(sft, tmp_path / "cut", GRPOConfig(**cfg), train_config=TrainConfig(**train),
                            resume=True)
    assert resumed.train.step == whole.train.step == 10
    a, b = (read_weights(tmp_path / name / "model.safetensors")[0] for name in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.report["after"]["held_out"] == whole.report["after"]["held_out"]


REWARDS = """
calls = 0

def fine(prompts, completions, **kw):
    return [float(len(c)) for c in completions]

def raises(prompts, completions, **kw):
    global calls
    calls += 1
    if calls > 2:  # the report's measure of the base and the first rollouts pass
        raise KeyError("answer_column")
    return [0.0] * len(completions)

def short(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = f"rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    yield name
    sys.modules.pop(name, None)


def test_a_failing_reward_ends_the_run_in_one_line_naming_it(sft, tmp_path, cli, rewards_module):
    """A reward that raises at step 1 ends the run with one line naming it: no checkpoint, no report (a run
    begun and not saved, which the same command starts again); one that returns too few rewards is refused
    as the base is measured, before anything is written."""
    out = tmp_path / "run"
    common = [sft, "--task", "addition", "--num-generations", 4, "--batch-size", 16, "--eval-size", 8, "--pass-k", 0,
              "--out", out, "--max-iters", 4, "--eval-interval", 2, "--quiet"]
    r = cli("grpo", *common, "--reward", f"{rewards_module}:raises")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"reward {rewards_module}:raises raised KeyError: 'answer_column'" in r.stderr
    assert not RunFolder(out).has_weights() and not RunFolder(out).report_file.exists()
    shutil.rmtree(out)
    r = cli("grpo", *common, "--reward", f"{rewards_module}:short")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"reward {rewards_module}:short returned 7 rewards for 8 completions" in r.stderr
    assert not out.exists()


def test_bad_input_is_refused_in_one_line_with_nothing_written(sft, tmp_path, cli, rewards_module):
    out = tmp_path / "run"
    common = [sft, "--task", "addition", "--out", out, "--max-iters", 2, "--quiet"]
    for args, message in [
        (["--num-generations", 1], "num_generations: must be an integer >= 2"),
        (["--reward", "no_such_module_anywhere:score"], "--reward no_such_module_anywhere:score: cannot import "
                                                        "no_such_module_anywhere (ModuleNotFoundError"),
        (["--reward", f"{rewards_module}:nothing"], f"{rewards_module} has no nothing"),
        (["--batch-size", 10, "--num-generations", 4], "batch_size: 10 completions a micro-step are not whole groups"),
        (["--max-completion-length", 15], "exceed the model's context of 16 tokens"),
    ]:
        r = cli("grpo", *common, *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (args, r.stderr)
        assert not out.exists(), args


def test_resume_asks_for_the_same_rewards_and_never_imports_the_recorded_ones(sft, tmp_path, cli, rewards_module):
    """A run records its rewards' names; loading or resuming it never imports them: a resume names them again,
    and other names are refused before the run is touched. Another command does not continue a GRPO run."""
    out = tmp_path / "run"
    common = [sft, "--task", "addition", "--num-generations", 4, "--batch-size", 16, "--eval-size", 8, "--pass-k", 0,
              "--out", out, "--eval-interval", 2, "--quiet"]
    assert cli("grpo", *common, "--max-iters", 2, "--reward", f"{rewards_module}:fine").returncode == 0
    assert json.loads((out / "train_config.json").read_text())["grpo"]["rewards"] == [f"{rewards_module}:fine"]
    sys.modules.pop(rewards_module)
    kept = {f.name: f.read_bytes() for f in out.iterdir()}
    tinygpt.load(out)  # loading a run imports nothing it names
    assert rewards_module not in sys.modules
    for args, message in [([], f"was trained with --reward {rewards_module}:fine: resume it with the same rewards"),
                          (["--reward", f"{rewards_module}:short"], f"trained with --reward {rewards_module}:fine")]:
        r = cli("grpo", *common, "--max-iters", 4, "--resume", *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
        assert {f.name: f.read_bytes() for f in out.iterdir()} == kept
    r = cli("finetune", sft, "--data", sft.parent / "data", "--out", out, "--resume", "--max-iters", 4)
    assert r.returncode == 2 and f"is a grpo run: continue it with tinygpt grpo" in r.stderr, r.stderr
    r = cli("grpo", *common, "--max-iters", 4, "--resume", "--reward", f"{rewards_module}:fine")
    assert r.returncode == 0, r.stderr
    assert RunFolder(out).weights_step() == 4


def test_the_bench_times_a_grpo_step_beside_trls():
    """`tinygpt bench --only grpo` at its smallest: a `tinygpt grpo` step and a step of TRL's GRPOTrainer on the
    same model, prompts, group size, prompts a step and completion length, and the ratio against its target."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from tinygpt.lab.bench import SMOKE, render, run
    from tinygpt.lab.bench.grpo import COMPLETION

    result = run(plan=SMOKE, sections=("grpo",), peers=True, log=lambda line: None, device="cpu")
    rows = {r["impl"]: r for r in result["grpo"]}
    assert rows.keys() == {"tinygpt", "trl"}
    per_step, group, _ = SMOKE.grpo
    for row in rows.values():
        assert (row["prompts"], row["group"], row["completion"]) == (per_step, group, COMPLETION)
        assert row["ms_per_step"] > 0
    (ratio,) = [r for r in result["ratios"] if r["name"].startswith("grpo step")]
    assert ratio["ratio"] == pytest.approx(rows["trl"]["ms_per_step"] / rows["tinygpt"]["ms_per_step"])
    assert ratio["target"] == 1.0 and ratio["met"] == (ratio["ratio"] >= 1.0)
    assert "TRL GRPOTrainer ms / tinygpt grpo ms" in render(result)


@pytest.fixture(scope="module")
def reward_model(sft, tmp_path_factory):
    """The SFT model with a new score for its head, saved as a reward model's run."""
    from tinygpt.checkpoint import load_run, save
    from tinygpt.model import score_head

    model, tok = load_run(sft, "cpu")
    run = tmp_path_factory.mktemp("reward") / "rm"
    save(score_head(model), run, tok)
    return run


def test_a_reward_model_is_a_reward(sft, reward_model, tmp_path, cli):
    """--reward RUN scores each prompt and completion as `tinygpt reward score` does (the text its training
    wrote a pair's side as), in a batch; a GRPO run trains with it beside the task's checker, its metrics under
    the folder's name as TRL names a reward model, and records it by the name given."""
    from tinygpt.align.preference_run import reward_score
    from tinygpt.align.rewards import model_reward, named_reward

    reward = named_reward(str(reward_model))
    prompts, completions = ["12+30=", "7+5=", "99+99="], ["42\n", "1", "198\n"]
    values = reward.fn(prompts=prompts, completions=completions, completion_ids=[[1]] * 3)
    assert values == pytest.approx([reward_score(reward_model, p, c) for p, c in zip(prompts, completions)], abs=1e-5)
    assert reward.label == "rm" and model_reward(reward_model, 0.5).weight == 0.5
    out = tmp_path / "run"
    r = cli("grpo", sft, "--task", "addition", "--reward", reward_model, "--reward-weights", "1,0.5",
            "--num-generations", 4, "--batch-size", 16, "--eval-size", 8, "--pass-k", 0, "--max-iters", 2,
            "--eval-interval", 2, "--out", out, "--quiet")
    assert r.returncode == 0, r.stderr
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/rm/mean" in s and "rewards/addition/mean" in s for s in steps if "loss" in s)
    assert json.loads((out / "train_config.json").read_text())["grpo"]["rewards"] == [str(reward_model)]


def test_a_reward_model_is_no_policy_and_a_language_model_no_reward(sft, reward_model, tmp_path, cli):
    """A reward model as FROM (grpo's, and finetune's) and a language model or no folder as --reward: one line
    each, nothing written."""
    out = tmp_path / "run"
    for args, message in [
        (["grpo", reward_model, "--task", "addition"], f"{reward_model} is a reward model (a score for a text, no "
                                                       "next token): tinygpt grpo trains a language model"),
        (["finetune", reward_model, "--data", sft.parent / "data"], "tinygpt finetune trains a language model"),
        (["grpo", sft, "--task", "addition", "--reward", sft], f"--reward {sft}: a language model, not a reward "
                                                               "model"),
        (["grpo", sft, "--task", "addition", "--reward", tmp_path / "nowhere"], "neither a function named "
                                                                                "module:function"),
    ]:
        r = cli(*args, "--out", out, "--max-iters", 2, "--quiet")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (args, r.stderr)
        assert not out.exists(), args
