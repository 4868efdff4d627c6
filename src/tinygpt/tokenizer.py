"""Tokenizers: text <-> token ids, each saved as one JSON file (never a pickle).

Three kinds share one small protocol (`Tokenizer`):

- `CharTokenizer`: one id per distinct character of the corpus, in sorted order (nanoGPT's
  shakespeare_char). Text with characters outside the vocabulary is refused, naming them.
- `BPETokenizer`: byte-level BPE trained on the user's corpus with Hugging Face `tokenizers`.
  Text is a sequence of UTF-8 bytes to it, so any string round-trips exactly.
- `GPT2Tokenizer`: GPT-2's own BPE through `tiktoken`, from local files. The saved JSON carries
  the ranks, so a data or run folder never needs the network again.

Every tokenizer has a fingerprint (`tokenizer.fingerprint()`): a SHA-256 of what it does, the same
however it was built or saved. Data folders and runs carry it, so data prepared with another
tokenizer is refused rather than trained on (`tinygpt.data.check_same_tokenizer`).

Encoding treats all text as text: the literal string "<|endoftext|>" is never turned into the
separator token (tiktoken's `encode_ordinary`). Documents are separated by the data pipeline,
which inserts `eot_id` between them. Decoding renders the separator as "<|endoftext|>".

Chat: a tokenizer may carry a `ChatTemplate` (`with_chat_template`), saved in its JSON. The template
names special tokens (one per role's start, one for the end of a turn) that get ids of their own:
reserved ids after the characters (char), added special tokens (bpe), new ids after GPT-2's 50,256
(gpt2). Like "<|endoftext|>", they are never produced by encoding text: only `render_chat` places
them, so a user who types "<|end|>" gets the characters, not the end of their turn.
"""

from __future__ import annotations

import base64
import codecs
import contextvars
import datetime
import functools
import hashlib
import itertools
import json
import operator
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .calc.units import plural
from .errors import ChatError, ConfigError, TokenizerError
from .fileio import read_json, write_json

FORMAT = "tinygpt-tokenizer"
VERSION = 1
KINDS = ("char", "bpe", "gpt2", "hf")
EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer split (tiktoken's r50k/gpt2 pattern): contractions, letters, digits,
# other symbols, whitespace. BPE merges never cross these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
BPE_MIN_VOCAB = 257  # the 256 byte tokens + <|endoftext|>
BPE_MAX_VOCAB = 1 << 20
DEFAULT_BPE_VOCAB = 4096
MAX_CODEPOINT = 0x10FFFF
# a tokenizer.json BPE model's options and the values that leave its merges to decide alone
BPE_OPTIONS = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
               "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}


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


def _digest(canonical: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical_json(canonical)).hexdigest()


class _TokenizerBase:
    """The parts all kinds share: id checking, decode via bytes, batch/array encoding, save."""

    kind: str = ""
    vocab_size: int = 0
    eot_id: int | None = None
    chat_template: ChatTemplate | None = None  # set by with_chat_template
    _fingerprint: str | None = None  # computed once, on first use

    def special_ids(self) -> dict[str, int]:  # pragma: no cover - overridden
        """Text -> id of the tokens encoding never produces (<|endoftext|>, a chat template's)."""
        raise NotImplementedError

    def _with_specials(self, tokens: list[str]) -> _TokenizerBase:  # pragma: no cover - overridden
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
        tinygpt.shards.Encoder sets it): prepare's workers each run one such call at a time, in parallel,
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
            self._fingerprint = _digest(canonical)
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


# ---------------------------------------------------------------------------------------------
# Character level


