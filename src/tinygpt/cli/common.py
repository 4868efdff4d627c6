"""What every command module shares: the exit codes, the argument types that check a flag as it is
read (Number, the --device type), the flags several commands take, and loading a run for inference."""

from __future__ import annotations

import argparse
import math

from ..errors import ConfigError

EXIT_ERROR = 2  # bad input of any kind: a one-line error on stderr
EXIT_NONFINITE = 3  # training stopped on a NaN or infinite loss; the last checkpoint is kept
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it
EXIT_PIPE = 141  # stdout's reader closed it (a pipe into `head`), as a shell reports SIGPIPE
EXIT_SIGNAL = {"SIGINT": EXIT_INTERRUPTED, "SIGTERM": 143}  # training stopped by a signal, after saving
MAX_INT = 2**63 - 1  # no count, size or seed is bigger than torch's int64: a larger one is a typo


class Number:
    """An argparse `type=` for a numeric flag that checks the value's range as it parses it, so a
    bad value is a one-line usage error (exit 2) before anything is loaded: never a traceback from
    deep inside (--batch-size -1 divided by zero, --seed 99999999999999999999 overflowed torch).

    Each flag's range is written once, where the flag is defined; tests/test_cli_flags.py reads it
    back (kind, low, high, low_open, high_open) and tries every numeric flag of every command with
    zero, negative, huge, NaN, infinite and wrong-type values.

    Args:
        kind: "int"; "float" (always finite); "count", a positive number that may be written 70B
            or 1.4e12 (calc.parse_count); "duration", seconds written 90s, 10m, 1h30m
            (config.parse_duration).
        low, high: the bounds, inclusive unless low_open / high_open; an int's high is at most
            MAX_INT; a count or a duration is more than 0 unless low says otherwise.
        grouped: an int may be written with , or _ between digit groups (1,000).
        items: the text is a comma-separated list, each item checked (the type returns the list).
        keep_text: return the text as given (once checked): for handlers that parse it themselves
            and show it as the user wrote it (--flops 70B).
    """

    def __init__(self, kind: str = "int", low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, grouped: bool = False, items: bool = False,
                 keep_text: bool = False) -> None:
        assert kind in ("int", "float", "count", "duration") and (kind != "int" or low is not None)
        if kind in ("count", "duration") and low is None:  # both are more than zero by their syntax
            low, low_open = 0, True
        self.kind, self.low, self.low_open, self.high_open = kind, low, low_open, high_open
        self.high = min(MAX_INT, MAX_INT if high is None else high) if kind == "int" else high
        self.grouped, self.items, self.keep_text = grouped, items, keep_text

    def describe(self) -> str:
        """The range in words: "an integer from 1 to 2**63 - 1", "a number >= 0 and < 1"."""
        if self.kind == "int":
            high = "2**63 - 1" if self.high == MAX_INT else str(self.high)
            return f"an integer from {self.low} to {high}"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        noun = "a duration" if self.kind == "duration" else "a number"
        example = {"count": " (such as 1e12 or 70B)", "duration": " (such as 90s, 10m or 1h30m)"}.get(self.kind, "")
        return " ".join([noun, *([" and ".join(bounds)] if bounds else [])]) + example

    def _one(self, text: str) -> int | float:
        raw = text.strip()
        try:
            if self.kind == "int":
                value: int | float = int(raw.replace(",", "").replace("_", "") if self.grouped else raw)
            elif self.kind == "float":
                value = float(raw)
            elif self.kind == "count":
                from ..calc import parse_count

                value = parse_count(raw)
            else:
                from ..config.duration import parse_duration

                value = parse_duration(raw)
        except (ValueError, ConfigError):
            value = math.nan
        if not self.inside(value):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return value

    def inside(self, value: float) -> bool:
        """Whether a parsed value is one this flag takes (finite, within the bounds)."""
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __call__(self, text: str):
        values = [self._one(t) for t in text.split(",")] if self.items else self._one(text)
        return text if self.keep_text else values

    def __repr__(self) -> str:
        return f"Number({self.describe()})"


# the ranges most flags share
POSITIVE = Number("int", 1)
NATURAL = Number("int", 0)
RATE = Number("float", 0, low_open=True)
FRACTION = Number("float", 0, 1, high_open=True)


