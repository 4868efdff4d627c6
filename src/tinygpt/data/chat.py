"""Chat data: the conversations of a JSONL file rendered into a data folder for supervised fine-tuning,
each token with a loss mask beside it that says whether the model learns it (the assistant's turns).

Preference pairs (a prompt with a chosen and a rejected answer, TRL's format) go beside this module, in
tinygpt.data.preference.
"""

from __future__ import annotations

import os
import shutil
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..calc.units import plural
from ..errors import ChatError, DataError, TokenizerError
from ..fileio import jsonl_records, printable_path, temp_folder
from ..tokenizer.base import Tokenizer
from ..tokenizer.bpe import DEFAULT_BPE_VOCAB, BPETokenizer
from ..tokenizer.char import CharTokenizer
from ..tokenizer.chat import check_messages, render_chat, with_chat_template
from ..tokenizer.chat_template import ChatTemplate
from .folder import check_out_dir, folder_meta, publish, token_dtype
from .settings import SHOW_BAD_LINES, check_prepare_args, check_tokenizer_args, make_tokenizer, split_point

CHAT_ERRORS = ("strict", "skip")
CHAT_BUFFER_TOKENS = 1 << 20  # rendered chat tokens held before they are written


class _ChatFile:
    """A JSONL file of {"messages": [{"role": ..., "content": ...}, ...]}, one conversation a line, read
    line by line on every pass, so a large file is never held in memory whole."""

    def __init__(self, path: Path, roles: Iterable[str]) -> None:
        if not path.is_file():
            raise DataError(f"chat file not found: {path}")
        self.path = path
        self.roles = tuple(roles)

    def __iter__(self) -> Iterator[tuple[int, list[dict[str, str]] | None, str]]:
        """(line number, messages, "") for a conversation; (line number, None, why) for a line that is not
        one (not UTF-8, bad JSON, an unknown role, empty content, no assistant turn). Blank lines are skipped."""
        for n, record, why in jsonl_records(self.path):
            if why:
                yield n, None, why
                continue
            messages = record.get("messages") if isinstance(record, dict) else None
            try:
                check_messages(messages, self.roles)
            except ChatError as e:
                yield n, None, str(e) if messages is not None else 'no "messages" list'
                continue
            yield n, [{"role": m["role"], "content": m["content"]} for m in messages], ""

    def contents(self) -> Iterator[str]:
        """Every message's content, in order: what a char or BPE vocabulary is built from."""
        for _, messages, _ in self:
            for m in messages or ():
                yield m["content"]


def bad_lines(bad: list[tuple[int, str]]) -> list[str]:
    """The first few bad lines, each with why, then how many more and their numbers: what an error or
    prepare's summary lists so that one pass can fix them all.

    Args:
        bad: (line number, why) of each bad line, in order.
    """
    notes = [f"line {n}: {why}" for n, why in bad[:SHOW_BAD_LINES]]
    rest = [str(n) for n, _ in bad[SHOW_BAD_LINES:]]
    if rest:
        notes.append(f"and {len(rest):,} more (line{'s' if len(rest) > 1 else ''} {', '.join(rest[:10])}"
                     f"{', ...' if len(rest) > 10 else ''})")
    return notes


def bad_lines_error(path: Path, bad: list[tuple[int, str]], noun: str, why: str = "") -> DataError:
    """The one-line error a strict prepare raises for a file's bad lines, listing the first few.

    Args:
        path: the file.
        bad: (line number, why) of each bad line.
        noun: what a bad line is ("malformed line").
        why: said after the count (" the tokenizer cannot encode").
    """
    return DataError(f"{path}: {plural(len(bad), noun)}{why}: {' | '.join(bad_lines(bad))}; fix them, or pass "
                     "--errors skip to leave such lines out")


def _why_unencodable(tok: Tokenizer, messages: list[dict[str, str]], error: TokenizerError) -> str:
    """Which messages of a conversation the tokenizer cannot encode, and their characters (render_chat
    encodes them together, so its error does not say which message)."""
    parts = []
    for i, m in enumerate(messages, start=1):
        try:
            tok.encode(m["content"])
        except TokenizerError as e:
            parts.append(f"message {i} ({m['role']}): {e}")
    return "; ".join(parts) or str(error)


