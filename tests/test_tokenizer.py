import json
import socket
import threading

import numpy as np
import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinygpt.errors import TinyGPTError, TokenizerError
from tinygpt.tokenizer import (
    EOT,
    GPT2_PATTERN,
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    IncrementalDecoder,
    Tokenizer,
    byte_to_unicode,
    load_tokenizer,
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog.\n"
    "def main(argv):\n    return 0  # done\n"
    "naïve café — 日本語のテキスト, emoji 😀🚀 and ümlauts.\r\n"
) * 20


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train([CORPUS[i : i + 500] for i in range(0, len(CORPUS), 500)], 320)


# --- char ---------------------------------------------------------------------------------


def test_char_vocab_is_sorted_and_round_trips():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world")) and tok.vocab_size == 8
    assert tok.eot_id is None and tok.kind == "char" and isinstance(tok, Tokenizer)
    ids = tok.encode("hello")
    assert ids == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(ids) == "hello"
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == "hello"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=sorted(set(CORPUS))))
def test_char_round_trip_property(text):
    tok = CharTokenizer.from_text(CORPUS)
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_to_array(text).tolist() == tok.encode(text)


def test_char_unknown_characters_are_named_with_positions():
    tok = CharTokenizer.from_text("abc ")
    with pytest.raises(TokenizerError) as e:
        tok.encode("a é b ü é")
    msg = str(e.value)
    assert "3 characters not in the tokenizer's vocabulary" in msg
    assert "'é' (U+00E9) at position 2, 8" in msg and "'ü' (U+00FC) at position 6" in msg
    assert "\n" not in msg
    with pytest.raises(TokenizerError, match=r"U\+D800"):
        tok.encode("a\ud800")


def test_char_bad_vocab_and_ids():
    with pytest.raises(TokenizerError, match="duplicate"):
        CharTokenizer(["a", "a"])
    with pytest.raises(TokenizerError, match="single characters"):
        CharTokenizer(["ab"])
    with pytest.raises(TokenizerError, match="at least one"):
        CharTokenizer([])
    tok = CharTokenizer("ab")
    with pytest.raises(TokenizerError, match="token id 2 is outside the vocabulary"):
        tok.decode([0, 2])
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.decode([-1])


def test_char_save_load(tmp_path):
    tok = CharTokenizer.from_text("ab\x00\n😀")
    tok.save(tmp_path / "t.json")
    back = load_tokenizer(tmp_path / "t.json")
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    tok.save(tmp_path)  # a folder: tokenizer.json inside it
    assert load_tokenizer(tmp_path).chars == tok.chars
    assert not list(tmp_path.glob(".*"))  # no temp files left


# --- byte-level BPE ---------------------------------------------------------------------------


def test_bpe_trains_to_the_asked_size_with_eot(bpe):
    assert bpe.kind == "bpe" and bpe.vocab_size == 320 and isinstance(bpe, Tokenizer)
    assert bpe.eot_id is not None and bpe.decode([bpe.eot_id]) == EOT
    assert len(bpe.encode(CORPUS)) < 0.6 * len(CORPUS.encode())  # merges were learned


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(0 <= i < bpe.vocab_size for i in ids)


@pytest.mark.parametrize(
    "text", ["", "\x00", "a\x00b", "😀🚀", "日本語", "\r\n\r\n", "\ufeffBOM", "ÿ\x7f\x80", "tab\tz  end  "]
)
def test_bpe_round_trips_edge_texts(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_literal_eot_is_text(bpe):
    ids = bpe.encode(f"a{EOT}b")
    assert bpe.eot_id not in ids and bpe.decode(ids) == f"a{EOT}b"


def test_bpe_decode_equals_tokenizers_decode(bpe):
    ids = bpe.encode(CORPUS[:300])
    assert bpe.decode(ids) == bpe.hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_bpe_save_load(tmp_path, bpe):
    bpe.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert isinstance(back, BPETokenizer) and back.vocab_size == bpe.vocab_size and back.eot_id == bpe.eot_id
    assert back.encode(CORPUS) == bpe.encode(CORPUS)
    assert back.encode(EOT) == bpe.encode(EOT)  # literal text stays text after loading too


@pytest.mark.parametrize("size, match", [(100, "too small"), (256, "at least 257"), (10**9, "too large")])
def test_bpe_vocab_size_limits(size, match):
    with pytest.raises(TokenizerError, match=match):
        BPETokenizer.train(["abc"], size)


def test_bpe_small_corpus_stops_short():
    tok = BPETokenizer.train(["ab ab ab"], 1000)
    assert 257 < tok.vocab_size < 1000
    assert tok.decode(tok.encode("ab ba")) == "ab ba"


# --- streaming --------------------------------------------------------------------------------


def test_incremental_decoder_holds_back_split_characters(bpe):
    text = "go 😀🚀 日本語 ok"
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # some token ends inside a character
    dec = IncrementalDecoder(bpe)
    parts = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)
    dec = IncrementalDecoder(bpe)
    assert dec.push(torch.tensor(ids)) + dec.flush() == text  # tensors too


