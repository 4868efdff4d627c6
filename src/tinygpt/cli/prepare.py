"""`tinygpt prepare`: text into the token files training reads."""

from __future__ import annotations

import argparse
import sys

from ..calc.units import plural
from ..errors import ConfigError
from .common import Number, cleans_up_on_sigterm


@cleans_up_on_sigterm
def cmd_prepare(args: argparse.Namespace) -> int:
    """Turn text into token files for training: train.bin, val.bin, tokenizer.json and meta.json.

    SOURCE is a text file, a folder (every text file below it, binary files skipped), or a
    built-in corpus: python-stdlib (this Python's standard library sources) or shakespeare
    (downloaded once). Files are read as UTF-8; line endings are kept as they are. Without --out
    the folder is data/NAME after the first source: data/python-stdlib, data/shakespeare, data/notes.

    SOURCE may instead be a dataset, a document a row of its --text-column: hf:NAME[:CONFIG][/SPLIT]
    (a Hugging Face dataset, streamed), or parquet, JSONL or CSV files or folders of them. A dataset
    is read in one pass and encoded on --workers threads; --shard-tokens writes train_00000.bin, ...
    and val shards, indexed in meta.json, and --resume continues an interrupted prepare from its last
    complete shard; --max-tokens takes the first N tokens. A row that is not UTF-8 stops naming its
    line, unless --errors replace or skip; files with no rows are skipped and counted.

    With --format chat, SOURCE is one JSONL file of conversations; each is written with the
    tokenizer's chat template and a loss mask (train.mask, val.mask) so training learns the
    assistant's turns only.

    With --format preference, SOURCE is one JSONL file of preference pairs in TRL's formats (standard:
    prompt, chosen and rejected texts; conversational: lists of messages; or chosen and rejected alone,
    sharing the prompt they begin with), tokenized with the model's tokenizer (--tokenizer-file FROM) for
    `tinygpt dpo` and `tinygpt reward train`.
    """
    import time

    from ..data.text import prepare

    if args.format == "chat":
        return _prepare_chat(args)
    if args.format == "preference":
        return _prepare_preference(args)
    out = args.out or default_data_folder(args.sources[0])
    start = time.perf_counter()
    progress, close = _progress_bars() if args.progress else (None, lambda: None)
    try:
        meta = prepare(
            args.sources,
            out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            errors=args.errors,
            tokenizer_file=args.tokenizer_file,
            progress=progress,
            text_column=args.text_column,
            max_tokens=args.max_tokens,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            resume=args.resume,
        )
    finally:
        close()
    files = sum(s["files"] for s in meta["sources"])
    size = sum(s["bytes"] for s in meta["sources"])
    names = ", ".join(s["name"] for s in meta["sources"])
    seconds = time.perf_counter() - start
    print(f"prepared {out} in {seconds:.1f}s from {names} ({plural(files, 'file')}, {size / 1e6:.1f} MB)")
    vocab = f"{meta['vocab_size']:,}"
    if meta.get("requested_vocab_size", meta["vocab_size"]) != meta["vocab_size"]:
        vocab += f" (of {meta['requested_vocab_size']:,} asked: the corpus had no more merges)"
    print(f"  tokenizer  {meta['tokenizer']}, vocab {vocab}, {meta['dtype']}")
    for split in ("train", "val"):
        print(
            f"  {split:<5}      {meta[f'{split}_tokens']:>12,} tokens  {meta[f'{split}_chars']:>12,} chars"
            f"  {meta[f'{split}_bytes']:>12,} bytes"
        )
    skipped = sum(s["skipped"] for s in meta["sources"])
    datasets = any(s.get("kind") == "dataset" for s in meta["sources"])
    if datasets:
        _print_dataset_counts(meta, skipped)
    elif skipped:
        print(f"  skipped {skipped:,} files (binary, or not decodable as Python source)")
    if meta.get("errors") == "replace":
        print(f"  replaced {meta['replacements']:,} invalid byte sequences with U+FFFD")
    return 0