def _chat_tokenizer(
    kind: str | Tokenizer | None, tokenizer_file: str | os.PathLike | None, chats: _ChatFile,
    vocab_size: int | None, template: ChatTemplate | None,
) -> Tokenizer:
    """The tokenizer chat data is written with: a char vocabulary of the conversations' characters, BPE
    trained on them, GPT-2's, or a reused one; with the chat template's special tokens (unless it has them)."""
    tok = make_tokenizer(kind, tokenizer_file)
    if tok == "char":
        chars: set[str] = set()
        for content in chats.contents():
            chars.update(content)
        tok = CharTokenizer(sorted(chars))
    elif tok == "bpe":
        tok = BPETokenizer.train(chats.contents(), vocab_size or DEFAULT_BPE_VOCAB)
    if tok.chat_template is not None and (template is None or template == tok.chat_template):
        return tok
    return with_chat_template(tok, template)


def prepare_chat(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | Tokenizer | None = "char",
    vocab_size: int | None = None,
    tokenizer_file: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    errors: str = "strict",
    template: ChatTemplate | None = None,
) -> dict[str, Any]:
    """Render the conversations of a JSONL file into a chat data folder for supervised fine-tuning.
    Returns the meta.json contents.

    Each conversation becomes its template's tokens (tinygpt.tokenizer.render_chat) and a loss mask
    beside them, 1 on the assistant's content and end-of-turn token, 0 elsewhere; the last
    `val_fraction` of the conversations are the validation split. meta.json counts conversations,
    tokens and trained tokens (the mask's sum) per split. The file is read line by line, a few times
    (check, build the vocabulary, write), never held in memory whole.

    Args:
        path: one conversation per line: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}.
        out_dir: the data folder to write (an existing one is replaced only if it is a tinygpt data folder).
        tokenizer: "char" (the conversations' characters), "bpe" (trained on them), "gpt2", a ready
            Tokenizer, or None to take the kind from `tokenizer_file`. The template's special tokens
            are added to it unless it carries that template already.
        vocab_size: the BPE vocabulary to train.
        tokenizer_file: GPT-2's files, or a tinygpt tokenizer.json / data or run folder to reuse.
        val_fraction: the share of conversations, from the end, held out (0 to 0.5).
        errors: "strict" stops at malformed lines, or else at conversations the tokenizer cannot encode,
            listing the first few with why and counting the others; "skip" leaves both out and counts
            them in meta.json (skipped, unencodable, skipped_lines, skipped_why).
        template: the chat template (ChatTemplate() when the tokenizer has none).

    Raises:
        DataError: malformed lines or content the tokenizer cannot encode (strict), or no conversation left.
    """
    if errors not in CHAT_ERRORS:
        raise DataError(f"errors must be one of {', '.join(CHAT_ERRORS)} for chat data, got {errors!r}")
    check_prepare_args(val_fraction, "strict")
    src = Path(path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out)
    check_tokenizer_args(tokenizer, vocab_size, tokenizer_file)
    chats = _ChatFile(src, template.roles if template is not None else ("system", "user", "assistant"))
    malformed, conversations = [], 0
    for n, messages, why in chats:
        if messages is None:
            malformed.append((n, why))
        else:
            conversations += 1
    if malformed and errors == "strict":
        raise bad_lines_error(src, malformed, "malformed line")
    if not conversations:
        raise DataError(f"{src}: no conversations" + (f" ({len(malformed)} malformed lines)" if malformed else ""))
    tok = _chat_tokenizer(tokenizer, tokenizer_file, chats, vocab_size, template)
    tmp = temp_folder(out)
    try:
        counts, unencodable = _write_chat(tok, chats, tmp, val_fraction)
        if unencodable and errors == "strict":
            raise bad_lines_error(src, unencodable, "conversation", " the tokenizer cannot encode")
        if len(unencodable) == conversations:
            raise DataError(f"{src}: no conversation the tokenizer can encode: {' | '.join(bad_lines(unencodable))}")
        skipped = sorted(malformed + unencodable)
        meta = {
            **folder_meta(tok, counts, "chat"),
            "conversations": counts["train_conversations"] + counts["val_conversations"],
            "trained_tokens": counts["train_trained_tokens"] + counts["val_trained_tokens"],
            "val_fraction": val_fraction, "eot_id": tok.eot_id, "chat_template": tok.chat_template.to_dict(),
            "sources": [{"name": printable_path(path), "path": printable_path(src),
                         "bytes": src.stat().st_size}],
            "errors": errors, "skipped": len(skipped), "skipped_lines": [n for n, _ in skipped[:100]],
            "unencodable": len(unencodable), "skipped_why": bad_lines(skipped),
        }
        publish(tmp, out, tok, meta, tokenizer_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _write_chat(
    tok: Tokenizer, chats: _ChatFile, folder: Path, val_fraction: float
) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """Render each conversation into folder's train.bin and train.mask, then move the last val_fraction
    of them to val.bin and val.mask (how many go there is known only once every line is rendered, since
    a conversation the tokenizer cannot encode is left out). Returns the counts for meta.json and the
    conversations left out, (line number, why)."""
    dtype = token_dtype(tok.vocab_size)
    # per conversation written: where it starts, its characters, bytes and trained tokens
    starts, chars, text_bytes, trained = array("Q"), array("Q"), array("Q"), array("Q")
    unencodable: list[tuple[int, str]] = []
    ids: list[int] = []
    mask: list[int] = []
    total = 0
    with open(folder / "train.bin", "wb") as ids_file, open(folder / "train.mask", "wb") as mask_file:
        for n, messages, _ in chats:
            if messages is None:
                continue
            try:
                rendered = render_chat(tok, messages)
            except TokenizerError as e:
                unencodable.append((n, _why_unencodable(tok, messages, e)))
                continue
            starts.append(total)
            total += len(rendered.ids)
            ids += rendered.ids
            mask += rendered.mask
            chars.append(sum(len(m["content"]) for m in messages))
            text_bytes.append(sum(len(m["content"].encode("utf-8")) for m in messages))
            trained.append(sum(rendered.mask))
            if len(ids) >= CHAT_BUFFER_TOKENS:
                np.asarray(ids, dtype=dtype).tofile(ids_file)
                np.asarray(mask, dtype=np.uint8).tofile(mask_file)
                ids, mask = [], []
        np.asarray(ids, dtype=dtype).tofile(ids_file)
        np.asarray(mask, dtype=np.uint8).tofile(mask_file)
    n = len(starts)
    n_train = split_point(n, val_fraction)
    cut = starts[n_train] if n_train < n else total  # the first validation token
    move_tail(folder / "train.bin", folder / "val.bin", cut * dtype.itemsize)
    move_tail(folder / "train.mask", folder / "val.mask", cut)
    offsets = np.array(starts, dtype=np.uint64)
    offsets[:n_train].tofile(folder / "train.starts")
    (offsets[n_train:] - np.uint64(cut)).tofile(folder / "val.starts")
    counts: dict[str, int] = {}
    for split, part, tokens in (("train", slice(0, n_train), cut), ("val", slice(n_train, n), total - cut)):
        counts.update({f"{split}_tokens": tokens, f"{split}_chars": sum(chars[part]),
                       f"{split}_bytes": sum(text_bytes[part]), f"{split}_conversations": len(starts[part]),
                       f"{split}_trained_tokens": sum(trained[part])})
    return counts, unencodable


def move_tail(path: Path, tail: Path, offset: int) -> None:
    """Move the bytes of `path` from `offset` on into a new file `tail`, cutting `path` there.

    Args:
        path: the file to cut.
        tail: the new file.
        offset: the first byte that moves.
    """
    with open(path, "r+b") as head, open(tail, "wb") as out:
        head.seek(offset)
        shutil.copyfileobj(head, out)
        head.truncate(offset)