def test_incremental_decoder_flush_releases_a_cut_character(bpe):
    ids = bpe.encode("😀")
    dec = IncrementalDecoder(bpe)
    assert dec.push(ids[:-1]) == ""
    assert dec.flush() == "\ufffd"
    assert dec.push(ids) == "😀"  # reset after flush


def test_incremental_decoder_char():
    tok = CharTokenizer.from_text("hé")
    dec = IncrementalDecoder(tok)
    assert [dec.push(i) for i in tok.encode("éh")] == ["é", "h"]


def test_push_at_says_where_the_ids_own_text_begins(bpe):
    byte = {b: next(i for i in range(bpe.vocab_size) if bpe.decode_bytes([i]) == bytes([b])) for b in b"\xe2\x98\x83a"}
    dec = IncrementalDecoder(bpe)
    # e2 98 83 is one character; an unfinished e2 98 cut by "a" becomes U+FFFD, before the "a"
    steps = [dec.push_at(byte[b]) for b in b"\xe2\x98\x83\xe2\x98a"]
    assert steps == [("", 0), ("", 0), ("\u2603", 0), ("", 0), ("", 0), ("\ufffda", 1)]


# --- GPT-2 (tiktoken) ------------------------------------------------------------------------

MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("Ġ", "w"), ("o", "r"), ("e", "n"), ("Ġt", "h"), ("in", "g"), ("Ċ", "Ċ"),
    ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ã", "©"), ("Ġ", "c"), ("Ġc", "af"), ("a", "f"),
]  # fmt: skip


def write_gpt2_files(folder, merges=MERGES):
    """A small vocabulary in GPT-2's file format: 256 byte tokens in GPT-2's order, a token per merge, <|endoftext|>."""
    folder.mkdir(parents=True, exist_ok=True)
    spelling = byte_to_unicode()
    vocab = {spelling[b]: i for i, b in enumerate(spelling)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[EOT] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    unicode_to_byte = {c: b for b, c in spelling.items()}
    ranks = {bytes(unicode_to_byte[c] for c in t): i for t, i in vocab.items() if t != EOT}
    return vocab, ranks


def reference_encoding(ranks):
    import tiktoken_ext.openai_public as openai_public

    return tiktoken.Encoding(
        "ref", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
    )


GPT2_TEXTS = [
    "the cat sat on the mat",
    "  The theory\n\n\tof everything's café ",
    "日本語 😀 x=1+2",
    f"a{EOT}b",
    "",
    "\x00",
]


def test_gpt2_from_vocab_and_merges_equals_tiktoken(tmp_path, monkeypatch):
    vocab, ranks = write_gpt2_files(tmp_path)
    ref = reference_encoding(ranks)
    for path in (tmp_path, tmp_path / "vocab.json", tmp_path / "merges.txt"):
        tok = GPT2Tokenizer.from_file(path)
        assert tok.vocab_size == len(vocab) and tok.eot_id == vocab[EOT] and tok.kind == "gpt2"
        for text in GPT2_TEXTS:
            assert tok.encode(text) == ref.encode_ordinary(text)
            assert tok.decode(tok.encode(text)) == text
    assert tok.encode(" the") == [vocab["Ġthe"]]
    assert tok.decode([tok.eot_id]) == EOT
    # tiktoken's own reader of GPT-2's files gives the same ranks
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    theirs = tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(tmp_path / "merges.txt"), str(tmp_path / "vocab.json"))
    assert theirs == ranks


