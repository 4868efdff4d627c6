import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import make_text
from test_tokenizer import reference_encoding, write_gpt2_files

from tinygpt import cli
from tinygpt.data import DataSet, get_batch, load_data, prepare, resolve_sources
from tinygpt.data import sources as data_sources, text as data_text
from tinygpt.errors import DataError, TinyGPTError
from tinygpt.tokenizer import load_tokenizer

META_KEYS = {
    "format", "version", "tokenizer", "dtype", "vocab_size", "train_tokens", "val_tokens", "train_chars",
    "val_chars", "train_bytes", "val_bytes", "sources", "errors", "replacements",
}  # fmt: skip

TEXT_A = "First line of a.\nSecond line, with é and 日本.\n"
TEXT_B = "def f(x):\n    return x * 2  # 😀\n" * 3
TEXT_C = "zebra words at the end\n"


def tokens(folder, split):
    meta = json.loads((Path(folder) / "meta.json").read_text())
    return np.fromfile(Path(folder) / f"{split}.bin", dtype=meta["dtype"])


def make_corpus(root: Path) -> Path:
    """A folder with nested text files, a hidden file, a binary file and an empty file."""
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(TEXT_A, encoding="utf-8")
    (root / "sub" / "b.py").write_text(TEXT_B, encoding="utf-8")
    (root / "z.md").write_text(TEXT_C, encoding="utf-8")
    (root / ".hidden.txt").write_text("SECRET", encoding="utf-8")
    (root / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00SECRET")
    (root / "empty.txt").write_text("")
    return root


@pytest.fixture
def small_reads(monkeypatch):
    """Tiny read/piece/batch sizes, so chunk seams (mid-character, mid-word) happen everywhere."""
    monkeypatch.setattr(data_text, "READ_BYTES", 5)
    monkeypatch.setattr(data_text, "PIECE_CHARS", 12)
    monkeypatch.setattr(data_text, "ENCODE_CHARS", 30)


# --- cutting text into pieces ----------------------------------------------------------------------


def gpt2_pretokens(text):
    import regex

    from tinygpt.tokenizer import GPT2_PATTERN

    return regex.findall(GPT2_PATTERN, text)


def bytelevel_pretokens(text):
    from tokenizers.pre_tokenizers import ByteLevel

    return [piece for piece, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(text)]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=" \n\t\r\u3000ab'sl.é日😀", max_size=300), st.integers(1, 30), st.integers(1, 9))
def test_pieces_are_cut_only_where_pretokenizers_split(text, size, chunk):
    """Encoding piece by piece must equal encoding the whole text: no pre-token may straddle a cut."""
    pieces = list(data_text._pieces([text[i : i + chunk] for i in range(0, len(text), chunk)], size))
    assert "".join(pieces) == text and all(pieces)
    for pretokens in (gpt2_pretokens, bytelevel_pretokens):
        assert [t for p in pieces for t in pretokens(p)] == pretokens(text)


def test_pieces_are_about_the_asked_size():
    text = "word " * 1000
    pieces = list(data_text._pieces([text], 64))
    assert len(pieces) > 70 and max(map(len, pieces)) <= 64


# --- prepare -----------------------------------------------------------------------------------


def test_prepare_char_folder(tmp_path, small_reads):
    src = make_corpus(tmp_path / "corpus")
    meta = prepare([str(src)], tmp_path / "data", val_fraction=0.25)
    assert META_KEYS <= set(meta) and meta == json.loads((tmp_path / "data" / "meta.json").read_text())
    assert sorted(os.listdir(tmp_path / "data")) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    text = TEXT_A + TEXT_B + TEXT_C  # sorted paths: a.txt, sub/b.py, z.md; hidden, binary, empty skipped
    tok = load_tokenizer(tmp_path / "data")
    assert tok.chars == sorted(set(text)) and meta["vocab_size"] == len(tok.chars)
    train, val = tokens(tmp_path / "data", "train"), tokens(tmp_path / "data", "val")
    n_val = round(0.25 * len(text))
    assert tok.decode(train) == text[:-n_val] and tok.decode(val) == text[-n_val:]  # the tail, contiguous
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert (meta["train_chars"], meta["val_chars"]) == (len(text) - n_val, n_val)
    assert meta["train_bytes"] + meta["val_bytes"] == len(text.encode())
    assert meta["val_bytes"] == len(text[-n_val:].encode())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "char" and meta["documents"] == 3
    assert meta["sources"][0]["files"] == 3 and meta["sources"][0]["skipped"] == 1
    assert meta["errors"] == "strict" and meta["replacements"] == 0


