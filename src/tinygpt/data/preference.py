"""Preference pairs: a prompt with a chosen and a rejected completion, in TRL's formats, tokenized into a
data folder for preference optimisation (DPO) and reward models.

The formats, as TRL's DPOTrainer and RewardTrainer read them, one JSON object a line:

    standard          {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    conversational    {"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", ...}],
                       "rejected": [...]}: the prompt rendered with the chat template and its generation
                       prompt, the completions as the assistant's turn
    implicit prompt   {"chosen": ..., "rejected": ...}: two texts (or conversations) that share their start,
                       the shared part the prompt (TRL's extract_prompt: whole messages, or characters)

Each pair is tokenized as TRL does: the prompt alone, and the prompt followed by each completion; the
completion begins where those ids part (a template or a tokenizer's merges may render the prompt's end
otherwise when a completion follows). A standard completion is closed by the tokenizer's end of text, a
conversational one by the template's end of turn. An optional numeric "margin" (TRL's reward margin) is
kept. The whole pair is stored; training fits it to its window (tinygpt.data.batches.Pairs).

A preference data folder holds, per split, the ids of every pair in a row (prompt, chosen, rejected) in
SPLIT.bin, and SPLIT.pairs: uint64 (start, prompt, chosen, rejected lengths) a pair; SPLIT.margins
(float32) where the file gives margins. The last val_fraction of the pairs are the validation split.
"""

from __future__ import annotations

import math
import os
import shutil
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ChatError, DataError, TokenizerError
from ..fileio import jsonl_records, printable_path, temp_folder
from ..tokenizer.base import Tokenizer
from ..tokenizer.chat import check_messages, render_chat, render_chat_prompt
from .chat import bad_lines, bad_lines_error, move_tail
from .folder import PAIR_FIELDS, check_out_dir, folder_meta, publish, token_dtype
from .settings import check_prepare_args, check_tokenizer_args, make_tokenizer, split_point

PAIR_ERRORS = ("strict", "skip")


@dataclass
class Pair:
    """One line's pair as the file gives it: texts (standard) or message lists (conversational)."""

    prompt: Any
    chosen: Any
    rejected: Any
    margin: float = 0.0


def common_prefix(a: list, b: list) -> int:
    """How many leading items two sequences share (TRL's common_prefix_length).

    Args:
        a, b: token ids, or messages.
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair whose prompt is the start its two sides share: whole messages,
    or characters, a space before the split going to the completions (TRL's extract_prompt)."""
    n = common_prefix(chosen, rejected)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def read_pair(record: Any, roles: tuple[str, ...]) -> tuple[Pair, str]:
    """A JSON line's pair and its format ("standard" or "conversational").

    Args:
        record: the parsed line.
        roles: the roles a conversation may hold (the template's).

    Raises:
        DataError: what is wrong with it, in words (a missing field, mixed kinds, chosen equal to rejected).
    """
    if not isinstance(record, dict):
        raise DataError("not a JSON object")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f'no "{missing[0]}" field')
    chosen, rejected = record["chosen"], record["rejected"]
    kind = "conversational" if isinstance(chosen, list) else "standard" if isinstance(chosen, str) else None
    if kind is None:
        raise DataError('"chosen" must be a text or a list of messages')
    prompt = record.get("prompt")
    same = list if kind == "conversational" else str
    for name in ("rejected", "prompt"):
        if name in record and not isinstance(record[name], same):
            raise DataError(f'"{name}" must be {"a list of messages" if same is list else "a text"}, as "chosen" is')
    if "prompt" not in record:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
    if chosen == rejected:
        raise DataError("chosen and rejected are the same")
    if not prompt:
        raise DataError("no prompt" if "prompt" in record else "chosen and rejected share no prompt")
    if kind == "conversational":
        try:
            check_messages(prompt, roles, training=False)
            for side in (chosen, rejected):
                check_messages(side, roles, training=False)
        except ChatError as e:
            raise DataError(str(e)) from None
    margin = record.get("margin", 0.0)
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not math.isfinite(margin):
        raise DataError(f'"margin" must be a number, got {margin!r}')
    return Pair(prompt, chosen, rejected, float(margin)), kind


