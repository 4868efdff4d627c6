"""The `tinygpt` command: parses flags into configs and calls the library. Only this layer prints
messages for the user and chooses exit codes."""

from __future__ import annotations

import argparse
import io
import math
import os
import sys

from ..errors import ConfigError, TinyGPTError

EXIT_ERROR = 2
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
                from ..config import parse_duration

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


def _seed() -> Number:
    from ..config import MAX_SEED

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


class _UsageError(Exception):
    """A command line argparse refused; main() prints it as every other error, on one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are the CLI's one-line errors (`tinygpt: error: argument --lr: ...`, no
    usage block), returned by main() as exit code 2 like any other bad input."""

    def error(self, message: str):
        raise _UsageError(message)


def cmd_lesson(args: argparse.Namespace) -> int:
    """Walk through the lesson's worked examples with tinygpt's own objects."""
    from ..lab import lesson

    for text in lesson.tour():
        print(text)
    return 0


EXIT_NONFINITE = 3
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}
MODEL_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_weights",
                "activation", "init")


def _train_settings(args: argparse.Namespace) -> tuple[dict, dict, str | None]:
    """Model and training overrides from the config file, then the flags (flags win)."""
    import dataclasses
    import tomllib

    from ..config import TrainConfig, parse_duration

    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                values = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{args.config}: not valid TOML ({e})") from None
        unknown = sorted(set(values) - train_fields - set(MODEL_FIELDS) - {"preset"})
        if unknown:
            raise ConfigError(f"{args.config}: unknown key(s): {', '.join(unknown)}")
    for name in (*MODEL_FIELDS, *train_fields, "preset"):
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
    for name in ("max_time", "dist_timeout"):
        if isinstance(values.get(name), str):
            values[name] = parse_duration(values[name], "--" + name.replace("_", "-"))
    preset = values.pop("preset", None)
    model = {k: v for k, v in values.items() if k in MODEL_FIELDS}
    train = {k: v for k, v in values.items() if k in train_fields}
    return model, train, preset


def cmd_train(args: argparse.Namespace) -> int:
    """Train a GPT on a prepared data folder; checkpoints and metrics.jsonl go to the run folder.

    Under `torchrun --nproc_per_node=N -m tinygpt train ...` the N processes train one model
    (DDP, or FSDP2 with --fsdp); --batch-size is per process; rank 0 writes and prints.

    Without --preset or size flags (--n-layer, --n-head, --n-embd) the model is chosen for you:
    with --max-time it is sized for the compute that time buys on this machine (the speed measured
    in a few seconds) by Chinchilla's rule, or by a sweep's fit with --sweep DIR, and the choice is
    printed (on stderr) and kept in train_config.json; without it, a default for the size of the data.
    """
    import dataclasses

    from ..config import GPTConfig, TrainConfig, from_mapping
    from ..data import load_data
    from ..errors import NonFiniteError
    from ..sizing import choose_model
    from ..train import has_checkpoint, read_train_config, train

    model_over, train_over, preset = _train_settings(args)
    resume = args.resume and has_checkpoint(args.out)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.sweep and (resume or preset or distributed):
        why = ("--preset" if preset else f"--resume: {args.out} already has its model" if resume
               else "torchrun: each process would time itself; give the model (--preset or size flags)")
        raise ConfigError(f"--sweep sizes a new model: it does not go with {why}")
    if args.resume and not resume and os.environ.get("RANK", "0") == "0":
        print(f"no checkpoint in {args.out} yet: starting a new run there", file=sys.stderr)
    if resume:
        saved, _ = read_train_config(args.out)
        train_cfg = from_mapping(TrainConfig, {**saved.to_dict(), **train_over})
        model_cfg = None
        if model_over or preset:
            from ..checkpoint import load_config

            base = GPTConfig.from_preset(preset).to_dict() if preset else load_config(args.out).to_dict()
            model_cfg = from_mapping(GPTConfig, {**base, **model_over})
    else:
        train_cfg = from_mapping(TrainConfig, train_over)
        meta = load_data(args.data).meta
        vocab = int(meta["vocab_size"])
        if preset:
            base = GPTConfig.from_preset(preset, vocab_size=vocab).to_dict()
            model_cfg = from_mapping(GPTConfig, {**base, **model_over})
        else:
            # one path for every default: sized for --max-time when no size flag is given, else for the
            # data; under torchrun the data's default, which every process computes alike
            sweep = None
            if args.sweep:
                from ..lab.sweep import load_fit

                sweep = load_fit(args.sweep)
            sizing = dataclasses.replace(train_cfg, max_time=None) if distributed else train_cfg
            choice = choose_model(vocab, int(meta["train_tokens"]), int(meta["val_tokens"]), sizing,
                                  fixed=model_over, sweep=sweep)
            model_cfg = choice  # train() records it and trains at its learning rate unless --lr is given
            if choice.plan is not None:  # on stderr beside the progress: stdout keeps the one result line
                print(choice.reason, file=sys.stderr, flush=True)
    from ..device import resolve_device
    from ..distributed import process_group

    # under torchrun the processes stay in one group until rank 0 has printed: torchrun ends the
    # whole job as soon as one process exits with a non-zero code (143 after SIGTERM, say)
    with process_group(resolve_device(train_cfg.device), train_cfg.dist_timeout) as ctx:
        try:
            result = train(args.data, args.out, model_cfg, train_cfg, resume=resume, progress=not args.quiet)
        except NonFiniteError as e:
            if ctx.is_main:
                print(f"tinygpt: error: {e}; the last checkpoint in {args.out} is unchanged", file=sys.stderr)
            return EXIT_NONFINITE
        if ctx.is_main:
            val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
            loss = f", train loss {result.train_loss:.4f}" if result.train_loss is not None else ""
            procs = f" on {ctx.world_size} processes" if ctx.enabled else ""
            print(
                f"{result.stopped}: {result.step} steps{procs}, {result.tokens:,} tokens in {result.elapsed:.1f}s"
                f"{loss}{val}; saved to {result.run}",
                flush=True,
            )
        ctx.barrier()
    return EXIT_SIGNAL.get(result.stopped, 0)


def _load_run(run: str, device: str, quantize: str | None = None, allow_nonfinite: bool = False):
    """Model and tokenizer of a run folder or a Hugging Face GPT-2 folder (shared by sample, eval, serve),
    with weights for inference: int8 or bf16 with --quantize, else float32 laid out for fast kernels.
    NaN or infinite weights are refused unless allow_nonfinite (--allow-nonfinite)."""
    from ..checkpoint import load_run
    from ..interop.quantize import quantize as to_format

    model, tokenizer = load_run(run, device, allow_nonfinite=allow_nonfinite)
    return to_format(model, quantize or "fp32"), tokenizer


def _encode_prompt(tokenizer, prompt: str) -> list[int]:
    if prompt:
        return tokenizer.encode(prompt)
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        return tokenizer.encode("\n")
    except TinyGPTError:
        return [0]