def test_gpt2_pattern_is_tiktokens():
    import tiktoken_ext.openai_public as openai_public

    assert GPT2_PATTERN == openai_public.r50k_pat_str


def test_gpt2_from_tiktoken_file_and_save_load(tmp_path):
    import base64

    _, ranks = write_gpt2_files(tmp_path / "hf")
    lines = "".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    (tmp_path / "gpt2.tiktoken").write_text(lines)
    tok = GPT2Tokenizer.from_file(tmp_path / "gpt2.tiktoken")
    ref = reference_encoding(ranks)
    assert tok.eot_id == len(ranks)
    for text in GPT2_TEXTS:
        assert tok.encode(text) == ref.encode_ordinary(text)
    tok.save(tmp_path / "saved.json")
    back = load_tokenizer(tmp_path / "saved.json")
    assert isinstance(back, GPT2Tokenizer) and back.vocab_size == tok.vocab_size and back.eot_id == tok.eot_id
    assert all(back.encode(t) == ref.encode_ordinary(t) for t in GPT2_TEXTS)
    assert GPT2Tokenizer.from_file(tmp_path / "saved.json").encode("the cat") == tok.encode("the cat")


def test_gpt2_bad_files(tmp_path):
    write_gpt2_files(tmp_path / "ok")
    with pytest.raises(TokenizerError, match="not found"):
        GPT2Tokenizer.from_file(tmp_path / "nope")
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely" / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerError, match="partner file is missing"):
        GPT2Tokenizer.from_file(tmp_path / "lonely" / "vocab.json")
    with pytest.raises(TokenizerError, match="no GPT-2 tokenizer files"):
        GPT2Tokenizer.from_file(tmp_path / "lonely")
    bad = tmp_path / "bad"
    write_gpt2_files(bad, MERGES[:3] + [("x", "zz")])
    with pytest.raises(TokenizerError, match=r"merges.txt:5: 'x zz' is not a merge"):
        GPT2Tokenizer.from_file(bad)
    (tmp_path / "t.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="t.tiktoken:1"):
        GPT2Tokenizer.from_file(tmp_path / "t.tiktoken")
    CharTokenizer("ab").save(tmp_path / "char.json")
    with pytest.raises(TokenizerError, match="holds a char tokenizer, not GPT-2's"):
        GPT2Tokenizer.from_file(tmp_path / "char.json")


def test_gpt2_offline_without_cache_names_the_option(monkeypatch):
    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(TokenizerError, match="--tokenizer-file PATH"):
        GPT2Tokenizer.from_tiktoken()


def test_gpt2_from_tiktoken_leaves_the_process_socket_timeout_alone(tmp_path, monkeypatch):
    # the download's timeout is its own: a process-wide socket timeout would reach a server's sockets too
    _, ranks = write_gpt2_files(tmp_path)
    seen = []

    def get_encoding(name):
        seen.append(socket.getdefaulttimeout())
        return reference_encoding(ranks)

    monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)
    socket.setdefaulttimeout(None)
    tok = GPT2Tokenizer.from_tiktoken()
    assert seen == [None] and socket.getdefaulttimeout() is None
    assert tok.encode(" the cat") == reference_encoding(ranks).encode_ordinary(" the cat")


def test_gpt2_from_tiktoken_stops_waiting_for_a_download_that_hangs(monkeypatch):
    release = threading.Event()

    def hanging(name):  # a network that drops packets: tiktoken's own request never times out
        release.wait(30)
        raise ConnectionError("gave up")

    monkeypatch.setattr(tiktoken, "get_encoding", hanging)
    try:
        with pytest.raises(TokenizerError, match=r"TimeoutError.*--tokenizer-file PATH"):
            GPT2Tokenizer.from_tiktoken(timeout=0.1)
    finally:
        release.set()


# --- loading refuses what is not a tinygpt tokenizer ------------------------------------------


