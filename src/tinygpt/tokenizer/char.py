"""The character-level tokenizer: one id per distinct character of the corpus, in sorted order (nanoGPT's
shakespeare_char). Text with characters outside the vocabulary is refused, naming them and where they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..calc.units import plural
from ..errors import TokenizerError
from .base import Tokenizer, TokenizerBase

MAX_CODEPOINT = 0x10FFFF


class CharTokenizer(TokenizerBase):
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

    def lookup(self, text: str) -> np.ndarray:
        """Each character's id (int32), -1 for those outside the vocabulary: UTF-32 code points through
        `table`, with no per-character Python loop.

        Args:
            text: the text.
        """
        return self.table[np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)]

    def encode_to_array(self, texts: str | Sequence[str]) -> np.ndarray:
        text = texts if isinstance(texts, str) else "".join(texts)
        ids = self.lookup(text)
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
    ids = tokenizer.lookup(text).astype(np.int64)
    known = ids >= 0
    # a run starts at a known character that follows an unknown one (or the start of the text)
    starts = np.flatnonzero(known & ~np.concatenate(([False], known[:-1])))
    position = np.cumsum(known) - 1  # index in the kept ids of each known character
    kept_starts = position[starts].tolist()
    kept = int(known.sum())
    segments = list(zip(kept_starts, kept_starts[1:] + [kept]))
    return ids[known], segments, len(ids) - kept


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
