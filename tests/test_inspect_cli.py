"""The look-inside commands end to end: attention, sample --trace, plot, fewshot, fewshot-data."""

import json
import os
import re

import numpy as np
import pytest

from tinygpt import cli
from tinygpt.lab import fewshot
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.train import train

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402


@pytest.fixture(scope="module")
def run(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect") / "run"
    vocab = int(json.loads((char_data / "meta.json").read_text())["vocab_size"])
    model = GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32)
    train(char_data, out, model, TrainConfig(max_iters=40, eval_interval=20, eval_iters=2, batch_size=8, device="cpu"),
          progress=False)
    return out


def tinygpt(capsys, *args):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(result, *fragments):
    code, out, err = result
    assert code == 2, out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinygpt: error: "), err
    for f in fragments:
        assert f in lines[0], lines[0]


def size(path):
    image = imread(path)
    return image.shape[1], image.shape[0]


def test_attention_one_head_and_all_heads(run, tmp_path, capsys):
    code, out, _ = tinygpt(capsys, "attention", run, "--prompt", "the cat sees", "--layer", 1, "--head", 1,
                           "--out", tmp_path / "one.png")
    assert code == 0 and "layer 1, head 1, 12 tokens" in out
    code, out, _ = tinygpt(capsys, "attention", run, "--prompt", "the cat sees", "--layer", 1, "--all-heads",
                           "--out", tmp_path / "all.png")
    assert code == 0 and "all 2 heads" in out
    (w1, h1), (w2, h2) = size(tmp_path / "one.png"), size(tmp_path / "all.png")
    assert w2 > 1.6 * w1 and abs(h2 - h1) < 0.3 * h1  # two panels side by side


def test_attention_bad_input(run, tmp_path, capsys):
    png = tmp_path / "x.png"
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "the", "--layer", 2, "--out", png),
                          "--layer 2", "2 layers", "valid 0..1")
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "the", "--head", 5, "--out", png),
                          "--head 5", "valid 0..1")
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "the", "--layer", -1, "--out", png),
                          "--layer", "from 0")  # refused as the flag is read, before the model is loaded
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "the cat sees the moon", "--out", png),
                          "longer than the model's context of 16")
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "THE", "--out", png), "'T'")
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "th\udcffe", "--out", png),
                          "--prompt: not valid UTF-8 text (byte 0xff at character 3)")  # `--prompt $'th\xffe'`
    assert_one_line_error(tinygpt(capsys, "attention", run, "--prompt", "the", "--out", tmp_path / "x.jpg"), ".png")
    assert_one_line_error(tinygpt(capsys, "attention", tmp_path / "none", "--prompt", "the", "--out", png),
                          "no such run folder")
    assert not png.exists()


def trace_blocks(out):
    return re.split(r"(?m)^(?=step \d+: )", out.split("\ntext: ")[0])[1:]


@pytest.mark.parametrize("n", [1, 7, 20])
def test_trace_lists_every_step_and_greedy_picks_a_shown_candidate(run, capsys, n):
    code, out, _ = tinygpt(capsys, "sample", run, "--prompt", "the cat", "--greedy", "--max-new-tokens", n,
                           "--trace", "--trace-top", 3)
    assert code == 0
    blocks = trace_blocks(out)
    assert len(blocks) == n
    text = out.split("\ntext: ", 1)[1]
    chosen = []
    for i, block in enumerate(blocks, start=1):
        assert block.startswith(f"step {i}: the model sees")
        candidates = re.findall(r"(?m)^    ('.*?') +([0-9.]+) +([0-9.]+)( +<- chosen)?$", block)
        assert 1 <= len(candidates) <= 3
        marked = [c for c in candidates if c[3]]
        assert len(marked) == 1, block  # under greedy the choice is always among the candidates...
        assert marked[0] == candidates[0]  # ...and it is the top one
        token = re.search(r"(?m)^  chosen: ('.*?') \(id \d+\)$", block).group(1)
        assert token == marked[0][0]
        chosen.append(eval(token))
    assert text.rstrip("\n") == "the cat" + "".join(chosen)
    # the context each step shows is the prompt plus what came before, cut to block_size (16)
    last = re.search(r"(?m)^  context: (.*)$", blocks[-1]).group(1)
    assert eval(last) == ("the cat" + "".join(chosen[:-1]))[-16:]
    if n == 20:
        assert "the last 16 of 26 tokens: block_size is 16" in blocks[-1]