@pytest.mark.parametrize(
    "content, match",
    [
        ("not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ('{"model": {"type": "BPE"}}', "not a tinygpt tokenizer file"),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "wordpiece"}', "unknown tokenizer kind 'wordpiece'"),
        (
            '{"format": "tinygpt-tokenizer", "version": 99, "kind": "char", "chars": ["a"]}',
            "version 99 is not supported",
        ),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "char"}', 'needs "chars"'),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "char", "chars": ["a", 5]}', "single characters"),
        (
            '{"format": "tinygpt-tokenizer", "version": 1, "kind": "char", "chars": ["a"], "vocab_size": 2}',
            "says vocab_size 2",
        ),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "bpe", "tokenizer": {"model": 1}}', "does not load"),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "gpt2", "ranks": ["!!"]}', "not base64"),
        ('{"format": "tinygpt-tokenizer", "version": 1, "kind": "gpt2", "ranks": ["YQ=="]}', "single-byte tokens"),
    ],
)
def test_load_refuses_corrupt_files(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError, match=match) as e:
        load_tokenizer(path)
    assert isinstance(e.value, TinyGPTError) and "\n" not in str(e.value)


def test_load_missing(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "x.json")
    with pytest.raises(TokenizerError, match="no tokenizer.json in"):
        load_tokenizer(tmp_path)


# --- fingerprints ------------------------------------------------------------------------------