def test_prepare_bpe_equals_encoding_each_file_whole(tmp_path, small_reads):
    src = make_corpus(tmp_path / "corpus")
    meta = prepare([str(src)], tmp_path / "data", tokenizer="bpe", vocab_size=300, val_fraction=0)
    tok = load_tokenizer(tmp_path / "data")
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == tok.vocab_size <= 300
    eot = [tok.eot_id]
    expected = tok.encode(TEXT_A) + eot + tok.encode(TEXT_B) + eot + tok.encode(TEXT_C)
    assert tokens(tmp_path / "data", "train").tolist() == expected  # pieces were cut where tokens split anyway
    assert meta["val_tokens"] == 0 and (tmp_path / "data" / "val.bin").stat().st_size == 0
    assert meta["eot_id"] == tok.eot_id and meta["requested_vocab_size"] == 300


def test_prepare_gpt2_with_local_files(tmp_path):
    _, ranks = write_gpt2_files(tmp_path / "gpt2")
    (tmp_path / "one.txt").write_text("the cat")
    (tmp_path / "two.txt").write_text("on the mat")
    meta = prepare([str(tmp_path / "one.txt"), str(tmp_path / "two.txt")], tmp_path / "data",
                   tokenizer="gpt2", tokenizer_file=tmp_path / "gpt2" / "vocab.json", val_fraction=0)  # fmt: skip
    ref = reference_encoding(ranks)
    assert tokens(tmp_path / "data", "train").tolist() == ref.encode_ordinary("the cat") + [
        len(ranks)
    ] + ref.encode_ordinary("on the mat")
    assert meta["tokenizer"] == "gpt2" and meta["eot_id"] == len(ranks)
    # the data folder is self-contained: its tokenizer loads without the GPT-2 files
    os.rename(tmp_path / "gpt2", tmp_path / "gone")
    assert load_data(tmp_path / "data").tokenizer.encode("the cat") == ref.encode_ordinary("the cat")


