"""Tokenizers in Hugging Face's forms, both ways: tokenizer.json (the `tokenizers` library's),
tokenizer_config.json, and GPT-2's own vocab.json + merges.txt.

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

from ..errors import ChatError, TokenizerError
from ..fileio import atomic_write, read_json, write_json
from .hf_folder import FAMILY
from ..tokenizer.base import EOT, Tokenizer
from ..tokenizer.bpe import BPETokenizer, byte_to_unicode
from ..tokenizer.char import CharTokenizer
from ..tokenizer.chat import with_chat_template
from ..tokenizer.chat_template import ChatTemplate
from ..tokenizer.gpt2 import GPT2Tokenizer
from ..tokenizer.hf import SPECIAL_TOKEN_NAMES, HFTokenizer

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GPT2_VOCAB = "vocab.json"
GPT2_MERGES = "merges.txt"
# every tokenizer file of a folder: an export removes those it does not write, which would be read
# in place of its own
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 5 writes a tokenizer's chat template
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_CONFIG, GPT2_VOCAB, GPT2_MERGES, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE)
TINYGPT_TEMPLATE = "tinygpt_chat_template"  # tokenizer_config.json: the template in tinygpt's form
# The char tokenizer as a `tokenizers` pipeline: every character its own piece, one id each.
CHAR_SPLIT = r"[\s\S]"
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


def _char_from_hf(data: dict[str, Any], where: str) -> CharTokenizer:
    """A tokenizer.json in the shape `to_hf_tokenizer` gives a char tokenizer, back as a CharTokenizer."""
    split = {"type": "Split", "pattern": {"Regex": CHAR_SPLIT}, "behavior": "Isolated", "invert": False}
    unsupported = TokenizerError(f"{where}: a WordLevel tokenizer that is not one token per character is not supported")
    try:  # a hand-edited file may hold any JSON where these are
        vocab = data["model"].get("vocab") or {}
        if not all(isinstance(i, int) for i in vocab.values()):
            raise unsupported
        chars = sorted(vocab, key=vocab.get)
        # special tokens after the characters (a chat template's), in id order
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens") or [] if t.get("special"))
    except (AttributeError, KeyError, TypeError):
        raise unsupported from None
    if (
        data.get("pre_tokenizer") != split
        or data.get("normalizer") is not None
        or sorted(vocab.values()) != list(range(len(vocab)))
        or not all(len(c) == 1 for c in chars)
        or not all(isinstance(i, int) and isinstance(t, str) for i, t in added)
        or [i for i, _ in added] != list(range(len(chars), len(chars) + len(added)))
    ):
        raise unsupported
    return CharTokenizer(chars, [t for _, t in added])


def load_hf_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder, as a tinygpt tokenizer; None if the folder has none.

    GPT-2's own files (vocab.json + merges.txt) load as GPT-2's BPE through tiktoken; otherwise
    tokenizer.json: a one-character-per-token WordLevel loads as a char tokenizer, a byte-level BPE
    as a bpe tokenizer. A chat template tinygpt exported (tokenizer_config.json's
    tinygpt_chat_template) comes back with it.
    """
    path = Path(path)
    if _model_type(path) in FAMILY:
        return _pretrained_tokenizer(path)
    template = _chat_template(path)
    tokenizer = _load_hf_tokenizer(path, template)
    if tokenizer is None or template is None:
        return tokenizer
    chat = with_chat_template(tokenizer, template)  # its tokens are there already: only the template is added
    if chat.vocab_size != tokenizer.vocab_size:
        raise TokenizerError(f"{path}: tokenizer_config.json names a chat template whose special tokens the "
                             "tokenizer lacks")
    return chat