def seed_type() -> Number:
    """The type of a --seed flag: any seed torch takes."""
    from ..config.fields import MAX_SEED

    return Number("int", 0, MAX_SEED)


def _device(text: str) -> str:
    """An argparse `type=` for --device: one this torch can use here (resolve_device's rule), else a
    one-line usage error; the name is kept as given ("auto" is resolved later, by the command)."""
    if text == "auto":
        return text
    from ..device import resolve_device

    try:
        resolve_device(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("device: ")) from None
    return text


def add_device_flag(p: argparse.ArgumentParser, default: str | None = "auto", **options) -> None:
    """--device, checked as it is read (every command's --device goes through here).

    Args:
        p: the command's parser.
        default: the device when the flag is not given ("auto"; None: the command decides).
        options: more add_argument options (help, choices).
    """
    p.add_argument("--device", type=_device, default=default, **options)


def add_quantize_flag(p: argparse.ArgumentParser) -> None:
    """--quantize, for the commands that run a model for inference (sample, eval, serve)."""
    p.add_argument("--quantize", choices=("int8", "int4", "fp16", "bf16"),
                   help="run with low-precision weights: int8 (per-channel scales), int4 (a scale and offset per "
                        "32 inputs; CPU), fp16 (the 16-bit format for CPUs without native bf16) or bf16")


def add_nonfinite_flag(p: argparse.ArgumentParser) -> None:
    """--allow-nonfinite, for the commands that look at a run which may have diverged (sample, eval)."""
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load NaN or infinite weights (refused by default), to inspect a diverged run")


def load_model(run: str, device: str, quantize: str | None = None, allow_nonfinite: bool = False,
               pack: bool | None = None, job: str | None = "generate"):
    """Model and tokenizer of a run folder or a Hugging Face folder (shared by sample, eval, serve),
    with weights for inference: a low-precision format with --quantize, else float32 laid out for fast kernels
    (pack=False: PyTorch's own layout, which torch.compile traces). NaN or infinite weights are refused
    unless allow_nonfinite (--allow-nonfinite). A reward model is refused for `job` (what the command does
    with a language model's head, which it has not); None takes it."""
    from ..checkpoint import load_run
    from ..interop.quantize import quantize as to_format

    model, tokenizer = load_run(run, device, allow_nonfinite=allow_nonfinite)
    if job is not None and model.config.head == "reward":
        raise ConfigError(f"{run} is a reward model: it scores texts (tinygpt reward score) and has no "
                          f"language-model head to {job} with")
    return to_format(model, quantize or "fp32", pack=pack), tokenizer


def int_flag(value: str | None, flag: str) -> int | None:
    """An integer flag parsed here rather than by argparse, so a bad value is a one-line error."""
    if value is None:
        return None
    try:
        return int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise ConfigError(f"{flag}: expected an integer, got {value!r}") from None


