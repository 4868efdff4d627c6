"""`prepare` from datasets (parquet, JSONL, hf:NAME) into shards, and training batches from shards.

Every dataset here is made by the test with pyarrow; nothing downloads."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tinygpt.data import get_batch, load_data, prepare
from tinygpt.errors import DataError
from tinygpt.fileio import hash_file
from tinygpt.shards import ShardedTokens

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing é 日本 songs".split()
SHARD = 1_000  # tokens per shard: several shards of each split from a small dataset


def make_docs(n: int = 500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Three parquet files of the documents (row groups of 40, an empty row and a null among them),
    the same documents as one JSONL file, and a BPE tokenizer for them all."""
    root = tmp_path_factory.mktemp("datasets")
    docs = make_docs()
    texts = docs[:100] + [""] + docs[100:300] + [None] + docs[300:]
    folder = root / "parquet"
    folder.mkdir()
    for i, chunk in enumerate((texts[:150], texts[150:350], texts[350:])):
        pq.write_table(pa.table({"text": chunk, "id": list(range(len(chunk)))}), folder / f"part-{i}.parquet",
                       row_group_size=40)
    (folder / "README.md").write_text("a dataset card\n")
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(jsonl)], root / "tok", tokenizer="bpe", vocab_size=400, workers=1)
    return {"root": root, "parquet": folder, "jsonl": jsonl, "docs": docs, "tok": root / "tok"}


@pytest.fixture(scope="module")
def sharded(dataset):
    """The parquet folder prepared in shards on one worker: the reference the other runs are held to."""
    out = dataset["root"] / "sharded"
    meta = prepare([str(dataset["parquet"])], out, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD, workers=1)
    return out, meta


def all_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.bin"))}