def _model_type(path: Path) -> Any:
    data = read_json(path / "config.json", TokenizerError) if (path / "config.json").is_file() else None
    return data.get("model_type") if isinstance(data, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's object with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pretrained_tokenizer(path: Path) -> HFTokenizer | None:
    """A Llama-family folder's own tokenizer: tokenizer.json, tokenizer_config.json's special tokens and
    class, the chat template (chat_template.jinja, as transformers 5 writes it, else
    tokenizer_config.json's chat_template, its "default" one where it names several), and
    generation_config.json's eos ids, which end generation. None without a tokenizer.json."""
    file = path / TOKENIZER
    if not file.is_file():
        return None
    data = read_json(file, TokenizerError)
    settings = read_json(path / TOKENIZER_CONFIG, TokenizerError) if (path / TOKENIZER_CONFIG).is_file() else {}
    extra = read_json(path / SPECIAL_TOKENS_MAP, TokenizerError) if (path / SPECIAL_TOKENS_MAP).is_file() else {}
    if not isinstance(settings, dict) or not isinstance(extra, dict):
        raise TokenizerError(f"{path}: {TOKENIZER_CONFIG} and {SPECIAL_TOKENS_MAP} must be JSON objects")
    config: dict[str, Any] = {name: _token_text(settings.get(name, extra.get(name))) for name in SPECIAL_TOKEN_NAMES}
    for flag in ("split_special_tokens", "legacy", "add_prefix_space"):
        if isinstance(settings.get(flag), bool):
            config[flag] = settings[flag]
    if isinstance(settings.get("tokenizer_class"), str):
        config["tokenizer_class"] = settings["tokenizer_class"]
    generation = read_json(path / GENERATION_CONFIG, TokenizerError) if (path / GENERATION_CONFIG).is_file() else {}
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    config["stop"] = [eos] if isinstance(eos, int) else [i for i in eos if isinstance(i, int)] if isinstance(
        eos, list) else []
    template = settings.get("chat_template")
    if (path / CHAT_TEMPLATE).is_file():
        try:
            template = (path / CHAT_TEMPLATE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path / CHAT_TEMPLATE}: cannot read it ({e})") from None
    elif isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{path / TOKENIZER_CONFIG}: chat_template must be text")
    try:
        return HFTokenizer(data, config, template)
    except (TokenizerError, ChatError) as e:
        raise TokenizerError(f"{path}: {e}") from None


def _chat_template(path: Path) -> ChatTemplate | None:
    """The tinygpt chat template an export recorded in tokenizer_config.json, if any."""
    file = path / TOKENIZER_CONFIG
    data = read_json(file, TokenizerError) if file.is_file() else None
    if not isinstance(data, dict) or TINYGPT_TEMPLATE not in data:
        return None
    try:
        return ChatTemplate.from_dict(data[TINYGPT_TEMPLATE])
    except ChatError as e:
        raise TokenizerError(f"{file}: {TINYGPT_TEMPLATE}: {e}") from None


def _load_hf_tokenizer(path: Path, template: ChatTemplate | None) -> Tokenizer | None:
    gpt2_error = None
    if (path / GPT2_VOCAB).is_file() and (path / GPT2_MERGES).is_file():
        try:
            specials = template.special_tokens() if template is not None else ()
            return GPT2Tokenizer.from_vocab_merges(path / GPT2_VOCAB, path / GPT2_MERGES, specials=specials)
        except TokenizerError as e:  # a BPE that is not rank-ordered like GPT-2's: try tokenizer.json
            gpt2_error = e
    file = path / TOKENIZER
    if not file.is_file():
        if gpt2_error is not None:
            raise gpt2_error
        return None
    data = read_json(file, TokenizerError)
    model = data.get("model") if isinstance(data, dict) else None
    model_type = model.get("type") if isinstance(model, dict) else None
    if model_type == "WordLevel":
        return _char_from_hf(data, str(file))
    if model_type == "BPE":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return BPETokenizer(HFTokenizer.from_str(json.dumps(data)))
        except TokenizerError as e:
            raise TokenizerError(f"{file}: {e}") from None
        except Exception as e:
            raise TokenizerError(f"{file}: does not load ({type(e).__name__}: {e})") from None
    raise TokenizerError(f"{file}: a {model_type} tokenizer is not supported (tinygpt reads char and byte-level BPE)")


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
        config[TINYGPT_TEMPLATE] = template.to_dict()  # what `tinygpt import` reads back (the Jinja is for transformers)
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
