"""Tokenizers written out in Hugging Face's forms: tokenizer.json (the `tokenizers` library's),
tokenizer_config.json, and GPT-2's own vocab.json + merges.txt. Reading them is tinygpt.tokenizer.hf_folder's;
this module picks the reader a model folder's type takes.

    to_hf_tokenizer(tokenizer)        a `tokenizers.Tokenizer` that encodes and decodes exactly like it
    load_hf_tokenizer(folder)         a Hugging Face folder's tokenizer as a tinygpt one (or None)
    save_hf_tokenizer(tokenizer, out, max_length)
                                      the files transformers' AutoTokenizer reads
    byte_level_vocab(tokenizer)       tokens, merges and special ids in GPT-2's byte-level spelling
                                      (what llama.cpp's GGUF stores too)

Every tinygpt kind converts: char (a WordLevel vocabulary of single characters), bpe (already a
`tokenizers` pipeline) and gpt2 (a byte-level BPE rebuilt from tiktoken's ranks). The `tokenizers`
library is imported only by the functions that build or read its objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from ..fileio import atomic_write, read_json, write_json
from ..tokenizer.base import EOT, Tokenizer
from ..tokenizer.bpe import BPETokenizer, byte_to_unicode
from ..tokenizer.char import CharTokenizer
from ..tokenizer.gpt2 import GPT2Tokenizer
from ..tokenizer.hf import HFTokenizer
from ..tokenizer.hf_folder import (CHAR_SPLIT, CHAT_TEMPLATE, GPT2_MERGES, GPT2_VOCAB, TINYGPT_TEMPLATE, TOKENIZER,
                                   TOKENIZER_CONFIG, TOKENIZER_FILES, gpt2_folder_tokenizer, pretrained_tokenizer)
from .hf_folder import CONFIG, FAMILY

_SPELLING = byte_to_unicode()


def spell_bytes(data: bytes) -> str:
    """Bytes in GPT-2's byte-level alphabet, as byte-level BPE vocabularies write tokens."""
    return "".join(_SPELLING[b] for b in data)


def _bpe_split(ranks: Mapping[bytes, int], token: bytes) -> list[bytes]:
    """Byte-pair encode `token` using only tokens ranked below it: the two parts it was merged from."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def ranks_to_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a rank-ordered BPE (tiktoken's form), in rank order: the pair each token of
    two or more bytes is made from.

    That pair is how byte-pair encoding builds the token from its own bytes with lower-ranked
    tokens only. In vocabularies not made by BPE training a token may not be built that way; it
    then gets the split into two tokens whose later rank is earliest, and a token that splits into
    no two tokens gets no merge (tiktoken cannot produce it either).
    """
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _bpe_split(ranks, token)
        if len(parts) != 2:
            splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
            if not splits:
                continue
            parts = min(splits, key=lambda pq: max(ranks[pq[0]], ranks[pq[1]]))
        merges.append((parts[0], parts[1]))
    return merges


def _char_merges(chars: list[str]) -> list[tuple[str, str]]:
    """Merges that rebuild each multi-byte character from its bytes, left to right.

    Every pair starts with a UTF-8 lead byte and adds one continuation byte, so no merge can join
    two characters: a byte-level BPE with these merges splits text exactly into characters.
    """
    merges: dict[tuple[str, str], None] = {}
    for c in chars:
        data = c.encode("utf-8")
        for n in range(2, len(data) + 1):
            merges[(spell_bytes(data[: n - 1]), spell_bytes(data[n - 1 : n]))] = None
    return list(merges)


def byte_level_vocab(tokenizer: Tokenizer) -> tuple[list[str], list[tuple[str, str]], set[int]]:
    """The tokenizer as a byte-level BPE (GPT-2's scheme, as llama.cpp reads it): tokens by id, spelled
    in GPT-2's byte alphabet; merges in rank order; the ids of special tokens.

    A char tokenizer becomes a BPE whose tokens are its characters and whose merges only assemble
    multi-byte characters, so it still encodes one id per character.
    """
    if isinstance(tokenizer, CharTokenizer):
        tokens = [spell_bytes(c.encode("utf-8")) for c in tokenizer.chars] + list(tokenizer.specials)
        return tokens, _char_merges(tokenizer.chars), set(range(len(tokenizer.chars), tokenizer.vocab_size))
    if isinstance(tokenizer, GPT2Tokenizer):
        tokens = [""] * tokenizer.vocab_size
        ranks, special = tokenizer.ranks, tokenizer.special_tokens
        for token, rank in ranks.items():
            tokens[rank] = spell_bytes(token)
        for text, i in special.items():
            tokens[i] = text
        merges = [(spell_bytes(a), spell_bytes(b)) for a, b in ranks_to_merges(ranks)]
        return tokens, merges, set(special.values())
    if isinstance(tokenizer, BPETokenizer):
        data = json.loads(tokenizer.hf_tokenizer.to_str())
        vocab = tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * tokenizer.vocab_size
        for token, i in vocab.items():
            tokens[i] = token
        # `tokenizers` writes merges as [a, b] pairs (0.20+) or "a b" strings (before)
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in data["model"]["merges"]]
        special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        return tokens, merges, special
    raise TokenizerError(f"cannot convert a {getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer")