def joined(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    if "shards" not in meta:
        return np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"])
    return np.concatenate([np.fromfile(folder / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]]
                          or [np.zeros(0, meta["dtype"])])


def test_shards_index_and_documents(dataset, sharded):
    out, meta = sharded
    tok = load_data(out).tokenizer
    for split in ("train", "val"):
        shards = meta["shards"][split]
        assert len(shards) >= 2 and all(s["tokens"] == SHARD for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= SHARD
        for s in shards:
            assert s["sha256"] == hash_file(out / s["file"]).hexdigest()
        assert sum(s["tokens"] for s in shards) == meta[f"{split}_tokens"]
        assert sum(s["documents"] for s in shards) == meta[f"{split}_documents"]
    docs = dataset["docs"]
    assert meta["documents"] == len(docs) and meta["sources"][0]["skipped"] == 2  # the empty row and the null
    # val is document 0, 10, 20, ... (val_fraction 0.1); each split's documents joined by <|endoftext|>
    val = [d for k, d in enumerate(docs) if k % 10 == 0]
    train = [d for k, d in enumerate(docs) if k % 10]
    assert meta["val_documents"] == len(val) and meta["train_documents"] == len(train)
    eot = tok.eot_id
    for split, expected in (("train", train), ("val", val)):
        ids = joined(out, split)
        want = np.concatenate([np.concatenate([[eot], tok.encode(d)]) if i else tok.encode(d)
                               for i, d in enumerate(expected)])
        np.testing.assert_array_equal(ids, want)
        assert meta[f"{split}_chars"] == sum(map(len, expected))
    assert not list(dataset["root"].glob(".sharded.*"))  # the work folder became the data folder


def test_workers_and_formats_give_the_same_tokens(dataset, sharded):
    """2 workers == 1 worker token for token (the same shard files, byte for byte); the same documents
    from JSONL in one file each per split == the shards joined."""
    out, meta = sharded
    two = dataset["root"] / "two"
    meta2 = prepare([str(dataset["parquet"])], two, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD, workers=2)
    assert all_bytes(two) == all_bytes(out) and meta2["shards"] == meta["shards"]
    single = dataset["root"] / "single"
    prepare([str(dataset["jsonl"])], single, tokenizer=None, tokenizer_file=dataset["tok"], workers=2)
    assert sorted(p.name for p in single.glob("*.bin")) == ["train.bin", "val.bin"]
    for split in ("train", "val"):
        np.testing.assert_array_equal(joined(single, split), joined(out, split))


def test_shard_boundaries_are_invisible_to_batches(dataset, sharded):
    """Training samples the same batches from shards as from the same tokens in one file."""
    out, _ = sharded
    single = dataset["root"] / "single-for-batches"
    prepare([str(dataset["jsonl"])], single, tokenizer=None, tokenizer_file=dataset["tok"], workers=1)
    a, b = load_data(out), load_data(single)
    assert isinstance(a.train, ShardedTokens) and len(a.train) == len(b.train)
    block = 64
    offsets = torch.tensor([0, SHARD - 10, SHARD - block - 1, SHARD - 1, 2 * SHARD - 30, len(b.train) - block - 1])
    for x, y in zip(get_batch(a.train, offsets, block), get_batch(b.train, offsets, block)):
        assert torch.equal(x, y)
    np.testing.assert_array_equal(a.val[5:SHARD + 7], b.val[5:SHARD + 7])


def test_max_tokens_takes_a_prefix(dataset, sharded):
    out = dataset["root"] / "prefix"
    meta = prepare([str(dataset["parquet"])], out, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD,
                   max_tokens=2 * SHARD + 5)
    assert meta["train_tokens"] + meta["val_tokens"] == 2 * SHARD + 5 and meta["truncated"]
    full = joined(sharded[0], "train")
    np.testing.assert_array_equal(joined(out, "train"), full[: meta["train_tokens"]])


KILLED = """
import os, signal, sys
from tinygpt import data, shards

finish = shards.ShardWriter._finish
def killed_at_third_shard(self, split):
    if split == "train" and self.open[split].index == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the full shard is still NAME.part, val's open shard ahead of the record
    finish(self, split)
shards.ShardWriter._finish = killed_at_third_shard
data.prepare([sys.argv[1]], sys.argv[2], tokenizer=None, tokenizer_file=sys.argv[3], shard_tokens=int(sys.argv[4]), workers=2)
"""


def test_kill_9_then_resume_gives_the_same_shards(dataset, sharded, tmp_path):
    out = tmp_path / "data"
    run = subprocess.run([sys.executable, "-c", KILLED, str(dataset["parquet"]), str(out), str(dataset["tok"]),
                          str(SHARD)], capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    work = tmp_path / ".data.prepare"
    assert not out.exists() and (work / "prepare-state.json").is_file()
    assert {"train_00000.bin", "train_00001.bin", "train_00002.bin.part"} <= {f.name for f in work.iterdir()}
    kept = (work / "train_00001.bin").stat().st_ino
    with pytest.raises(DataError, match="other sources or settings"):
        prepare([str(dataset["parquet"])], out, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD + 1, resume=True)
    meta = prepare([str(dataset["parquet"])], out, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD, resume=True)
    assert all_bytes(out) == all_bytes(sharded[0]) and meta["shards"] == sharded[1]["shards"]
    assert not work.exists() and not list(out.glob("*.part"))
    assert (out / "train_00001.bin").stat().st_ino == kept  # resumed: the full shards were kept, not written again


def test_bad_datasets_are_one_line_errors(dataset, tmp_path, monkeypatch):
    tok = dataset["tok"]

    def refused(source, match, **kw):
        with pytest.raises(DataError, match=match) as e:
            prepare([str(source)], tmp_path / "out", tokenizer=None, tokenizer_file=tok, **kw)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.prepare").exists()

    refused(dataset["parquet"], r"has no column 'body' \(its columns: text, id\)", text_column="body")
    refused(dataset["parquet"], r"column 'id' .* holds int64, not text", text_column="id")
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    refused(empty, "holds no rows: an empty dataset")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": null}\n')
    refused(blank, "holds no text")
    corrupt = tmp_path / "corrupt" / "part-0.parquet"
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"PAR1 not really parquet")
    refused(corrupt.parent, f"{corrupt}: not a readable parquet file")
    refused(dataset["parquet"], "--resume continues from the last complete shard", resume=True)
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n")
    refused(text, "--shard-tokens applies to datasets", shard_tokens=10)
    with pytest.raises(DataError, match="prepare them apart"):
        prepare([str(text), str(dataset["jsonl"])], tmp_path / "out", tokenizer=None, tokenizer_file=tok)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    refused("hf:someone/stories:tiny/train", r"hf:someone/stories:tiny/train: the Hugging Face Hub cannot be "
            r"reached \(offline\); .*`hf download someone/stories --repo-type dataset")
    refused("hf:not a name", "not a Hugging Face dataset name")


def test_cli_prepares_shards_and_refuses_in_one_line(dataset, tmp_path, cli):
    out = tmp_path / "data"
    r = cli("prepare", dataset["parquet"], "--tokenizer-file", dataset["tok"], "--shard-tokens", "4,000",
            "--workers", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "documents  450 train, 50 val (2 rows without text skipped)" in r.stdout
    assert "shards" in r.stdout and (out / "train_00000.bin").stat().st_size == 4000 * 2
    r = cli("prepare", dataset["parquet"], "--tokenizer-file", dataset["tok"], "--text-column", "body", "--out", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "its columns: text, id" in r.stderr
    assert load_data(out).meta["shard_tokens"] == 4000  # the folder that was there is untouched