def _print_dataset_counts(meta: dict, skipped: int) -> None:
    """A dataset's documents, the rows and files left out, and its shards."""
    docs = f"  documents  {meta['train_documents']:,} train, {meta['val_documents']:,} val"
    empty_files = sum(s["empty_files"] for s in meta["sources"])
    notes = [f"{skipped:,} rows without text skipped"] * bool(skipped)
    notes += [f"{plural(empty_files, 'file')} without rows skipped"] * bool(empty_files)
    if notes:
        docs += f" ({', '.join(notes)})"
    print(docs + (f"; stopped at --max-tokens {meta['max_tokens']:,}" if meta["truncated"] else ""))
    if meta["errors"] == "skip" and meta["invalid_rows"]:
        more = meta["invalid_rows"] - len(meta["invalid_lines"])
        print(f"  skipped {plural(meta['invalid_rows'], 'row')} not UTF-8: {', '.join(meta['invalid_lines'])}"
              + (f" and {more:,} more" if more else ""))
    if "shards" in meta:
        print(f"  shards     {len(meta['shards']['train']):,} train, {len(meta['shards']['val']):,} val "
              f"of {meta['shard_tokens']:,} tokens")


def _prepare_chat(args: argparse.Namespace) -> int:
    """`prepare FILE.jsonl --format chat`: conversations into token files and loss masks."""
    from ..data.chat import prepare_chat

    if len(args.sources) != 1:
        raise ConfigError("--format chat reads one JSONL file of conversations")
    if args.errors == "replace":
        raise ConfigError("--errors replace applies to text; chat data takes strict or skip")
    out = args.out or default_data_folder(args.sources[0])
    meta = prepare_chat(args.sources[0], out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                        tokenizer_file=args.tokenizer_file, val_fraction=args.val_fraction,
                        errors="skip" if args.errors == "skip" else "strict")
    print(f"prepared {out} from {args.sources[0]}: {meta['conversations']:,} conversations "
          f"({meta['train_conversations']:,} train, {meta['val_conversations']:,} val)")
    print(f"  tokenizer  {meta['tokenizer']} with a chat template, vocab {meta['vocab_size']:,}, {meta['dtype']}")
    for split in ("train", "val"):
        print(f"  {split:<5}      {meta[f'{split}_tokens']:>12,} tokens  {meta[f'{split}_trained_tokens']:>12,} "
              "trained (the assistant's)")
    if meta["skipped"]:
        malformed = meta["skipped"] - meta["unencodable"]
        why = [f"{malformed:,} malformed"] * bool(malformed)
        why += [f"{meta['unencodable']:,} the tokenizer cannot encode"] * bool(meta["unencodable"])
        print(f"  skipped {plural(meta['skipped'], 'line')} ({', '.join(why)}):")
        for note in meta["skipped_why"]:
            print(f"    {note}")
    return 0


def _prepare_preference(args: argparse.Namespace) -> int:
    """`prepare FILE.jsonl --format preference`: preference pairs into token files and their index."""
    from ..data.preference import prepare_preference

    if len(args.sources) != 1:
        raise ConfigError("--format preference reads one JSONL file of preference pairs")
    if args.errors == "replace" or args.vocab_size is not None:
        raise ConfigError("--format preference takes --errors strict or skip, and the model's tokenizer as it is "
                          "(--tokenizer-file FROM), without --vocab-size")
    out = args.out or default_data_folder(args.sources[0])
    meta = prepare_preference(args.sources[0], out, tokenizer=args.tokenizer, tokenizer_file=args.tokenizer_file,
                              val_fraction=args.val_fraction, errors="skip" if args.errors == "skip" else "strict")
    prompt = "implicit prompts" if meta["implicit_prompt"] else "prompts"
    print(f"prepared {out} from {args.sources[0]}: {meta['pairs']:,} {meta['pair_format']} pairs with {prompt} "
          f"({meta['train_pairs']:,} train, {meta['val_pairs']:,} val)")
    print(f"  tokenizer  {meta['tokenizer']}, vocab {meta['vocab_size']:,}, {meta['dtype']}")
    for split in ("train", "val"):
        print(f"  {split:<5}      {meta[f'{split}_tokens']:>12,} tokens")
    if meta["skipped"]:
        print(f"  skipped {plural(meta['skipped'], 'line')}:")
        for note in meta["skipped_why"]:
            print(f"    {note}")
    return 0