def test_fingerprint_is_the_same_for_the_same_tokenizer_however_it_was_made(tmp_path, bpe):
    text = "the cat sat on the mat.\n"
    char = CharTokenizer.from_text(text)
    fp = char.fingerprint()
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    char.save(tmp_path / "char.json")
    assert load_tokenizer(tmp_path / "char.json").fingerprint() == fp
    # the file's spacing, key order and format version are not the tokenizer
    data = json.loads((tmp_path / "char.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(dict(reversed(list(data.items()))), indent=4, ensure_ascii=False))
    assert load_tokenizer(tmp_path / "other.json").fingerprint() == fp
    assert CharTokenizer(sorted(set(text))).fingerprint() == fp
    # the same kind and size with other characters (the text upper-cased) is another tokenizer
    upper = CharTokenizer.from_text(text.upper())
    assert upper.vocab_size == char.vocab_size and upper.fingerprint() != fp
    assert CharTokenizer(list(reversed(char.chars))).fingerprint() != fp  # the same characters, other ids

    bpe.save(tmp_path / "bpe.json")
    assert load_tokenizer(tmp_path / "bpe.json").fingerprint() == bpe.fingerprint()
    # merges as older tokenizers releases wrote them ("a b") load as the same tokenizer
    data = json.loads((tmp_path / "bpe.json").read_text())
    merges = data["tokenizer"]["model"]["merges"]
    data["tokenizer"]["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_tokenizer(tmp_path / "old.json").fingerprint() == bpe.fingerprint()
    other = BPETokenizer.train([CORPUS.upper()], 320)
    assert len({bpe.fingerprint(), other.fingerprint(), fp}) == 3

    _, ranks = write_gpt2_files(tmp_path / "gpt2")
    gpt2 = GPT2Tokenizer.from_file(tmp_path / "gpt2")
    gpt2.save(tmp_path / "gpt2.json")
    assert load_tokenizer(tmp_path / "gpt2.json").fingerprint() == gpt2.fingerprint()
    assert GPT2Tokenizer.from_file(tmp_path / "gpt2" / "merges.txt").fingerprint() == gpt2.fingerprint()
    assert GPT2Tokenizer(ranks, {EOT: len(ranks)}, pat_str=r"\s+|\S+").fingerprint() != gpt2.fingerprint()
    assert gpt2.describe() == f"gpt2, {gpt2.vocab_size:,} tokens, {gpt2.fingerprint()[:19]}"


def fingerprint_before(tok) -> str:
    """An hf tokenizer's fingerprint as tinygpt recorded it before the rules were written as a bpe tokenizer's:
    its tokenizer.json as the folder had it, tokenizer_config.json's settings and the template."""
    import hashlib

    inner = {k: v for k, v in tok.to_dict()["tokenizer"].items() if k not in ("version", "truncation", "padding")}
    canonical = {"kind": "hf", "tokenizer": inner, "config": tok.to_dict()["config"], "jinja_chat_template": None}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def test_a_bpe_tokenizer_exported_as_a_gpt2_and_as_a_qwen3_folder_reads_back_as_one(tmp_path, bpe):
    # once 'bpe' and 'hf' kinds with two fingerprints: data prepared with one export was refused for the other
    from tinygpt import GPT, GPTConfig
    from tinygpt.checkpoint import folder_tokenizer as load_any
    from tinygpt.data import load_data, prepare
    from tinygpt.errors import DataError
    from tinygpt.interop.hf import export_hf
    from tinygpt.train import check_data_for_run

    small = dict(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=bpe.vocab_size)
    gpt2, qwen3 = tmp_path / "gpt2", tmp_path / "qwen3"
    export_hf(GPT(GPTConfig(**small)), bpe, gpt2)
    export_hf(GPT(GPTConfig(arch="llama", qk_norm=True, **small)), bpe, qwen3)
    assert json.loads((qwen3 / "config.json").read_text())["model_type"] == "qwen3"
    via_gpt2, via_qwen3 = load_any(gpt2), load_any(qwen3)
    assert (via_gpt2.kind, via_qwen3.kind) == ("bpe", "hf")
    assert via_gpt2.fingerprint() == via_qwen3.fingerprint() == bpe.fingerprint()
    (tmp_path / "a.txt").write_text(CORPUS)
    (tmp_path / "b.txt").write_text(CORPUS.upper())
    for prepared_with, used_with in ((gpt2, qwen3), (qwen3, gpt2)):
        data = tmp_path / f"data-{prepared_with.name}"
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], data, tokenizer=None, tokenizer_file=prepared_with)
        check_data_for_run(used_with, load_data(data), load_any(used_with))  # the same ids: accepted
    assert np.array_equal(load_data(tmp_path / "data-gpt2").train, load_data(tmp_path / "data-qwen3").train)

    # a rule a bpe tokenizer never has still tells them apart: without an eos, no separator between documents
    settings = json.loads((qwen3 / "tokenizer_config.json").read_text())
    del settings["eos_token"]
    (qwen3 / "tokenizer_config.json").write_text(json.dumps(settings))
    assert load_any(qwen3).eot_id is None and load_any(qwen3).fingerprint() != bpe.fingerprint()
    with pytest.raises(DataError, match="another tokenizer"):
        check_data_for_run(qwen3, load_data(tmp_path / "data-gpt2"), load_any(qwen3))


def test_fingerprints_an_earlier_tinygpt_recorded_for_an_hf_tokenizer_still_match(tmp_path):
    # data folders and runs written before an hf tokenizer's fingerprint followed its rules keep working
    import shutil

    from tinygpt.data import load_data, prepare
    from tinygpt.errors import DataError
    from tinygpt.tokenizer import HFTokenizer
    from tinygpt.train import check_data_for_run

    bos = BPETokenizer.train([CORPUS], 300).hf_tokenizer  # an hf tokenizer a bpe one is not: a BOS before each text
    bos.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single=f"{EOT}:0 $A:0", special_tokens=[(EOT, bos.token_to_id(EOT))])
    tok = HFTokenizer(json.loads(bos.to_str()), {"bos_token": EOT, "eos_token": EOT})
    before = fingerprint_before(tok)
    assert tok.fingerprint() != before and tok.fingerprints() == (tok.fingerprint(), before)
    (tmp_path / "a.txt").write_text(CORPUS)
    prepare([str(tmp_path / "a.txt")], tmp_path / "new", tokenizer=tok)
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": before}))
    run = tmp_path / "run"  # a run begun on the old folder: its train_config.json recorded the old fingerprint
    run.mkdir()
    tok.save(run / "tokenizer.json")
    (run / "train_config.json").write_text(json.dumps({"tokenizer_fingerprint": before}))
    for data in ("old", "new"):  # data prepared before and after, for the run and for a folder that records
        check_data_for_run(run, load_data(tmp_path / data))  # nothing (a Hugging Face one: its tokenizer decides)
        check_data_for_run(tmp_path / "hf", load_data(tmp_path / data), tok)
    # a recorded fingerprint that is none of the tokenizer's is refused as before
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": "sha256:" + "0" * 64}))
    with pytest.raises(DataError, match="another tokenizer"):
        check_data_for_run(run, load_data(tmp_path / "old"))
