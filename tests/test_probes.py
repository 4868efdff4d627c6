"""The probes (tinygpt.lab.probes): induction and previous-token scores on hand-built attention patterns,
the second copy's loss, and that probing a run leaves its training bitwise as it was."""

from __future__ import annotations

import json

import pytest
import torch

from tinygpt import GPTConfig, TrainConfig
from tinygpt.errors import ConfigError
from tinygpt.lab import probes, viz
from tinygpt.train import train

T, PERIOD = 16, 8


def pattern(key_of) -> torch.Tensor:
    """A (T, T) head that puts all its weight on key_of(i) from query i (causal: key_of(i) <= i)."""
    w = torch.zeros(T, T)
    for i in range(T):
        w[i, key_of(i)] = 1.0
    return w


INDUCTION = pattern(lambda i: i - PERIOD + 1 if i >= PERIOD else i)  # first copy: on itself
PREVIOUS = pattern(lambda i: max(i - 1, 0))
SELF = pattern(lambda i: i)
DUPLICATE = pattern(lambda i: i - PERIOD if i >= PERIOD else i)  # the earlier occurrence itself, not its successor


def test_a_perfect_induction_head_scores_one_and_no_previous_token():
    assert probes.induction_scores(INDUCTION, PERIOD).item() == 1.0
    assert probes.previous_token_scores(INDUCTION).item() == 0.0


def test_a_perfect_previous_token_head_scores_one_and_no_induction():
    assert probes.previous_token_scores(PREVIOUS).item() == 1.0
    assert probes.induction_scores(PREVIOUS, PERIOD).item() == 0.0


@pytest.mark.parametrize("head", [SELF, DUPLICATE])
def test_other_heads_score_zero_on_both(head):
    assert probes.induction_scores(head, PERIOD).item() == 0.0
    assert probes.previous_token_scores(head).item() == 0.0


def test_scores_keep_the_leading_dimensions_and_average_the_queries():
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    heads = torch.stack([INDUCTION, PREVIOUS, uniform]).expand(5, 2, 3, T, T)  # (B, layer, head, T, T)
    scores = probes.induction_scores(heads, PERIOD)
    assert scores.shape == (5, 2, 3)
    expected = sum(1 / (i + 1) for i in range(PERIOD, T)) / (T - PERIOD)  # the uniform head's weight on one key
    assert scores[0, 0].tolist() == pytest.approx([1.0, 0.0, expected])


def test_half_and_half_scores_a_half():
    assert probes.induction_scores((INDUCTION + PREVIOUS) / 2, PERIOD).item() == pytest.approx(0.5)


@pytest.mark.parametrize("period", [1, T, 0])
def test_a_period_that_leaves_no_second_copy_is_refused(period):
    with pytest.raises(ConfigError, match="period"):
        probes.induction_scores(INDUCTION, period)


def test_repeated_tokens_are_distinct_and_repeat():
    rows = probes.repeated_tokens(20, 7, 50, torch.Generator().manual_seed(0))
    assert rows.shape == (50, 14)
    assert torch.equal(rows[:, :7], rows[:, 7:])
    assert all(len(set(r[:7].tolist())) == 7 for r in rows)
    assert int(rows.min()) >= 0 and int(rows.max()) < 20
    with pytest.raises(ConfigError, match="distinct"):
        probes.repeated_tokens(5, 7, 1, torch.Generator())


def test_second_copy_loss_and_accuracy_count_the_second_copy_only():
    tokens = probes.repeated_tokens(10, 4, 3, torch.Generator().manual_seed(1))  # (3, 8)
    logits = torch.zeros(3, 8, 10)
    logits[:, :-1].scatter_(2, tokens[:, 1:, None], 50.0)  # every next token, confidently
    logits[:, :4] = 0.0  # the first copy: no idea (it does not count)
    loss, accuracy = probes.second_copy(logits, tokens, 4)
    assert accuracy == 1.0 and loss < 1e-6
    logits[:, 5] = 0.0  # one of the three second-copy predictions made uniform
    loss, accuracy = probes.second_copy(logits, tokens, 4)
    assert accuracy == pytest.approx(2 / 3)
    assert loss == pytest.approx(torch.log(torch.tensor(10.0)).item() / 3, rel=1e-4)


def test_best_head():
    assert probes.best_head([[0.1, 0.2], [0.9, 0.3]]) == (1, 0, 0.9)


def tiny(char_data) -> tuple[GPTConfig, TrainConfig]:
    from tinygpt.data import load_data

    vocab = load_data(char_data).vocab_size
    return (GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1),
            TrainConfig(batch_size=4, max_iters=12, eval_interval=6, eval_iters=2, device="cpu", dtype="float32",
                        warmup=2))


def test_probes_leave_training_bitwise_unchanged(char_data, tmp_path):
    """With dropout on, any draw from torch's generator would change the run: the probes draw none."""
    from safetensors.torch import load_file

    model, cfg = tiny(char_data)
    train(char_data, tmp_path / "plain", model, cfg)
    train(char_data, tmp_path / "probed", model, cfg, callbacks=[probes.Probes(5, data=char_data)])
    plain = [json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    probed = [json.loads(x) for x in (tmp_path / "probed" / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in probed if "probe" in r]
    assert [r["step"] for r in found] == [0, 5, 10, 12]  # before the first step, every 5, after the last
    drop = ("time", "tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in plain] == \
        [{k: v for k, v in r.items() if k not in drop} for r in probed if "probe" not in r]
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "probed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    p = found[-1]["probe"]
    assert p["period"] == 8
    assert len(p["induction"]) == 2 and len(p["induction"][0]) == 2 and len(p["previous_token"][1]) == 2
    assert 0.0 <= p["second_copy_accuracy"] <= 1.0 and p["second_copy_loss"] > 0
    assert isinstance(p["icl_score"], float)

    metrics = viz.read_metrics(tmp_path / "probed")
    assert [s for s, _ in metrics.probes] == [0, 5, 10, 12]
    assert metrics.steps == list(range(1, 13))  # the probe lines are not steps
    fig = viz.plot_loss([metrics, viz.read_metrics(tmp_path / "plain")], tmp_path / "loss.png")
    assert len(fig.axes) == 7  # the three loss panels, then the probes' four
    assert [ax.get_title() for ax in fig.axes[3:]][-1] == "in-context learning score (val)"


def test_a_resumed_probed_run_keeps_one_probe_a_step(char_data, tmp_path):
    model, cfg = tiny(char_data)
    run = tmp_path / "run"
    train(char_data, run, model, TrainConfig(**{**cfg.to_dict(), "max_iters": 6}), callbacks=[probes.Probes(4)])
    train(char_data, run, None, cfg, resume=True, callbacks=[probes.Probes(4)])
    assert [s for s, _ in viz.read_metrics(run).probes] == [0, 4, 6, 8, 12]
