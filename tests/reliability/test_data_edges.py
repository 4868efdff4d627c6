"""Data at the edges, end to end: a vocabulary past uint16, data too short for a block, token files
that disagree with meta.json. (Invalid UTF-8, BOMs, CRLF, empty and whitespace-only files are
covered where `prepare` is tested: tests/test_data.py, through the library and the CLI.)"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch

from tinygpt import cli
from tinygpt.checkpoint import load_run
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.data import get_batch, load_data, prepare

pytestmark = pytest.mark.reliability

TOP = 65536  # the first id that needs uint32


def test_token_65536_round_trips_through_prepare_batches_training_and_sampling(tmp_path, monkeypatch, capsys):
    chars = [chr(c) for c in range(0x20, 0x20 + TOP + 1 + 2048) if not 0xD800 <= c <= 0xDFFF][: TOP + 1]
    last = chars[-1]  # the character that gets id 65,536 (the vocabulary is sorted)
    # every other character is `last`, so every training batch holds id 65,536
    (tmp_path / "wide.txt").write_text("".join(c + last for c in chars), encoding="utf-8")
    meta = prepare([str(tmp_path / "wide.txt")], tmp_path / "data", val_fraction=0.01)
    assert meta["vocab_size"] == TOP + 1 and meta["dtype"] == "uint32"
    ds = load_data(tmp_path / "data")
    assert ds.train.dtype == np.uint32 and ds.tokenizer.encode(last) == [TOP]
    x, y = get_batch(ds.train, torch.tensor([0]), 8)
    assert x[0, 1].item() == TOP and y[0, 0].item() == TOP and x.dtype == torch.int64

    train_module = importlib.import_module("tinygpt.train")
    batches_module = importlib.import_module("tinygpt.data.batches")
    seen = []
    real_get_batch = batches_module.get_batch

    def recording_get_batch(tokens, offsets, block):
        xb, yb = real_get_batch(tokens, offsets, block)
        seen.append(int(xb.max()))
        return xb, yb

    monkeypatch.setattr(batches_module, "get_batch", recording_get_batch)
    model = GPTConfig(vocab_size=TOP + 1, block_size=8, n_layer=1, n_head=1, n_embd=8)
    cfg = TrainConfig(batch_size=2, max_iters=1, eval_interval=1, eval_iters=1, device="cpu", dtype="float32")
    result = train_module.train(tmp_path / "data", tmp_path / "run", model, cfg, progress=False)
    assert result.step == 1 and np.isfinite(result.train_loss) and seen[0] == TOP
    gpt, tok = load_run(tmp_path / "run", "cpu")
    assert gpt.wte.weight.shape[0] == TOP + 1 and tok.decode([TOP]) == last
    assert cli.main(["sample", str(tmp_path / "run"), "--prompt", last * 3, "--max-new-tokens", "4", "--greedy",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(last * 3)


@pytest.fixture
def short_data(tmp_path):
    (tmp_path / "short.txt").write_text("a tiny text\n" * 3)  # 36 characters: 32 to train on, 4 held out
    prepare([str(tmp_path / "short.txt")], tmp_path / "data")
    return tmp_path / "data"


def one_line_error(capsys, *args) -> str:
    assert cli.main([str(a) for a in args]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("tinygpt: error: ") and err.count("\n") == 1, err
    return err


def test_a_file_shorter_than_a_block_is_a_one_line_error(short_data, tmp_path, capsys):
    err = one_line_error(capsys, "train", "--data", short_data, "--out", tmp_path / "run", "--block-size", 64,
                         "--n-layer", 1, "--n-head", 1, "--n-embd", 8, "--device", "cpu", "--quiet")
    assert "split has" in err and "fewer than block_size + 1 = 65" in err
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_a_token_file_whose_dtype_disagrees_with_meta(short_data, tmp_path, capsys):
    meta = json.loads((short_data / "meta.json").read_text())
    (short_data / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    err = one_line_error(capsys, "train", "--data", short_data, "--out", tmp_path / "run", "--quiet")
    assert "train.bin holds" in err and "uint32 tokens" in err and "the size of" in err
    # the other way round: a uint32 file described as uint16 is as long as twice the tokens
    ids = np.fromfile(short_data / "train.bin", dtype=np.uint16).astype(np.uint32)
    ids.tofile(short_data / "train.bin")
    (short_data / "meta.json").write_text(json.dumps(meta))
    err = one_line_error(capsys, "train", "--data", short_data, "--out", tmp_path / "run", "--quiet")
    assert "train.bin holds" in err and "uint16 tokens" in err