def to_hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """The tokenizer as a Hugging Face `tokenizers.Tokenizer` that encodes and decodes exactly like it.

    char: a WordLevel vocabulary of single characters behind a pre-tokenizer that isolates every
    character, and a decoder that joins tokens without spaces. bpe: the tokenizer itself. gpt2: a
    byte-level BPE built from tiktoken's ranks, with <|endoftext|> as a special token.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if isinstance(tokenizer, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tokenizer.chars)}
        # "<unk>" is not in the vocabulary, so an unknown character is an error, as in tinygpt
        tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_SPLIT), behavior="isolated")
        tok.decoder = decoders.Fuse()
        for i, text in enumerate(tokenizer.specials, start=len(tokenizer.chars)):  # a chat template's, in id order
            tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
            if tok.token_to_id(text) != i:
                raise TokenizerError(f"special token {text!r} does not land on its id {i}")
        return tok
    if isinstance(tokenizer, BPETokenizer):
        return HFTokenizer.from_str(tokenizer.hf_tokenizer.to_str())
    if isinstance(tokenizer, GPT2Tokenizer):
        tokens, merges, special = byte_level_vocab(tokenizer)
        vocab = {t: i for i, t in enumerate(tokens) if i not in special}
        tok = HFTokenizer(models.BPE(vocab, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        for i in sorted(special):  # added in id order, so each lands on its own id
            tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)])
            if tok.token_to_id(tokens[i]) != i:
                raise TokenizerError(f"special token {tokens[i]!r} must follow the ordinary tokens (id {i})")
        return tok
    raise TokenizerError(f"cannot convert a {getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer")


def load_hf_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder, as a tinygpt tokenizer; None if the folder has none.

    A Llama-family folder's (by its config.json's model_type) is the pretrained model's own, an
    HFTokenizer (tinygpt.tokenizer.hf_folder.pretrained_tokenizer); any other folder's is one of
    tinygpt's kinds as a GPT-2 folder holds it (gpt2_folder_tokenizer): GPT-2's vocab.json + merges.txt,
    or a tokenizer.json of single characters or byte-level BPE, with the chat template tinygpt exported.

    Args:
        path: the folder.
    """
    path = Path(path)
    return pretrained_tokenizer(path) if _model_type(path) in FAMILY else gpt2_folder_tokenizer(path)


def _model_type(path: Path) -> Any:
    data = read_json(path / CONFIG, TokenizerError) if (path / CONFIG).is_file() else None
    return data.get("model_type") if isinstance(data, dict) else None


def tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over tokenizer.json, with GPT-2's special tokens."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        # tinygpt encodes the text "<|endoftext|>" as text; only the data pipeline inserts the separator
        "split_special_tokens": True,
    }
    if tokenizer.eot_id is not None:
        config.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
    template = tokenizer.chat_template
    if template is not None:
        # apply_chat_template renders a string and encodes it: the template's special tokens in it must
        # be found as such, so special spellings are not split here (unlike tinygpt's render_chat, a
        # message that spells one in its text gets the token); generation ends at the end of turn
        config.update(chat_template=template.jinja(), split_special_tokens=False, eos_token=template.end)
        # what `tinygpt import` reads back (the Jinja is for transformers)
        config[TINYGPT_TEMPLATE] = template.to_dict()
    return config


def save_hf_tokenizer(tokenizer: Tokenizer | None, out: str | Path, max_length: int) -> None:
    """Write the tokenizer into a Hugging Face folder as transformers' AutoTokenizer reads it:
    tokenizer.json + tokenizer_config.json, and GPT-2's BPE also as vocab.json + merges.txt (as the
    Hub ships GPT-2). Tokenizer files already there that this one does not write are removed.

    Args:
        tokenizer: char, bpe or gpt2, or a pretrained model's (hf: its tokenizer.json, special tokens and
            Jinja chat template as they came); None removes the folder's tokenizer files.
        out: the folder (it exists).
        max_length: the model's context, for tokenizer_config.json.
    """
    out = Path(out)
    written = {TOKENIZER, TOKENIZER_CONFIG} if tokenizer is not None else set()
    if isinstance(tokenizer, GPT2Tokenizer):
        written |= {GPT2_VOCAB, GPT2_MERGES}
    if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None:
        written.add(CHAT_TEMPLATE)
    for name in set(TOKENIZER_FILES) - written:
        (out / name).unlink(missing_ok=True)
    if tokenizer is None:
        return
    if isinstance(tokenizer, HFTokenizer):  # a pretrained model's, written back as its folder had it
        saved = tokenizer.to_dict()
        write_json(out / TOKENIZER, saved["tokenizer"], indent=None)
        settings = {k: v for k, v in saved["config"].items() if k != "stop"}  # generation_config.json's
        write_json(out / TOKENIZER_CONFIG, {"model_max_length": max_length, "clean_up_tokenization_spaces": False,
                                            **{k: v for k, v in settings.items() if v is not None}})
        if tokenizer.chat_template is not None:  # where transformers 5 writes it
            source = saved["jinja_chat_template"]
            atomic_write(out / CHAT_TEMPLATE, lambda tmp: tmp.write_text(source, encoding="utf-8"))
        return
    hf_tok = to_hf_tokenizer(tokenizer)
    atomic_write(out / TOKENIZER, lambda tmp: hf_tok.save(str(tmp)))
    write_json(out / TOKENIZER_CONFIG, tokenizer_config(tokenizer, max_length))
    if isinstance(tokenizer, GPT2Tokenizer):
        tokens, merges, _ = byte_level_vocab(tokenizer)
        write_json(out / GPT2_VOCAB, {t: i for i, t in enumerate(tokens)}, indent=None)
        text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
        atomic_write(out / GPT2_MERGES, lambda tmp: tmp.write_text(text, encoding="utf-8"))
