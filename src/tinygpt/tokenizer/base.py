"""What every tokenizer shares: the `Tokenizer` protocol, the base its kinds build on (ids checked,
decoding through bytes, batch and array encoding, the fingerprint, saving) and reading a saved one back.

A tokenizer is saved as one JSON file, never a pickle: "format" (tinygpt-tokenizer), "version", "kind",
"vocab_size", the kind's own fields, and "chat_template" where it carries one. `tokenizer_from_dict` rebuilds
it with its kind's class, which registered itself by subclassing `TokenizerBase`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ChatError, ConfigError, TokenizerError
from ..fileio import read_json, write_json
from .chat_template import ChatTemplate

FORMAT = "tinygpt-tokenizer"
VERSION = 1
KINDS = ("char", "bpe", "gpt2", "hf")
EOT = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer offers. `eot_id` is the document separator, where the kind has one."""

    kind: str
    vocab_size: int
    eot_id: int | None
    chat_template: ChatTemplate | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_to_array(self, texts: str | Sequence[str]) -> np.ndarray: ...

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def decode_bytes(self, ids: Iterable[int]) -> bytes: ...

    def to_dict(self) -> dict[str, Any]: ...

    def save(self, path: str | os.PathLike) -> None: ...

    def fingerprint(self) -> str: ...

    def fingerprints(self) -> tuple[str, ...]: ...