def tokenize_pair(tok: Tokenizer, pair: Pair) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids of a pair, split as TRL splits them: at the common prefix of the
    prompt's ids and those of the prompt followed by each completion. A standard completion ends with
    the tokenizer's end of text; a conversational one with what the template writes after the turn.

    Args:
        tok: the model's tokenizer (with a chat template, for conversations).
        pair: the pair (read_pair).

    Raises:
        DataError: the sides tokenize alike, or share no prompt token.
        TokenizerError, ChatError: text the tokenizer cannot encode.
    """
    if isinstance(pair.prompt, str):
        prompt = tok.encode(pair.prompt)
        whole = [tok.encode(pair.prompt + side) + [tok.eot_id] for side in (pair.chosen, pair.rejected)]
    else:
        prompt = render_chat_prompt(tok, pair.prompt)
        whole = [render_chat(tok, pair.prompt + side).ids for side in (pair.chosen, pair.rejected)]
    n = min(common_prefix(prompt, ids) for ids in whole)
    chosen, rejected = (ids[n:] for ids in whole)
    if chosen == rejected:
        raise DataError("chosen and rejected are the same once tokenized")
    if n == 0:
        raise DataError("the prompt shares no token with its completions once tokenized")
    return prompt[:n], chosen, rejected


class _PairFile:
    """A JSONL file of preference pairs, read line by line: (line number, pair, "") for a good line,
    (line number, None, why) for a bad one; blank lines skipped. Every pair must have the format of
    the first good one."""

    def __init__(self, path: Path, roles: tuple[str, ...]) -> None:
        if not path.is_file():
            raise DataError(f"preference file not found: {path}")
        self.path, self.roles = path, roles
        self.kind: str | None = None
        self.first = 0  # the line the format was read from
        self.implicit = False

    def __iter__(self) -> Iterator[tuple[int, Pair | None, str]]:
        for n, record, why in jsonl_records(self.path):
            if why:
                yield n, None, why
                continue
            try:
                pair, kind = read_pair(record, self.roles)
            except ValueError as e:  # DataError is one
                yield n, None, str(e) if isinstance(e, DataError) else f"not a pair ({e})"
                continue
            if self.kind is None:
                self.kind, self.first, self.implicit = kind, n, "prompt" not in record
            elif kind != self.kind:
                yield n, None, f"a {kind} pair, where the file's first (line {self.first}) is {self.kind}"
                continue
            yield n, pair, ""


def prepare_preference(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | Tokenizer | None = None,
    tokenizer_file: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    errors: str = "strict",
) -> dict[str, Any]:
    """Tokenize the preference pairs of a JSONL file (TRL's standard, conversational or implicit-prompt
    format) into a data folder for `tinygpt dpo` and `tinygpt reward train`. Returns the meta.json contents.

    Args:
        path: one pair a line (see the module's formats); an optional numeric "margin" is kept.
        out_dir: the data folder to write (an existing one is replaced only if it is a tinygpt data folder).
        tokenizer: "gpt2", a ready Tokenizer, or None to read it from `tokenizer_file`: the model's own
            (pairs are for a trained model: no vocabulary is learned from them).
        tokenizer_file: the model's run or Hugging Face folder, or a tokenizer file (`--tokenizer-file FROM`).
        val_fraction: the share of pairs, from the end, held out (0 to 0.5).
        errors: "strict" stops at bad lines (a missing field, chosen equal to rejected, text the tokenizer
            cannot encode, ...), listing the first five with their line numbers; "skip" leaves them out
            and counts them in meta.json.

    Raises:
        DataError: bad lines (strict), no pair left, a tokenizer without the end of text a standard
            completion needs or the chat template a conversational pair needs.
    """
    if errors not in PAIR_ERRORS:
        raise DataError(f"errors must be one of {', '.join(PAIR_ERRORS)} for preference data, got {errors!r}")
    check_prepare_args(val_fraction, "strict")
    src = Path(path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out)
    check_tokenizer_args(tokenizer, None, tokenizer_file)
    tok = make_tokenizer(tokenizer, tokenizer_file)
    if isinstance(tok, str):
        raise DataError("preference pairs are for a trained model: give its tokenizer with --tokenizer-file FROM "
                        "(its run or Hugging Face folder)")
    template = getattr(tok, "chat_template", None)
    pairs = _PairFile(src, template.roles if template is not None else ("system", "user", "assistant"))
    tmp = temp_folder(out)
    try:
        counts, bad = _write_pairs(tok, pairs, tmp, val_fraction)
        if bad and errors == "strict":
            raise bad_lines_error(src, bad, "bad line")
        n = counts["train_pairs"] + counts["val_pairs"]
        if not n:
            raise DataError(f"{src}: no preference pair" + (f": {' | '.join(bad_lines(bad))}" if bad else ""))
        meta = {
            **folder_meta(tok, counts, "preference"), "pairs": n, "pair_format": pairs.kind,
            "implicit_prompt": pairs.implicit, "closing": "eos" if pairs.kind == "standard" else "turn",
            "margins": counts.pop("margins"), "val_fraction": val_fraction, "eot_id": tok.eot_id,
            "sources": [{"name": printable_path(path), "path": printable_path(src), "bytes": src.stat().st_size}],
            "errors": errors, "skipped": len(bad), "skipped_lines": [n for n, _ in bad[:100]],
            "skipped_why": bad_lines(bad),
        }
        publish(tmp, out, tok, meta, tokenizer_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _check_tokenizer(tok: Tokenizer, kind: str, path: Path) -> None:
    """A standard completion needs an end of text to close it; a conversation needs a chat template."""
    if kind == "standard" and tok.eot_id is None:
        raise DataError(f"{path}: standard pairs end each completion with the end of text, which this {tok.kind} "
                        "tokenizer has none of: use the conversational format with a chat model's tokenizer, or a "
                        "BPE or GPT-2 tokenizer")
    if kind == "conversational" and getattr(tok, "chat_template", None) is None:
        raise DataError(f"{path}: conversational pairs are rendered with the model's chat template, and this "
                        "tokenizer has none: fine-tune the model on chat data first (prepare --format chat), or "
                        "give the pairs as plain text (prompt, chosen, rejected strings)")


def _write_pairs(tok: Tokenizer, pairs: _PairFile, folder: Path, val_fraction: float
                 ) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """Tokenize every good pair into folder's train.bin, then move the last val_fraction of them to val.bin
    (how many is known only once every line is read). Returns the counts for meta.json and the bad lines."""
    dtype = token_dtype(tok.vocab_size)
    rows, chars, sizes, margins = array("Q"), array("Q"), array("Q"), array("f")
    bad: list[tuple[int, str]] = []
    total = 0
    with open(folder / "train.bin", "wb") as ids_file:
        for n, pair, why in pairs:
            if pair is None:
                bad.append((n, why))
                continue
            if len(rows) == 0:
                _check_tokenizer(tok, pairs.kind, pairs.path)
            try:
                prompt, chosen, rejected = tokenize_pair(tok, pair)
            except (DataError, TokenizerError, ChatError) as e:
                bad.append((n, f"the tokenizer cannot encode it ({e})" if isinstance(e, TokenizerError) else str(e)))
                continue
            np.asarray(prompt + chosen + rejected, dtype=dtype).tofile(ids_file)
            rows.extend((total, len(prompt), len(chosen), len(rejected)))
            total += len(prompt) + len(chosen) + len(rejected)
            text = "".join(_texts(pair))
            chars.append(len(text))
            sizes.append(len(text.encode("utf-8")))
            margins.append(pair.margin)
    index = np.frombuffer(rows, dtype=np.uint64).reshape(-1, PAIR_FIELDS).copy()
    n = len(index)
    n_train = split_point(n, val_fraction)
    cut = int(index[n_train, 0]) if n_train < n else total  # the first validation token
    move_tail(folder / "train.bin", folder / "val.bin", cut * dtype.itemsize)
    index[n_train:, 0] -= np.uint64(cut)
    has_margins = any(m != 0.0 for m in margins)
    counts: dict[str, Any] = {"margins": has_margins}
    for split, part, tokens in (("train", slice(0, n_train), cut), ("val", slice(n_train, n), total - cut)):
        index[part].tofile(folder / f"{split}.pairs")
        if has_margins:
            np.asarray(margins[part], dtype=np.float32).tofile(folder / f"{split}.margins")
        counts.update({f"{split}_tokens": tokens, f"{split}_chars": sum(chars[part]),
                       f"{split}_bytes": sum(sizes[part]), f"{split}_pairs": len(index[part])})
    return counts, bad


def _texts(pair: Pair) -> Iterator[str]:
    """A pair's text: its strings, or its messages' contents."""
    for side in (pair.prompt, pair.chosen, pair.rejected):
        if isinstance(side, str):
            yield side
        else:
            yield from (m.get("content") or "" for m in side)
