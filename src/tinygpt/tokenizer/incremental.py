"""Incremental decoding: generated ids streamed as text, a character cut between tokens held back until whole."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from .base import Tokenizer


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