class CharTokenizer(_TokenizerBase):
    """One token per character; ids follow the order of `chars` (sorted when built from text)."""

    kind = "char"

    def __init__(self, chars: Iterable[str], specials: Sequence[str] = ()) -> None:
        """Args:
        chars: the vocabulary, one single-character string per id.
        specials: special tokens (a chat template's), given the ids after the characters. Text
            never encodes to them, even when it spells one.
        """
        chars, specials = list(chars), list(specials)
        if any(not isinstance(t, str) or not t for t in specials) or len(set(specials)) != len(specials):
            raise TokenizerError("special tokens must be distinct non-empty strings")
        if not chars:
            raise TokenizerError("a character vocabulary needs at least one character")
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise TokenizerError(f"character vocabulary entries must be single characters, got {c!r}")
            if 0xD800 <= ord(c) <= 0xDFFF:
                raise TokenizerError(f"character vocabulary holds a lone surrogate {c!r}")
        if len(set(chars)) != len(chars):
            raise TokenizerError("character vocabulary has duplicate entries")
        self.chars = chars
        self.specials = specials
        self._pieces = chars + specials  # id -> text
        self.vocab_size = len(chars) + len(specials)
        self.eot_id = None
        self._table: np.ndarray | None = None

    def special_ids(self) -> dict[str, int]:
        return {t: len(self.chars) + i for i, t in enumerate(self.specials)}

    def _with_specials(self, tokens: list[str]) -> CharTokenizer:
        return CharTokenizer(self.chars, self.specials + [t for t in tokens if t not in self.specials])

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The sorted set of characters of `text` as the vocabulary."""
        return cls(sorted(set(text)))

    @property
    def table(self) -> np.ndarray:
        """Code point -> id lookup (int32, -1 for characters outside the vocabulary)."""
        if self._table is None:
            table = np.full(MAX_CODEPOINT + 1, -1, dtype=np.int32)
            table[[ord(c) for c in self.chars]] = np.arange(len(self.chars), dtype=np.int32)
            self._table = table
        return self._table

    def encode_to_array(self, texts: str | Sequence[str]) -> np.ndarray:
        # Vectorized: UTF-32 code points through a lookup table, no per-character Python loop.
        text = texts if isinstance(texts, str) else "".join(texts)
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self.table[codepoints]
        if ids.size and ids.min() < 0:
            raise TokenizerError(_unknown_chars_message(text, np.flatnonzero(ids < 0)))
        return ids.astype(np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_to_array(t).tolist() for t in texts]

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_to_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(map(self._pieces.__getitem__, self._check_ids(ids)))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def to_dict(self) -> dict[str, Any]:
        return {**self._header(), "chars": self.chars, **({"specials": self.specials} if self.specials else {})}

    def _canonical(self) -> dict[str, Any]:
        # "specials" only when there are some: a plain vocabulary keeps the fingerprint it always had
        return {"kind": self.kind, "chars": self.chars, **({"specials": self.specials} if self.specials else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        chars, specials = data.get("chars"), data.get("specials", [])
        if not isinstance(chars, list) or not isinstance(specials, list):
            raise TokenizerError('a char tokenizer needs "chars", a list of characters (and "specials" a list)')
        return cls(chars, specials)


def encode_skipping_unknown(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, list[tuple[int, int]], int]:
    """Token ids of `text` without the characters a char vocabulary lacks, for scoring what it can.

    Returns (ids, segments, skipped): the ids of the known characters, in order; the (start, end)
    ranges of `ids` that were unbroken runs of known characters in the text (so a context never
    reaches across a character that was left out); and how many characters were left out. Other
    kinds encode every text: the ids of all of it, one segment, 0 skipped.
    """
    if not isinstance(tokenizer, CharTokenizer):
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        return ids, [(0, len(ids))], 0
    codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    ids = tokenizer.table[codepoints].astype(np.int64)
    known = ids >= 0
    # a run starts at a known character that follows an unknown one (or the start of the text)
    starts = np.flatnonzero(known & ~np.concatenate(([False], known[:-1])))
    position = np.cumsum(known) - 1  # index in the kept ids of each known character
    kept_starts = position[starts].tolist()
    kept = int(known.sum())
    segments = list(zip(kept_starts, kept_starts[1:] + [kept]))
    return ids[known], segments, len(ids) - kept


def encode_named(tokenizer: Tokenizer, text: str, name: str) -> list[int]:
    """The ids of a text a user gave under `name` (a flag, a setting): characters the vocabulary lacks
    are a ConfigError naming it (and the characters' positions in its text), where the tokenizer's own
    words name neither and the text may be one of several."""
    try:
        return tokenizer.encode(text)
    except TokenizerError as e:
        raise ConfigError(f"{name}: {e}") from None


def _unknown_chars_message(text: str, positions: np.ndarray, show: int = 5) -> str:
    """Name the characters outside the vocabulary and where they are (0-based character positions)."""
    where: dict[str, list[int]] = {}
    for p in positions.tolist():
        where.setdefault(text[p], []).append(p)
    parts = []
    for c, ps in list(where.items())[:show]:
        at = ", ".join(map(str, ps[:show])) + (f" (+{len(ps) - show} more)" if len(ps) > show else "")
        parts.append(f"{c!r} (U+{ord(c):04X}) at position {at}")
    more = f"; and {len(where) - show} more" if len(where) > show else ""
    n = len(positions)
    return f"{plural(n, 'character')} not in the tokenizer's vocabulary: " + "; ".join(parts) + more


# ---------------------------------------------------------------------------------------------
# Byte-level BPE trained with Hugging Face `tokenizers`


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell tokens.

    Bytes that are printable Latin-1 (except space) stand for themselves; the other 68 bytes are
    mapped, in order, to code points 256, 257, ... so every token is a visible string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}


def _token_bytes(token: str) -> bytes:
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        raise TokenizerError(f"token {token!r} is not spelled in GPT-2's byte-level alphabet") from None


def check_bpe_vocab_size(vocab_size: int) -> None:
    """Refuse a BPE vocabulary size that cannot work: below 257 (256 bytes + <|endoftext|>) or absurdly large."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TokenizerError(f"vocab size must be an integer, got {vocab_size!r}")
    if vocab_size < BPE_MIN_VOCAB:
        raise TokenizerError(
            f"vocab size {vocab_size} is too small for byte-level BPE: it needs at least {BPE_MIN_VOCAB} "
            "(the 256 byte tokens and <|endoftext|>)"
        )
    if vocab_size > BPE_MAX_VOCAB:
        raise TokenizerError(f"vocab size {vocab_size:,} is too large for BPE (at most {BPE_MAX_VOCAB:,})")


class _TokenizersKind(_TokenizerBase):
    """What the kinds a `tokenizers.Tokenizer` runs (self._tok) share: text encoded as text, each id's
    bytes (self._bytes), the special tokens."""

    _tok: Any
    _bytes: list[bytes]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode expects str")
        try:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as e:  # tokenizers refuses strings it cannot hold, e.g. lone surrogates
            raise TokenizerError(f"cannot encode text: {e}") from None
        return [e.ids for e in encodings]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(map(self._bytes.__getitem__, self._check_ids(ids)))

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying `tokenizers.Tokenizer` (for export to Hugging Face formats)."""
        return self._tok

    def special_ids(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def _canonical(self) -> dict[str, Any]:
        return self._rules(json.loads(self._tok.to_str()))

    def _rules(self, pipeline: dict[str, Any]) -> dict[str, Any]:
        """The byte-pair encoding `pipeline` (tokenizer.json's form) runs, as the fingerprint holds it."""
        # tokenizers 0.20 began writing a merge as ["a", "b"] instead of "a b"; byte-level tokens hold
        # no space, so "a b" is the same merge either way
        merges = [m if isinstance(m, str) else " ".join(m) for m in (pipeline.get("model") or {}).get("merges", [])]
        added = sorted([t.get("id"), t.get("content"), bool(t.get("special"))]
                       for t in pipeline.get("added_tokens") or [])
        return {
            "kind": "bpe",  # the scheme, whichever kind runs it
            "tokens": [base64.b64encode(b).decode("ascii") for b in self._bytes],
            "merges": merges,
            "added": added,
            "normalizer": pipeline.get("normalizer"),
            "pre_tokenizer": pipeline.get("pre_tokenizer"),
        }

    def _with_added_specials(self, tokens: list[str]) -> Any:
        """A copy of the `tokenizers.Tokenizer` with `tokens` added as special tokens where it lacks them,
        one by one in order, so each lands on the next id."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizerCore

        tok = HFTokenizerCore.from_str(self._tok.to_str())  # a copy: this tokenizer stays as it is
        have = self.special_ids()
        for t in tokens:
            if t not in have:
                tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        return tok


class BPETokenizer(_TokenizersKind):
    """Byte-level BPE (GPT-2's scheme) trained on your corpus with Hugging Face `tokenizers`."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any) -> None:
        """Args:
        hf_tokenizer: a `tokenizers.Tokenizer` with a BPE model and ByteLevel pre-tokenizer.
        """
        model = json.loads(hf_tokenizer.to_str())
        if (model.get("model") or {}).get("type") != "BPE":
            raise TokenizerError("the embedded tokenizer is not a BPE model")
        if (model.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
            raise TokenizerError("the embedded tokenizer is not byte-level (its pre_tokenizer is not ByteLevel)")
        self._tok = hf_tokenizer
        # Literal "<|endoftext|>" in user text stays text; only the data pipeline inserts the separator.
        self._tok.encode_special_tokens = True
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = len(vocab)
        if sorted(vocab.values()) != list(range(self.vocab_size)):
            raise TokenizerError("the BPE vocabulary's ids are not 0..N-1")
        added = {i: t.content for i, t in hf_tokenizer.get_added_tokens_decoder().items()}
        table: list[bytes] = [b""] * self.vocab_size
        for token, i in vocab.items():
            table[i] = added[i].encode("utf-8") if i in added else _token_bytes(token)
        self._bytes = table
        self.eot_id = hf_tokenizer.token_to_id(EOT)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int = DEFAULT_BPE_VOCAB,
        *,
        min_frequency: int = 2,
        show_progress: bool = False,
    ) -> BPETokenizer:
        """Learn a byte-level BPE vocabulary from an iterable of texts.

        Args:
            texts: the corpus, in pieces of any size (streamed, never joined in memory).
            vocab_size: the target size, including the 256 byte tokens and <|endoftext|>. A small
                corpus may stop short of it: the result has as many tokens as merges were found.
            min_frequency: a pair must occur this often to be merged.
            show_progress: let `tokenizers` draw its own progress bars.
        """
        check_bpe_vocab_size(vocab_size)
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        # The Rust trainer pulls from our iterator; keep any error it raises so it surfaces as itself.
        failure: list[BaseException] = []

        def guarded() -> Iterable[str]:
            try:
                yield from texts
            except BaseException as e:
                failure.append(e)
                raise

        try:
            tok.train_from_iterator(guarded(), trainer=trainer)
        except BaseException:
            if failure:
                raise failure[0] from None
            raise
        return cls(tok)

    def _with_specials(self, tokens: list[str]) -> BPETokenizer:
        return BPETokenizer(self._with_added_specials(tokens))

    def to_dict(self) -> dict[str, Any]:
        return {**self._header(), "eot": EOT, "tokenizer": json.loads(self._tok.to_str())}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        inner = data.get("tokenizer")
        if not isinstance(inner, dict):
            raise TokenizerError('a bpe tokenizer needs "tokenizer", the Hugging Face tokenizer JSON object')
        try:
            tok = HFTokenizer.from_str(json.dumps(inner))
        except Exception as e:
            raise TokenizerError(f"the embedded Hugging Face tokenizer does not load: {e}") from None
        return cls(tok)


# ---------------------------------------------------------------------------------------------
# GPT-2's BPE through tiktoken


class GPT2Tokenizer(_TokenizerBase):
    """GPT-2's BPE (50,257 tokens) run by `tiktoken`; ids equal tiktoken's "gpt2" encoding."""

    kind = "gpt2"

    def __init__(
        self,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int] | None = None,
        *,
        pat_str: str = GPT2_PATTERN,
        name: str = "gpt2",
    ) -> None:
        """Args:
        ranks: token bytes -> rank (= token id); the merge order of byte-pair encoding.
        special_tokens: text -> id for tokens outside the merges, e.g. {"<|endoftext|>": 50256}.
        pat_str: the pre-tokenizer regex (GPT-2's by default).
        name: a label for tiktoken.
        """
        import tiktoken

        special_tokens = dict(special_tokens or {})
        ids = sorted([*ranks.values(), *special_tokens.values()])
        if not ranks or ids != list(range(len(ids))):
            raise TokenizerError("GPT-2 token ids (ranks and special tokens) must be exactly 0..N-1")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerError(f"the vocabulary lacks {len(missing)} of the 256 single-byte tokens")
        self._ranks = ranks
        self._special = special_tokens
        self._pat_str = pat_str
        try:
            self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)
        except Exception as e:
            raise TokenizerError(f"tiktoken refused the vocabulary: {e}") from None
        self.vocab_size = len(ids)
        self.eot_id = special_tokens.get(EOT)

    @classmethod
    def from_tiktoken(cls, name: str = "gpt2", timeout: float = 10.0) -> GPT2Tokenizer:
        """tiktoken's own encoding: from its cache, else downloaded.

        Args:
            name: the tiktoken encoding ("gpt2").
            timeout: seconds to wait for it: tiktoken's download has no timeout of its own, so a
                machine whose network drops packets would otherwise wait forever.
        """
        try:
            enc = _get_encoding_within(name, timeout)
        except Exception as e:
            raise TokenizerError(
                f"GPT-2's BPE files are not in tiktoken's cache and could not be downloaded ({type(e).__name__}); "
                "pass --tokenizer-file PATH with a local GPT-2 vocab.json + merges.txt or gpt2.tiktoken"
            ) from None
        ranks = {b: enc.encode_single_token(b) for b in enc.token_byte_values()}
        special = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}
        return cls(ranks, special, pat_str=enc._pat_str, name=enc.name)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> GPT2Tokenizer:
        """Load GPT-2's BPE from local files.

        Args:
            path: a `vocab.json` + `merges.txt` pair (Hugging Face's names; OpenAI's `encoder.json`
                + `vocab.bpe` too), given as either file or their folder; a tiktoken `.tiktoken`
                file (e.g. `gpt2.tiktoken`); or a tinygpt tokenizer JSON of kind gpt2.
        """
        p = Path(path).expanduser()
        if not p.exists():
            raise TokenizerError(f"tokenizer file not found: {p}")
        if p.is_dir():
            for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
                if (p / vocab_name).is_file() and (p / merges_name).is_file():
                    return cls.from_vocab_merges(p / vocab_name, p / merges_name)
            tiktoken_files = sorted(p.glob("*.tiktoken"))
            if tiktoken_files:
                return cls.from_tiktoken_file(tiktoken_files[0])
            if (p / "tokenizer.json").is_file():
                return _as_gpt2(load_tokenizer(p / "tokenizer.json"), p)
            raise TokenizerError(f"no GPT-2 tokenizer files in {p} (expected vocab.json + merges.txt or *.tiktoken)")
        if p.suffix == ".tiktoken":
            return cls.from_tiktoken_file(p)
        if p.suffix in (".txt", ".bpe"):
            vocab = _sibling(
                p, [("merges.txt", "vocab.json"), ("vocab.bpe", "encoder.json")], ["vocab.json", "encoder.json"]
            )
            return cls.from_vocab_merges(vocab, p)
        data = read_json(p, TokenizerError)
        if isinstance(data, dict) and data.get("format") == FORMAT:
            return _as_gpt2(tokenizer_from_dict(data, where=str(p)), p)
        merges = _sibling(p, [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")], ["merges.txt", "vocab.bpe"])
        return cls.from_vocab_merges(p, merges, vocab=data)

    @classmethod
    def from_vocab_merges(
        cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike, *, vocab: Any = None,
        specials: Sequence[str] = (),
    ) -> GPT2Tokenizer:
        """GPT-2's files as Hugging Face (vocab.json + merges.txt) and OpenAI (encoder.json + vocab.bpe) ship them.

        Args:
            vocab_path, merges_path: the two files.
            vocab: vocab.json's contents, when already read.
            specials: tokens of the vocabulary that are special besides <|endoftext|> (a chat
                template's, which an export writes into vocab.json after it).
        """
        if vocab is None:
            vocab = read_json(Path(vocab_path), TokenizerError)
        if not isinstance(vocab, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()
        ):
            raise TokenizerError(f"{vocab_path}: expected a JSON object of token -> id")
        special = {t: vocab[t] for t in (EOT, *specials) if t in vocab}
        try:
            ranks = {_token_bytes(t): i for t, i in vocab.items() if t not in special}
        except TokenizerError as e:
            raise TokenizerError(f"{vocab_path}: {e}") from None
        if len(ranks) + len(special) != len(vocab):
            raise TokenizerError(f"{vocab_path}: two tokens spell the same bytes")
        # tiktoken merges by rank; that equals merging in merges.txt order only if each merge's
        # result ranks after the previous one, as in GPT-2's files. Check it rather than assume it.
        try:
            lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {merges_path}: {e}") from None
        last = -1
        for n, line in enumerate(lines, start=1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split()
            merged = vocab.get("".join(parts)) if len(parts) == 2 else None
            if merged is None or parts[0] not in vocab or parts[1] not in vocab:
                raise TokenizerError(
                    f"{merges_path}:{n}: {line!r} is not a merge of two tokens into one in {Path(vocab_path).name}"
                )
            if merged <= last:
                raise TokenizerError(f"{merges_path}:{n}: merge ranks are not in id order, unlike GPT-2's files")
            last = merged
        return cls(ranks, special)

    @classmethod
    def from_tiktoken_file(cls, path: str | os.PathLike) -> GPT2Tokenizer:
        """A tiktoken BPE file: one `base64(token) rank` per line; <|endoftext|> follows the last rank."""
        ranks: dict[bytes, int] = {}
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {path} as a .tiktoken file: {e}") from None
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise TokenizerError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}") from None
        return cls(ranks, {EOT: len(ranks)})

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        # one text at a time: encode_ordinary_batch would start a thread pool of its own
        return [np.asarray(self._enc.encode_ordinary(t), dtype=np.uint32) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes(self._check_ids(ids))

    @property
    def encoding(self) -> Any:
        """The underlying `tiktoken.Encoding`."""
        return self._enc

    @property
    def ranks(self) -> Mapping[bytes, int]:
        """Token bytes -> rank (= token id), read-only: the merge order of byte-pair encoding."""
        return MappingProxyType(self._ranks)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Text -> id of the tokens outside the merges (GPT-2's <|endoftext|>), read-only."""
        return MappingProxyType(self._special)

    def special_ids(self) -> dict[str, int]:
        return dict(self._special)

    def _with_specials(self, tokens: list[str]) -> GPT2Tokenizer:
        special = dict(self._special)
        for t in tokens:  # new ids after the last one (50,256 for GPT-2's own)
            special.setdefault(t, len(self._ranks) + len(special))
        return GPT2Tokenizer(self._ranks, special, pat_str=self._pat_str, name=f"{self._enc.name}-chat")

    def to_dict(self) -> dict[str, Any]:
        by_rank = sorted(self._ranks.items(), key=lambda kv: kv[1])
        return {
            **self._header(),
            "pat_str": self._pat_str,
            "special_tokens": self._special,
            # ranks[i] is the base64 of the token whose rank is i (ranks are 0..n-1, checked on load)
            "ranks": [base64.b64encode(b).decode("ascii") for b, _ in by_rank],
        }

    def _canonical(self) -> dict[str, Any]:
        return {key: value for key, value in self.to_dict().items() if key not in ("format", "version", "vocab_size")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPT2Tokenizer:
        ranks_b64, special, pat = data.get("ranks"), data.get("special_tokens", {}), data.get("pat_str", GPT2_PATTERN)
        if not isinstance(ranks_b64, list) or not isinstance(special, dict) or not isinstance(pat, str):
            raise TokenizerError('a gpt2 tokenizer needs "ranks" (a list), "special_tokens" (an object) and "pat_str"')
        try:
            ranks = {base64.b64decode(t, validate=True): i for i, t in enumerate(ranks_b64)}
        except (TypeError, ValueError):
            raise TokenizerError('"ranks" holds an entry that is not base64') from None
        if len(ranks) != len(ranks_b64):
            raise TokenizerError('"ranks" holds duplicate tokens')
        return cls(ranks, special, pat_str=pat)


def _get_encoding_within(name: str, timeout: float) -> Any:
    """tiktoken.get_encoding(name), waited for at most `timeout` seconds.

    It runs in a daemon thread that the caller stops waiting for, so nothing process-wide changes
    (socket.setdefaulttimeout would reach every socket of the process, a server's included); a
    download that finishes later still lands in tiktoken's cache.

    Raises:
        TimeoutError: no encoding after `timeout` seconds; else whatever tiktoken raised.
    """
    import tiktoken

    outcome: dict[str, Any] = {}

    def fetch() -> None:
        try:
            outcome["encoding"] = tiktoken.get_encoding(name)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=fetch, name=f"tiktoken-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"tiktoken's {name} encoding did not arrive within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["encoding"]


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint as messages show it: "sha256:" and its first 12 hex digits."""
    return fingerprint[: len("sha256:") + 12]


def _sibling(path: Path, renames: list[tuple[str, str]], fallbacks: list[str]) -> Path:
    """The other file of a vocab/merges pair: by name pattern (gpt2-vocab.json -> gpt2-merges.txt) or usual name."""
    names = [path.name.replace(a, b) for a, b in renames if a in path.name] + fallbacks
    for name in names:
        if name != path.name and (path.parent / name).is_file():
            return path.parent / name
    raise TokenizerError(
        f"{path}: its partner file is missing (looked for {', '.join(dict.fromkeys(names))} beside it)"
    )


def _as_gpt2(tokenizer: Tokenizer, where: Path) -> GPT2Tokenizer:
    if not isinstance(tokenizer, GPT2Tokenizer):
        raise TokenizerError(f"{where} holds a {tokenizer.kind} tokenizer, not GPT-2's")
    return tokenizer


# ---------------------------------------------------------------------------------------------
# A Hugging Face model's own tokenizer: tokenizer.json with its special tokens and Jinja chat template


# tokenizer_config.json's names for the special tokens a chat template sees (transformers' special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _is_byte_level(data: dict[str, Any]) -> bool:
    """Whether a tokenizer.json decodes byte-level tokens (GPT-2's alphabet)."""
    decoder = data.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps)


def _as_transformers_builds(data: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json as transformers 5 runs it. Its LlamaTokenizer class (TinyLlama's and Llama 2's
    tokenizer_class) builds a SentencePiece pipeline of its own around tokenizer.json's vocabulary and
    merges: no normalizer, a Metaspace pre-tokenizer that puts "▁" before the first piece only
    (legacy false, its default; before every piece with legacy true; never without add_prefix_space),
    and the matching decoder. Every other tokenizer.json (byte-level ones included, which it loads for
    a LlamaTokenizer too, as Llama 3's) runs as written: the classes that rebuild theirs (Qwen2's,
    GPT-2's) rebuild what the Hub's files hold."""
    name = config.get("tokenizer_class") or ""
    if name.removesuffix("Fast") != "LlamaTokenizer" or _is_byte_level(data):
        return data
    from tokenizers import Tokenizer as HFTokenizerCore
    from tokenizers import decoders, pre_tokenizers

    prefix = config.get("add_prefix_space") is not False
    scheme = ("always" if config.get("legacy") is True else "first") if prefix else "never"
    tok = HFTokenizerCore.from_str(json.dumps(data))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return json.loads(tok.to_str())


class HFTokenizer(_TokenizersKind):
    """A pretrained model's tokenizer as its Hugging Face folder has it: tokenizer.json run by the
    `tokenizers` library (byte-level BPE as SmolLM2, Qwen and Llama 3 have it, or SentencePiece-style
    BPE with byte fallback as TinyLlama's), the special tokens of tokenizer_config.json, and the
    model's Jinja chat template (a JinjaChatTemplate), kept whole in a run's tokenizer.json.

    Text is text, as for every tinygpt tokenizer (`encode`: a "<|im_start|>" typed in a prompt is its
    characters); a rendered chat template is encoded with its special tokens found (`encode_rendered`),
    as transformers' apply_chat_template does. `added_ids` are the ids transformers puts around a text
    it encodes (Llama's and TinyLlama's BOS, say): tokenizer.json's post-processor's, as transformers 5
    has it (it ignores tokenizer_config.json's add_bos_token and add_eos_token beside a tokenizer.json).
    eot_id, the document separator, is the eos token.

    Args:
        data: tokenizer.json's content.
        config: bos_token, eos_token, unk_token, pad_token (strings or None), split_special_tokens, tokenizer_class,
            legacy and add_prefix_space (see _as_transformers_builds), and stop: the ids generation
            ends at (generation_config.json's eos_token_id).
        chat_template: the Jinja template, or None.
    """

    kind = "hf"

    def __init__(self, data: dict[str, Any], config: dict[str, Any], chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore

        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE":
            kind = model.get("type") if isinstance(model, dict) else None
            raise TokenizerError(f"a {kind} tokenizer.json is not supported (tinygpt reads BPE: byte-level, or "
                                 "SentencePiece-style with byte fallback)")
        self._data, self.config = data, dict(config)
        try:
            pipeline = json.dumps(_as_transformers_builds(data, self.config))
            self._tok = HFTokenizerCore.from_str(pipeline)
            self._rendered = HFTokenizerCore.from_str(pipeline)
        except Exception as e:
            raise TokenizerError(f"tokenizer.json does not load ({type(e).__name__}: {e})") from None
        self._tok.encode_special_tokens = True  # a prompt's "<|im_end|>" is text
        self._rendered.encode_special_tokens = bool(config.get("split_special_tokens", False))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._bytes = self._byte_table(data, vocab)
        names = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
        for name, token in names.items():
            if token is not None and token not in vocab:
                raise TokenizerError(f"tokenizer_config.json's {name} {token!r} is not in the vocabulary")
        probe = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(probe) + 1) if full[i:i + len(probe)] == probe), 0)
        self._added = (full[:at], full[at + len(probe):])
        self.eot_id = vocab.get(names["eos_token"]) if names["eos_token"] is not None else None
        self.bos_id = vocab.get(names["bos_token"]) if names["bos_token"] is not None else None
        stop = config.get("stop") or []
        if not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in stop):
            raise TokenizerError(f"generation stop ids {stop!r} are not ids of the vocabulary")
        self.chat_template = JinjaChatTemplate(chat_template, self.template_tokens()) if chat_template else None

    @staticmethod
    def _byte_table(data: dict[str, Any], vocab: dict[str, int]) -> list[bytes]:
        """Each id's bytes, as the tokenizer's decoder writes them: byte-level tokens in GPT-2's alphabet,
        or SentencePiece pieces ("▁" a space, "<0xNN>" a byte); added tokens as their text."""
        decoder = data.get("decoder") or {}
        steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {step.get("type") for step in steps if isinstance(step, dict)}
        added = {t["id"]: t["content"] for t in data.get("added_tokens") or [] if isinstance(t, dict)}
        table = [b""] * (max(vocab.values()) + 1)
        if "ByteLevel" in kinds:
            for token, i in vocab.items():
                table[i] = added[i].encode("utf-8") if i in added else _token_bytes(token)
            return table
        spaces = "Metaspace" in kinds or any(s.get("type") == "Replace" and s.get("content") == " "
                                              for s in steps if isinstance(s, dict))
        if not spaces:
            raise TokenizerError(f"a tokenizer.json whose decoder is {decoder.get('type')!r} is not supported "
                                 "(tinygpt reads byte-level BPE and SentencePiece-style BPE with byte fallback)")
        fallback = "ByteFallback" in kinds
        for token, i in vocab.items():
            if i in added:
                table[i] = added[i].encode("utf-8")
            elif fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                table[i] = bytes([int(token[3:5], 16)])
            else:
                table[i] = token.replace("\u2581", " ").encode("utf-8")
        return table

    def template_tokens(self) -> dict[str, str]:
        """What a chat template sees of the special tokens: bos_token, eos_token, ... (transformers'
        special_tokens_map), the ones tokenizer_config.json names."""
        return {name: self.config[name] for name in SPECIAL_TOKEN_NAMES if self.config.get(name) is not None}

    @property
    def added_ids(self) -> tuple[list[int], list[int]]:
        """(before, after): the ids transformers adds around an encoded text (a BOS, an EOS), or none."""
        return list(self._added[0]), list(self._added[1])

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids generation ends at: generation_config.json's eos ids, the eos token, and the chat
        template's end of turn."""
        ids = set(self.config.get("stop") or [])
        if self.eot_id is not None:
            ids.add(self.eot_id)
        if self.chat_template is not None:
            special = self.special_ids()
            ids.update(special[t] for t in self.chat_template.turn_ends(self) if t in special)
        return sorted(ids)

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered chat template's ids, its special tokens found as such (apply_chat_template's
        encoding: no BOS or EOS added), and each token's (start, end) characters in `text`."""
        try:
            encoding = self._rendered.encode(text, add_special_tokens=False)
        except Exception as e:
            raise TokenizerError(f"cannot encode text: {e}") from None
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        """A text's ids back as transformers decodes them (special tokens written out): a SentencePiece
        tokenizer drops the space its encoding put before the first word, which decode_bytes (each
        token's bytes: what IncrementalDecoder streams of a continuation) keeps."""
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)

    def _with_specials(self, tokens: list[str]) -> HFTokenizer:
        return HFTokenizer(json.loads(self._with_added_specials(tokens).to_str()), self.config)

    def to_dict(self) -> dict[str, Any]:
        header = self._header()
        header.pop("chat_template", None)  # this kind keeps its own, in Jinja
        template = self.chat_template.source if self.chat_template is not None else None
        return {**header, "tokenizer": self._data, "config": self.config, "jinja_chat_template": template}

    def _canonical(self) -> dict[str, Any]:
        pipeline = json.loads(self._tok.to_str())  # as it runs: after _as_transformers_builds
        rules, model = self._rules(pipeline), pipeline.get("model") or {}
        # the rules a bpe tokenizer never has, each only where this one has it: without them, it is the
        # bpe tokenizer of the same vocabulary (a tinygpt run's, exported to a Llama-family folder)
        options = {k: model.get(k, v) for k, v in BPE_OPTIONS.items() if model.get(k, v) != v}
        if options:
            rules["options"] = options
        if not _is_byte_level(pipeline):
            rules["decoder"] = pipeline.get("decoder")
        if self.eot_id != self._tok.token_to_id(EOT):
            rules["eot_id"] = self.eot_id
        if any(self._added):
            rules["added_ids"] = [list(self._added[0]), list(self._added[1])]
        if self.chat_template is not None:  # what the template sees, and how its text is encoded
            rules["template_tokens"] = self.template_tokens()
            rules["split_special_tokens"] = bool(self.config.get("split_special_tokens", False))
        return rules

    def fingerprints(self) -> tuple[str, ...]:
        # before the rules above, an hf tokenizer's fingerprint took its files as they were
        inner = {k: v for k, v in self._data.items() if k not in ("version", "truncation", "padding")}
        template = self.chat_template.source if self.chat_template is not None else None
        return self.fingerprint(), _digest({"kind": self.kind, "tokenizer": inner, "config": self.config,
                                            "jinja_chat_template": template})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HFTokenizer:
        inner, config, template = data.get("tokenizer"), data.get("config"), data.get("jinja_chat_template")
        if not isinstance(inner, dict) or not isinstance(config, dict) or not (template is None or
                                                                              isinstance(template, str)):
            raise TokenizerError('an hf tokenizer needs "tokenizer" (tokenizer.json\'s object), "config" (an object) '
                                 'and "jinja_chat_template" (text or null)')
        return cls(inner, config, template)


# ---------------------------------------------------------------------------------------------
# Chat templates

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes tokens: each message is its role's start token, the content's
    ids, and the end-of-turn token; a prompt for a reply ends with the assistant's start token.

        <|system|>You answer briefly.<|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>

    Args:
        start: the spelling of a role's start token, with "{role}" where the role's name goes.
        end: the spelling of the end-of-turn token (the one generation stops at).
        roles: the roles a message may have.
    """

    start: str = "<|{role}|>"
    end: str = "<|end|>"
    roles: tuple[str, ...] = ROLES

    def __post_init__(self) -> None:
        if not isinstance(self.start, str) or self.start.count("{role}") != 1:
            raise ChatError(f'a chat template\'s start must hold "{{role}}" once, got {self.start!r}')
        if not isinstance(self.end, str) or not self.end:
            raise ChatError("a chat template's end-of-turn token must be a non-empty string")
        roles = tuple(self.roles)
        if "assistant" not in roles or not all(isinstance(r, str) and r for r in roles) or len(set(roles)) != len(roles):
            raise ChatError(f"a chat template's roles must be distinct names including assistant, got {roles!r}")
        object.__setattr__(self, "roles", roles)
        if len(set(self.special_tokens())) != len(roles) + 1:
            raise ChatError("a chat template's special tokens must all differ")

    def start_token(self, role: str) -> str:
        """The spelling of `role`'s start token."""
        return self.start.replace("{role}", role)

    def special_tokens(self) -> list[str]:
        """Every special token the template uses, in id order: the roles' starts, then the end of turn."""
        return [self.start_token(r) for r in self.roles] + [self.end]

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "roles": list(self.roles)}

    @classmethod
    def from_dict(cls, data: Any) -> ChatTemplate:
        """The template from its `to_dict()` form.

        Raises:
            ChatError: not a template's form.
        """
        if not isinstance(data, dict) or not isinstance(data.get("roles", []), list):
            raise ChatError('a chat template is an object with "start", "end" and "roles"')
        return cls(data.get("start", cls.start), data.get("end", cls.end), tuple(data.get("roles", ROLES)))

    def jinja(self) -> str:
        """The template in Jinja, as transformers' `apply_chat_template` runs it (tokenizer_config.json's
        `chat_template`): messages with another role raise, `add_generation_prompt` appends the
        assistant's start. The special tokens it writes are split out by the tokenizer before the
        contents are encoded, so the ids equal `render_chat`'s."""
        before, after = self.start.split("{role}")
        roles = "[" + ", ".join(map(_jinja_str, self.roles)) + "]"
        return (
            "{% for message in messages %}"
            f"{{% if message['role'] not in {roles} %}}"
            "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
            f"{{{{ {_jinja_str(before)} + message['role'] + {_jinja_str(after)} + message['content'] + "
            f"{_jinja_str(self.end)} }}}}"
            "{% endfor %}"
            f"{{% if add_generation_prompt %}}{{{{ {_jinja_str(self.start_token('assistant'))} }}}}{{% endif %}}"
        )


class JinjaChatTemplate:
    """A Hugging Face model's chat template: Jinja, rendered with jinja2 as transformers' apply_chat_template
    renders it (a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, the
    {% generation %} tag, raise_exception, strftime_now and a tojson that keeps non-ASCII text; the
    special tokens as bos_token, eos_token, ...), the text then encoded with its special tokens found.

    The loss mask of a conversation (render_chat) covers the assistant's replies: the text inside
    {% generation %} blocks where the template marks them, otherwise each reply found by rendering
    the conversation up to it (with the generation prompt) and through it, whatever the template
    writes between (the end of turn included).

    Args:
        source: the template.
        tokens: the special tokens it may name (HFTokenizer.template_tokens()).
    """

    roles = ROLES

    def __init__(self, source: str, tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatError("a Jinja chat template must be non-empty text")
        self.source = source
        self.tokens = dict(tokens or {})
        _compiled_template(source)  # a template that does not compile is refused here, once

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JinjaChatTemplate) and (self.source, self.tokens) == (other.source, other.tokens)

    __hash__ = None

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's replies with {% generation %}."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> tuple[str, list]:
        """The conversation's text, and the (start, end) characters of its {% generation %} blocks.

        Raises:
            ChatError: the template raises (raise_exception, an undefined name, a sandbox refusal).
        """
        import jinja2

        template = _compiled_template(self.source)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _GENERATION.set((blocks, spans))
        try:
            for chunk in template.generate(messages=[dict(m) for m in messages], tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **self.tokens):
                blocks.append(chunk)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template raised: {e}") from None
        except Exception as e:  # anything a template's expressions can raise (a type error in it, say)
            raise ChatError(f"the chat template raised {type(e).__name__}: {e}") from None
        finally:
            _GENERATION.reset(token)
        return "".join(blocks), spans

    def rendered(self, tokenizer: HFTokenizer, messages: list[dict[str, str]]) -> Rendered:
        """The conversation's ids as apply_chat_template gives them, and its loss mask (see the class)."""
        text, spans = self.render(messages)
        if not self.marks_generation:
            spans = self._replies(messages, text)
        ids, offsets = tokenizer.encode_rendered(text)
        mask, at = [], 0
        for start, end in offsets:  # a token learns where it overlaps a reply (offsets and spans in order)
            while at < len(spans) and start >= spans[at][1]:
                at += 1
            mask.append(int(at < len(spans) and end > spans[at][0] and end > start))
        return Rendered(ids, mask)

    def _replies(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Each assistant reply's span in `text`, from the renderings up to it and through it."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, _ = self.render(messages[:i], add_generation_prompt=True)
            through, _ = self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatError(f"the chat template does not write message {i + 1} (assistant) after the ones before "
                                "it as it writes the whole conversation, so its reply cannot be found; mark replies "
                                "with {% generation %} ... {% endgeneration %}")
            spans.append((len(before), len(through)))
        return spans

    def prompt_ids(self, tokenizer: HFTokenizer, messages: list[dict[str, str]]) -> list[int]:
        """The ids a model continues to write the assistant's next turn (add_generation_prompt)."""
        return tokenizer.encode_rendered(self.render(messages, add_generation_prompt=True)[0])[0]

    def turn_ends(self, tokenizer: HFTokenizer) -> list[str]:
        """The special token the template writes right after a reply (its end of turn), as a list of
        none or one: found by rendering a reply and reading the first special token after it."""
        reply = "tinygpt-reply"
        try:
            text, _ = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}])
        except ChatError:
            return []
        rest = text[text.rfind(reply) + len(reply):] if reply in text else ""
        found = [(rest.find(t), t) for t in tokenizer.special_ids() if t and t in rest]
        return [min(found)[1]] if found else []

    def special_tokens(self) -> list[str]:
        return list(self.tokens.values())

    def jinja(self) -> str:
        return self.source

    def to_dict(self) -> dict[str, Any]:
        return {"jinja": self.source}


# the {% generation %} blocks of the template being rendered: (the chunks written so far, their spans)
_GENERATION: contextvars.ContextVar = contextvars.ContextVar("tinygpt_generation_spans", default=None)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> Any:
    """A chat template compiled as transformers compiles one (see JinjaChatTemplate)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise TokenizerError("jinja2 is not installed: pip install jinja2") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %} ... {% endgeneration %}: where its text lands in the rendering."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracked = _GENERATION.get()
            if tracked is not None:
                start = sum(map(len, tracked[0]))
                tracked[1].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template is not valid Jinja ({e})") from None


def _jinja_str(text: str) -> str:
    """A Jinja string literal of `text` (its escapes are Python's)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def with_chat_template(tokenizer: Tokenizer, template: ChatTemplate | JinjaChatTemplate | None = None) -> Tokenizer:
    """A copy of `tokenizer` that carries a chat template, its special tokens added where missing.

    Char vocabularies get them as ids after the characters, BPE as added special tokens, GPT-2 as
    ids after 50,256 (a model trained before needs its embedding grown: `tinygpt.model.grow_vocab`).
    The tokenizer given is not changed. A Jinja template goes with a pretrained model's own
    tokenizer (HFTokenizer), whose special tokens it names.

    Args:
        tokenizer: any tinygpt tokenizer.
        template: the template (ChatTemplate(): <|system|>, <|user|>, <|assistant|>, <|end|>).
    """
    if isinstance(template, JinjaChatTemplate):
        if not isinstance(tokenizer, HFTokenizer):
            raise ChatError(f"a Jinja chat template goes with a Hugging Face model's tokenizer, not a {tokenizer.kind} one")
        return HFTokenizer(tokenizer._data, tokenizer.config, template.source)
    template = template or ChatTemplate()
    tok = tokenizer._with_specials(template.special_tokens())
    tok.chat_template = template
    return tok


def _checked_template(tokenizer: Tokenizer, template: ChatTemplate) -> ChatTemplate:
    missing = [t for t in template.special_tokens() if t not in tokenizer.special_ids()]
    if missing:
        raise TokenizerError(f"the chat template's tokens {', '.join(missing)} are not special tokens of the vocabulary")
    return template


@dataclass(frozen=True)
class Rendered:
    """A conversation as token ids, and its loss mask: 1 where a model learns to write the token
    (the assistant's content and end of turn), 0 elsewhere."""

    ids: list[int]
    mask: list[int]


def check_messages(messages: Any, roles: Sequence[str] = ROLES, *, training: bool = True) -> None:
    """Refuse a conversation that is not a list of {"role", "content"} messages with known roles and
    text content.

    Args:
        messages: the conversation.
        roles: the roles allowed (the template's).
        training: the conversation is training data: it needs an assistant turn (something to learn),
            and no turn may be empty. A prompt may hold an empty assistant turn (a reply the model
            ended at once, or one stopped before its first word) but no empty system or user turn.

    Raises:
        ChatError: what is wrong, naming the message (1-based).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError('"messages" must be a non-empty list')
    for n, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise ChatError(f"message {n} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in roles:
            raise ChatError(f"message {n} has an unknown role {role!r} (expected {', '.join(roles)})")
        if not isinstance(content, str):
            raise ChatError(f"message {n} ({role}) has no text content")
        if not content.strip() and (training or role != "assistant"):
            raise ChatError(f"message {n} ({role}) has empty content")
    if training and not any(m["role"] == "assistant" for m in messages):
        raise ChatError("the conversation has no assistant turn")


def chat_template_of(tokenizer: Tokenizer) -> ChatTemplate | JinjaChatTemplate:
    """The tokenizer's chat template.

    Raises:
        ChatError: it has none.
    """
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ChatError("the tokenizer has no chat template (prepare the data with --format chat)")
    return template


def stop_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a generation: the document separator (eot_id) where the kind has one, and,
    where the tokenizer carries a chat template, its end of turn and every role's start (a chat run's
    reply, or its sample, ends there: a role's start begins another turn, and its spelling is no text
    the conversation could carry on with). What the server's chat, `tinygpt chat` and `tinygpt sample`
    pass as stop_tokens."""
    if isinstance(tokenizer, HFTokenizer):  # generation_config.json's eos ids, the eos token, the end of turn
        return frozenset(tokenizer.stop_token_ids)
    ids = set() if tokenizer.eot_id is None else {tokenizer.eot_id}
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        special = tokenizer.special_ids()
        ids.update(special[token] for token in template.special_tokens())
    return frozenset(ids)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Rendered:
    """A whole conversation as ids and loss mask, with the tokenizer's chat template.

    Args:
        tokenizer: a tokenizer with a chat template (with_chat_template).
        messages: [{"role": "system" | "user" | "assistant", "content": "..."}, ...], with an
            assistant turn.

    Raises:
        ChatError: a malformed conversation or a tokenizer without a template.
        TokenizerError: content the vocabulary cannot encode.
    """
    template = chat_template_of(tokenizer)
    check_messages(messages, template.roles)
    if isinstance(template, JinjaChatTemplate):
        return template.rendered(tokenizer, messages)
    ids, mask = _render(tokenizer, template, messages)
    return Rendered(ids, mask)


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The ids a model continues to write the assistant's next turn: the messages, then the assistant's start.

    Raises:
        ChatError, TokenizerError: as render_chat (no assistant turn is needed).
    """
    template = chat_template_of(tokenizer)
    check_messages(messages, template.roles, training=False)
    if isinstance(template, JinjaChatTemplate):
        return template.prompt_ids(tokenizer, messages)
    ids, _ = _render(tokenizer, template, messages)
    return ids + [tokenizer.special_ids()[template.start_token("assistant")]]


def fit_chat_prompt(
    tokenizer: Tokenizer, messages: list[dict[str, str]], max_tokens: int
) -> tuple[list[dict[str, str]], list[int], int]:
    """The conversation trimmed oldest-first until its prompt (render_chat_prompt) holds at most
    `max_tokens` ids, a whole exchange at a time: the oldest message and what follows it up to the next
    user message go together, so what is kept starts with a user's turn, as templates that require the
    roles to alternate (Llama 2's, Mistral's, Gemma's) demand. A leading system message stays, and so
    does the last exchange, even alone over the limit (generation then sees the prompt's last tokens only).

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: the conversation so far, ending with the message to answer.
        max_tokens: the prompt's budget (the model's context less room for the reply).

    Returns:
        (the messages kept, their prompt's ids, how many messages were dropped).
    """
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(system):]
    dropped = 0
    while True:
        ids = render_chat_prompt(tokenizer, system + rest)
        following = next((i for i in range(1, len(rest)) if rest[i].get("role") == "user"), None)
        if len(ids) <= max_tokens or following is None:
            return system + rest, ids, dropped
        rest, dropped = rest[following:], dropped + following


def _render(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    special = tokenizer.special_ids()
    end = special[template.end]
    contents = tokenizer.encode_batch([m["content"] for m in messages])  # text only: never a special token
    ids: list[int] = []
    mask: list[int] = []
    for m, content in zip(messages, contents):
        learn = int(m["role"] == "assistant")
        ids += [special[template.start_token(m["role"])], *content, end]
        mask += [0] + [learn] * (len(content) + 1)
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Files


_KIND_CLASSES: dict[str, Any] = {"char": CharTokenizer, "bpe": BPETokenizer, "gpt2": GPT2Tokenizer, "hf": HFTokenizer}


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


# ---------------------------------------------------------------------------------------------
# Streaming


class IncrementalDecoder:
    """Turn a stream of token ids into text as it is generated.

    A byte-level token can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens);
    push() returns only complete characters and holds the rest back until the next ids finish
    them. flush() releases what is left (an unfinished character becomes U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int] | int) -> str:
        """Add token ids (a list, an int, an array or a tensor); return the newly completed text."""
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def push_at(self, ids: Iterable[int] | int) -> tuple[str, int]:
        """push(), and where the ids' own text begins in what it returns: after the U+FFFD of an
        unfinished character that their first byte cannot continue (0 otherwise). The characters
        completed before the ids, plus this, is their text offset (where their text begins)."""
        data = self.tokenizer.decode_bytes(ids)
        pending = self._utf8.getstate()[0]
        lead = 0
        if pending and data:
            try:
                codecs.getincrementaldecoder("utf-8")().decode(pending + data[:1])
            except UnicodeDecodeError:
                lead = len(pending.decode("utf-8", errors="replace"))
        return self._utf8.decode(data), lead

    def flush(self) -> str:
        """The text still held back, at the end of the stream; resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