def _canonical_json(value: Any) -> bytes:
    """One byte string per value: keys sorted, no whitespace, ASCII escapes (so no encoding choice)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def digest(canonical: dict[str, Any]) -> str:
    """"sha256:" and the SHA-256 of `canonical` as _canonical_json writes it: a fingerprint.

    Args:
        canonical: what the fingerprint holds (a tokenizer's canonical form).
    """
    return "sha256:" + hashlib.sha256(_canonical_json(canonical)).hexdigest()


# kind -> its class, for tokenizer_from_dict. Each kind's class enters itself when defined
# (TokenizerBase.__init_subclass__): this module imports none of them, so gpt2, whose from_file reads
# tinygpt's files too, imports it without a cycle
_KIND_CLASSES: dict[str, type[TokenizerBase]] = {}


class TokenizerBase:
    """The parts all kinds share: id checking, decode via bytes, batch/array encoding, save."""

    kind: str = ""
    vocab_size: int = 0
    eot_id: int | None = None
    chat_template: ChatTemplate | None = None  # set by with_chat_template
    _fingerprint: str | None = None  # computed once, on first use

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # a kind of its own, not a base shared by kinds
            _KIND_CLASSES[cls.kind] = cls

    def special_ids(self) -> dict[str, int]:  # pragma: no cover - overridden
        """Text -> id of the tokens encoding never produces (<|endoftext|>, a chat template's)."""
        raise NotImplementedError

    def _with_specials(self, tokens: list[str]) -> TokenizerBase:  # pragma: no cover - overridden
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.encode_batch([text])[0]

    @property
    def added_ids(self) -> tuple[list[int], list[int]]:
        """(before, after): the ids put around a document or a prompt, as transformers' tokenizer puts
        a pretrained model's BOS (HFTokenizer); none for tinygpt's own kinds."""
        return [], []

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:  # pragma: no cover - overridden
        raise NotImplementedError

    def encode_to_array(self, texts: str | Sequence[str]) -> np.ndarray:
        """Token ids of the texts, encoded one by one and concatenated, as a uint32 array."""
        if isinstance(texts, str):
            texts = [texts]
        lists = self.encode_batch(texts)
        return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.uint32, count=sum(map(len, lists)))

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids as its own uint32 array, computed in the calling thread alone (no thread
        pool of the tokenizer's own; for BPE, with TOKENIZERS_PARALLELISM=false, as
        tinygpt.data.datasets.Encoder sets it): prepare's workers each run one such call at a time, in parallel,
        since every kind's encoder releases the GIL while it works."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode_batch(texts)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`. Byte sequences that are not valid UTF-8 (a character cut between tokens)
        decode to U+FFFD; use `IncrementalDecoder` to stream text token by token."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _canonical(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def fingerprint(self) -> str:
        """"sha256:" and 64 hex digits: the SHA-256 of this tokenizer's canonical form.

        The canonical form holds what decides the ids of a text and the text of ids, and nothing
        else, whatever route the tokenizer took: for char, the characters in id order; for BPE as
        `tokenizers` runs it (bpe and hf alike), each id's bytes, the merges (spelled "a b", whichever
        way the `tokenizers` release writes them), the normalizer, the pre-tokenizer and the added
        tokens, and for hf the rules a bpe tokenizer never has, each only where it has it (BPE options,
        a decoder that is not byte-level, an eos other than <|endoftext|>, ids added around a text),
        so a bpe tokenizer exported as a GPT-2 folder and as a Llama-family one reads back as one;
        for gpt2, the ranks, the special tokens and the split pattern; and the chat template. It is
        serialized as JSON with sorted keys, no whitespace and ASCII escapes. So the same tokenizer
        gives the same fingerprint whether it was just trained or loaded from a file, whatever the
        file's key order, spacing or format version; a vocabulary of the same kind and size with
        other characters (text upper-cased) gives another.
        """
        if self._fingerprint is None:
            canonical = self._canonical()
            if self.chat_template is not None:  # it decides the ids a conversation renders to
                canonical["chat_template"] = self.chat_template.to_dict()
            self._fingerprint = digest(canonical)
        return self._fingerprint

    def fingerprints(self) -> tuple[str, ...]:
        """Every fingerprint this tokenizer goes by: fingerprint() first, then those earlier releases of
        tinygpt gave it, which the data folders and runs they wrote still hold."""
        return (self.fingerprint(),)

    def describe(self) -> str:
        """A short label for messages: kind, size and the fingerprint's first 12 hex digits."""
        return f"{self.kind}, {self.vocab_size:,} tokens, {short_fingerprint(self.fingerprint())}"

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file (into `path/tokenizer.json` if path is a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        write_json(path, self.to_dict(), indent=None)

    def _check_ids(self, ids: Iterable[int] | int) -> list[int]:
        """ids as a list of Python ints, each in [0, vocab_size). Accepts lists, numpy arrays and tensors."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors, including 0-d ones
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        try:
            out = [operator.index(i) for i in ids]
        except TypeError:
            raise TokenizerError("token ids must be integers") from None
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            bad = next(i for i in out if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return out

    def _header(self) -> dict[str, Any]:
        header = {"format": FORMAT, "version": VERSION, "kind": self.kind, "vocab_size": self.vocab_size}
        if self.chat_template is not None:
            header["chat_template"] = self.chat_template.to_dict()
        return header

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint as messages show it: "sha256:" and its first 12 hex digits."""
    return fingerprint[: len("sha256:") + 12]


def encode_named(tokenizer: Tokenizer, text: str, name: str) -> list[int]:
    """The ids of a text a user gave under `name` (a flag, a setting): characters the vocabulary lacks
    are a ConfigError naming it (and the characters' positions in its text), where the tokenizer's own
    words name neither and the text may be one of several."""
    try:
        return tokenizer.encode(text)
    except TokenizerError as e:
        raise ConfigError(f"{name}: {e}") from None


def _checked_template(tokenizer: Tokenizer, template: ChatTemplate) -> ChatTemplate:
    missing = [t for t in template.special_tokens() if t not in tokenizer.special_ids()]
    if missing:
        raise TokenizerError(f"the chat template's tokens {', '.join(missing)} are not special tokens of the "
                             "vocabulary")
    return template


def tokenizer_from_dict(data: Any, *, where: str = "tokenizer") -> Tokenizer:
    """Rebuild a tokenizer from its `to_dict()` form, refusing anything else with TokenizerError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TokenizerError(f'{where}: not a tinygpt tokenizer file (no "format": "{FORMAT}")')
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise TokenizerError(
            f"{where}: tokenizer format version {version!r} is not supported (this tinygpt reads {VERSION})"
        )
    kind = data.get("kind")
    if kind not in _KIND_CLASSES:
        raise TokenizerError(f"{where}: unknown tokenizer kind {kind!r} (expected one of {', '.join(KINDS)})")
    try:
        tok = _KIND_CLASSES[kind].from_dict(data)
    except TokenizerError as e:
        raise TokenizerError(f"{where}: {e}") from None
    except Exception as e:  # anything else in a damaged file is still a damaged file
        raise TokenizerError(f"{where}: corrupt {kind} tokenizer ({type(e).__name__}: {e})") from None
    if "chat_template" in data:
        try:
            tok.chat_template = _checked_template(tok, ChatTemplate.from_dict(data["chat_template"]))
        except (ChatError, TokenizerError) as e:
            raise TokenizerError(f"{where}: {e}") from None
    if "vocab_size" in data and data["vocab_size"] != tok.vocab_size:
        raise TokenizerError(f"{where}: says vocab_size {data['vocab_size']} but holds {tok.vocab_size} tokens")
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer saved by tinygpt.

    Args:
        path: a tokenizer JSON file, or a folder (a data folder or a run) holding `tokenizer.json`.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").exists():
            raise TokenizerError(f"no tokenizer.json in {p}")
        p = p / "tokenizer.json"
    elif not p.exists():
        raise TokenizerError(f"tokenizer file not found: {p}")
    return tokenizer_from_dict(read_json(p, TokenizerError), where=str(p))
