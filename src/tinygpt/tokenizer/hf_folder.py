"""A Hugging Face folder's tokenizer files read as a tinygpt tokenizer (writing them out is
tinygpt.interop.hf_tokenizer's, which also picks which of the two readers a model folder takes, by its
config.json's model type):

    pretrained_tokenizer(folder)     a pretrained model's own (HFTokenizer): tokenizer.json, tokenizer_config.json's
                                     special tokens and class, the Jinja chat template, generation_config.json's
                                     eos ids
    gpt2_folder_tokenizer(folder)    one of tinygpt's kinds, as a GPT-2 folder holds it (the Hub's GPT-2, or a run
                                     tinygpt exported): GPT-2's vocab.json + merges.txt, or a tokenizer.json of one
                                     token per character or of byte-level BPE, with the chat template an export
                                     recorded
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ChatError, TokenizerError
from ..fileio import read_json
from .base import Tokenizer
from .bpe import BPETokenizer
from .char import CharTokenizer
from .chat import with_chat_template
from .chat_template import ChatTemplate
from .gpt2 import GPT2Tokenizer
from .hf import SPECIAL_TOKEN_NAMES, HFTokenizer

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GPT2_VOCAB = "vocab.json"
GPT2_MERGES = "merges.txt"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 5 writes a tokenizer's chat template
GENERATION_CONFIG = "generation_config.json"
# every tokenizer file these readers take: an export removes those it does not write, which would be read
# in place of its own
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_CONFIG, GPT2_VOCAB, GPT2_MERGES, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE)
TINYGPT_TEMPLATE = "tinygpt_chat_template"  # tokenizer_config.json: the template in tinygpt's form
# The char tokenizer as a `tokenizers` pipeline: every character its own piece, one id each.
CHAR_SPLIT = r"[\s\S]"


def _optional_json(path: Path, name: str) -> Any:
    """The folder's file `name` as JSON, or {} where the folder has none."""
    return read_json(path / name, TokenizerError) if (path / name).is_file() else {}


def pretrained_tokenizer(path: str | Path) -> HFTokenizer | None:
    """A pretrained model's own tokenizer, as a Llama-family folder holds it: tokenizer.json,
    tokenizer_config.json's special tokens and class, the chat template (chat_template.jinja, as
    transformers 5 writes it, else tokenizer_config.json's chat_template, its "default" one where it names
    several), and generation_config.json's eos ids, which end generation.

    Args:
        path: the folder.

    Returns:
        The tokenizer, or None where the folder has no tokenizer.json.
    """
    path = Path(path)
    file = path / TOKENIZER
    if not file.is_file():
        return None
    data = read_json(file, TokenizerError)
    settings, extra = _optional_json(path, TOKENIZER_CONFIG), _optional_json(path, SPECIAL_TOKENS_MAP)
    if not isinstance(settings, dict) or not isinstance(extra, dict):
        raise TokenizerError(f"{path}: {TOKENIZER_CONFIG} and {SPECIAL_TOKENS_MAP} must be JSON objects")
    config: dict[str, Any] = {name: _token_text(settings.get(name, extra.get(name))) for name in SPECIAL_TOKEN_NAMES}
    for flag in ("split_special_tokens", "legacy", "add_prefix_space"):
        if isinstance(settings.get(flag), bool):
            config[flag] = settings[flag]
    if isinstance(settings.get("tokenizer_class"), str):
        config["tokenizer_class"] = settings["tokenizer_class"]
    generation = _optional_json(path, GENERATION_CONFIG)
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


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's object with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def gpt2_folder_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a GPT-2 folder (the Hub's, or a run tinygpt exported) as one of tinygpt's kinds.

    GPT-2's own files (vocab.json + merges.txt) load as GPT-2's BPE through tiktoken; otherwise
    tokenizer.json: a one-character-per-token WordLevel loads as a char tokenizer, a byte-level BPE
    as a bpe tokenizer. A chat template tinygpt exported (tokenizer_config.json's
    tinygpt_chat_template) comes back with it.

    Args:
        path: the folder.

    Returns:
        The tokenizer, or None where the folder has none.
    """
    path = Path(path)
    template = _tinygpt_template(path)
    tokenizer = _gpt2_folder_kind(path, template)
    if tokenizer is None or template is None:
        return tokenizer
    chat = with_chat_template(tokenizer, template)  # its tokens are there already: only the template is added
    if chat.vocab_size != tokenizer.vocab_size:
        raise TokenizerError(f"{path}: tokenizer_config.json names a chat template whose special tokens the "
                             "tokenizer lacks")
    return chat


def _tinygpt_template(path: Path) -> ChatTemplate | None:
    """The tinygpt chat template an export recorded in tokenizer_config.json, if any."""
    data = _optional_json(path, TOKENIZER_CONFIG)
    if not isinstance(data, dict) or TINYGPT_TEMPLATE not in data:
        return None
    try:
        return ChatTemplate.from_dict(data[TINYGPT_TEMPLATE])
    except ChatError as e:
        raise TokenizerError(f"{path / TOKENIZER_CONFIG}: {TINYGPT_TEMPLATE}: {e}") from None


def _gpt2_folder_kind(path: Path, template: ChatTemplate | None) -> Tokenizer | None:
    """gpt2_folder_tokenizer's tokenizer before its template: the kind the folder's files make."""
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
        from tokenizers import Tokenizer as HFTokenizerCore

        try:
            return BPETokenizer(HFTokenizerCore.from_str(json.dumps(data)))
        except TokenizerError as e:
            raise TokenizerError(f"{file}: {e}") from None
        except Exception as e:
            raise TokenizerError(f"{file}: does not load ({type(e).__name__}: {e})") from None
    raise TokenizerError(f"{file}: a {model_type} tokenizer is not supported (tinygpt reads char and byte-level BPE)")


def _char_from_hf(data: dict[str, Any], where: str) -> CharTokenizer:
    """A tokenizer.json in the shape tinygpt.interop.hf_tokenizer.to_hf_tokenizer gives a char tokenizer, back as
    a CharTokenizer."""
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
