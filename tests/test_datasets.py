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

from tinygpt.checkpoint import load, load_training
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.data import datasets, get_batch, load_data, prepare
from tinygpt.data.batches import Stream
from tinygpt.data.shards import OPEN_SHARDS, ShardedTokens
from tinygpt.errors import DataError, TrainingError
from tinygpt.fileio import hash_file
from tinygpt.train import TrainCallback, train

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing é 日本 songs".split()
SHARD = 1_000  # tokens per shard: several shards of each split from a small dataset
FLOOR = datasets.MIN_SHARD_TOKENS  # prepare's smallest shard, lowered for this file's small shards


@pytest.fixture(scope="module", autouse=True)
def small_shards():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets, "MIN_SHARD_TOKENS", 1)
        yield


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
from tinygpt import data
from tinygpt.data import datasets, shards

datasets.MIN_SHARD_TOKENS = 1
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


def test_long_documents_are_encoded_a_few_at_a_time(dataset, sharded, tmp_path, monkeypatch):
    """A source's batch of rows is cut to about ENCODE_CHARS characters before it is encoded (a
    batch of 1,024 long documents held gigabytes of encodings in each worker); the shards are the same
    bytes, and a prepare killed between two cuts of one batch resumes to them."""
    from tinygpt.tokenizer import BPETokenizer

    monkeypatch.setattr(datasets, "ENCODE_CHARS", 300)
    sizes = []
    encode_each = BPETokenizer.encode_each

    def counted(self, texts):
        sizes.append((len(texts), sum(map(len, texts))))
        return encode_each(self, texts)

    monkeypatch.setattr(BPETokenizer, "encode_each", counted)
    out = tmp_path / "cut"
    prepare([str(dataset["parquet"])], out, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD, workers=2)
    assert all_bytes(out) == all_bytes(sharded[0])
    assert all(n == 1 or chars <= 300 for n, chars in sizes) and len(sizes) > 100  # 500 documents of 3-60 words

    killed = tmp_path / "killed"
    run = subprocess.run([sys.executable, "-c",
                          KILLED.replace("finish = ", "datasets.ENCODE_CHARS = 300\nfinish = ", 1),
                          str(dataset["parquet"]), str(killed), str(dataset["tok"]), str(SHARD)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    state = json.loads((tmp_path / ".killed.prepare" / "prepare-state.json").read_text())
    assert state["at"]["position"][2] % 40  # the batch it resumes from begins inside a row group of 40
    prepare([str(dataset["parquet"])], killed, tokenizer=None, tokenizer_file=dataset["tok"], shard_tokens=SHARD,
            resume=True)
    assert all_bytes(killed) == all_bytes(sharded[0])


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
    refused(text, "--errors skip applies to datasets .* is text", errors="skip")
    monkeypatch.setattr(datasets, "MIN_SHARD_TOKENS", FLOOR)  # 10 tokens a shard set out to write ~44,000 files
    assert FLOOR >= 1 << 16
    for doc in ("tutorials/train.md", "reference/formats.md"):
        assert f"at least {FLOOR:,}" in (Path(__file__).parents[1] / "docs" / doc).read_text(), doc
    refused(dataset["parquet"], f"--shard-tokens 10 is below the floor of {FLOOR:,} tokens a shard: each shard is "
            "a file synced to disk, 100,000 files a million tokens", shard_tokens=10)
    with pytest.raises(DataError, match="prepare them apart"):
        prepare([str(text), str(dataset["jsonl"])], tmp_path / "out", tokenizer=None, tokenizer_file=tok)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    refused("hf:someone/stories:tiny/train", r"hf:someone/stories:tiny/train: the Hugging Face Hub cannot be "
            r"reached \(offline\); .*`hf download someone/stories --repo-type dataset --include 'tiny/\*' "
            r"--include '\*/tiny/\*' --local-dir data/hf/stories` \(a guess")
    refused("hf:not a name", "not a Hugging Face dataset name")


FINEWEB_CARD = """---
license: odc-by
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
- config_name: tiny
  data_files:
  - split: train
    path: tiny/train-*
  - split: test
    path: tiny/test-*
---
# a dataset card
"""


def test_the_offline_hint_downloads_the_config_asked_for(tmp_path, monkeypatch):
    """Offline, the `hf download` command fetches the config asked for (it fetched every config: terabytes
    for fineweb-edu): the data_files the dataset card names, when the card is in the Hugging Face cache,
    the split's where it names splits, the default config's without one; else, plainly a guess, the
    folder named after the config. hf's own parser reads each command as those patterns."""
    import huggingface_hub.constants
    from hf_cli import fetched_patterns

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def hint(name: str) -> str:
        with pytest.raises(DataError) as e:
            prepare([name], tmp_path / "out", tokenizer="char")
        assert "\n" not in str(e.value) and "cannot be reached (offline)" in str(e.value)
        return str(e.value).split("`")[1]

    def fetched(command: str) -> list[str] | None:
        return fetched_patterns(command, monkeypatch)

    fineweb = "hf download HuggingFaceFW/fineweb-edu --repo-type dataset"
    guess = hint("hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    assert guess == f"{fineweb} --include 'sample-10BT/*' --include '*/sample-10BT/*' --local-dir data/hf/fineweb-edu"
    assert fetched(guess) == ["sample-10BT/*", "*/sample-10BT/*"]
    with pytest.raises(DataError, match=r"--local-dir data/hf/fineweb-edu` \(a guess, a folder named sample-10BT: "
                                        r"the dataset card's configs: section names the config's files; `hf download "
                                        r"HuggingFaceFW/fineweb-edu README.md --repo-type dataset` fetches the card\)"):
        prepare(["hf:HuggingFaceFW/fineweb-edu:sample-10BT"], tmp_path / "out", tokenizer="char")
    everything = hint("hf:HuggingFaceFW/fineweb-edu")  # no config named: the whole dataset, as asked
    assert everything == f"{fineweb} --local-dir data/hf/fineweb-edu" and fetched(everything) is None

    repo = tmp_path / "hub" / "datasets--HuggingFaceFW--fineweb-edu"
    (repo / "snapshots" / "c0ffee").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee" / "README.md").write_text(FINEWEB_CARD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    card = hint("hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    assert card == f"{fineweb} --include 'sample/10BT/*' --local-dir data/hf/fineweb-edu"
    assert fetched(card) == ["sample/10BT/*"]
    with pytest.raises(DataError, match=r"` \(config sample-10BT's train files, as the dataset card in the Hugging "
                                        r"Face cache names them\) and prepare"):
        prepare(["hf:HuggingFaceFW/fineweb-edu:sample-10BT"], tmp_path / "out", tokenizer="char")
    assert fetched(hint("hf:HuggingFaceFW/fineweb-edu:tiny/test")) == ["tiny/test-*"]
    assert fetched(hint("hf:HuggingFaceFW/fineweb-edu")) == ["data/*/*"]  # the card's default config
    assert fetched(hint("hf:HuggingFaceFW/fineweb-edu:other")) == ["other/*", "*/other/*"]  # not in the card


def test_cli_prepares_shards_and_refuses_in_one_line(dataset, tmp_path, cli, monkeypatch):
    out = tmp_path / "data"
    r = cli("prepare", dataset["parquet"], "--tokenizer-file", dataset["tok"], "--shard-tokens", "4,000",
            "--workers", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "documents  450 train, 50 val (2 rows without text skipped)" in r.stdout
    assert "shards" in r.stdout and (out / "train_00000.bin").stat().st_size == 4000 * 2
    r = cli("prepare", dataset["parquet"], "--tokenizer-file", dataset["tok"], "--text-column", "body", "--out", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "its columns: text, id" in r.stderr
    monkeypatch.setattr(datasets, "MIN_SHARD_TOKENS", FLOOR)
    r = cli("prepare", dataset["parquet"], "--tokenizer-file", dataset["tok"], "--shard-tokens", "10", "--out", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"below the floor of {FLOOR:,} tokens" in r.stderr
    assert load_data(out).meta["shard_tokens"] == 4000  # the folder that was there is untouched


def test_files_without_rows_are_skipped_and_counted(dataset, sharded, tmp_path, cli):
    """An empty parquet file as pandas writes one (its column of None typed null) and a JSONL file of blank
    lines, among a folder's files, are left out and counted: the shards are those of the folder without
    them. An empty file alone is an empty dataset, said so (it was '... near row 1 (StopIteration)')."""
    import shutil

    import pandas as pd

    folder = Path(shutil.copytree(dataset["parquet"], tmp_path / "folder"))
    pd.DataFrame({"text": pd.Series([], dtype=object)}).to_parquet(folder / "part-1a.parquet")
    assert pq.read_schema(folder / "part-1a.parquet").field("text").type == pa.null()
    (folder / "part-1b.jsonl").write_text("\n \n")
    out = tmp_path / "data"
    r = cli("prepare", folder, "--tokenizer-file", dataset["tok"], "--shard-tokens", SHARD, "--workers", 2,
            "--out", out)
    assert r.returncode == 0, r.stderr
    assert "documents  450 train, 50 val (2 rows without text skipped, 2 files without rows skipped)" in r.stdout
    meta = load_data(out).meta
    assert meta["sources"][0]["files"] == 3 and meta["sources"][0]["empty_files"] == 2
    assert all_bytes(out) == all_bytes(sharded[0]) and meta["shards"] == sharded[1]["shards"]
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.csv", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=f"{tmp_path / name} holds no rows: an empty dataset"):
            prepare([str(tmp_path / name)], tmp_path / "none", tokenizer=None, tokenizer_file=dataset["tok"])


def test_other_formats_give_the_same_rows_from_any_row_on(dataset, tmp_path):
    """CSV (a header, a document a record, quotes and line breaks inside one), a .json file that is one
    array, and gzip-compressed JSONL read the same documents as JSONL, from the first row or from any
    row a resumed prepare starts at."""
    import csv
    import gzip

    from tinygpt.data.datasources import dataset_source

    docs = dataset["docs"][:60] + ['a "quoted"\nline, broken']
    with open(tmp_path / "docs.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "text"], *([i, d] for i, d in enumerate(docs))])
    (tmp_path / "docs.json").write_text(json.dumps([{"text": d} for d in docs], indent=1))
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    for name in ("docs.csv", "docs.json", "docs.jsonl.gz"):
        src = dataset_source(name, tmp_path / name, [tmp_path / name], "text")
        src.check()
        assert [t for b in src.rows() for t in b.texts] == docs, name
        assert [t for b in src.rows((0, 37)) for t in b.texts] == docs[37:], name
    out = tmp_path / "csv"
    meta = prepare([str(tmp_path / "docs.csv")], out, tokenizer=None, tokenizer_file=dataset["tok"])
    val = load_data(out).tokenizer.decode(joined(out, "val").tolist())
    assert meta["documents"] == len(docs) and val == "<|endoftext|>".join(docs[::10])


def test_a_row_that_is_not_utf8_is_named_by_its_line_and_skipped_or_replaced(dataset, tmp_path, cli):
    """Invalid UTF-8 in one JSONL row: strict names its line (the blank first line counted; it said 'near row
    1' of the batch), skip leaves that row out and replace puts one U+FFFD for each invalid sequence, each
    giving the tokens of the same file with the row so written; a CSV record is named by its first line."""
    docs = dataset["docs"][:40]
    lines = [json.dumps({"text": d}).encode() for d in docs]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n" + b"\n".join(lines[:5] + [b'{"text": "caf\xe9 au lait \xe2\x82"}'] + lines[5:]) + b"\n")

    def same_tokens(out, rows):
        want = tmp_path / f"want-{out.name}.jsonl"
        want.write_text("".join(json.dumps({"text": d}) + "\n" for d in rows))
        prepare([str(want)], tmp_path / f"want-{out.name}", tokenizer=None, tokenizer_file=dataset["tok"])
        for split in ("train", "val"):
            np.testing.assert_array_equal(joined(out, split), joined(tmp_path / f"want-{out.name}", split))

    with pytest.raises(DataError, match=rf"{bad} line 7: invalid UTF-8 \(e9\); use --errors replace .* "
                                        "--errors skip to leave such rows out"):
        prepare([str(bad)], tmp_path / "strict", tokenizer=None, tokenizer_file=dataset["tok"])
    skip = prepare([str(bad)], tmp_path / "skip", tokenizer=None, tokenizer_file=dataset["tok"], errors="skip")
    assert skip["documents"] == 40 and skip["invalid_rows"] == 1 and skip["invalid_lines"] == [f"{bad} line 7"]
    assert skip["sources"][0]["skipped"] == 0  # a row left out is not a row without text
    same_tokens(tmp_path / "skip", docs)
    replace = prepare([str(bad)], tmp_path / "replace", tokenizer=None, tokenizer_file=dataset["tok"],
                      errors="replace")
    assert replace["documents"] == 41 and replace["replacements"] == 2  # e9, and e2 82 cut short: one each
    same_tokens(tmp_path / "replace", docs[:5] + ["caf\ufffd au lait \ufffd"] + docs[5:])

    r = cli("prepare", bad, "--tokenizer-file", dataset["tok"], "--errors", "skip", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    assert f"  skipped 1 row not UTF-8: {bad} line 7" in r.stdout.splitlines()
    r = cli("prepare", bad, "--tokenizer-file", dataset["tok"], "--out", tmp_path / "cli")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"{bad} line 7: invalid UTF-8" in r.stderr
    table = tmp_path / "bad.csv"
    table.write_bytes(b'id,text\n1,"two\nlines"\n2,caf\xe9\n3,plain\n')
    with pytest.raises(DataError, match=rf"{table} line 4: invalid UTF-8"):
        prepare([str(table)], tmp_path / "csv", tokenizer=None, tokenizer_file=dataset["tok"])
    meta = prepare([str(table)], tmp_path / "csv", tokenizer=None, tokenizer_file=dataset["tok"], errors="skip")
    assert meta["documents"] == 2 and meta["invalid_lines"] == [f"{table} line 4"]


# ---------------------------------------------------------------------------------------------
# Training on shards: streamed in order, as one file, across processes, resumed where it stopped

TINY = GPTConfig(vocab_size=400, block_size=16, n_layer=1, n_head=2, n_embd=32)


def tiny_train(steps: int, **kw) -> TrainConfig:
    settings = dict(batch_size=4, max_iters=steps, eval_interval=4, eval_iters=2, warmup=0, lr=1e-3, min_lr=1e-3,
                    device="cpu", dtype="float32")
    return TrainConfig(**{**settings, **kw})


class Offsets(TrainCallback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_batch(self, offsets: torch.Tensor) -> None:
        self.seen.append(offsets.tolist())


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def one_file(dataset):
    """The sharded fixture's tokens in one train.bin and one val.bin."""
    out = dataset["root"] / "one-file"
    prepare([str(dataset["jsonl"])], out, tokenizer=None, tokenizer_file=dataset["tok"], workers=1)
    return out


def test_a_sharded_folder_streams_in_order_and_trains_as_one_file(sharded, one_file, tmp_path):
    """Shards stream by default: consecutive windows from the split's start, crossing shard ends; the
    same tokens in one file with --data-order sequential train the same loss, bit for bit (random
    order draws the same batches from both: test_shard_boundaries_are_invisible_to_batches)."""
    seen = Offsets()
    a = train(sharded[0], tmp_path / "shards", TINY, tiny_train(16), callbacks=[seen])
    b = train(one_file, tmp_path / "file", TINY, tiny_train(16, data_order="sequential"))
    assert seen.seen == [list(range(k * 64, (k + 1) * 64, 16)) for k in range(16)]  # 64 = 4 rows x 16 tokens
    assert losses(tmp_path / "shards") == losses(tmp_path / "file") and a.val_loss == b.val_loss
    state = load_training(tmp_path / "shards")["data"]
    assert state == {"order": "sequential", "position": 1024, "epoch": 0, "shard": 1, "offset": 24}  # past shard 0
    assert load_training(tmp_path / "file")["data"]["shard"] == 0  # one file: one shard


def test_resume_continues_from_the_saved_data_position(sharded, tmp_path):
    """Stopped at step 20 (shard 1) and resumed to 36, a run ends bitwise as a straight 36-step one, the
    resumed part reading the tokens after the saved (shard, offset)."""
    straight, seen = tmp_path / "straight", Offsets()
    train(sharded[0], straight, TINY, tiny_train(36), callbacks=[seen])
    cut = tmp_path / "cut"
    train(sharded[0], cut, TINY, tiny_train(20))
    assert load_training(cut)["data"] == {"order": "sequential", "position": 1280, "epoch": 0, "shard": 1,
                                          "offset": 280}
    later = Offsets()
    train(sharded[0], cut, None, tiny_train(36), resume=True, callbacks=[later])
    assert later.seen == seen.seen[20:] and later.seen[0][0] == 1280
    assert losses(cut) == losses(straight)
    for name, tensor in load(straight).state_dict().items():
        assert torch.equal(tensor, load(cut).state_dict()[name]), name
    with pytest.raises(TrainingError, match="trained with --data-order sequential"):
        train(sharded[0], cut, None, tiny_train(40, data_order="random"), resume=True)


def test_training_refuses_a_shard_changed_inside_the_vocabulary_in_one_line(sharded, tmp_path, cli):
    """Two ids of train_00001.bin swapped: the same size, every id inside the vocabulary, and only the
    sha256 prepare recorded tells. The run trains on shard 0, stops in one line naming the shard as the
    stream reaches it (step 16), and keeps its last checkpoint (step 8) as it was."""
    import shutil

    changed = Path(shutil.copytree(sharded[0], tmp_path / "changed"))
    ids = np.fromfile(changed / "train_00001.bin", dtype=np.uint16)
    other = int(np.flatnonzero(ids != ids[0])[0])
    ids[[0, other]] = ids[[other, 0]]
    ids.tofile(changed / "train_00001.bin")
    run = tmp_path / "run"
    r = cli("train", "--data", changed, "--out", run, "--n-layer", 1, "--n-head", 2, "--n-embd", 32, "--block-size", 16,
            "--batch-size", 4, "--max-iters", 24, "--eval-interval", 8, "--eval-iters", 2, "--device", "cpu", "--quiet")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == (f"tinygpt: error: {changed / 'train_00001.bin'} is not the file prepare wrote: its sha256 is "
                        "not meta.json's; prepare the data again\n")
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 16))  # step 16's last row ends in shard 1: refused before it trains
    assert load_training(run)["step"] == 8 and load(run) is not None


def test_each_shard_is_hashed_once_as_training_first_reads_it_and_again_on_resume(sharded, tmp_path, monkeypatch):
    """Windows through every shard twice read each for its sha256 once; a run reads those its batches
    read (not those its evaluations' random windows touch), once, and a resume, a new opening, again."""
    import shutil

    from tinygpt.data import shards

    hashed: list[str] = []

    def counted(path, *args):
        hashed.append(Path(path).name)
        return hash_file(path, *args)

    monkeypatch.setattr(shards, "hash_file", counted)
    tokens = load_data(sharded[0]).train
    for _ in range(2):
        tokens.check_windows(np.arange(0, len(tokens) - 17, 300), 17)
    assert hashed == [p.name for p in tokens.paths] and len(tokens.paths) > OPEN_SHARDS
    hashed.clear()
    train(sharded[0], tmp_path / "run", TINY, tiny_train(8))  # 8 x 64 tokens: shard 0
    assert hashed == ["train_00000.bin"]
    train(sharded[0], tmp_path / "run", None, tiny_train(20), resume=True)  # on past token 1,000: shard 1
    assert hashed == ["train_00000.bin", "train_00000.bin", "train_00001.bin"]
    # meta.json without a shard's sha256 is refused as the folder is opened
    bare = Path(shutil.copytree(sharded[0], tmp_path / "bare"))
    meta = json.loads((bare / "meta.json").read_text())
    del meta["shards"]["val"][0]["sha256"]
    (bare / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta.json: the sha256 of val_00000.bin must be 64 hex digits, got None"):
        load_data(bare)


def test_the_stream_wraps_round_and_keeps_a_few_shards_mapped(sharded):
    """Streaming reads every token of the split once per epoch, the shards one after another, never
    more than OPEN_SHARDS of them mapped (the memory a run holds, whatever the split's size)."""
    tokens = load_data(sharded[0]).train
    assert len(tokens.paths) > 2 * OPEN_SHARDS
    stream, block, rows, covered = Stream(tokens, 16), 16, 5, []
    per_epoch = (len(tokens) - 1) // (rows * block)
    for _ in range(per_epoch):
        offsets = stream.draw(rows)
        x, y = get_batch(tokens, offsets, block)
        covered.append(x.reshape(-1))
        assert len(tokens.open_shards) <= OPEN_SHARDS
    assert stream.epoch == 1 and stream.position == 0  # the next draw would not fit: back to the start
    whole = np.asarray(tokens)
    np.testing.assert_array_equal(torch.cat(covered).numpy(), whole[: per_epoch * rows * block])
    assert torch.equal(stream.draw(rows), torch.arange(rows) * block)


def test_two_processes_stream_their_own_rows_as_one_process_and_resume_in_one(sharded, tmp_path):
    """torchrun, 2 processes x batch 4 on shards: every micro-step each reads its own half of the next
    global batch (rank 0 the first 4 rows), the losses are one process's with batch 8; the checkpoint
    it leaves resumes in one process with batch 8 at the next unseen tokens."""
    from test_distributed import FLAT, single, torchrun, trace

    data = ["--data", sharded[0]]
    single("train", *data, "--out", tmp_path / "one", "--batch-size", 8, "--max-iters", 6, *FLAT,
           trace=tmp_path / "one-debug")
    torchrun("train", *data, "--out", tmp_path / "two", "--batch-size", 4, "--max-iters", 6, *FLAT,
             trace=tmp_path / "two-debug")
    whole, *ranks = ([r["offsets"] for r in trace(tmp_path / d, k) if "offsets" in r]
                     for d, k in (("one-debug", 0), ("two-debug", 0), ("two-debug", 1)))
    micro = 8 * 16  # a global micro-batch: 8 rows of 16 tokens; --grad-accum 2
    assert whole == [[list(range((2 * s + m) * micro, (2 * s + m + 1) * micro, 16)) for m in (0, 1)] for s in range(6)]
    assert [[m[:4] for m in s] for s in whole] == ranks[0] and [[m[4:] for m in s] for s in whole] == ranks[1]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-4)
    assert load_training(tmp_path / "two")["data"]["position"] == 6 * 2 * micro
    later = Offsets()
    train(sharded[0], tmp_path / "two", None, tiny_train(8, batch_size=8, grad_accum=2), resume=True,
          callbacks=[later])
    assert later.seen[0] == list(range(6 * 2 * micro, 6 * 2 * micro + micro, 16))


# ---------------------------------------------------------------------------------------------
# inspect data: documents, their lengths and the files, read a chunk at a time and held to meta.json


def expected_bins(lengths: list[int]) -> dict[int, int]:
    """{a bin's lowest length: documents} by the test's own binning: powers of two, 0 alone."""
    out: dict[int, int] = {}
    for n in lengths:
        low = 0 if n == 0 else 1 << (n.bit_length() - 1)
        out[low] = out.get(low, 0) + 1
    return out


def test_inspect_data_counts_documents_and_their_lengths(dataset, sharded, one_file, monkeypatch):
    """Every document's length is its own encoding's, in shards as in one file, however the files are
    chunked while they are read (7 ids at a time: documents and separators cut across chunks)."""
    from tinygpt.data import inspect as data

    tok = load_data(sharded[0]).tokenizer
    lengths = [len(tok.encode(d)) for d in dataset["docs"]]
    info = data.inspect_data(sharded[0])
    assert info["documents"] == 500 and info["lengths"]["documents"] == 500
    assert {b["low"]: b["documents"] for b in info["lengths"]["bins"] if b["documents"]} == expected_bins(lengths)
    assert all(b["high"] == max(2 * b["low"] - 1, 0) for b in info["lengths"]["bins"])
    assert (info["lengths"]["min"], info["lengths"]["max"]) == (min(lengths), max(lengths))
    assert info["lengths"]["mean"] == pytest.approx(sum(lengths) / len(lengths))
    for split, documents in (("train", 450), ("val", 50)):
        s = info["splits"][split]
        assert s["documents"] == documents and s["tokens"] == sharded[1][f"{split}_tokens"]
        assert s["files"] == [{k: e[k] for k in ("file", "tokens", "documents")} for e in sharded[1]["shards"][split]]
    first = joined(sharded[0], "train")[:32].tolist()
    assert info["first"] == {"split": "train", "ids": first, "text": tok.decode(first)}
    assert dataset["docs"][1].startswith(info["first"]["text"].split("<|endoftext|>")[0])  # doc 0 is val's
    monkeypatch.setattr(data, "SCAN_TOKENS", 7)
    assert data.inspect_data(sharded[0]) == info
    single = data.inspect_data(one_file)
    assert single["lengths"] == info["lengths"] and single["first"] == info["first"]
    assert [f["file"] for f in single["splits"]["train"]["files"]] == ["train.bin"]
    assert single["splits"]["val"]["documents"] == 50 and single["shard_tokens"] is None


def test_inspect_data_cli_prints_the_shards_the_histogram_and_the_first_tokens(sharded, cli):
    out, meta = sharded
    r = cli("inspect", "data", out, "--tokens", 6, "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    eot = meta["eot_id"]
    assert lines[0] == f'{out}: text, bpe tokenizer (vocab {meta["vocab_size"]}, uint16); documents separated by token ' \
                       f'{eot} "<|endoftext|>"'
    train = meta["shards"]["train"]
    assert len(train) > 6
    rows = [line.split() for line in lines if line.startswith("train ")]
    assert [row[1] for row in rows] == [s["file"] for s in train[:3]] + ["...", *(s["file"] for s in train[-3:]),
                                                                         str(len(train))]
    assert rows[3] == ["train", "...", f"{len(train) - 6}", "more", f"{sum(s['tokens'] for s in train[3:-3]):,}",
                       f"{sum(s['documents'] for s in train[3:-3]):,}"]
    assert rows[-1] == ["train", str(len(train)), "shards", f"{meta['train_tokens']:,}", "450"]
    info = json.loads(lines[-1])
    bins = info["lengths"]["bins"]
    widest = max(bins, key=lambda b: b["documents"])
    label = f"{widest['low']:,}-{widest['high']:,}"
    assert any(line.split()[:3] == [label, f"{widest['documents']:,}", "#" * 40] for line in lines)
    assert f"first 6 tokens of train: {' '.join(map(str, info['first']['ids']))}" in lines
    assert f"  {json.dumps(info['first']['text'], ensure_ascii=False)}" in lines


def test_inspect_data_refuses_files_that_disagree_with_meta_json(sharded, one_file, tmp_path, cli):
    """Not a data folder, a missing shard, a shard changed in place, meta.json's counts edited: one line each."""
    import shutil

    def refused(folder, *fragments):
        r = cli("inspect", "data", folder)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("tinygpt: error: ")
        for f in fragments:
            assert f in r.stderr, r.stderr

    def copy(folder, name, edit_meta=None):
        new = shutil.copytree(folder, tmp_path / name)
        if edit_meta:
            meta = json.loads((new / "meta.json").read_text())
            edit_meta(meta)
            (new / "meta.json").write_text(json.dumps(meta))
        return new

    refused(tmp_path, "not a tinygpt data folder (no meta.json)")
    refused(tmp_path / "nowhere", "data folder not found")
    gone = copy(sharded[0], "gone")
    (gone / "train_00002.bin").unlink()
    refused(gone, f"{gone / 'train_00002.bin'} is missing")
    changed = copy(sharded[0], "changed")
    ids = np.fromfile(changed / "val_00000.bin", dtype=np.uint16)
    ids[:2] = ids[1::-1]  # same size, other bytes
    ids.tofile(changed / "val_00000.bin")
    refused(changed, f"{changed / 'val_00000.bin'} is not the file prepare wrote: its sha256 is not meta.json's")
    counted = copy(sharded[0], "counted", lambda m: m["shards"]["train"][1].update(documents=99))
    refused(counted, f"{counted / 'train_00001.bin'} holds", "documents but meta.json says 99")
    fewer = copy(sharded[0], "fewer", lambda m: m.update(train_tokens=m["train_tokens"] - 1))
    refused(fewer, "the train shards hold", "train_tokens says")
    single = copy(one_file, "single", lambda m: m.update(val_documents=51))
    refused(single, "the val files hold 50 documents but meta.json's val_documents says 51")
    cut = copy(one_file, "cut")
    with open(cut / "train.bin", "r+b") as f:
        f.truncate(100)
    refused(cut, f"{cut / 'train.bin'} holds 100 bytes but meta.json says")
