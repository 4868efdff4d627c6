"""Using a trained run: `tinygpt sample` (generate text, or watch it chosen step by step with --trace) and
`eval` (loss, perplexity and bits per character or byte on held-out text)."""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, TinyGPTError
from .common import (NATURAL, POSITIVE, RATE, Number, add_constraint_flags, add_device_flag, add_nonfinite_flag,
                     add_quantize_flag, add_speculation_flags, constraint_flags, json_line, load_model,
                     load_speculation, seed_type, utf8_flag)
from .preference import eval_pairs


def _encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids, after the ids a pretrained model's tokenizer puts first (its BOS), as
    transformers encodes a prompt for generation."""
    first = tokenizer.added_ids[0]
    if prompt:
        return first + tokenizer.encode(prompt)
    if first:
        return first
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        return tokenizer.encode("\n")
    except TinyGPTError:
        return [0]


def _turn_ends(tokenizer) -> set[int]:
    """The ids of the tokenizer's chat end-of-turn token (none without a template)."""
    from ..tokenizer.chat_template import JinjaChatTemplate

    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return set()
    special = tokenizer.special_ids()
    ends = template.turn_ends(tokenizer) if isinstance(template, JinjaChatTemplate) else [template.end]
    return {special[t] for t in ends}


def cmd_sample(args: argparse.Namespace) -> int:
    """Generate text from a trained run, streaming it to the terminal as it is chosen. A run trained on
    chat data stops at its chat template's end-of-turn token, as its replies do (`tinygpt chat`).
    --json-schema, --regex or --choice constrain the text: each step chooses among the tokens that keep it
    valid, and it ends where it is complete.

    With --draft RUN or --prompt-lookup N, tokens are proposed several at a time and checked in one pass of
    the model (speculative decoding): the same text, faster where the proposals stand; a line on stderr
    says how many did (--trace marks each)."""
    import torch

    from ..config.sampling import SampleConfig
    from ..generate import StopText, generate_stream
    from ..tokenizer.chat import stop_ids
    from ..tokenizer.incremental import IncrementalDecoder

    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise ConfigError("--num-samples must be >= 1 and --max-new-tokens >= 0")
    utf8_flag(args.prompt, "--prompt")
    for stop in args.stop or ():
        utf8_flag(stop, "--stop")
    sampling = dict(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty)
    SampleConfig(**sampling)  # check the settings before loading anything
    if args.trace_top is not None and args.trace_top < 1:
        raise ConfigError("--trace-top must be >= 1")
    args.trace = args.trace or args.trace_top is not None
    model, tokenizer = load_model(args.run, args.device, args.quantize, args.allow_nonfinite,
                                  pack=False if args.compile else None)
    device = next(model.parameters()).device
    speculation = load_speculation(args, model, tokenizer) or {}
    ids = torch.tensor([_encode_prompt(tokenizer, args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed) if args.seed is not None else None
    # the end-of-text token, and a chat run's end of turn: a sample stops where a reply would
    stop_tokens = sorted(stop_ids(tokenizer)) or None
    constraint = constraint_flags(args, model, tokenizer, stop_ids(tokenizer))
    turn_ends = _turn_ends(tokenizer)
    printer = _TracePrinter(tokenizer, args.trace_top or 5, ids.shape[1], model.config.block_size, args.trace)
    observer = printer if args.trace or speculation else None
    for i in range(args.num_samples):
        # with --trace the steps are printed as they happen and the text once at the end
        out = io.StringIO() if args.trace else sys.stdout
        if i:
            sys.stdout.write("\n" + "-" * 40 + "\n")
        out.write(args.prompt)
        decoder, stopper = IncrementalDecoder(tokenizer), StopText(args.stop or ())
        ended = None
        for token in generate_stream(model, ids, args.max_new_tokens, stop_tokens=stop_tokens, generator=generator,
                                     observer=observer, vocab_size=tokenizer.vocab_size, compile=args.compile,
                                     tokenizer=tokenizer, **constraint, **sampling, **speculation):
            if stop_tokens and int(token[0]) in stop_tokens:
                ended = "the end-of-turn token" if int(token[0]) in turn_ends else "the end-of-text token"
                break
            out.write(stopper.push(decoder.push([int(token[0])])))
            out.flush()
            if stopper.done:
                ended = "a --stop text"
                break
        out.write(stopper.push(decoder.flush()) + stopper.flush() + "\n")
        out.flush()
        if printer.speculation is not None:
            print(f"speculation: {printer.speculation.describe()}", file=sys.stdout if args.trace else sys.stderr)
        if args.trace:
            if ended:
                print(f"stopped early: {ended} was generated")
            print(f"text: {out.getvalue()}", end="")
    return 0


class _TracePrinter:
    """The observer behind `tinygpt sample --trace`: one block per generation step (with `show`), and the
    sample's speculation figures (`speculation`, kept from the last step)."""

    def __init__(self, tokenizer, top: int, prompt_len: int, block_size: int, show: bool = True) -> None:
        self.tokenizer, self.top, self.prompt_len, self.block_size = tokenizer, top, prompt_len, block_size
        self.show = show
        self.speculation = None

    def _token(self, i: int) -> str:
        return repr(self.tokenizer.decode([i]))

    def __call__(self, step) -> None:
        import torch

        self.speculation = step.speculation
        if not self.show:
            return
        cfg = step.config
        context = step.context[0].tolist()
        total = self.prompt_len + step.step
        where = f"{len(context)} tokens" if len(context) == total else (
            f"the last {len(context)} of {total} tokens: block_size is {self.block_size}")
        print(f"step {step.step + 1}: the model sees {where}")
        print(f"  context: {self.tokenizer.decode(context)!r}")
        if cfg.is_greedy:
            how = "greedy (argmax)"
        else:
            how = ", ".join([f"temperature {cfg.temperature:g}"] + ([f"top-k {cfg.top_k}"] if cfg.top_k else [])
                            + ([f"top-p {cfg.top_p:g}"] if cfg.top_p is not None else []))
        if cfg.repetition_penalty != 1.0:
            how += f", repetition penalty {cfg.repetition_penalty:g}"
        probs = step.processed[0].float().softmax(-1)
        raw = step.logits[0].float().softmax(-1)
        alive = int((probs > 0).sum())
        values, order = torch.topk(probs, min(self.top, alive))
        chosen = int(step.token[0])
        print(f"  candidates after {how} ({alive} of {probs.numel()} tokens possible):")
        print(f"    {'token':<14} {'p':>7}  {'model p':>7}")
        for p, i in zip(values.tolist(), order.tolist()):
            mark = "  <- chosen" if i == chosen else ""
            print(f"    {self._token(i):<14} {p:7.4f}  {raw[i].item():7.4f}{mark}")
        if chosen not in order.tolist():
            rank = int((probs > probs[chosen]).sum()) + 1
            print(f"    ... chosen: {self._token(chosen)} at rank {rank}, p {probs[chosen].item():.4f}")
        kept = " (proposed by speculation, and the model agreed)" if step.drafted else ""
        print(f"  chosen: {self._token(chosen)} (id {chosen}){kept}")


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss, perplexity and bits per character (char) or per byte (BPE) on held-out text.

    On chat data (`prepare --format chat`) only the assistant's tokens are scored (the loss mask), as
    training's evaluation does, each conversation alone; bits are per byte of the assistant's text. On
    preference pairs, the pair accuracy: the share whose chosen side the model (or reward model) prefers.

    --text FILE with characters a char vocabulary lacks is refused, naming them; with --unknown skip
    those characters are left out and each run of known characters between them is scored as a
    text of its own (its first character starts the context and is not predicted, like the first
    character of any text), so no context holds a character the model never saw. The report says
    how many characters were left out and their share of the text.
    """

    import numpy as np

    from ..train.evaluation import eval_report, evaluate

    if args.unknown == "skip" and not args.text:
        raise ConfigError("--unknown skip applies to --text: a prepared data folder holds only known tokens")
    model, tokenizer = load_model(args.run, args.device, args.quantize, args.allow_nonfinite, job=None)
    dataset = None if args.text else _eval_data(args.run, args.data, tokenizer)
    if dataset is not None and dataset.is_chat:
        return _eval_chat(args, model, dataset)
    if (dataset is not None and dataset.is_preference) or model.config.head == "reward":  # no next-token loss
        return eval_pairs(args, model, dataset)
    scored = _from_text(args.text, tokenizer, args.unknown) if args.text else _from_dataset(dataset)
    tokens, chars, nbytes, segments = scored.tokens, scored.chars, scored.nbytes, scored.segments
    skipped = scored.skipped
    if args.max_tokens is not None and args.max_tokens < len(tokens):
        tokens = np.asarray(tokens[: args.max_tokens])
        # counted as the data folder counts them: text only, not the separators between documents
        kept = tokenizer.decode_bytes([t for t in tokens.tolist() if t != tokenizer.eot_id])
        chars, nbytes = len(kept.decode("utf-8", errors="replace")), len(kept)
        if segments is not None:
            segments = [(a, min(b, len(tokens))) for a, b in segments if a < len(tokens)]
    result = evaluate(model, tokens, batch_size=args.batch_size, segments=segments)
    report = eval_report(result, len(tokens), chars=chars, nbytes=nbytes, kind=tokenizer.kind)
    if skipped is not None:
        report.update(skipped_chars=skipped, skipped_share=skipped / max(1, scored.text_chars))
    print(f"{scored.where}: {result['tokens']:,} tokens")
    if skipped is not None:
        runs = f"; the {len(segments):,} runs of known text between them scored separately" if skipped else ""
        print(f"skipped {skipped:,} of {scored.text_chars:,} characters ({report['skipped_share']:.2%}): not in the "
              f"vocabulary{runs}")
    per_byte = f"  bits per byte {report['bits_per_byte']:.4f}" if "bits_per_byte" in report else ""
    print(f"loss {report['loss']:.4f}  perplexity {report['perplexity']:.3f}  "
          f"bits per char {report['bits_per_char']:.4f}{per_byte}")
    if args.json:
        print(json_line(report))
    return 0


@dataclass
class _Scored:
    """What `tinygpt eval` scores: the tokens, the characters and UTF-8 bytes they stand for, where
    they come from; for --text, the file's characters and the runs of them scored (--unknown skip)."""

    tokens: Any  # token ids: a numpy array (or a memory-mapped one)
    chars: int
    nbytes: int
    where: str
    segments: list[tuple[int, int]] | None = None
    skipped: int | None = None  # characters left out (--unknown skip)
    text_chars: int = 0  # the --text file's characters, skipped ones included


def _from_text(path: str, tokenizer, unknown: str) -> _Scored:
    """A --text file's tokens; with --unknown skip, without the characters the vocabulary lacks."""
    import numpy as np

    from ..errors import DataError, TokenizerError
    from ..fileio import check_regular_file
    from ..tokenizer.char import encode_skipping_unknown

    check_regular_file(path, DataError)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    segments, skipped = None, None
    if unknown == "skip":
        tokens, segments, skipped = encode_skipping_unknown(tokenizer, text)
    else:
        try:
            tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}; --unknown skip scores the rest") from None
    chars, nbytes = len(text), len(text.encode("utf-8"))
    if skipped:  # the characters scored: the known ones
        kept = tokenizer.decode_bytes(tokens.tolist())
        chars, nbytes = len(kept.decode("utf-8")), len(kept)
    return _Scored(tokens, chars, nbytes, path, segments, skipped, len(text))


def _eval_data(run: str, data: str | None, tokenizer):
    """--data, or the data folder the run was trained on, checked against the run's tokenizer."""
    from ..data.folder import load_data
    from ..run_folder import RunFolder

    folder = RunFolder(run)
    if data is None and folder.recorded():  # a Hugging Face folder has none
        data = folder.train_config()[1]
    if data is None:
        raise ConfigError(f"{run} holds a model but no data of its own (an imported or Hugging Face folder): "
                          "give --data DIR (a folder from `tinygpt prepare` with this model's tokenizer) "
                          "or --text FILE")
    dataset = load_data(data)
    folder.check_data(dataset, tokenizer)
    return dataset


def _from_dataset(dataset) -> _Scored:
    """The val split of a text data folder."""
    meta = dataset.meta
    return _Scored(dataset.val, int(meta["val_chars"]), int(meta["val_bytes"]), f"the val split of {dataset.path}")


def _eval_chat(args: argparse.Namespace, model, dataset) -> int:
    """`eval` on chat data: the loss of the assistant's tokens only (the loss mask), as training's
    evaluation counts it, each conversation alone; --max-tokens keeps the first conversations that fit."""
    import math

    from ..train.evaluation import conversations_within, evaluate_chat

    keep = None if args.max_tokens is None else conversations_within(dataset, args.max_tokens)
    result = evaluate_chat(model, dataset, batch_size=args.batch_size, conversations=keep)
    n = len(dataset.starts["val"]) if keep is None else keep
    report = {"loss": result["loss"], "perplexity": math.exp(result["loss"]),
              "bits_per_byte": result["nll"] / math.log(2) / max(1, result["bytes"]), "tokens": result["tokens"],
              "conversations": n, "masked": True}
    print(f"the val split of {dataset.path}: {n:,} conversations; scored the assistant's tokens only "
          f"(the loss mask, as training's evaluation): {result['tokens']:,} tokens")
    print(f"loss {report['loss']:.4f}  perplexity {report['perplexity']:.3f}  "
          f"bits per byte {report['bits_per_byte']:.4f} (of the assistant's text)")
    if args.json:
        print(json_line(report))
    return 0


def add_sample(sub: argparse._SubParsersAction) -> None:
    """`tinygpt sample` and its flags."""
    seed = seed_type()
    p = sub.add_parser("sample", help="generate text from a run", description=cmd_sample.__doc__)
    p.add_argument("run", help="a run folder or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3)")
    p.add_argument("--prompt", default="", help="text to continue (default: start of text)")
    p.add_argument("--max-new-tokens", type=NATURAL, default=200)
    p.add_argument("--temperature", type=Number("float", 0), default=0.8)
    p.add_argument("--top-k", type=POSITIVE)
    p.add_argument("--top-p", type=Number("float", 0, 1, low_open=True))
    p.add_argument("--repetition-penalty", type=RATE, default=1.0)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=seed, help="makes sampling reproducible")
    p.add_argument("--num-samples", type=POSITIVE, default=1)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when TEXT is generated (repeatable)")
    p.add_argument("--trace", action="store_true",
                   help="show every step: the context, the top candidates after sampling settings, the choice")
    p.add_argument("--trace-top", type=POSITIVE, metavar="N", help="candidates shown per step (5); implies --trace")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile, CUDA graphs on a GPU (the first token waits for the compile)")
    add_constraint_flags(p)
    add_speculation_flags(p)
    add_device_flag(p)
    add_quantize_flag(p)
    add_nonfinite_flag(p)
    p.set_defaults(func=cmd_sample, hub_args=("run", "draft"))


def add_eval(sub: argparse._SubParsersAction) -> None:
    """`tinygpt eval` and its flags."""
    p = sub.add_parser("eval", help="loss, perplexity and bits per char/byte", description=cmd_eval.__doc__)
    p.add_argument("run", help="a run folder or a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="a prepared data folder: its val split (default: the run's own data)")
    src.add_argument("--text", help="any UTF-8 text file")
    p.add_argument("--batch-size", type=POSITIVE, default=8)
    p.add_argument("--max-tokens", type=Number("int", 2), help="evaluate only the first N tokens (a quicker estimate)")
    p.add_argument("--unknown", choices=("refuse", "skip"), default="refuse",
                   help="--text characters a char vocabulary lacks: refuse the file (default), or skip them "
                        "and score each run of known text between them on its own")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    add_device_flag(p)
    add_quantize_flag(p)
    add_nonfinite_flag(p)
    p.set_defaults(func=cmd_eval, hub_args=("run",))