def test_prepare_gpt2_without_endoftext_refuses_files_it_cannot_separate(tmp_path, capsys):
    from tinygpt.tokenizer import EOT

    vocab, ranks = write_gpt2_files(tmp_path / "gpt2")
    del vocab[EOT]
    (tmp_path / "gpt2" / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "one.txt").write_text("the cat")
    (tmp_path / "two.txt").write_text("on the mat")
    files = [str(tmp_path / "one.txt"), str(tmp_path / "two.txt")]
    # once joined with no separator: "the caton the mat"
    code = cli.main(["prepare", *files, "--tokenizer", "gpt2", "--tokenizer-file", str(tmp_path / "gpt2"),
                     "--out", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR and err.count("\n") == 1 and not (tmp_path / "data").exists()
    assert err.startswith(f"tinygpt: error: {tmp_path / 'gpt2'}: the gpt2 tokenizer has no <|endoftext|> token to "
                          "separate the 2 files; add it to its vocabulary"), err
    # one document needs no separator
    meta = prepare(files[:1], tmp_path / "data", tokenizer="gpt2", tokenizer_file=tmp_path / "gpt2", val_fraction=0)
    assert meta["eot_id"] is None
    assert tokens(tmp_path / "data", "train").tolist() == reference_encoding(ranks).encode_ordinary("the cat")


def test_prepare_uint32_when_the_vocabulary_exceeds_65536(tmp_path):
    chars = [chr(c) for c in range(0x20, 0x20 + 65537 + 2048) if not 0xD800 <= c <= 0xDFFF][:65537]
    (tmp_path / "wide.txt").write_text("".join(chars) + chars[-1] * 3, encoding="utf-8")
    meta = prepare([str(tmp_path / "wide.txt")], tmp_path / "data", val_fraction=4e-5)  # the last 3 characters
    assert meta["vocab_size"] == 65537 and meta["dtype"] == "uint32"
    ds = load_data(tmp_path / "data")
    assert ds.train.dtype == np.uint32 and ds.val.tolist() == [65536] * 3
    assert set(np.concatenate([ds.train, ds.val]).tolist()) == set(range(65537))
    assert ds.tokenizer.decode([65536]) == chars[-1]


def test_prepare_bom_dropped_crlf_kept(tmp_path):
    (tmp_path / "w.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    prepare([str(tmp_path / "w.txt")], tmp_path / "data", val_fraction=0)
    ds = load_data(tmp_path / "data")
    assert ds.tokenizer.decode(ds.train) == "line one\r\nline two\r\n"


@pytest.mark.parametrize(
    "content, offset",
    [
        (b"hello world \xff and more", 12),  # a byte that is never UTF-8
        (b"abcdefgh\xe6\x97", 8),  # a sequence cut off at the end of the file
        (b"abc \xed\xa0\x80 surrogate", 4),  # an encoded surrogate
        (b"0123456789\xc0\xaf overlong", 10),  # an overlong encoding
        (b"\xef\xbb\xbfbom then \xff", 12),  # offsets count the BOM's bytes
    ],
)
def test_invalid_utf8_strict_names_file_and_offset(tmp_path, small_reads, content, offset):
    (tmp_path / "bad.txt").write_bytes(content)
    with pytest.raises(DataError, match=rf"bad.txt: invalid UTF-8 at byte {offset} .*--errors replace"):
        prepare([str(tmp_path / "bad.txt")], tmp_path / "data")
    assert not (tmp_path / "data").exists() and os.listdir(tmp_path) == ["bad.txt"]


def test_invalid_utf8_replace_counts(tmp_path, small_reads):
    content = b"ok \xff ok \xed\xa0\x80 end\xe6\x97"
    (tmp_path / "bad.txt").write_bytes(content)
    meta = prepare([str(tmp_path / "bad.txt")], tmp_path / "data", errors="replace", val_fraction=0)
    expected = content.decode("utf-8", errors="replace")
    assert meta["replacements"] == expected.count("\ufffd") == 5 and meta["errors"] == "replace"
    ds = load_data(tmp_path / "data")
    assert ds.tokenizer.decode(ds.train) == expected


def test_replace_counts_only_substitutions_not_the_files_own_u_fffd(tmp_path, small_reads):
    # U+FFFD written in the file (EF BF BD, cut across reads of 5 bytes) is text, not a substitution
    content = "ok \ufffd then ".encode() + b"\xff" + " and \ufffd\ufffd at a seam".encode() + b"\xe6\x97"
    (tmp_path / "mixed.txt").write_bytes(content)
    meta = prepare([str(tmp_path / "mixed.txt")], tmp_path / "data", errors="replace", val_fraction=0)
    expected = content.decode("utf-8", errors="replace")
    assert expected.count("\ufffd") == 5 and meta["replacements"] == 2
    ds = load_data(tmp_path / "data")
    assert ds.tokenizer.decode(ds.train) == expected


def test_replacements_are_counted_per_prepare_call(tmp_path):
    # a prepare that runs while another is reading (here from its progress callback) must not add
    # its substitutions to the other's count: the old process-wide counter did
    (tmp_path / "clean.txt").write_text("clean text, nothing to replace\n", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"bad \xff bytes \xfe here")
    inner = []

    def progress(phase, done, total):
        if not inner:
            inner.append(prepare([str(tmp_path / "bad.txt")], tmp_path / "bad", errors="replace"))

    meta = prepare([str(tmp_path / "clean.txt")], tmp_path / "clean", errors="replace", progress=progress)
    assert inner[0]["replacements"] == 2
    assert meta["replacements"] == 0


def test_python_stdlib_corpus_resolution():
    (src,) = resolve_sources(["python-stdlib"])
    root = data_sources.python_stdlib_root()
    assert src.path == root and (root / "os.py").is_file()
    paths = [d.path for d in src.documents]
    assert root / "os.py" in paths and root / "json" / "decoder.py" in paths
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in paths)
    assert len(paths) > 500 and src.size > 10_000_000
    rel = [p.relative_to(root).parts for p in paths]
    assert rel == sorted(rel)
    encodings = {d.encoding for d in src.documents}
    assert "utf-8" in encodings  # declared encodings (koi8-r test modules) are kept per file


def test_shakespeare_download_and_cache(tmp_path, monkeypatch):
    (tmp_path / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data_sources, "SHAKESPEARE_URL", (tmp_path / "input.txt").as_uri())
    meta = prepare(["shakespeare"], tmp_path / "data")
    assert meta["sources"][0]["name"] == "shakespeare" and meta["train_chars"] + meta["val_chars"] == 61
    assert (tmp_path / "cache" / "shakespeare.txt").is_file()
    monkeypatch.setattr(data_sources, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    prepare(["shakespeare"], tmp_path / "data")  # from the cache: no network needed


def test_shakespeare_offline_names_the_local_file_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data_sources, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # nothing listens there
    with pytest.raises(DataError, match=r"cannot download tiny-shakespeare .*tinygpt prepare path/to/shakespeare.txt"):
        prepare(["shakespeare"], tmp_path / "data")
    (tmp_path / "page.html").write_text("<html>captive portal</html>")
    monkeypatch.setattr(data_sources, "SHAKESPEARE_URL", (tmp_path / "page.html").as_uri())
    with pytest.raises(DataError, match="is not tiny-shakespeare"):
        prepare(["shakespeare"], tmp_path / "data")


def test_a_single_source_may_be_a_plain_string(tmp_path):
    (tmp_path / "t.txt").write_text("just text")
    assert prepare(str(tmp_path / "t.txt"), tmp_path / "data")["documents"] == 1


def test_reuse_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("abcabc")
    (tmp_path / "b.txt").write_text("cab")
    (tmp_path / "c.txt").write_text("cabd")
    prepare([str(tmp_path / "a.txt")], tmp_path / "d1")
    meta = prepare([str(tmp_path / "b.txt")], tmp_path / "d2", tokenizer=None, tokenizer_file=tmp_path / "d1")
    assert load_tokenizer(tmp_path / "d2").chars == ["a", "b", "c"] and meta["vocab_size"] == 3
    with pytest.raises(DataError, match=r"1 characters outside the reused tokenizer's vocabulary: 'd' \(U\+0064\)"):
        prepare([str(tmp_path / "c.txt")], tmp_path / "d3", tokenizer_file=tmp_path / "d1" / "tokenizer.json")
    with pytest.raises(DataError, match="holds a char tokenizer, not bpe"):
        prepare([str(tmp_path / "b.txt")], tmp_path / "d3", tokenizer="bpe", tokenizer_file=tmp_path / "d1")
    assert not (tmp_path / "d3").exists()


def test_output_inside_the_source_folder_is_not_read(tmp_path):
    (tmp_path / "notes.txt").write_text("some notes here\n")
    prepare([str(tmp_path)], tmp_path / "data")
    meta = prepare([str(tmp_path)], tmp_path / "data")  # again: data/meta.json must not become text
    assert meta["documents"] == 1


def test_symlinked_folders_are_followed_each_once(tmp_path):
    # a folder holding only links to folders used to give "no text files"; a loop must still end
    real = tmp_path / "real"
    (real / "deep").mkdir(parents=True)
    (real / "a.txt").write_text("alpha text\n")
    (real / "deep" / "b.txt").write_text("beta text\n")
    (real / "deep" / "up").symlink_to(real, target_is_directory=True)  # a loop back to the top
    (real / "deep" / "again").symlink_to(real / "deep", target_is_directory=True)  # a loop onto itself
    top = tmp_path / "top"
    top.mkdir()
    (top / "linked").symlink_to(real, target_is_directory=True)
    (top / "twice").symlink_to(real, target_is_directory=True)  # the same folder through a second link
    (src,) = resolve_sources([str(top)])
    assert [d.path.relative_to(top).as_posix() for d in src.documents] == ["linked/a.txt", "linked/deep/b.txt"]
    meta = prepare([str(top)], tmp_path / "data", val_fraction=0)
    assert meta["documents"] == 2 and meta["train_chars"] == len("alpha text\nbeta text\n")
    (src,) = resolve_sources([str(real)])  # the loops below the folder given: each file once
    assert [d.path.name for d in src.documents] == ["a.txt", "b.txt"]
    (alias,) = resolve_sources([str(tmp_path / "top" / "linked")])  # a folder given through a link
    assert len(alias.documents) == 2


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokenizer="wordpiece"), "unknown tokenizer 'wordpiece'"),
        (dict(val_fraction=0.6), "val fraction must be between 0 and 0.5, got 0.6"),
        (dict(val_fraction=-0.1), "val fraction must be between 0 and 0.5"),
        (dict(val_fraction=float("nan")), "val fraction must be between"),
        (dict(tokenizer="bpe", vocab_size=200), "vocab size 200 is too small for byte-level BPE"),
        (dict(tokenizer="bpe", vocab_size=10**8), "too large"),
        (dict(vocab_size=300), "--vocab-size applies only when training a BPE tokenizer"),
        (dict(errors="ignore"), "errors must be 'strict' or 'replace'"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(DataError, match=match):
        prepare([str(tmp_path / "t.txt")], tmp_path / "data", **kwargs)
    assert not (tmp_path / "data").exists()


def test_bad_sources(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\t\r\n ")
    (tmp_path / "ok.txt").write_text("text")
    (tmp_path / "bins").mkdir()
    (tmp_path / "bins" / "x.bin").write_bytes(b"\x00\x01")
    cases = [
        (["missing.txt"], "source not found: .*missing.txt .*python-stdlib, shakespeare"),
        ([], "no source given"),
        (["empty.txt"], "source .*empty.txt is empty"),
        (["ok.txt", "blank.txt"], "source .*blank.txt holds only whitespace"),
        (["bins"], r"no text files in .*bins \(1 binary files skipped\)"),
    ]
    for sources, match in cases:
        with pytest.raises(DataError, match=match):
            prepare([str(tmp_path / s) for s in sources], tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_never_clobbers_a_folder_that_is_not_data(tmp_path):
    (tmp_path / "t.txt").write_text("text")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("years of work")
    with pytest.raises(DataError, match="refusing to overwrite .*precious"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "precious")
    assert os.listdir(tmp_path / "precious") == ["thesis.tex"]
    prepare([str(tmp_path / "t.txt")], tmp_path / "data")
    (tmp_path / "data" / "notes.md").write_text("mine")  # a data folder with a user's file in it
    with pytest.raises(DataError, match="refusing to overwrite"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "data")
    with pytest.raises(DataError, match="exists and is not a folder"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "t.txt")


def test_interrupted_prepare_keeps_the_old_folder(tmp_path):
    (tmp_path / "t.txt").write_text("old text " * 100)
    prepare([str(tmp_path / "t.txt")], tmp_path / "data")
    before = {f: (tmp_path / "data" / f).read_bytes() for f in os.listdir(tmp_path / "data")}
    (tmp_path / "t.txt").write_text("new text " * 100)

    def interrupt(phase, done, total):
        if phase == "encode":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "t.txt")], tmp_path / "data", progress=interrupt)
    assert {f: (tmp_path / "data" / f).read_bytes() for f in os.listdir(tmp_path / "data")} == before
    assert sorted(os.listdir(tmp_path)) == ["data", "t.txt"]  # no temporary folder left behind
    prepare([str(tmp_path / "t.txt")], tmp_path / "data")  # an existing data folder is replaced
    assert load_data(tmp_path / "data").tokenizer.decode(load_data(tmp_path / "data").train).startswith("new text")


# --- load_data ------------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "t.txt").write_text("hello there, general kenobi\n" * 40)
    prepare([str(tmp_path / "t.txt")], tmp_path / "data")
    return tmp_path / "data"


def test_load_data(prepared):
    ds = load_data(prepared)
    assert isinstance(ds, DataSet) and isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    assert ds.vocab_size == ds.tokenizer.vocab_size == ds.meta["vocab_size"]
    assert len(ds.train) == ds.meta["train_tokens"] and len(ds.val) == ds.meta["val_tokens"]
    with pytest.raises(ValueError):
        ds.train[0] = 1  # read-only


def edit_meta(folder, **changes):
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_load_data_refuses_bad_folders(prepared, tmp_path):
    with pytest.raises(DataError, match="data folder not found"):
        load_data(tmp_path / "nope")
    with pytest.raises(DataError, match="is not a folder"):
        load_data(tmp_path / "t.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a tinygpt data folder .*tinygpt prepare"):
        load_data(tmp_path / "empty")
    n = json.loads((prepared / "meta.json").read_text())["train_tokens"]
    wrong_dtype = rf"train.bin holds {2 * n:,} bytes but meta.json says {n:,} uint32 tokens .*size of {n:,} uint16"
    cases = [
        (lambda: (prepared / "meta.json").write_text("{oops"), "meta.json is not valid JSON"),
        (lambda: edit_meta(prepared, format="other"), "not a tinygpt data description"),
        (lambda: edit_meta(prepared, version=2), "version 2 is not supported"),
        (lambda: edit_meta(prepared, train_tokens="many"), "train_tokens must be a non-negative integer"),
        (lambda: edit_meta(prepared, dtype="float32"), "dtype must be uint16 or uint32"),
        (lambda: edit_meta(prepared, vocab_size=70000), "does not fit uint16"),
        (lambda: edit_meta(prepared, vocab_size=5), "disagrees with meta.json"),
        (lambda: edit_meta(prepared, dtype="uint32"), wrong_dtype),
        (lambda: (prepared / "val.bin").unlink(), "val.bin is missing"),
        (lambda: (prepared / "tokenizer.json").write_text("[]"), "not a tinygpt tokenizer file"),
    ]  # fmt: skip
    original = {f: (prepared / f).read_bytes() for f in os.listdir(prepared)}
    for damage, match in cases:
        damage()
        with pytest.raises(DataError, match=match):
            load_data(prepared)
        for f, b in original.items():
            (prepared / f).write_bytes(b)
    bad = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    bad[7] = 999
    bad.tofile(prepared / "train.bin")
    with pytest.raises(DataError, match="holds token id 999, outside the vocabulary"):
        load_data(prepared)


# --- get_batch ------------------------------------------------------------------------------------


def test_get_batch():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = get_batch(tokens, torch.tensor([0, 5, 89]), 10)
    assert x.shape == y.shape == (3, 10) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert x[1].tolist() == list(range(5, 15)) and y[1].tolist() == list(range(6, 16))
    assert y[2, -1].item() == 99
    with pytest.raises(DataError, match=r"offsets must lie in \[0, 89\]"):
        get_batch(tokens, torch.tensor([90]), 10)
    with pytest.raises(DataError, match="offsets must lie"):
        get_batch(tokens, torch.tensor([-1]), 10)
    with pytest.raises(DataError, match="needs at least 101 tokens; this split has 100"):
        get_batch(tokens, torch.tensor([0]), 100)


def test_get_batch_uint32_memmap(tmp_path):
    ids = np.array([70000, 1, 65536, 3, 4], dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    x, y = get_batch(np.memmap(tmp_path / "t.bin", dtype=np.uint32, mode="r"), torch.tensor([0, 1]), 3)
    assert x.tolist() == [[70000, 1, 65536], [1, 65536, 3]] and y.tolist() == [[1, 65536, 3], [65536, 3, 4]]


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_prepare_prints_a_summary(tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    assert (
        cli.main(["prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "data"), "--val-fraction", "0.2"]) == 0
    )
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert f"prepared {tmp_path / 'data'}" in out and "(3 files," in out
    assert f"tokenizer  char, vocab {meta['vocab_size']}, uint16" in out
    assert f"{meta['train_tokens']:,} tokens" in out and f"{meta['val_tokens']:,} tokens" in out
    assert "skipped 1 files" in out


def test_cli_prepare_replace_reports_substitutions(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"abc \xff\xfe def")
    assert cli.main(["prepare", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "d"), "--errors", "replace"]) == 0
    assert "replaced 2 invalid byte sequences with U+FFFD" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope.txt"], "source not found"),
        (["bad.txt"], "invalid UTF-8 at byte 4"),
        (["cut.txt"], "invalid UTF-8 at byte 3"),
        (["surrogate.txt"], "invalid UTF-8 at byte 2"),
        (["empty.txt"], "is empty"),
        (["ok.txt", "blank.txt"], "holds only whitespace"),
        (["ok.txt", "--val-fraction", "0.9"], "--val-fraction: expected a number >= 0 and <= 0.5"),
        (["ok.txt", "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size: expected an integer from 257"),
        (["ok.txt", "--tokenizer", "gpt2", "--tokenizer-file", "nope"], "tokenizer file not found"),
    ],
)
def test_cli_prepare_errors_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.txt").write_text("fine text")
    (tmp_path / "bad.txt").write_bytes(b"abc \xff")
    (tmp_path / "cut.txt").write_bytes(b"abc\xe6\x97")  # a character cut off by the end of the file
    (tmp_path / "surrogate.txt").write_bytes(b"ab\xed\xa0\x80cd")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b" \r\n\t \n")
    assert cli.main(["prepare", *args, "--out", "data"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("tinygpt: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_cli_prepare_out_below_a_file_names_the_file(tmp_path, capsys, fmt):
    (tmp_path / "ok.txt").write_text("fine text")
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}) + "\n")
    source = tmp_path / ("c.jsonl" if fmt == "chat" else "ok.txt")
    for out in (tmp_path / "ok.txt" / "sub", tmp_path / "ok.txt" / "sub" / "deeper"):
        # once "[Errno 17] File exists: '.../ok.txt'" (making the folder beside the output for its temp)
        assert cli.main(["prepare", str(source), "--out", str(out), "--format", fmt]) == cli.EXIT_ERROR
        err = capsys.readouterr().err
        assert err == f"tinygpt: error: {out.resolve()}: {(tmp_path / 'ok.txt').resolve()} is not a folder\n"
    assert (tmp_path / "ok.txt").read_text() == "fine text"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc: a folder where nobody can make a file")
def test_cli_prepare_out_where_nothing_can_be_written_is_refused_before_the_work(tmp_path, capsys):
    # once the whole text was read and tokenized, then "[Errno 2] No such file or directory: '/proc/.d.tmp-N'"
    (tmp_path / "ok.txt").write_text("fine text")
    assert cli.main(["prepare", str(tmp_path / "ok.txt"), "--out", "/proc/tinygpt-data"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.startswith("tinygpt: error: cannot write in /proc: ")


def test_cli_prepare_subprocess_exit_codes(tmp_path):
    (tmp_path / "ok.txt").write_text("a small text to tokenize\n" * 10)

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "tinygpt", "prepare", *args], capture_output=True, text=True, timeout=120
        )

    r = run(
        str(tmp_path / "ok.txt"),
        "--out",
        str(tmp_path / "data"),
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "300",
        "--progress",
    )
    assert r.returncode == 0, r.stderr
    assert "tokenizer  bpe" in r.stdout and load_data(tmp_path / "data").meta["tokenizer"] == "bpe"
    r = run(str(tmp_path / "ok.txt"), "--out", str(tmp_path / "d2"), "--tokenizer", "sentencepiece")
    assert r.returncode == 2 and "invalid choice: 'sentencepiece'" in r.stderr and "Traceback" not in r.stderr
    r = run(str(tmp_path / "missing"), "--out", str(tmp_path / "d2"))
    assert r.returncode == 2 and r.stderr.startswith("tinygpt: error: source not found") and "Traceback" not in r.stderr


def test_errors_are_typed():
    assert issubclass(DataError, TinyGPTError)


@pytest.mark.slow
def test_prepare_100mb_stays_under_500mb(tmp_path):
    """Peak memory of `tinygpt prepare` on 100 MB of text (see benchmarks/prepare_memory.py)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import prepare_memory

    corpus = prepare_memory.make_corpus(tmp_path / "corpus", 100_000_000)
    for kind in ("char", "bpe"):
        peak_mb, _ = prepare_memory.measure(corpus, tmp_path / f"data-{kind}", kind)
        assert peak_mb < 500, f"{kind}: peak RSS {peak_mb:.0f} MB"


def test_a_source_inside_the_output_folder_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text(make_text(50))
    prepare([str(tmp_path / "a.txt")], tmp_path / "data", tokenizer="char")
    before = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()}
    # `prepare data --out data` read meta.json and tokenizer.json as the text and replaced the tokens
    for source in (tmp_path / "data", tmp_path / "data" / "meta.json"):
        with pytest.raises(DataError, match="is the output folder"):
            prepare([str(source)], tmp_path / "data", tokenizer="char")
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == before


def test_a_file_name_that_is_not_utf8_is_written_readably(tmp_path):
    name = os.fsdecode(b"caf\xe9.txt")  # a Latin-1 name: meta.json could not be written
    (tmp_path / name).write_text(make_text(50))
    meta = prepare([str(tmp_path / name)], tmp_path / "data", tokenizer="char")
    assert meta["sources"][0]["name"].endswith("caf\\xe9.txt")
    assert load_data(tmp_path / "data").meta["sources"][0]["path"].endswith("caf\\xe9.txt")


def test_what_a_killed_prepare_left_is_removed_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".data.tmp-{int(dead.stdout)}"  # a finished process's pid: it is gone
    (left / "sub").mkdir(parents=True)
    alive = tmp_path / f".data.tmp-{os.getpid()}x"  # not a pid: kept
    alive.mkdir()
    (tmp_path / "a.txt").write_text(make_text(50))
    prepare([str(tmp_path / "a.txt")], tmp_path / "data", tokenizer="char")
    assert not left.exists() and alive.exists()


def test_sigterm_ends_a_command_through_its_cleanup():
    import signal

    from tinygpt.cli.common import cleans_up_on_sigterm

    cleaned = []

    @cleans_up_on_sigterm
    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        command(None)
    assert e.value.code == 143 and cleaned == [True] and signal.getsignal(signal.SIGTERM) is before


def test_the_package_gives_the_names_users_import_and_loads_no_torch():
    # tinygpt.data is a module a topic since issue 56; the package still gives what users import from it (the
    # tutorials' prepare, load_data and inspect_data, the benchmarks' resolve_sources, the batches the tests
    # build), each the topic module's own object; preparing data still needs no torch (a smaller memory floor)
    import tinygpt
    import tinygpt.data as data
    from tinygpt.data import batches, chat, folder, inspect, preference, sources, text

    assert tinygpt.prepare is data.prepare is text.prepare and data.prepare_chat is chat.prepare_chat
    assert data.prepare_preference is preference.prepare_preference
    assert data.load_data is folder.load_data and data.DataSet is folder.DataSet
    assert data.inspect_data is inspect.inspect_data and data.resolve_sources is sources.resolve_sources
    assert (data.get_batch, data.get_chat_batch, data.pack_conversations) == (
        batches.get_batch, batches.get_chat_batch, batches.pack_conversations)
    assert set(data.__all__) == {"prepare", "prepare_chat", "prepare_preference", "resolve_sources", "load_data",
                                 "DataSet", "inspect_data", "get_batch", "get_chat_batch", "pack_conversations"}
    loaded = subprocess.run([sys.executable, "-c", "import sys, tinygpt.data; print('torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "False", loaded.stderr