def test_trace_with_sampling_settings(run, capsys):
    code, out, _ = tinygpt(capsys, "sample", run, "--prompt", "a", "--max-new-tokens", 5, "--top-k", 2,
                           "--temperature", 0.7, "--repetition-penalty", 1.3, "--seed", 3, "--trace")
    assert code == 0
    blocks = trace_blocks(out)
    assert len(blocks) == 5
    for block in blocks:
        assert "candidates after temperature 0.7, top-k 2, repetition penalty 1.3 (2 of " in block
        probs = [float(p) for p in re.findall(r"(?m)^    '.*?' +([0-9.]+) +[0-9.]+", block)]
        assert len(probs) == 2 and sum(probs) == pytest.approx(1.0, abs=2e-4)
        assert "<- chosen" in block  # with top-k 2 every choice is one of the two
    again = tinygpt(capsys, "sample", run, "--prompt", "a", "--max-new-tokens", 5, "--top-k", 2,
                    "--temperature", 0.7, "--repetition-penalty", 1.3, "--seed", 3)
    assert again[1].rstrip("\n") == out.split("\ntext: ", 1)[1].rstrip("\n")  # tracing changes nothing
    assert_one_line_error(tinygpt(capsys, "sample", run, "--trace", "--trace-top", 0), "--trace-top")


def test_plot_runs(run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "tokens": 100 * s, "loss": 3.0 / s}) + "\n" for s in range(1, 30)))
    code, out, _ = tinygpt(capsys, "plot", run, other, "--out", tmp_path / "loss.png", "--title", "two")
    assert code == 0
    assert "run: 40 steps, val loss" in out and "other: 29 steps" in out
    assert size(tmp_path / "loss.png") == (1600, 460)
    assert_one_line_error(tinygpt(capsys, "plot", tmp_path / "nope", "--out", tmp_path / "l.png"), "no such run")
    assert_one_line_error(tinygpt(capsys, "plot", tmp_path, "--out", tmp_path / "l.png"), "no metrics.jsonl")
    assert_one_line_error(tinygpt(capsys, "plot", run, "--out", tmp_path / "l.gif"), ".png")


def test_fewshot_on_a_task_file(run, tmp_path, capsys):
    task = tmp_path / "animals.jsonl"
    lines = [{"template": "{input} {output}.", "separator": "\n"}] + [
        {"input": subject, "output": verb} for subject, verb in
        [("the cat", "sees"), ("a dog", "likes"), ("my friend", "follows"), ("the old king", "draws")]]
    task.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = tinygpt(capsys, "fewshot", run, "--task", task, "--shots", "0-2", "--show-prompt", "--json",
                           "--quiet", "--plot", tmp_path / "fs.png")
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["shots"] for r in report["results"]] == [0, 1, 2] and all(r["total"] == 4 for r in report["results"])
    assert "--- 0-shot prompt (answer: 'sees'):\nthe cat \n" in out
    assert (tmp_path / "fs.png").exists()
    code, out, _ = tinygpt(capsys, "fewshot", run, "--task", task, "--scoring", "likelihood", "--queries", 2,
                           "--json", "--quiet")
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1])["results"][0]["total"] == 2
    assert_one_line_error(tinygpt(capsys, "fewshot", run, "--task", task, "--shots", "4", "--quiet"),
                          "4-shot prompts need 4 other examples")
    assert_one_line_error(tinygpt(capsys, "fewshot", run, "--task", task, "--shots", "x"), "--shots")
    assert_one_line_error(tinygpt(capsys, "fewshot", run, "--task", task, "--shots", "3-1"),
                          "--shots: the range 3-1 goes down; write it low to high: 1-3")
    assert_one_line_error(tinygpt(capsys, "fewshot", run, "--task", tmp_path / "none.jsonl"), "no such task file")
    # the synthetic task needs digits, which this run's characters do not include
    assert_one_line_error(tinygpt(capsys, "fewshot", run, "--task", "synthetic", "--quiet"), "vocabulary")


def test_fewshot_data(tmp_path, capsys):
    code, out, _ = tinygpt(capsys, "fewshot-data", "--out", tmp_path / "d", "--episodes", 30, "--seed", 2)
    assert code == 0 and "30 episodes" in out
    text = (tmp_path / "d" / "train.txt").read_text()
    assert text == fewshot.synthetic_corpus(30, seed=2)
    task = fewshot.read_task(tmp_path / "d" / "task.jsonl")
    assert task.examples == fewshot.load_task("synthetic", seed=2).examples
    assert_one_line_error(tinygpt(capsys, "fewshot-data", "--out", tmp_path / "e", "--episodes", 0), "--episodes")
    # a folder that holds anything is refused, untouched: the files written there once mixed with what it held
    (tmp_path / "d" / "notes.txt").write_text("mine")
    assert_one_line_error(tinygpt(capsys, "fewshot-data", "--out", tmp_path / "d", "--episodes", 5),
                          f"{tmp_path / 'd'} is not empty: give a new folder (or an empty one)")
    assert (tmp_path / "d" / "train.txt").read_text() == text
    assert_one_line_error(tinygpt(capsys, "fewshot-data", "--out", tmp_path / "d" / "notes.txt", "--episodes", 5),
                          "notes.txt exists and is not a folder")
    assert_one_line_error(tinygpt(capsys, "fewshot-data", "--out", tmp_path / "d" / "notes.txt" / "x"),
                          f"notes.txt{os.sep}x: {tmp_path / 'd' / 'notes.txt'} is not a folder")
    (tmp_path / "empty").mkdir()
    code, out, _ = tinygpt(capsys, "fewshot-data", "--out", tmp_path / "empty", "--episodes", 5)
    assert code == 0 and (tmp_path / "empty" / "task.jsonl").exists()