def cmd_sample(args: argparse.Namespace) -> int:
    """Generate text from a trained run, streaming it to the terminal as it is chosen."""
    import torch

    from ..config import SampleConfig
    from ..generate import StopText, generate_stream
    from ..tokenizer import IncrementalDecoder

    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise ConfigError("--num-samples must be >= 1 and --max-new-tokens >= 0")
    sampling = dict(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty)
    SampleConfig(**sampling)  # check the settings before loading anything
    if args.trace_top is not None and args.trace_top < 1:
        raise ConfigError("--trace-top must be >= 1")
    args.trace = args.trace or args.trace_top is not None
    model, tokenizer = _load_run(args.run, args.device, args.quantize, args.allow_nonfinite)
    device = next(model.parameters()).device
    ids = torch.tensor([_encode_prompt(tokenizer, args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed) if args.seed is not None else None
    stop_tokens = [tokenizer.eot_id] if tokenizer.eot_id is not None else None
    observer = None
    if args.trace:
        observer = _TracePrinter(tokenizer, args.trace_top or 5, ids.shape[1], model.config.block_size)
    for i in range(args.num_samples):
        # with --trace the steps are printed as they happen and the text once at the end
        out = io.StringIO() if args.trace else sys.stdout
        if i:
            sys.stdout.write("\n" + "-" * 40 + "\n")
        out.write(args.prompt)
        decoder, stopper = IncrementalDecoder(tokenizer), StopText(args.stop or ())
        ended = None
        for token in generate_stream(model, ids, args.max_new_tokens, stop_tokens=stop_tokens, generator=generator,
                                     observer=observer, vocab_size=tokenizer.vocab_size, **sampling):
            if stop_tokens and int(token[0]) in stop_tokens:
                ended = "the end-of-text token"
                break
            out.write(stopper.push(decoder.push([int(token[0])])))
            out.flush()
            if stopper.done:
                ended = "a --stop text"
                break
        out.write(stopper.push(decoder.flush()) + stopper.flush() + "\n")
        out.flush()
        if args.trace:
            if ended:
                print(f"stopped early: {ended} was generated")
            print(f"text: {out.getvalue()}", end="")
    return 0


class _TracePrinter:
    """The observer behind `tinygpt sample --trace`: one block per generation step."""

    def __init__(self, tokenizer, top: int, prompt_len: int, block_size: int) -> None:
        self.tokenizer, self.top, self.prompt_len, self.block_size = tokenizer, top, prompt_len, block_size

    def _token(self, i: int) -> str:
        return repr(self.tokenizer.decode([i]))

    def __call__(self, step) -> None:
        import torch

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
        print(f"  chosen: {self._token(chosen)} (id {chosen})")


# ---- look inside: attention maps, loss curves, few-shot prompting ----------------------------


def _check_index(value: int, count: int, flag: str, what: str) -> None:
    if not 0 <= value < count:
        raise ConfigError(f"{flag} {value} is out of range: the model has {count} {what}, valid 0..{count - 1}")


def cmd_attention(args: argparse.Namespace) -> int:
    """Draw a run's attention weights for a prompt, its tokens on both axes.

    Args (flags):
        RUN: a run folder. --prompt TEXT: the tokens to look at (at most block_size of them).
        --layer L (0): the block. --head H (0) or --all-heads: one heatmap, or every head of the
            layer in a grid. --out FILE: the picture (.png, .svg or .pdf).
    """
    from ..lab import viz

    if not args.prompt:
        raise ConfigError("--prompt: give the text whose attention to draw")
    viz.check_picture(args.out)
    model, tokenizer = _load_run(args.run, args.device)
    cfg = model.config
    _check_index(args.layer, cfg.n_layer, "--layer", "layers")
    if args.head is not None:
        _check_index(args.head, cfg.n_head, "--head", "heads per layer")
    ids = tokenizer.encode(args.prompt)
    weights = viz.attention_weights(model, ids)[args.layer]  # (n_head, T, T)
    labels = viz.token_labels(tokenizer, ids)
    if args.all_heads:
        viz.plot_attention(weights, labels, args.out, titles=[f"head {h}" for h in range(cfg.n_head)],
                           suptitle=f"layer {args.layer}: {args.prompt!r}")
        what = f"all {cfg.n_head} heads"
    else:
        head = args.head or 0
        viz.plot_attention(weights[head], labels, args.out, titles=[f"layer {args.layer}, head {head}"])
        what = f"head {head}"
    print(f"wrote {args.out}: layer {args.layer}, {what}, {len(ids)} tokens")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Plot train and val loss against steps, tokens and wall-clock time from runs' metrics.jsonl, overlaid.

    Args (flags):
        RUN...: run folders (or metrics.jsonl files). --out FILE: the picture (.png, .svg or .pdf).
        --title TEXT: a title over the plot.
    """
    from ..lab import viz

    viz.check_picture(args.out)
    runs = [viz.read_metrics(run) for run in args.runs]
    names = [m.name for m in runs]
    for m, run in zip(runs, args.runs):
        if names.count(m.name) > 1:  # two runs called "run" in different folders: use the paths
            m.name = str(run)
    viz.plot_loss(runs, args.out, title=args.title)
    for m in runs:
        last = f", val loss {m.val_loss[-1]:.4f} at step {m.eval_steps[-1]}" if m.val_loss else ""
        steps = m.steps[-1] if m.steps else m.eval_steps[-1]
        print(f"{m.name}: {steps} steps{last}")
    print(f"wrote {args.out}")
    return 0


def cmd_fewshot(args: argparse.Namespace) -> int:
    """Few-shot accuracy: prompts of k worked examples plus a query, for each k in --shots.

    Args (flags):
        RUN: a run folder. --task FILE.jsonl | synthetic: a task file (see tinygpt.lab.fewshot) or the
            built-in in-context-learning task. --shots 0,1,2,3: the k values.
        --scoring generate|likelihood: greedy answer compared exactly, or the best-scoring choice.
        --queries N: evaluate the first N examples. --seed S: the draw of the worked examples (and
            of the synthetic task). --show-prompt: print the first query's prompt for each k.
        --plot FILE: draw accuracy against k. --json: end with one JSON line.
    """
    import json

    from ..lab import fewshot

    shots = fewshot.parse_shots(args.shots)
    task = fewshot.load_task(args.task, seed=args.seed)
    if args.plot:
        from ..lab.viz import check_picture

        check_picture(args.plot)  # before the evaluation, not after it
    model, tokenizer = _load_run(args.run, args.device)
    lm = fewshot.GPTLanguageModel(model, tokenizer)
    if args.show_prompt:
        order = fewshot.shot_order(task, 0, args.seed)
        for k in shots:
            prompt = fewshot.build_prompt(task, task.examples[0], [task.examples[j] for j in order[:k]])
            print(f"--- {k}-shot prompt (answer: {task.examples[0].output!r}):\n{prompt}")
        print("---")
    from tqdm.auto import tqdm

    bar = tqdm(total=args.queries or len(task.examples), unit="query", file=sys.stderr, disable=args.quiet)
    try:
        report = fewshot.evaluate(lm, task, shots, scoring=args.scoring, queries=args.queries, seed=args.seed,
                                  progress=lambda done, total: bar.update(done - bar.n))
    finally:
        bar.close()
    how = "greedy answer, exact match" if args.scoring == "generate" else "most likely candidate answer"
    print(f"{report.task}: {report.results[0].total} queries, {how}")
    print(f"{'shots':>5}  {'accuracy':>8}  correct")
    for r in report.results:
        note = f"  ({r.truncated} prompts longer than the context)" if r.truncated else ""
        print(f"{r.shots:>5}  {100 * r.accuracy:7.1f}%  {r.correct}/{r.total}{note}")
    if report.chance is not None:
        print(f"chance: {100 * report.chance:.1f}%")
    if args.plot:
        from ..lab import viz

        viz.plot_fewshot([r.shots for r in report.results], [r.accuracy for r in report.results], args.plot,
                         title=f"{report.task}: {args.run}", chance=report.chance,
                         counts=[(r.correct, r.total) for r in report.results])
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0


def cmd_fewshot_data(args: argparse.Namespace) -> int:
    """Write the synthetic in-context-learning task: training text and an evaluation task file.

    OUT/train.txt holds one episode per line: letter-digit pairs such as "q7 x3 q7 b1 x3", 4 to 16
    of them over 2 to 6 letters, each episode under a fresh random mapping of letters to digits (so
    only the context can reveal what a letter means). OUT/task.jsonl is a held-out task in the
    task-file format (the same draw as `--task synthetic --seed SEED`).
    """
    from pathlib import Path

    from ..lab import fewshot
    from ..fileio import atomic_write

    if args.episodes < 1:
        raise ConfigError("--episodes must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = fewshot.synthetic_corpus(args.episodes, seed=args.seed)
    atomic_write(out / "train.txt", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    task = fewshot.synthetic_task(seed=args.seed)
    fewshot.write_task(task, out / "task.jsonl")
    print(f"wrote {out / 'train.txt'} ({args.episodes:,} episodes, {len(text):,} characters) and "
          f"{out / 'task.jsonl'} ({len(task.examples)} queries)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss, perplexity and bits per character (char) or per byte (BPE) on held-out text.

    --text FILE with characters a char vocabulary lacks is refused, naming them; with --unknown skip
    those characters are left out and each run of known characters between them is scored as a
    text of its own (its first character starts the context and is not predicted, like the first
    character of any text), so no context holds a character the model never saw. The report says
    how many characters were left out and their share of the text.
    """
    import json
    from pathlib import Path

    import numpy as np

    from ..data import load_data
    from ..errors import TokenizerError
    from ..tokenizer import encode_skipping_unknown
    from ..train import TRAIN_CONFIG, check_data_for_run, eval_report, evaluate, read_train_config

    if args.unknown == "skip" and not args.text:
        raise ConfigError("--unknown skip applies to --text: a prepared data folder holds only known tokens")
    model, tokenizer = _load_run(args.run, args.device, args.quantize, args.allow_nonfinite)
    segments, skipped = None, None
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        if args.unknown == "skip":
            tokens, segments, skipped = encode_skipping_unknown(tokenizer, text)
        else:
            try:
                tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
            except TokenizerError as e:
                raise TokenizerError(f"{args.text}: {e}; --unknown skip scores the rest") from None
        chars, nbytes, where = len(text), len(text.encode("utf-8")), args.text
        if skipped:  # the characters scored: the known ones
            kept = tokenizer.decode_bytes(tokens.tolist())
            chars, nbytes = len(kept.decode("utf-8")), len(kept)
    else:
        data = args.data
        if data is None and (Path(args.run) / TRAIN_CONFIG).exists():  # a Hugging Face folder has none
            data = read_train_config(args.run)[1]
        if data is None:
            raise ConfigError(f"{args.run} holds a model but no data of its own (an imported or Hugging Face folder): "
                              "give --data DIR (a folder from `tinygpt prepare` with this model's tokenizer) "
                              "or --text FILE")
        dataset = load_data(data)
        check_data_for_run(args.run, dataset, tokenizer)
        tokens, chars, nbytes = dataset.val, int(dataset.meta["val_chars"]), int(dataset.meta["val_bytes"])
        where = f"the val split of {data}"
    if args.max_tokens is not None and args.max_tokens < len(tokens):
        tokens = np.asarray(tokens[: args.max_tokens])
        kept = tokenizer.decode_bytes(tokens.tolist())
        chars, nbytes = len(kept.decode("utf-8", errors="replace")), len(kept)
        if segments is not None:
            segments = [(a, min(b, len(tokens))) for a, b in segments if a < len(tokens)]
    result = evaluate(model, tokens, batch_size=args.batch_size, segments=segments)
    report = eval_report(result, len(tokens), chars=chars, nbytes=nbytes, kind=tokenizer.kind)
    unit = "char" if "bits_per_char" in report else "byte"
    if skipped is not None:
        report.update(skipped_chars=skipped, skipped_share=skipped / max(1, len(text)))
    print(f"{where}: {result['tokens']:,} tokens")
    if skipped is not None:
        runs = f"; the {len(segments):,} runs of known text between them scored separately" if skipped else ""
        print(f"skipped {skipped:,} of {len(text):,} characters ({report['skipped_share']:.2%}): not in the "
              f"vocabulary{runs}")
    print(f"loss {report['loss']:.4f}  perplexity {report['perplexity']:.3f}  bits per {unit} {report[f'bits_per_{unit}']:.4f}")
    if args.json:
        print(json.dumps(report))


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run as a Hugging Face GPT-2 folder (--format hf) or a GGUF file for llama.cpp (--format gguf).

    Args (flags):
        RUN: a run folder (or a Hugging Face GPT-2 folder).
        --format hf: a folder that transformers' GPT2LMHeadModel, AutoTokenizer and
            pipeline("text-generation") load: config.json, model.safetensors, generation_config.json,
            tokenizer.json and tokenizer_config.json.
        --format gguf: one .gguf file with GPT-2 metadata, the tokenizer and the weights.
        --out: the folder (hf) or file (gguf) to write.
        --dtype: with gguf, float32 (default) or float16 matrices.
    """
    from pathlib import Path

    from ..calc import format_count
    from ..checkpoint import load_run

    src, out = Path(args.run), Path(args.out)
    if out.resolve() == src.resolve():
        raise ConfigError("--out must not be the folder being exported")
    if args.dtype != "float32" and args.format != "gguf":
        raise ConfigError("--dtype applies to --format gguf only")
    model, tokenizer = load_run(src, "cpu", tokenizer_required=args.format == "gguf")
    params = f"{format_count(model.num_params())} parameters"
    tok = f"{tokenizer.kind} tokenizer, {tokenizer.vocab_size:,} tokens" if tokenizer is not None else "no tokenizer"
    if args.format == "hf":
        from ..interop.hf_gpt2 import export_hf

        export_hf(model, tokenizer, out)
        print(f"exported {src} to {out} (Hugging Face GPT-2: {params}, {tok})")
        print(f"  transformers: GPT2LMHeadModel.from_pretrained('{out}'), AutoTokenizer.from_pretrained('{out}')")
        if tokenizer is None:
            print(f"  note: {src} has no tokenizer.json, so {out} holds the model alone")
    else:
        from ..interop.gguf import export_gguf, gguf_notes

        export_gguf(model, tokenizer, out, dtype=args.dtype)
        size = out.stat().st_size
        print(f"exported {src} to {out} (GGUF, architecture gpt2, {args.dtype}: {params}, {tok}; {size / 1e6:.1f} MB)")
        for note in gguf_notes(model, tokenizer):
            print(f"  note: {note}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Turn a Hugging Face GPT-2 folder (config.json + model.safetensors) into a tinygpt run.

    The tokenizer comes along: GPT-2's vocab.json + merges.txt (run by tiktoken), or a
    tokenizer.json holding a byte-level BPE or a one-token-per-character vocabulary. A folder with
    only pytorch_model.bin is refused: it is a pickle, and tinygpt never unpickles a file.
    """
    from ..calc import format_count
    from ..interop.hf_gpt2 import import_hf

    model, tokenizer = import_hf(args.dir, args.out)
    run, c = args.out, model.config
    tok = f"{tokenizer.kind} tokenizer, {tokenizer.vocab_size:,} tokens" if tokenizer is not None else "no tokenizer"
    print(
        f"imported {args.dir} to {run}: {format_count(model.num_params())} parameters "
        f"({c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, context {c.block_size}), {tok}"
    )
    if tokenizer is None:
        print(f"  note: {args.dir} has no tokenizer, so `tinygpt sample {run}` cannot run until one is added")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Fold an adapter run's LoRA adapters into its base model's weights and write a plain run.

    Args (flags):
        RUN: an adapter run (adapter_config.json + adapter.safetensors, naming its base model).
        --out MERGED: the run folder to create (model.safetensors, config.json, tokenizer.json):
            a model like any other, which needs neither the adapters nor the base any more.
    """
    from ..calc import format_count
    from ..lora import merge_run, read_adapter_config

    model, tokenizer = merge_run(args.run, args.out)
    info = read_adapter_config(args.run)
    lora = info.lora
    print(f"merged {args.run} (LoRA r={lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}) into the "
          f"weights of {info.shown_base}: wrote {args.out} ({format_count(model.num_params())} parameters"
          f"{'' if tokenizer is not None else ', no tokenizer'})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a run over an OpenAI-compatible HTTP API, with a web playground at /.

    Args (flags):
        RUN: the run folder to serve (or a Hugging Face GPT-2 folder with its tokenizer).
        --host, --port: where to listen (127.0.0.1:8000; port 0 picks a free one).
        --api-key KEY: require `Authorization: Bearer KEY` on /v1 routes (default: $TINYGPT_API_KEY).
        --max-concurrency N: sequences decoded together in one batched step (8).
        --max-queue N: sequences that may wait for a slot; past that, 429 (32).
        --max-tokens N: the largest max_tokens a request may ask for (2048).
        --cors-origin ORIGIN: let browser pages from ORIGIN call the API (repeatable; "*" for any).
        --allow-host NAME: also answer requests whose Host header is NAME (repeatable). Bound to a
            loopback address, the server answers only Host headers naming localhost or a loopback
            address (421 otherwise), so that no web page can reach it through a rebound DNS name.
        --model-name NAME: the model id clients send (default: the run folder's name).
        --threads N: torch's intra-op threads on CPU (default: torch's choice; 1 often batches
            better on a CPU shared with other work).
    Prompts longer than the model's context are cut to their last block_size tokens (the
    response's usage.prompt_tokens_truncated says how many were dropped). SIGTERM stops accepting
    requests (503), finishes those running, then exits. The KV cache for --max-concurrency
    sequences is allocated before the server listens: one it cannot hold is a one-line error.
    """
    import os
    from pathlib import Path

    try:
        from ..server import create_app, listen, serve
    except ImportError as e:
        if e.name in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise ConfigError("tinygpt serve needs FastAPI and uvicorn: pip install 'tinygpt[serve]'") from None
        raise
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.max_concurrency < 1 or args.max_queue < 0 or args.max_tokens < 1:
        raise ConfigError("--max-concurrency and --max-tokens must be >= 1, --max-queue >= 0")
    api_key = args.api_key if args.api_key is not None else os.environ.get("TINYGPT_API_KEY") or None
    if args.api_key == "":
        raise ConfigError("--api-key must not be empty")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if any(not name.strip() or "/" in name for name in args.allow_host or ()):
        raise ConfigError("--allow-host takes a host name (or address) such as my.host, without a scheme or path")
    allowed = tuple(args.allow_host or ())
    model, tokenizer = _load_run(args.run, args.device, args.quantize)
    name = args.model_name or Path(args.run).resolve().name
    app = create_app(model, tokenizer, model_name=name, api_key=api_key, max_concurrency=args.max_concurrency,
                     max_queue=args.max_queue, max_tokens=args.max_tokens, cors_origins=tuple(args.cors_origin or ()),
                     trusted_hosts=allowed if allowed or _is_loopback(args.host) else None)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    device = next(model.parameters()).device
    key = " (needs the API key)" if api_key else ""
    print(f"serving {args.run} as model '{name}' on {device}\n  playground  {url}/\n  OpenAI API  {url}/v1{key}",
          flush=True)
    serve(app, sock)
    return 0


def _is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.1, ::1, localhost)."""
    import ipaddress
    import socket

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        return False  # listen() says what is wrong with the address


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure this machine's limits, training and generation speed, beside Hugging Face transformers.

    Prints tables and the target ratios, all measured in the same run (a shared machine's absolute
    figures move between runs; the ratios are what to compare).

    Args (flags):
        --quick: a shorter run (under two minutes on a 2-core CPU).
        --json FILE: also write every figure as JSON.
        --only SECTION: limits, train or generate (repeatable; default all).
        --no-peers: skip transformers even when it is installed.
    """

    from ..lab import bench
    from ..fileio import write_json

    sections = tuple(args.only or ("limits", "train", "generate"))
    result = bench.run(quick=args.quick, sections=sections, peers=not args.no_peers,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench.render(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _int_flag(value: str | None, flag: str) -> int | None:
    """An integer flag parsed here rather than by argparse, so a bad value is a one-line error."""
    if value is None:
        return None
    try:
        return int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise ConfigError(f"{flag}: expected an integer, got {value!r}") from None


def _params_config(args: argparse.Namespace):
    """The GPTConfig `tinygpt params` describes: a preset, a run folder's config.json, or defaults, then flags."""
    import json
    from pathlib import Path

    from ..checkpoint import CONFIG, is_hf_config
    from ..config import GPTConfig

    if args.preset and args.run:
        raise ConfigError("give --preset or a RUN folder, not both")
    if args.run:
        path = Path(args.run)
        if path.is_dir():
            path = path / CONFIG
            if not path.is_file():
                raise ConfigError(f"{args.run}: no {CONFIG} in this folder (is it a tinygpt run?)")
        elif not path.is_file():
            raise ConfigError(f"{args.run}: no such run folder or {CONFIG} file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if is_hf_config(data):  # a Hugging Face GPT-2 folder
            from ..interop.hf_gpt2 import config_from_hf

            base, name = config_from_hf(data, str(args.run)).to_dict(), str(args.run)
        else:
            base, name = GPTConfig.from_dict(data).to_dict(), str(args.run)
    elif args.preset:
        base, name = GPTConfig.from_preset(args.preset).to_dict(), args.preset
    else:
        base, name = GPTConfig().to_dict(), None
    overrides = {
        field: _int_flag(getattr(args, field), "--" + field.replace("_", "-"))
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
    }
    overrides.update(bias=args.bias, tie_weights=args.tie)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name is None:
        name = "custom" if overrides else "GPTConfig defaults (gpt2)"
    elif overrides:
        name += " (modified)"
    return GPTConfig(**{**base, **overrides}), name


def _params_method(args: argparse.Namespace) -> dict:
    """The training method `tinygpt params` sizes: LoRA from any --lora-* flag, freezing from --freeze-*."""
    from ..config import LoraConfig

    lora = None
    if args.lora_rank is not None or args.lora_alpha is not None or args.lora_targets is not None:
        given = {"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": args.lora_targets}
        lora = LoraConfig(**{k: v for k, v in given.items() if v is not None})
    return dict(lora=lora, freeze_embeddings=args.freeze_embeddings, freeze_layers=args.freeze_layers or 0)


def cmd_params(args: argparse.Namespace) -> int:
    """Count a model's parameters, FLOPs per token and memory, from its architecture alone.

    Args (flags):
        --preset NAME | RUN: the model (a preset, or a run folder holding config.json); model flags
            override either. Without both, GPTConfig's defaults (GPT-2 small) with the flags.
        --batch-size, --seq-len: the batch the KV cache and the training activations are sized for.
        --dtype: compute dtype of activations, KV cache and inference weights.
        --lora-rank R, --lora-alpha A, --lora-targets LIST: trainable parameters and training memory
            for LoRA (any of the three turns it on; defaults rank 8, alpha 8, c_attn).
        --freeze-layers N, --freeze-embeddings: the same for full training with the first N blocks
            and/or the embeddings frozen.
        --family: the GPT-2 family table instead of one model.
        --json: one JSON object (last line); for one model its "total" is the parameter count.
    """
    import json

    from ..calc import report

    batch_size = _int_flag(args.batch_size, "--batch-size")
    seq_len = _int_flag(args.seq_len, "--seq-len")
    method = _params_method(args)
    if args.family:
        model_flags = [args.preset, args.run, args.n_layer, args.n_head, args.n_embd, args.vocab_size,
                       args.block_size, args.bias, args.tie, batch_size, seq_len, method["lora"],
                       args.freeze_layers, args.freeze_embeddings or None]
        if any(v is not None for v in model_flags):
            raise ConfigError("--family describes the four GPT-2 sizes: it takes no model, batch or method flags")
        rows = report.family_report(args.dtype)
        print(json.dumps({"family": rows}) if args.json else report.render_family(rows, args.dtype))
        return 0
    config, name = _params_config(args)
    result = report.model_report(
        config, name=name, batch_size=1 if batch_size is None else batch_size, seq_len=seq_len, dtype=args.dtype,
        **method,
    )
    print(json.dumps(result) if args.json else report.render_model_report(result))
    return 0


def cmd_chinchilla(args: argparse.Namespace) -> int:
    """Plan a compute-optimal run: C = 6·N·D with D = 20·N, and the loss Hoffmann et al.'s fit predicts.

    Args (flags):
        --flops C | --params N | --tokens D: the budget (numbers like 5.76e23, 70B, 1.4T). Two or
            three may be given only if they agree.
        --time T: measure this machine's training FLOP/s with a few real steps and plan for T
            (90s, 10m, 1h30m).
        --tokens-per-param R: the D / N ratio (default 20).
        --dtype, --device: how --time measures (float32 or bfloat16 autocast; cpu or cuda).
        --json: one JSON object (last line) with params, tokens, flops, loss.
    """
    import json

    from ..calc import compute_optimal, format_count, parse_count, report
    from ..config import parse_duration

    budgets = {flag: getattr(args, flag) for flag in ("flops", "params", "tokens")}
    given = {flag: parse_count(v, "--" + flag) for flag, v in budgets.items() if v is not None}
    ratio = parse_count(args.tokens_per_param, "--tokens-per-param")
    if args.time is not None and given:
        raise ConfigError("--time measures the compute budget: give it alone, without --flops/--params/--tokens")
    if args.time is None and (args.dtype is not None or args.device is not None):
        raise ConfigError("--dtype and --device choose how --time measures: use them with --time")
    if args.time is None and not given:
        raise ConfigError("give a budget: --flops C, --params N, --tokens D or --time T (e.g. --flops 5.76e23)")
    measured = None
    if args.time is not None:
        from ..lab.throughput import measure_training_throughput

        seconds = parse_duration(args.time, "--time")
        measured = measure_training_throughput(dtype=args.dtype or "float32", device=args.device)
        given = {"flops": measured.flops_per_second * seconds}
        source = f"--time {args.time} on this machine"
    else:
        source = ", ".join(f"--{flag} {args_value}" for flag, args_value in budgets.items() if args_value is not None)
    plan = compute_optimal(**given, tokens_per_param=ratio)
    if args.json:
        out = plan.to_dict()
        if measured is not None:
            out.update(seconds=seconds, measured=measured.to_dict())
        print(json.dumps(out))
        return 0
    if measured is not None:
        c = measured.config
        print(
            f"Measured: {measured.steps} training steps (forward, backward, AdamW) of a {c.n_layer}-layer, "
            f"{c.n_embd}-wide GPT ({format_count(measured.params)} parameters),\n"
            f"  batch {measured.batch_size} x {measured.seq_len} random tokens, {measured.dtype} on {measured.device}: "
            f"{measured.flops_per_second / 1e9:.1f} GFLOP/s, {measured.tokens_per_second:,.0f} tokens/s, "
            f"{measured.step_seconds * 1000:.0f} ms a step\n"
            f"Budget: {args.time} = {seconds:,.0f} s x {measured.flops_per_second / 1e9:.1f} GFLOP/s = "
            f"{plan.flops:.3g} FLOP (measured speed; the rest below is arithmetic)\n"
        )
    print(report.render_plan(plan, source))
    return 0


def _counts(values: list[str] | None, flag: str) -> list[float] | None:
    """Numbers given as separate words or comma lists ("1e12 3e12" or "1e12,3e12"), each checked."""
    from ..calc import parse_count

    if values is None:
        return None
    return [parse_count(v, flag) for value in values for v in value.split(",") if v.strip()]


def cmd_sweep(args: argparse.Namespace) -> int:
    """Train a grid of models (IsoFLOP: several sizes per compute budget), fit the scaling laws, plot them.

    For each budget C (training FLOPs) and model size N the model trains for C / (FLOPs per token)
    tokens. Results go to --out: results.json and .csv (final val loss against parameters, tokens
    and FLOPs), fit.json (the compute-optimal frontier N_opt ∝ C^a, D_opt ∝ C^b and the parametric
    loss L = E + A/N^alpha + B/D^beta), PNG plots, and runs/ (each model's run folder). Rerunning
    the same command trains only the points not finished yet.

    Args (flags):
        --budgets C [C ...]: compute budgets (1e12, 3e12 ... or 1e12,3e12); or --quick.
        --sizes N [N ...]: model sizes to train at every budget (default: --points sizes --spread
            apart around --centre x Chinchilla's N for each budget).
        --quick: a small grid that finishes in under 20 minutes on a 2-core laptop CPU.
        --batch-size, --block-size, --lr, --eval-iters, --seed, --device, --dtype: how every model trains.
        --threads N: CPU threads for training (default 1).
    """
    import json

    from ..lab import sweep

    budgets = _counts(args.budgets, "--budgets")
    sizes = _counts(args.sizes, "--sizes")
    points = _int_flag(args.points, "--points")
    spread = None if args.spread is None else _counts([args.spread], "--spread")[0]
    centre = None if args.centre is None else _counts([args.centre], "--centre")[0]
    if args.quick:
        given = [flag for flag, v in (("--budgets", budgets), ("--sizes", sizes), ("--points", points),
                                      ("--spread", spread), ("--centre", centre)) if v is not None]
        if given:
            raise ConfigError(f"--quick chooses the grid itself: drop {', '.join(given)} or --quick")
        budgets, points, centre = list(sweep.QUICK_BUDGETS), sweep.QUICK_POINTS, sweep.QUICK_CENTRE
    elif budgets is None:
        raise ConfigError("give the compute budgets: --budgets 1e12 3e12 1e13 (training FLOPs), or --quick")
    if sizes is not None and (points is not None or spread is not None or centre is not None):
        raise ConfigError("--points, --spread and --centre place sizes around Chinchilla's N: "
                          "give them or --sizes, not both")
    defaults = sweep.SweepSettings()
    flags = {"batch_size": _int_flag(args.batch_size, "--batch-size"),
             "block_size": _int_flag(args.block_size, "--block-size"),
             "eval_iters": _int_flag(args.eval_iters, "--eval-iters"), "seed": _int_flag(args.seed, "--seed"),
             "lr": None if args.lr is None else _counts([args.lr], "--lr")[0], "device": args.device,
             "dtype": args.dtype}
    settings = sweep.SweepSettings(**{**defaults.to_dict(), **{k: v for k, v in flags.items() if v is not None}})

    def report(i: int, n: int, record: dict, new: bool) -> None:
        from ..calc import format_count

        head = (f"[{i + 1}/{n}] C={record['budget']:.3g}  N={format_count(record['params'])} "
                f"({record['n_layer']}x{record['n_embd']})  D={format_count(record['tokens'])}, {record['steps']:,} steps")
        outcome = "diverged (left out of the fit)" if record["val_loss"] is None else f"val loss {record['val_loss']:.4f}"
        when = f"{record['seconds']:.0f}s" if new else "done before"
        print(f"{head}: {outcome}  ({when})", flush=True)

    result = sweep.run_sweep(
        args.data, args.out, budgets, sizes=sizes, points=5 if points is None else points,
        spread=2.0 if spread is None else spread, centre=1.0 if centre is None else centre, settings=settings,
        progress=not args.quiet, on_point=report, plots=not args.no_plots,
        threads=_int_flag(args.threads, "--threads"),
    )
    for line in result.skipped:
        print(f"skipped {line}")
    done = len(result.points)
    if result.interrupted:
        print(f"interrupted: {done} grid points done; run the same command again to continue", file=sys.stderr)
        return 130
    minutes = result.seconds / 60
    print(f"\n{done} models ({result.trained} trained now, {minutes:.1f} min) in {result.out}; "
          f"results.json, results.csv, fit.json" + "".join(f", {p.name}" for p in result.plots))
    for line in sweep.summary_lines(result.fit):
        print(line)
    if args.json:
        print(json.dumps(result.fit))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Turn text into token files for training: train.bin, val.bin, tokenizer.json and meta.json.

    SOURCE is a text file, a folder (every text file below it, binary files skipped), or a
    built-in corpus: python-stdlib (this Python's standard library sources) or shakespeare
    (downloaded once). Files are read as UTF-8; line endings are kept as they are. Without --out
    the folder is data/NAME after the first source: data/python-stdlib, data/shakespeare, data/notes.
    """
    import time

    from ..data import prepare

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
        )
    finally:
        close()
    files = sum(s["files"] for s in meta["sources"])
    size = sum(s["bytes"] for s in meta["sources"])
    names = ", ".join(s["name"] for s in meta["sources"])
    seconds = time.perf_counter() - start
    plural = "s" if files != 1 else ""
    print(f"prepared {out} in {seconds:.1f}s from {names} ({files:,} file{plural}, {size / 1e6:.1f} MB)")
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
    if skipped:
        print(f"  skipped {skipped:,} files (binary, or not decodable as Python source)")
    if meta["errors"] == "replace":
        print(f"  replaced {meta['replacements']:,} invalid byte sequences with U+FFFD")
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


def _add_quantize_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=("int8", "bf16"),
                   help="run with low-precision weights: int8 (weight-only, per-channel scales) or bf16")


def build_parser() -> argparse.ArgumentParser:
    from ..tokenizer import BPE_MAX_VOCAB, BPE_MIN_VOCAB

    # every numeric flag's range is here, in its type (Number); every --device is checked by _device
    positive, natural, seed = Number("int", 1), Number("int", 0), _seed()
    rate, fraction = Number("float", 0, low_open=True), Number("float", 0, 1, high_open=True)
    parser = _Parser(prog="tinygpt", description="Build, train, inspect and serve small GPTs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("lesson", help="a guided tour of the lesson's worked examples", description=cmd_lesson.__doc__)
    p.set_defaults(func=cmd_lesson)

    p = sub.add_parser("train", help="train a GPT on a prepared data folder", description=cmd_train.__doc__)
    p.add_argument("--data", required=True, help="a folder written by `tinygpt prepare`")
    p.add_argument("--out", required=True, help="the run folder to create (or continue with --resume)")
    p.add_argument("--preset", help="start from a preset: lesson, stretch, baby, gpt2, ...")
    p.add_argument("--config", help="a TOML file with any of the settings below (flags override it)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--sweep", metavar="DIR",
                   help="with --max-time and no size flags: size the model by this `tinygpt sweep` folder's fit "
                        "(default: Chinchilla's rule)")
    m = p.add_argument_group("model (default: sized for --max-time on this machine, else for the data)")
    m.add_argument("--n-layer", type=positive)
    m.add_argument("--n-head", type=positive)
    m.add_argument("--n-embd", type=positive)
    m.add_argument("--block-size", type=positive)
    m.add_argument("--dropout", type=fraction)
    m.add_argument("--vocab-size", type=positive, help="default: the data's vocabulary")
    m.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None)
    m.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=None)
    m.add_argument("--activation", choices=["gelu", "gelu_tanh"])
    m.add_argument("--init", choices=["gpt2", "torch"])
    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=positive, help="sequences per micro-step, per process (12)")
    t.add_argument("--grad-accum", type=positive, help="micro-steps per optimizer step (1)")
    t.add_argument("--lr", type=rate,
                   help="peak learning rate (1e-3; a model sized for --max-time gets one for its width)")
    t.add_argument("--min-lr", type=Number("float", 0), help="end of the cosine decay (lr/10)")
    t.add_argument("--warmup", type=natural, help="linear warmup steps (100)")
    t.add_argument("--max-iters", type=positive, help="optimizer steps (2000 unless --max-time is given)")
    t.add_argument("--max-time", type=Number("duration", keep_text=True), help="wall-clock budget, e.g. 90s, 5m, 1h")
    t.add_argument("--weight-decay", type=Number("float", 0), help="AdamW weight decay on matrices (0.1)")
    t.add_argument("--beta1", type=fraction)
    t.add_argument("--beta2", type=fraction)
    t.add_argument("--grad-clip", type=Number("float", 0), help="max gradient norm, 0 = off (1.0)")
    t.add_argument("--eval-interval", type=positive, help="steps between evaluations and checkpoints (250)")
    t.add_argument("--eval-iters", type=positive, help="batches per evaluation (20)")
    t.add_argument("--seed", type=seed, help="initialization, dropout and batch order (1337)")
    t.add_argument("--device", type=_device, help="auto, cpu, cuda, cuda:N, mps")
    t.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: bfloat16 autocast where the hardware multiplies it natively, "
                        "CUDA GPUs and CPUs with AVX-512 BF16 or AMX; else float32)")
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    t.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP")
    t.add_argument("--dist-timeout", metavar="T", type=Number("duration", keep_text=True),
                   help="under torchrun: how long a process waits for the others before the job fails (10m)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate text from a run", description=cmd_sample.__doc__)
    p.add_argument("run", help="a run folder or a Hugging Face GPT-2 folder")
    p.add_argument("--prompt", default="", help="text to continue (default: start of text)")
    p.add_argument("--max-new-tokens", type=natural, default=200)
    p.add_argument("--temperature", type=Number("float", 0), default=0.8)
    p.add_argument("--top-k", type=positive)
    p.add_argument("--top-p", type=Number("float", 0, 1, low_open=True))
    p.add_argument("--repetition-penalty", type=rate, default=1.0)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=seed, help="makes sampling reproducible")
    p.add_argument("--num-samples", type=positive, default=1)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when TEXT is generated (repeatable)")
    p.add_argument("--trace", action="store_true",
                   help="show every step: the context, the top candidates after sampling settings, the choice")
    p.add_argument("--trace-top", type=positive, metavar="N", help="candidates shown per step (5); implies --trace")
    p.add_argument("--device", type=_device, default="auto")
    _add_quantize_flag(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load NaN or infinite weights (refused by default), to inspect a diverged run")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("attention", help="draw attention maps for a prompt", description=cmd_attention.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder")
    p.add_argument("--prompt", required=True, help="the text whose attention to draw (at most block_size tokens)")
    p.add_argument("--layer", type=natural, default=0, help="the block, from 0 (0)")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--head", type=natural, help="the head, from 0 (0)")
    heads.add_argument("--all-heads", action="store_true", help="every head of the layer, in a grid")
    p.add_argument("--out", required=True, metavar="FILE", help="the picture to write (.png, .svg, .pdf)")
    p.add_argument("--device", type=_device, default="auto")
    p.set_defaults(func=cmd_attention)

    p = sub.add_parser("plot", help="loss curves of one or more runs", description=cmd_plot.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or their metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE", help="the picture to write (.png, .svg, .pdf)")
    p.add_argument("--title", help="a title over the plot")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("fewshot", help="few-shot accuracy for 0, 1, 2, ... worked examples",
                       description=cmd_fewshot.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder")
    p.add_argument("--task", required=True, metavar="FILE|synthetic", help="a task file (JSON Lines) or synthetic")
    p.add_argument("--shots", default="0,1,2,3", help="numbers of worked examples, e.g. 0,1,2,3 or 0-5 (0,1,2,3)")
    p.add_argument("--scoring", choices=("generate", "likelihood"), default="generate",
                   help="greedy answer, exact match (default), or the most likely candidate answer")
    p.add_argument("--queries", type=positive, metavar="N", help="evaluate the first N examples (default: all)")
    p.add_argument("--seed", type=seed, default=0, help="the draw of worked examples and of the synthetic task (0)")
    p.add_argument("--show-prompt", action="store_true", help="print the first query's prompt for each k")
    p.add_argument("--plot", metavar="FILE", help="draw accuracy against k (.png, .svg, .pdf)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", type=_device, default="auto")
    p.set_defaults(func=cmd_fewshot)

    p = sub.add_parser("fewshot-data", help="write the synthetic in-context-learning task's data",
                       description=cmd_fewshot_data.__doc__)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for train.txt and task.jsonl")
    p.add_argument("--episodes", type=positive, default=40000, help="training episodes, each a fresh mapping (40000)")
    p.add_argument("--seed", type=seed, default=0, help="the draw of the episodes and of task.jsonl (0)")
    p.set_defaults(func=cmd_fewshot_data)

    p = sub.add_parser("eval", help="loss, perplexity and bits per char/byte", description=cmd_eval.__doc__)
    p.add_argument("run", help="a run folder or a Hugging Face GPT-2 folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="a prepared data folder: its val split (default: the run's own data)")
    src.add_argument("--text", help="any UTF-8 text file")
    p.add_argument("--batch-size", type=positive, default=8)
    p.add_argument("--max-tokens", type=Number("int", 2), help="evaluate only the first N tokens (a quicker estimate)")
    p.add_argument("--unknown", choices=("refuse", "skip"), default="refuse",
                   help="--text characters a char vocabulary lacks: refuse the file (default), or skip them "
                        "and score each run of known text between them on its own")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--device", type=_device, default="auto")
    _add_quantize_flag(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load NaN or infinite weights (refused by default), to inspect a diverged run")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "params", help="parameters, FLOPs and memory of a model, from its config",
        description=cmd_params.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt params --preset gpt2\n  tinygpt params RUN --batch-size 32 --dtype bfloat16\n"
               "  tinygpt params --n-layer 6 --n-head 6 --n-embd 384 --vocab-size 65 --block-size 256 --json\n"
               "  tinygpt params --preset gpt2 --batch-size 4 --seq-len 256 --lora-rank 8 --lora-targets attn,mlp\n"
               "  tinygpt params --preset gpt2 --freeze-layers 10 --freeze-embeddings\n"
               "  tinygpt params --family",
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="a run folder holding config.json (or the file itself)")
    p.add_argument("--preset", help="a preset name: lesson, stretch, baby, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--vocab-size", "--block-size"):
        p.add_argument(flag, metavar="N", type=Number("int", 1, grouped=True, keep_text=True),
                       help="override the architecture")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None, help="biases in Linear and LayerNorm")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to wte")
    p.add_argument("--batch-size", metavar="B", type=Number("int", 1, grouped=True, keep_text=True),
                   help="sequences per batch for memory figures (default 1)")
    p.add_argument("--seq-len", metavar="T", type=Number("int", 1, grouped=True, keep_text=True),
                   help="training sequence length (default block_size)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype (default float32)")
    f = p.add_argument_group("fine-tuning method (trainable parameters and training memory; default: full)")
    f.add_argument("--lora-rank", metavar="R", type=Number("int", 1), help="LoRA adapters of rank R (8)")
    f.add_argument("--lora-alpha", metavar="A", type=Number("float", 0, low_open=True), help="LoRA's scale is alpha / rank (alpha 8)")
    f.add_argument("--lora-targets", metavar="LIST",
                   help="projections to adapt: c_attn, attn.c_proj, c_fc, mlp.c_proj, attn, mlp (c_attn)")
    f.add_argument("--freeze-layers", metavar="N", type=Number("int", 0), help="full training with the first N blocks frozen")
    f.add_argument("--freeze-embeddings", action="store_true", help="full training with wte and wpe frozen")
    p.add_argument("--family", action="store_true", help="print the GPT-2 family table")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)

    p = sub.add_parser(
        "chinchilla", help="compute-optimal model and data size for a budget",
        description=cmd_chinchilla.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt chinchilla --flops 5.76e23\n  tinygpt chinchilla --params 70B --json\n"
               "  tinygpt chinchilla --time 10m",
    )
    count = Number("count", keep_text=True)
    p.add_argument("--flops", metavar="C", type=count, help="training compute in FLOPs (e.g. 5.76e23)")
    p.add_argument("--params", metavar="N", type=count, help="model parameters (e.g. 70B)")
    p.add_argument("--tokens", metavar="D", type=count, help="training tokens (e.g. 1.4T)")
    p.add_argument("--time", metavar="T", type=Number("duration", keep_text=True),
                   help="a training time on this machine (90s, 10m, 1h30m); measures FLOP/s")
    p.add_argument("--tokens-per-param", metavar="R", type=count, default="20", help="the D / N ratio (default 20)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --time: measure in this dtype")
    p.add_argument("--device", type=_device, choices=("cpu", "cuda"), help="with --time: measure on this device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_chinchilla)

    p = sub.add_parser(
        "sweep", help="train an IsoFLOP grid of models and fit the scaling laws",
        description=cmd_sweep.__doc__.split("\n\n")[0] + "\n\n" + cmd_sweep.__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt sweep --data data/stdlib --out sweeps/quick --quick\n"
               "  tinygpt sweep --data data/stdlib --out sweeps/mine --budgets 1e12 3e12 1e13 --points 5\n"
               "  tinygpt sweep --data data/stdlib --out sweeps/fixed --budgets 1e12,1e13 --sizes 50K,100K,200K,400K",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="a folder written by `tinygpt prepare`")
    p.add_argument("--out", required=True, metavar="DIR", help="the sweep folder (rerun to continue it)")
    counts = Number("count", items=True, keep_text=True)  # 1e12 3e12, or 1e12,3e12
    grouped = Number("int", 1, grouped=True, keep_text=True)
    p.add_argument("--budgets", nargs="+", metavar="C", type=counts,
                   help="compute budgets in training FLOPs (e.g. 1e12 1e13)")
    p.add_argument("--sizes", nargs="+", metavar="N", type=counts, help="model sizes for every budget (e.g. 50K 200K 1M)")
    p.add_argument("--points", metavar="K", type=grouped, help="sizes per budget around Chinchilla's N (default 5)")
    p.add_argument("--spread", metavar="F", type=Number("float", 1, low_open=True, keep_text=True),
                   help="ratio between neighbouring default sizes (default 2)")
    p.add_argument("--centre", metavar="F", type=Number("float", 0, low_open=True, keep_text=True),
                   help="default sizes centre on F x Chinchilla's N (default 1)")
    p.add_argument("--quick", action="store_true", help="the small built-in grid (< 20 minutes on a laptop CPU)")
    p.add_argument("--batch-size", metavar="B", type=grouped, help="sequences per step for every model (16)")
    p.add_argument("--block-size", metavar="T", type=grouped, help="context of every model (128)")
    p.add_argument("--lr", metavar="LR", type=Number("float", 0, low_open=True, keep_text=True),
                   help="peak learning rate for every model (2e-3)")
    p.add_argument("--eval-iters", metavar="K", type=grouped, help="val batches behind each final loss (20)")
    p.add_argument("--seed", metavar="S", type=Number("int", 0, seed.high, grouped=True, keep_text=True),
                   help="initialization and batch order (1337)")
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", metavar="N", type=grouped, default="1",
                   help="CPU threads for training (1: small models, and steady on a busy machine)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib: the viz extra)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="end with fit.json's content on one line")
    p.set_defaults(func=cmd_sweep)
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
        "--errors", choices=("strict", "replace"), default="strict", help="invalid UTF-8: stop (default) or put U+FFFD"
    )
    p.add_argument(
        "--tokenizer-file",
        metavar="PATH",
        help="GPT-2's vocab.json + merges.txt or .tiktoken file, or a tinygpt tokenizer.json / data folder to reuse",
    )
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "export", help="write a run as a Hugging Face GPT-2 folder or a GGUF file",
        description=cmd_export.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt export runs/mine --format hf --out hf/mine\n"
               "  tinygpt export runs/mine --format gguf --out mine.gguf",
    )
    p.add_argument("run", metavar="RUN", help="a run folder (or a Hugging Face GPT-2 folder)")
    p.add_argument("--format", required=True, choices=("hf", "gguf"), help="hf (a folder) or gguf (a file)")
    p.add_argument("--out", required=True, metavar="PATH", help="the folder (hf) or .gguf file (gguf) to write")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                   help="gguf only: the matrices' dtype (norms and biases stay float32)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="turn a Hugging Face GPT-2 folder into a run", description=cmd_import.__doc__)
    p.add_argument("dir", metavar="DIR", help="a Hugging Face GPT-2 folder (config.json + model.safetensors)")
    p.add_argument("--out", required=True, metavar="RUN", help="the run folder to create")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("merge", help="fold an adapter run's LoRA adapters into a plain run",
                       description=cmd_merge.__doc__.split("\n\n")[0],
                       epilog="example:\n  tinygpt merge runs/lora --out runs/merged",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="an adapter run (it names its base model)")
    p.add_argument("--out", required=True, metavar="MERGED", help="the plain run folder to create")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser(
        "serve", help="serve a run over an OpenAI-compatible HTTP API with a playground",
        description=cmd_serve.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prompts longer than the model's context are cut to their last block_size tokens\n"
               "(usage.prompt_tokens_truncated says how many were dropped). SIGTERM drains: new\n"
               "requests get 503, running ones finish, then the server exits.\n\n"
               "examples:\n  tinygpt serve runs/stdlib\n"
               "  tinygpt serve runs/stdlib --host 0.0.0.0 --port 8080 --api-key KEY --cors-origin https://my.app",
    )
    p.add_argument("run", metavar="RUN", help="a run folder (or a Hugging Face GPT-2 folder)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=Number("int", 0, 65535), default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY", help="require this bearer key on /v1 routes (default $TINYGPT_API_KEY)")
    p.add_argument("--max-concurrency", type=positive, default=8, metavar="N", help="sequences decoded together (8)")
    p.add_argument("--max-queue", type=natural, default=32, metavar="N", help="sequences waiting for a slot (32)")
    p.add_argument("--max-tokens", type=positive, default=2048, metavar="N", help="largest max_tokens per request (2048)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN", help="allow browser calls from ORIGIN")
    p.add_argument("--allow-host", action="append", metavar="NAME",
                   help="also answer Host: NAME (repeatable; bound to loopback, only localhost and loopback addresses "
                        "are answered otherwise)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients use (default: RUN's folder name)")
    p.add_argument("--threads", type=positive, metavar="N", help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda, cuda:N, mps")
    _add_quantize_flag(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="training and generation speed against transformers, in one run",
                       description=cmd_bench.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a shorter run (under two minutes)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--only", action="append", choices=("limits", "train", "generate"), help="measure only this")
    p.add_argument("--no-peers", action="store_true", help="skip transformers")
    p.set_defaults(func=cmd_bench)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        print(f"tinygpt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return args.func(args) or 0
    except (TinyGPTError, ValueError, OSError) as e:
        rank = os.environ.get("RANK", "0")  # under torchrun every process may report
        print(f"tinygpt: error: {'' if rank == '0' else f'[rank {rank}] '}{e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
