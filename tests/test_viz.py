"""Pictures: attention weights and heatmaps, metrics and loss curves, few-shot plots."""

import json
import math

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.lab import viz
from tinygpt.errors import CheckpointError, ConfigError
from tinygpt.tokenizer import CharTokenizer

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402


def png_size(path):
    image = imread(path)
    return image.shape[1], image.shape[0]  # width, height in pixels


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=4, n_embd=32)).eval()


def test_attention_weights_rows_sum_to_one_and_the_future_is_zero(model):
    ids = torch.randint(0, 20, (12,))
    w = viz.attention_weights(model, ids)
    assert w.shape == (2, 4, 12, 12)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12))
    assert torch.all(torch.triu(w, diagonal=1) == 0)  # exactly zero, not merely small
    assert torch.all(w[..., torch.tril(torch.ones(12, 12, dtype=torch.bool))] > 0)  # the past is seen
    # the same weights as the model's explicit path reports
    _, per_layer = model(ids.unsqueeze(0), return_attention=True)
    torch.testing.assert_close(w, torch.stack([x[0] for x in per_layer]))


def test_attention_weights_bad_input(model):
    with pytest.raises(ConfigError, match="longer than the model's context of 16"):
        viz.attention_weights(model, list(range(17)))
    with pytest.raises(ConfigError, match="one non-empty sequence"):
        viz.attention_weights(model, [])
    vocab = model.config.vocab_size
    for ids in ([1, vocab], [-1, 1]):  # once the embedding's IndexError, "index out of range in self"
        with pytest.raises(ConfigError, match=rf"token ids must be in 0\.\.{vocab - 1}"):
            viz.attention_weights(model, ids)
    with pytest.raises(ConfigError, match="integer token ids"):  # once truncated to [1, 2] without a word
        viz.attention_weights(model, [1.5, 2.0])


def test_without_the_causal_mask_the_future_is_attended(model):
    model.causal = False
    w = viz.attention_weights(model, torch.randint(0, 20, (8,)))
    assert torch.all(w[..., torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)] > 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 8))


def test_token_labels_make_whitespace_visible():
    tok = CharTokenizer.from_text("ab \n\t")
    assert viz.token_labels(tok, tok.encode("a b\n\t")) == ["a", "\u2423", "b", "\u21b5", "\u2192"]


def test_one_head_heatmap(model, tmp_path):
    ids = list(range(10))
    w = viz.attention_weights(model, ids)
    labels = [f"t{i}" for i in ids]
    fig = viz.plot_attention(w[1, 2], labels, tmp_path / "one.png", titles=["layer 1, head 2"])
    assert len(fig.axes) == 2  # the heatmap and its colorbar
    heat = fig.axes[0]
    assert [t.get_text() for t in heat.get_xticklabels()] == labels
    assert [t.get_text() for t in heat.get_yticklabels()] == labels
    assert heat.get_title() == "layer 1, head 2"
    width, height = png_size(tmp_path / "one.png")
    assert 300 < width < 1000 and 300 < height < 1000
    assert width > height  # the colorbar sits on the right


def test_all_heads_grid(model, tmp_path):
    w = viz.attention_weights(model, list(range(10)))[0]  # (4, 10, 10)
    fig = viz.plot_attention(w, [str(i) for i in range(10)], tmp_path / "grid.png",
                             titles=[f"head {h}" for h in range(4)], suptitle="layer 0")
    assert len(fig.axes) == 5  # four heatmaps and one shared colorbar
    assert [ax.get_title() for ax in fig.axes[:4]] == ["head 0", "head 1", "head 2", "head 3"]
    width, height = png_size(tmp_path / "grid.png")
    viz.plot_attention(w[0], [str(i) for i in range(10)], tmp_path / "one.png")
    one_w, _ = png_size(tmp_path / "one.png")
    assert width > 3 * one_w * 0.8 and width > 3 * height  # one row of four panels
    # six heads: a grid of two rows
    w6 = torch.softmax(torch.randn(6, 5, 5), -1)
    fig = viz.plot_attention(w6, list("abcde"), tmp_path / "six.png")
    assert len(fig.axes) == 7
    rows = {round(ax.get_position().y0, 3) for ax in fig.axes[:6]}
    assert len(rows) == 2


