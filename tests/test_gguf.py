"""GGUF export: read the file back with gguf's own reader and check every key, every tensor, and that
the stored vocabulary tokenizes as tinygpt does under llama.cpp's BPE algorithm."""

import numpy as np
import pytest
import torch
from conftest import make_text

gguf = pytest.importorskip("gguf", reason="the hf extra is not installed: pip install 'tinygpt[hf]'")
regex = pytest.importorskip("regex")

from test_tokenizer import GPT2_TEXTS, reference_encoding, write_gpt2_files  # noqa: E402

from tinygpt import GPT, GPTConfig  # noqa: E402
from tinygpt.errors import CheckpointError, TokenizerError  # noqa: E402
from tinygpt.interop.gguf import INERT_MERGE, export_gguf, gguf_notes  # noqa: E402
from tinygpt.interop.hf_tokenizer import spell_bytes  # noqa: E402
from tinygpt.tokenizer import EOT, GPT2_PATTERN, BPETokenizer, CharTokenizer, GPT2Tokenizer  # noqa: E402

CORPUS = make_text(300) + "un café à 3 € 😀, naïve\tcoöperation\r\n"
TEXTS = [make_text(4, seed=7), "the cat  sees\n\n  a dog.", "un café à 3 € 😀", " ", ""]


def read(path):
    """Every key (value as Python) and every tensor (name -> ReaderTensor) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def llama_cpp_encode(tokens, merges, text):
    """llama.cpp's "gpt2" tokenizer with the "gpt-2" pre-tokenizer: split with GPT-2's regex, spell
    each piece in the byte alphabet, apply the lowest-ranked merge until none applies, look up."""
    ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    ids = {t: i for i, t in enumerate(tokens)}
    out = []
    for piece in regex.findall(GPT2_PATTERN, text):
        word = list(spell_bytes(piece.encode("utf-8")))
        while len(word) > 1:
            candidates = [(ranks[pair], i) for i, pair in enumerate(zip(word, word[1:])) if pair in ranks]
            if not candidates:
                break
            _, i = min(candidates)
            word[i : i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


def llama_names(n_layer, tied):
    names = {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"}
    for i in range(n_layer):
        for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"):
            names |= {f"blk.{i}.{t}.weight", f"blk.{i}.{t}.bias"}
    return names if tied else names | {"output.weight"}


def check_file(path, model, tokenizer, dtype="float32"):
    c = model.config
    fields, tensors = read(path)
    tokens, merges = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"]
    expected = {
        "general.architecture": "gpt2",
        "general.name": path.stem,
        "general.file_type": 1 if dtype == "float16" else 0,
        "gpt2.context_length": c.block_size,
        "gpt2.embedding_length": c.n_embd,
        "gpt2.block_count": c.n_layer,
        "gpt2.feed_forward_length": 4 * c.n_embd,
        "gpt2.attention.head_count": c.n_head,
        "gpt2.vocab_size": c.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.add_bos_token": False,
    }
    if tokenizer.eot_id is not None:
        expected["tokenizer.ggml.bos_token_id"] = expected["tokenizer.ggml.eos_token_id"] = tokenizer.eot_id
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    scalar = {k: v for k, v in fields.items() if k not in (*arrays, "gpt2.attention.layer_norm_epsilon")}
    assert scalar == expected
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(c.layer_norm_eps)
    # one token and one type per row of the embedding; the special token is a control token
    assert len(tokens) == len(fields["tokenizer.ggml.token_type"]) == c.vocab_size
    types = fields["tokenizer.ggml.token_type"]
    for i in range(c.vocab_size):
        if i >= tokenizer.vocab_size:
            want = gguf.TokenType.UNUSED
        else:
            want = gguf.TokenType.CONTROL if i == tokenizer.eot_id else gguf.TokenType.NORMAL
        assert types[i] == want, i
    checked = 0
    for text in TEXTS:
        try:
            want = tokenizer.encode(text)
        except TokenizerError:  # a character outside a char vocabulary
            continue
        assert llama_cpp_encode(tokens, merges, text) == want, text
        checked += 1
    assert checked >= 3

    # every tensor, under llama.cpp's GPT-2 names, in nn.Linear's (out, in) layout
    assert set(tensors) == llama_names(c.n_layer, c.tie_weights)
    params = dict(model.named_parameters())
    ours = {
        "token_embd": "wte", "position_embd": "wpe", "output_norm": "ln_f", "output": "lm_head",
        "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
    }
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk":
            key = f"h.{parts[1]}.{ours[parts[2]]}.{parts[3]}"
        else:
            key = f"{ours[parts[0]]}.{parts[1]}"
        want = params[key].detach().numpy() if key in params else np.zeros(tensor.data.shape, np.float32)
        half = dtype == "float16" and want.ndim == 2
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F16 if half else gguf.GGMLQuantizationType.F32)
        assert tensor.data.shape == want.shape, name
        if half:
            np.testing.assert_allclose(tensor.data.astype(np.float32), want, rtol=1e-3, atol=1e-4)
        else:
            assert np.array_equal(tensor.data, want), name
    return fields


def random_model(config):
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # no LayerNorm at its init, so a mix-up shows
    return model


def test_char_model(tmp_path):
    tok = CharTokenizer.from_text(CORPUS)
    model = random_model(GPTConfig(vocab_size=tok.vocab_size, block_size=24, n_layer=2, n_head=3, n_embd=18))
    path = export_gguf(model, tok, tmp_path / "char.gguf")
    fields = check_file(path, model, tok)
    # characters spelled as GPT-2 spells bytes; merges only rebuild multi-byte characters
    assert fields["tokenizer.ggml.tokens"][tok.encode(" ")[0]] == "Ġ"
    assert "Ã ©" in fields["tokenizer.ggml.merges"]
    assert any("--ignore-eos" in n for n in gguf_notes(model, tok))


def test_ascii_char_vocabulary_gets_the_inert_merge(tmp_path):
    tok = CharTokenizer.from_text(make_text(50))
    assert all(ord(c) < 128 for c in tok.chars)
    model = random_model(GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=1, n_embd=8))
    fields = check_file(export_gguf(model, tok, tmp_path / "ascii.gguf"), model, tok)
    assert fields["tokenizer.ggml.merges"] == [" ".join(INERT_MERGE)]
    assert "À".encode("latin-1") == b"\xc0"  # a byte that UTF-8 never uses, so the merge never applies


def test_bpe_model_untied_exact_gelu_float16(tmp_path):
    tok = BPETokenizer.train([CORPUS], 300)
    config = GPTConfig(vocab_size=tok.vocab_size + 5, block_size=16, n_layer=3, n_head=2, n_embd=10,
                       tie_weights=False, activation="gelu", bias=False, layer_norm_eps=1e-6)
    model = random_model(config)
    check_file(export_gguf(model, tok, tmp_path / "bpe.gguf"), model, tok)
    fields = check_file(export_gguf(model, tok, tmp_path / "bpe16.gguf", dtype="float16"), model, tok, "float16")
    assert fields["tokenizer.ggml.tokens"][-1] == f"[PAD{config.vocab_size - 1}]"  # rows past the tokenizer's
    notes = gguf_notes(model, tok)
    assert len(notes) == 1 and "exact GELU" in notes[0]


def test_gpt2_tokenizer_equals_tiktoken(tmp_path):
    vocab, ranks = write_gpt2_files(tmp_path / "files")
    tok = GPT2Tokenizer.from_file(tmp_path / "files")
    model = random_model(GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=8))
    fields = check_file(export_gguf(model, tok, tmp_path / "gpt2.gguf"), model, tok)
    ref = reference_encoding(ranks)
    for text in GPT2_TEXTS:
        assert llama_cpp_encode(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"], text) == \
            ref.encode_ordinary(text), text
    assert fields["tokenizer.ggml.tokens"][vocab[EOT]] == EOT


def test_char_vocabulary_without_end_of_text_is_noted():
    tok = CharTokenizer.from_text(make_text(50))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=1, n_embd=8))
    (note,) = gguf_notes(model, tok)
    assert "--ignore-eos" in note and repr(tok.chars[11]) in note


def test_bad_targets(tmp_path):
    tok = CharTokenizer.from_text("abc")
    model = GPT(GPTConfig(vocab_size=2, block_size=4, n_layer=1, n_head=1, n_embd=4))
    with pytest.raises(CheckpointError, match="3 tokens, the model 2"):
        export_gguf(model, tok, tmp_path / "x.gguf")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(CheckpointError, match="is a folder"):
        model = GPT(GPTConfig(vocab_size=3, block_size=4, n_layer=1, n_head=1, n_embd=4))
        export_gguf(model, tok, tmp_path / "dir.gguf")
    assert not (tmp_path / "x.gguf").exists()
    # an existing file is replaced only when it is an earlier export
    (tmp_path / "notes.txt").write_text("my notes")
    with pytest.raises(CheckpointError, match="exists and is not a GGUF file"):
        export_gguf(model, tok, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    export_gguf(model, tok, tmp_path / "x.gguf")
    export_gguf(model, tok, tmp_path / "x.gguf")