def utf8_flag(value: str | None, flag: str) -> str | None:
    """A text flag, refused in one line naming the flag when the command line held bytes that are not
    UTF-8: Python keeps them as lone surrogates, which each tokenizer refuses in words of its own."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise ConfigError(f"{flag}: not valid UTF-8 text ({what} at character {e.start + 1})") from None
    return value


def encodable_flag(tokenizer, value: str | None, flag: str) -> str | None:
    """A text flag the tokenizer must encode, refused in one line naming the flag (and the characters'
    positions in its text) when the vocabulary lacks some: the tokenizer's own words name neither."""
    from ..tokenizer.base import encode_named

    if value is not None:
        encode_named(tokenizer, value, flag)
    return value


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """--json-schema FILE, --regex RE, --choice TEXT: what the generated text must be (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE",
                       help="write JSON valid against this JSON Schema file (compact: json.dumps' spacing)")
    group.add_argument("--regex", metavar="RE", help="write text the whole of which this regular expression matches")
    group.add_argument("--choice", action="append", metavar="TEXT", help="write one of these texts (repeatable)")


def constraint_flags(args: argparse.Namespace, model, tokenizer, stops: frozenset[int]) -> dict:
    """The constraint flags as generate's arguments (json_schema=, regex=, choices=), compiled here once so a
    constraint the vocabulary cannot write is an error before anything is written.

    Args:
        args: the parsed flags (add_constraint_flags).
        model: the model (its head sizes the mask).
        tokenizer: its tokenizer.
        stops: the ids that end the text.
    """
    from ..constrain import Constraint, compile_grammar
    from ..fileio import read_json

    schema = None
    if args.json_schema is not None:
        schema = read_json(args.json_schema, ConfigError)
    chosen = {"json_schema": schema, "regex": utf8_flag(args.regex, "--regex"),
              "choices": [utf8_flag(c, "--choice") for c in args.choice] if args.choice else None}
    constraint = Constraint.given(**chosen)
    if constraint is not None:
        compile_grammar(tokenizer, constraint, model.config.vocab_size, stops)
    return {name: value for name, value in chosen.items() if value is not None}


def json_line(obj, indent: int | None = None) -> str:
    """`obj` as strict JSON for --json: a float that is not finite (a diverged run's loss) is null,
    not the NaN or Infinity that JSON parsers refuse."""
    import json

    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def time_trained(result) -> str:
    """A TrainResult's training time for the summary line: the whole run's, and this invocation's
    share when it resumed one."""
    this = f" ({result.elapsed:.1f}s of it this time)" if result.total_elapsed > result.elapsed else ""
    return f"{result.total_elapsed:.1f}s{this}"


def kept_checkpoint(run: str) -> str:
    """What a run that stopped on a non-finite loss keeps, for its error line."""
    from ..run_folder import RunFolder

    return (f"the last checkpoint in {run} is unchanged" if RunFolder(run).has_weights()
            else f"no checkpoint was saved in {run}")


def cleans_up_on_sigterm(command):
    """Decorate a command so that SIGTERM ends it as Ctrl-C does, through its `finally` blocks (a
    half-written output is removed), with exit code 143; the previous handler is put back after."""
    import functools
    import signal
    import threading

    def stop(signum, frame):
        raise SystemExit(EXIT_SIGNAL["SIGTERM"])

    @functools.wraps(command)
    def run(args):
        if threading.current_thread() is not threading.main_thread():
            return command(args)
        previous = signal.signal(signal.SIGTERM, stop)
        try:
            return command(args)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return run


def add_speculation_flags(p: argparse.ArgumentParser) -> None:
    """--draft, --prompt-lookup and --speculate: speculative decoding, for sample, chat and serve."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--draft", metavar="RUN",
                        help="speculative decoding: a smaller run with the same tokenizer proposes tokens that the "
                             "model checks several at a time (the same text token for token, greedy or sampled "
                             "with --seed); with --quantize in the same format")
    source.add_argument("--prompt-lookup", type=POSITIVE, metavar="N",
                        help="speculative decoding without a draft: propose the tokens that followed the latest "
                             "earlier occurrence of the last N tokens in the prompt or the text so far (pays where "
                             "the reply repeats its input: editing, summaries, code)")
    p.add_argument("--speculate", type=POSITIVE, metavar="K",
                   help="the most tokens a round proposes (8; at most 16, 8 for int8 and int4), fewer as they fall")


def load_speculation(args: argparse.Namespace, model, tokenizer) -> dict | None:
    """generate's speculation arguments from --draft, --prompt-lookup and --speculate (None without them): the
    draft run loaded on --device in --quantize's format and refused unless its tokenizer is the model's; a
    draft as large as the model or larger is a warning on stderr, with the figures."""
    from ..speculative import check_draft, check_tokens, vocabulary_mismatch

    if args.draft is None and args.prompt_lookup is None:
        if args.speculate is not None:
            raise ConfigError("--speculate K: the most tokens a round proposes; give --draft RUN or --prompt-lookup N")
        return None
    if args.speculate is not None:
        check_tokens(model, args.speculate, "--speculate")
    if args.prompt_lookup is not None:
        return {"prompt_lookup": args.prompt_lookup, "speculate": args.speculate}
    draft, draft_tokenizer = load_model(args.draft, args.device, getattr(args, "quantize", None))
    mismatch = vocabulary_mismatch(tokenizer, draft_tokenizer)
    if mismatch is not None:
        raise ConfigError(f"--draft {args.draft}: {mismatch}")
    why = check_draft(model, draft, tokenizer.vocab_size)
    if why is not None:
        import sys

        print(f"tinygpt: warning: --draft {args.draft}: {why}", file=sys.stderr)
    return {"draft": draft, "speculate": args.speculate}
