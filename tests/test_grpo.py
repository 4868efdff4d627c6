"""GRPO's arithmetic against TRL's (advantages, per-token losses and their reduction), the rollouts against
tinygpt's own decoding, and the reward functions' contract."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from tinygpt import GPT, GPTConfig, generate
from tinygpt.align import grpo
from tinygpt.align.rewards import Reward, import_reward, read_prompts, score
from tinygpt.align.rollouts import completion_logps, sample_groups
from tinygpt.config.sampling import SampleConfig
from tinygpt.errors import ConfigError, DataError, RewardError


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
    with pytest.raises(DataError, match=r"6 bad lines: line 2: not JSON; line 3: no \"prompt\"; line 4: .*"
                                        r"\(and 1 more\)"):
        read_prompts(bad)