# ---- inspect data on each tokenizer kind and on chat data (shards: tests/test_datasets.py) ----------


def inspect_json(capsys, folder, *flags):
    code, out, err = tinygpt(capsys, "inspect", "data", folder, "--json", *flags)
    assert code == 0, err
    return out, json.loads(out.splitlines()[-1])


def test_inspect_data_on_gpt2_and_hugging_face_tokenizers(tmp_path, capsys):
    """Three files, three documents: each one's length is its own encoding's (GPT-2's BPE; a Hugging Face
    folder's tokenizer, SmolLM2's style, whose documents its eos separates); the histogram is drawn."""
    from conftest import make_text
    from test_tokenizer import write_gpt2_files

    from tinygpt.data import load_data, prepare

    files = []
    for i, lines in enumerate((40, 3, 300)):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(make_text(lines, seed=i))
    write_gpt2_files(tmp_path / "gpt2")
    prepare(files, tmp_path / "gpt2-data", tokenizer="gpt2", tokenizer_file=tmp_path / "gpt2", val_fraction=0)
    tok = load_data(tmp_path / "gpt2-data").tokenizer
    out, info = inspect_json(capsys, tmp_path / "gpt2-data", "--out", tmp_path / "lengths.png")
    assert info["tokenizer"] == "gpt2" and info["eot_id"] == tok.eot_id and info["eot_token"] == "<|endoftext|>"
    lengths = sorted(len(tok.encode(f.read_text())) for f in files)
    assert info["splits"]["train"]["documents"] == 3 and info["splits"]["val"]["documents"] == 0
    assert (info["lengths"]["min"], info["lengths"]["max"]) == (lengths[0], lengths[-1])
    assert info["first"]["text"] == tok.decode(tok.encode(files[0].read_text())[:32])
    assert f"wrote {tmp_path / 'lengths.png'}" in out and size(tmp_path / "lengths.png")[0] > 300

    pytest.importorskip("transformers")
    import hf_family

    hf = hf_family.make_folder(tmp_path / "smollm", "llama", "smollm")
    prepare(files, tmp_path / "hf-data", tokenizer=None, tokenizer_file=hf, val_fraction=0)
    tok = load_data(tmp_path / "hf-data").tokenizer
    _, info = inspect_json(capsys, tmp_path / "hf-data")
    assert info["tokenizer"] == "hf" and info["eot_token"] == "<|im_end|>" and info["documents"] == 3
    lengths = sorted(len(tok.added_ids[0]) + len(tok.encode(f.read_text())) for f in files)
    assert (info["lengths"]["min"], info["lengths"]["max"]) == (lengths[0], lengths[-1])


def test_inspect_data_on_char_and_chat_data(char_data, tmp_path, capsys):
    """A char vocabulary has no separator: no lengths, and --out is refused in one line; a chat folder's
    documents are its conversations, with the tokens its loss mask trains on."""
    from tinygpt.data import load_data, prepare_chat

    out, info = inspect_json(capsys, char_data)
    assert info["lengths"] is None and info["eot_id"] is None and info["documents"] == 1
    assert "no separator between documents: their lengths are unknown" in out.splitlines()[0]
    assert info["first"]["text"] == load_data(char_data).tokenizer.decode(load_data(char_data).train[:32])
    png = tmp_path / "no.png"
    assert_one_line_error(tinygpt(capsys, "inspect", "data", char_data, "--out", png),
                          "--out:", "has no document lengths to draw (no separator between its documents)")
    assert not png.exists()
    talks = tmp_path / "talks.jsonl"
    talks.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi " * (i + 1)},
                                                      {"role": "assistant", "content": f"hello {i}"}]}) + "\n"
                             for i in range(10)))
    meta = prepare_chat(talks, tmp_path / "chat", val_fraction=0.2)
    out, info = inspect_json(capsys, tmp_path / "chat", "--tokens", 100)
    data = load_data(tmp_path / "chat")
    assert info["content"] == "chat" and info["splits"]["train"]["documents"] == 8
    assert info["splits"]["val"]["trained_tokens"] == meta["val_trained_tokens"]
    lengths = np.diff(np.append(data.starts["train"], meta["train_tokens"])).tolist() + \
        np.diff(np.append(data.starts["val"], meta["val_tokens"])).tolist()
    assert (info["lengths"]["documents"], info["lengths"]["min"], info["lengths"]["max"]) == \
        (10, min(lengths), max(lengths))
    assert info["first"]["trained_text"].startswith("hello 0")  # the assistant's turn, not the user's
    assert "hi" not in info["first"]["trained_text"]
    assert "trained tokens (the assistant's): " in out and "conversation lengths in tokens: 10 conversations" in out
