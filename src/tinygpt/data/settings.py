"""What every prepare (text, datasets, chat) is given and checks before it reads a byte, and what it
decides from it: the validation share and its split, the error handling, and the tokenizer it encodes
with (a ready one, one read from a file or a folder, or the kind to learn from the corpus), with the
separator between documents; and the limits the three share.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import DataError, TokenizerError
from ..tokenizer.base import EOT, KINDS, Tokenizer, load_tokenizer
from ..tokenizer.bpe import check_bpe_vocab_size
from ..tokenizer.char import CharTokenizer
from ..tokenizer.gpt2 import GPT2Tokenizer

MAX_VAL_FRACTION = 0.5
ENCODE_CHARS = 1 << 21  # characters per batch handed to the tokenizer (BPE encodes a batch's pieces in parallel)
SHOW_BAD_LINES = 5  # the bad lines of a file an error or prepare's summary spells out; the rest are counted

ProgressFn = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


def check_prepare_args(val_fraction: float, errors: str) -> None:
    """Refuse a validation share outside 0..MAX_VAL_FRACTION and an unknown error handling.

    Args:
        val_fraction: the share held out for validation.
        errors: "strict", "replace" or "skip".
    """
    if (
        not isinstance(val_fraction, (int, float))
        or not 0 <= val_fraction <= MAX_VAL_FRACTION
        or math.isnan(val_fraction)
    ):
        raise DataError(f"val fraction must be between 0 and {MAX_VAL_FRACTION}, got {val_fraction}")
    if errors not in ("strict", "replace", "skip"):
        raise DataError(f"errors must be 'strict' or 'replace' (or 'skip', for a dataset), got {errors!r}")


def split_point(total: int, val_fraction: float) -> int:
    """How many of `total` (characters, or conversations), from the start, go to train: the rest is the
    validation split (at least one when val_fraction > 0 and there are two).

    Args:
        total: the characters or conversations of the corpus.
        val_fraction: the share held out for validation.
    """
    n_val = round(val_fraction * total)
    if val_fraction > 0 and n_val == 0 and total > 1:
        n_val = 1
    return total - n_val


def check_tokenizer_args(
    kind: str | Tokenizer | None, vocab_size: int | None, tokenizer_file: str | os.PathLike | None
) -> None:
    """Refuse impossible tokenizer settings before any file is read.

    Args:
        kind: prepare's `tokenizer`: a kind (KINDS), a ready Tokenizer, or None.
        vocab_size: the BPE vocabulary to train, if given.
        tokenizer_file: the file or folder to read the tokenizer from, if given.
    """
    if kind is not None and not isinstance(kind, str):
        if not isinstance(kind, Tokenizer):
            raise DataError(f"tokenizer must be one of {', '.join(KINDS)} or a Tokenizer, got {type(kind).__name__}")
        if vocab_size is not None or tokenizer_file is not None:
            raise DataError("vocab_size and tokenizer_file do not apply to a ready tokenizer object")
        return
    if kind is not None and kind not in KINDS:
        raise DataError(f"unknown tokenizer {kind!r} (expected one of {', '.join(KINDS)})")
    if vocab_size is not None:
        if kind != "bpe" or tokenizer_file is not None:
            raise DataError("--vocab-size applies only when training a BPE tokenizer (--tokenizer bpe)")
        try:
            check_bpe_vocab_size(vocab_size)
        except TokenizerError as e:
            raise DataError(str(e)) from None


def make_tokenizer(kind: str | Tokenizer | None, tokenizer_file: str | os.PathLike | None) -> Tokenizer | str:
    """A ready tokenizer, or "char"/"bpe" when one must be learned from the corpus first.

    Args:
        kind: prepare's `tokenizer` (checked by check_tokenizer_args).
        tokenizer_file: GPT-2's files, a tinygpt tokenizer.json or a data or run folder holding one, or
            a Hugging Face folder; None to make or learn one of `kind`.
    """
    if kind is not None and not isinstance(kind, str):
        return kind
    if tokenizer_file is None:
        if kind == "gpt2":
            return GPT2Tokenizer.from_tiktoken()
        return kind or "char"
    if kind == "gpt2":
        return GPT2Tokenizer.from_file(tokenizer_file)
    path = Path(tokenizer_file).expanduser()
    hf = _hf_folder_tokenizer(path)
    if hf is not None:
        if kind is not None and hf.kind != kind:
            raise DataError(f"{tokenizer_file} holds a {hf.kind} tokenizer, not {kind}")
        return hf
    is_tinygpt = (
        (path / "tokenizer.json").is_file() if path.is_dir() else path.suffix == ".json" and _is_tinygpt_json(path)
    )
    if kind is None and not is_tinygpt:
        return GPT2Tokenizer.from_file(path)  # GPT-2's own files
    tok = load_tokenizer(path)
    if kind is not None and tok.kind != kind:
        raise DataError(f"{tokenizer_file} holds a {tok.kind} tokenizer, not {kind}")
    return tok


def check_separator(tok: Tokenizer | str, tokenizer_file: str | os.PathLike | None, documents: int) -> None:
    """Refuse a BPE or GPT-2 tokenizer without <|endoftext|> for two or more documents: the files would
    run into each other (the last word of one joined to the first of the next), which a separator
    exists to prevent. A character vocabulary has none by design, and one document needs none.

    Args:
        tok: make_tokenizer's answer.
        tokenizer_file: where it was read from, for the message.
        documents: how many documents the corpus holds (2 for a dataset: any number).
    """
    if isinstance(tok, str) or tok.kind == "char" or tok.eot_id is not None or documents < 2:
        return
    where = f"{tokenizer_file}: the" if tokenizer_file is not None else "the"
    raise DataError(f"{where} {tok.kind} tokenizer has no {EOT} token to separate the {documents:,} files; add it "
                    "to its vocabulary (as the last id, as GPT-2's vocab.json has it) or prepare one file")


class Alphabet:
    """The characters a corpus holds, a flag per code point, noted as its text goes by: what a char
    vocabulary is learned from, or a reused one checked against."""

    def __init__(self) -> None:
        self.seen = np.zeros(0x110000, dtype=bool)

    def add(self, text: str) -> None:
        self.seen[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)] = True

    def tokenizer(self) -> CharTokenizer:
        """A char vocabulary of these characters, in code point order."""
        return CharTokenizer(map(chr, np.flatnonzero(self.seen).tolist()))

    def missing(self, tok: CharTokenizer) -> list[str]:
        """These characters `tok` has no id for, in code point order."""
        return [chr(c) for c in np.flatnonzero(self.seen & (tok.table < 0)).tolist()]


def _hf_folder_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face GPT-2 folder (what fine-tuning one needs its data prepared
    with, and what `tinygpt load` reads there), or None when `path` is not such a folder."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    from ..interop.hf import is_hf_folder
    from ..interop.hf_tokenizer import load_hf_tokenizer

    if not is_hf_folder(path):
        return None
    tok = load_hf_tokenizer(path)
    if tok is None:
        raise DataError(f"{path}: a Hugging Face folder without a tokenizer (tokenizer.json, or vocab.json + "
                        "merges.txt)")
    return tok


def _is_tinygpt_json(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b'"tinygpt-tokenizer"' in f.read(256)
    except OSError:
        return False