def default_data_folder(source: str) -> str:
    """Where `prepare` writes without --out: data/NAME, NAME from the first source (a file's name without
    its suffix, a folder's name, or the built-in corpus), so `prepare python-stdlib` makes data/python-stdlib.

    Args:
        source: the first SOURCE given to `prepare`.
    """
    from pathlib import Path

    path = Path(source).expanduser()
    name = path.stem if path.is_file() else path.resolve().name if path.is_dir() else path.name
    return str(Path("data") / (name or "text"))


def _progress_bars():
    """A tqdm bar per phase of `prepare`, on stderr; returns (callback, close)."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in bars:
            for bar in bars.values():
                bar.close()
            bars[phase] = tqdm(total=total, desc=phase, unit="B", unit_scale=True, file=sys.stderr)
        bars[phase].update(done - bars[phase].n)

    def close() -> None:
        for bar in bars.values():
            bar.close()

    return update, close


def add_prepare(sub: argparse._SubParsersAction) -> None:
    """`tinygpt prepare` and its flags."""
    from ..tokenizer.bpe import BPE_MAX_VOCAB, BPE_MIN_VOCAB

    p = sub.add_parser("prepare", help="turn text into token files for training", description=cmd_prepare.__doc__)
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="text file, folder, python-stdlib or shakespeare")
    p.add_argument("--out", metavar="DIR",
                   help="the data folder to write (default: data/NAME after the first source, e.g. data/shakespeare)")
    p.add_argument(
        "--tokenizer",
        choices=("char", "bpe", "gpt2"),
        help="char (default), bpe (trained on the corpus) or gpt2 (GPT-2's BPE)",
    )
    p.add_argument("--vocab-size", type=Number("int", BPE_MIN_VOCAB, BPE_MAX_VOCAB), metavar="N",
                   help="BPE vocabulary size to train (default 4096)")
    p.add_argument(
        "--val-fraction", type=Number("float", 0, 0.5), default=0.1, metavar="F",
        help="share held out for validation, 0-0.5 (0.1)"
    )
    p.add_argument(
        "--errors", choices=("strict", "replace", "skip"), default="strict",
        help="invalid UTF-8: stop (default), put U+FFFD, or (a dataset) skip the row; --format chat: stop at "
             "malformed lines and conversations the tokenizer cannot encode, listing them (default), or skip them"
    )
    p.add_argument("--format", choices=("text", "chat", "preference"), default="text",
                   help="text (default); chat: one JSONL file, a conversation per line "
                        '({"messages": [{"role": ..., "content": ...}]}), trained on the assistant\'s turns; '
                        "preference: one JSONL file of TRL's preference pairs (prompt, chosen, rejected)")
    p.add_argument(
        "--tokenizer-file",
        metavar="PATH",
        help="reuse a tokenizer: a run, data or Hugging Face GPT-2 folder's (what `finetune FROM` needs), a tinygpt "
             "tokenizer.json, or GPT-2's vocab.json + merges.txt or .tiktoken file",
    )
    p.add_argument("--text-column", default="text", metavar="NAME",
                   help="a dataset's column of text, a document a row (text)")
    p.add_argument("--max-tokens", type=Number("int", 1, grouped=True), metavar="N",
                   help="a dataset: stop after N tokens, train and val together (a prefix of it)")
    p.add_argument("--shard-tokens", type=Number("int", 1, grouped=True), metavar="N",
                   help="a dataset: write each split as shards of N tokens (train_00000.bin, ...; val_00000.bin, ...)")
    p.add_argument("--workers", type=Number("int", 1, 1024), metavar="N",
                   help="a dataset: threads tokenizing (default: this machine's cores); the tokens are those of one")
    p.add_argument("--resume", action="store_true",
                   help="a dataset with --shard-tokens: continue an interrupted prepare from its last complete shard")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.set_defaults(func=cmd_prepare, hub_args=("tokenizer_file",))