def test_picture_names_and_label_counts(model, tmp_path):
    w = viz.attention_weights(model, [1, 2, 3])
    with pytest.raises(ConfigError, match=r"\.png, \.svg or \.pdf"):
        viz.plot_attention(w[0, 0], ["a", "b", "c"], tmp_path / "x.jpg")
    with pytest.raises(ConfigError, match="labels"):
        viz.plot_attention(w[0, 0], ["a", "b"], tmp_path / "x.png")
    assert not (tmp_path / "x.jpg").exists() and not (tmp_path / "x.png").exists()
    viz.plot_attention(w[0, 0], ["a", "b", "c"], tmp_path / "new" / "x.svg")
    assert (tmp_path / "new" / "x.svg").read_text().lstrip().startswith("<?xml")
    # a name that cannot become a file is refused by the check every command makes before its work
    # (fewshot --plot used to fail after the whole evaluation, naming its temp file)
    (tmp_path / "d.png").mkdir()
    (tmp_path / "f").write_text("")
    for bad, message in ((tmp_path / "d.png", "is a folder"), (tmp_path / "f" / "x.png", "is not a folder")):
        with pytest.raises(ConfigError, match=message):
            viz.check_picture(bad)


def write_metrics(run, steps=40, eval_every=10, start_loss=3.0, tokens_per_step=64, tail=""):
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        loss = start_loss * 0.97**s
        lines.append({"step": s, "tokens": s * tokens_per_step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_per_s": 1000.0, "time": s * 0.1})
        if s % eval_every == 0:
            lines.append({"step": s, "tokens": s * tokens_per_step, "train_loss": loss, "val_loss": loss + 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + tail)
    return run


def test_read_metrics(tmp_path):
    m = viz.read_metrics(write_metrics(tmp_path / "a"))
    assert m.name == "a" and m.steps == list(range(1, 41)) and m.tokens[-1] == 40 * 64
    assert m.eval_steps == [10, 20, 30, 40] and m.val_loss[0] == pytest.approx(m.train_loss[0] + 0.1)
    # a last line cut short by a kill is skipped
    m = viz.read_metrics(write_metrics(tmp_path / "b", tail='{"step": 41, "tok'))
    assert m.steps[-1] == 40


def write_rewarded(run):
    """A GRPO-like run's metrics: rewards and a KL each step, held-out accuracy and pass@k at its evaluations."""
    run.mkdir()
    lines = [{"step": 0, "tokens": 0, "val_loss": -0.2, "val_accuracy": 0.25},
             {"step": 1, "tokens": 30, "loss": 0.1, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "time": 0.5,
              "reward": 0.5, "rewards/addition/mean": 0.5, "kl": 0.01},
             {"step": 2, "tokens": 60, "loss": 0.05, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "time": 1.0,
              "reward": 0.75, "rewards/addition/mean": 0.75, "kl": 0.02},
             {"step": 2, "tokens": 60, "val_loss": -0.4, "val_accuracy": 0.5, "val_pass@4": 0.75, "kept": True}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_read_metrics_keeps_every_number_an_objective_logs(tmp_path):
    """An objective's metrics beside the loss (a reward, a KL) and an evaluation of its own without a train loss
    (held-out accuracy) are series by name; what the loss curves read stays where it was."""
    m = viz.read_metrics(write_rewarded(tmp_path / "rl"))
    assert m.steps == [1, 2] and m.loss == [0.1, 0.05] and m.eval_steps == [0, 2] and m.val_loss == [-0.2, -0.4]
    assert math.isnan(m.train_loss[0])
    assert m.series("reward") == ([1, 2], [0.5, 0.75]) and m.series("val_accuracy") == ([0, 2], [0.25, 0.5])
    assert m.series("rewards/addition/mean")[1] == [0.5, 0.75] and m.series("nothing") == ([], [])
    assert not {"loss", "lr", "val_loss", "kept", "step"} & m.logged.keys()


def test_a_rewarded_runs_plot(tmp_path):
    """plot_rewards draws the rollouts' reward, the held-out accuracy and pass@k, and the KL against steps."""
    fig = viz.plot_rewards([viz.read_metrics(write_rewarded(tmp_path / "rl"))], tmp_path / "r.png", title="GRPO")
    reward, accuracy, kl = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["optimizer step"] * 3
    assert [line.get_label() for line in accuracy.get_lines()] == ["rl: accuracy", "rl: pass@4"]
    assert list(accuracy.get_lines()[0].get_xdata()) == [0, 2] and kl.get_ylabel().startswith("KL")
    assert list(reward.get_lines()[0].get_ydata()) == [0.5, 0.75] and (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such run folder"),
        (lambda p: p.mkdir(), "no metrics.jsonl"),
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("")), "no training step logged"),
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text('nope\n{"step": 1, "tokens": 1, "loss": 1}\n')),
         "line 1: not a metrics line"),
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')), "line 1"),
    ],
)
def test_read_metrics_errors(tmp_path, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(CheckpointError, match=message):
        viz.read_metrics(run)


def test_loss_plot_overlays_runs(tmp_path):
    runs = [viz.read_metrics(write_metrics(tmp_path / "small")),
            viz.read_metrics(write_metrics(tmp_path / "big", steps=30, start_loss=2.5, tokens_per_step=128))]
    fig = viz.plot_loss(runs, tmp_path / "loss.png", title="two runs")
    by_step, by_token, by_time = fig.axes
    assert by_step.get_xlabel() == "optimizer step" and by_token.get_xlabel() == "training tokens"
    assert by_time.get_xlabel() == "wall-clock time (s)"
    assert by_step.get_xlim()[1] >= 40 and by_token.get_xlim()[1] >= 30 * 128
    labels = [t.get_text() for t in by_time.get_legend().get_texts()]
    assert "small: val" in labels and "big: val" in labels and "big: train (eval)" in labels
    val = [line for line in by_step.get_lines() if line.get_label() == "big: val"][0]
    assert list(val.get_xdata()) == [10, 20, 30]
    val = [line for line in by_time.get_lines() if line.get_label() == "big: val"][0]
    assert list(val.get_xdata()) == pytest.approx([1.0, 2.0, 3.0])  # each evaluation at its step's time
    width, height = png_size(tmp_path / "loss.png")
    assert (width, height) == (1600, 460)


def test_a_resumed_runs_clock_carries_on(tmp_path):
    run = write_metrics(tmp_path / "r", steps=4, eval_every=2)
    again = [{"step": s, "tokens": s * 64, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
              "time": (s - 4) * 0.25} for s in (5, 6)]
    with (run / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in again))
    m = viz.read_metrics(run)
    assert m.times == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.65, 0.9]) and m.eval_times == pytest.approx([0.2, 0.4])


def test_fewshot_plot(tmp_path):
    fig = viz.plot_fewshot([0, 1, 2, 3], [0.1, 0.5, 0.7, 0.8], tmp_path / "fs.png", chance=0.125,
                           counts=[(10, 100), (50, 100), (70, 100), (80, 100)])
    (ax,) = fig.axes
    model = [line for line in ax.get_lines() if line.get_label() == "model"][0]
    assert list(model.get_ydata()) == pytest.approx([10, 50, 70, 80])
    assert png_size(tmp_path / "fs.png") == (550, 400)
    with pytest.raises(ConfigError):
        viz.plot_fewshot([0, 1], [0.5], tmp_path / "bad.png")


def test_the_package_gives_the_names_the_tutorial_uses():
    # docs/tutorials/inside.md calls these on `from tinygpt.lab import viz`, a package of a module a kind of
    # picture since issue 56
    for name in ("attention_weights", "plot_attention", "token_labels", "plot_loss", "read_metrics"):
        assert name in viz.__all__ and callable(getattr(viz, name))
