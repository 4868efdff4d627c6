"""Looking inside models and data: `tinygpt lesson`, `attention`, `plot` (loss curves), `inspect heads` (induction
and previous-token heads), `inspect data` (a data folder's shards, documents and tokens), `emergence` (the lab
that watches heads form), `fewshot` and `fewshot-data`."""

from __future__ import annotations

import argparse
import sys

from ..calc.units import plural
from ..errors import ConfigError
from .common import (NATURAL, POSITIVE, RATE, Number, add_device_flag, json_line, load_model, seed_type,
                     utf8_flag)

HISTOGRAM_WIDTH = 40  # characters of the longest bar of `inspect data`'s histogram


def cmd_lesson(args: argparse.Namespace) -> int:
    """Walk through the lesson's worked examples with tinygpt's own objects."""
    from ..lab import lesson

    for text in lesson.tour():
        print(text)
    return 0


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
    utf8_flag(args.prompt, "--prompt")
    viz.check_picture(args.out)
    model, tokenizer = load_model(args.run, args.device)
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
        print(f"{m.name}: {plural(steps, 'step')}{last}")
    print(f"wrote {args.out}")
    return 0


def cmd_inspect_heads(args: argparse.Namespace) -> int:
    """Score every head of a run as an induction head and as a previous-token head.

    The probe is tinygpt.lab.probes': sequences of distinct random tokens repeated once. A head's
    induction score is its mean attention, from the second copy, on the token after the query token's
    earlier occurrence; its previous-token score, its mean attention on the token before the query.

    Args (flags):
        heads RUN: a run folder. --period N: the repeat's length (half the context). --sequences N:
        repeated sequences (32). --seed S: their draw. --threshold X (0.4): the score a head needs to
        be named. --out FILE: a heatmap of both scores. --json: end with one JSON line.
    """
    import shlex

    from ..lab import probes

    if args.out:
        from ..lab.viz import check_picture

        check_picture(args.out)
    model, tokenizer = load_model(args.run, args.device)
    cfg = model.config
    result, tokens = probes.probe_heads(model, tokenizer.vocab_size, args.period, sequences=args.sequences,
                                        seed=args.seed)
    period = result["period"]
    print(f"{args.run}: {cfg.n_layer} layers x {cfg.n_head} heads, on {args.sequences} sequences of {period} distinct "
          f"random tokens repeated once")
    print(f"{'layer':>5} {'head':>4}  {'induction':>9}  {'previous token':>14}")
    named = []
    for layer, (ind_row, prev_row) in enumerate(zip(result["induction"], result["previous_token"])):
        for head, (ind, prev) in enumerate(zip(ind_row, prev_row)):
            kinds = [k for k, v in (("induction head", ind), ("previous-token head", prev)) if v >= args.threshold]
            print(f"{layer:>5} {head:>4}  {ind:9.3f}  {prev:14.3f}  {', '.join(kinds)}")
            named += [(layer, head, k) for k in kinds]
    print(f"second copy: loss {result['second_copy_loss']:.3f}, accuracy {100 * result['second_copy_accuracy']:.1f}%")
    if not named:
        print(f"no head scores {args.threshold} or more")
    prompt = tokenizer.decode(tokens[0].tolist())
    for layer, head, kind in named:
        out = shlex.quote(f"{kind.split()[0]}-L{layer}H{head}.png")
        print(f"{kind} at layer {layer}, head {head}: tinygpt attention {shlex.quote(args.run)} "
              f"--prompt {shlex.quote(prompt)} --layer {layer} --head {head} --out {out}")
    if args.out:
        from ..lab import viz

        viz.plot_head_scores(result["induction"], result["previous_token"], args.out,
                             title=f"{args.run}: heads on repeated random sequences (period {period})")
        print(f"wrote {args.out}")
    if args.json:
        print(json_line({"run": args.run, **result,
                         "heads": [{"layer": la, "head": h, "kind": k} for la, h, k in named]}))
    return 0


def cmd_inspect_data(args: argparse.Namespace) -> int:
    """What a data folder holds: each split's files (train.bin and val.bin, or its shards) with their
    tokens and documents, a histogram of the documents' lengths in tokens, and the first tokens decoded.

    Documents are what the end-of-text token separates; a chat folder's are its conversations (and
    the tokens the loss mask trains on are counted). Every file is read a chunk at a time, so a folder
    of any size fits in memory, and checked against meta.json: each shard's size, sha256 and
    documents, the ids inside the vocabulary.

    Args (flags):
        data DIR: a data folder. --tokens N: decode the first N tokens (32). --out FILE: a bar chart of
        the document lengths (.png, .svg or .pdf). --json: end with one JSON line.
    """
    import json

    from ..data.inspect import file_rows, inspect_data, length_label

    if args.out:
        from ..lab.viz import check_picture

        check_picture(args.out)
    info = inspect_data(args.data, first_tokens=args.tokens)
    chat = info["content"] == "chat"
    what = "conversations" if chat else "documents"
    lengths = info["lengths"]
    if args.out and not (lengths and lengths["documents"]):
        raise ConfigError(f"--out: {args.data} has no {what[:-1]} lengths to draw "
                          + ("(no separator between its documents)" if lengths is None else f"(no {what})"))
    eot = (f"documents separated by token {info['eot_id']} {json.dumps(info['eot_token'], ensure_ascii=False)}"
           if info["eot_id"] is not None else "a conversation a document" if chat
           else "no separator between documents: their lengths are unknown")
    print(f"{info['path']}: {'chat' if chat else 'text'}, {info['tokenizer']} tokenizer (vocab "
          f"{info['vocab_size']:,}, {info['dtype']}); {eot}")

    def count(n: int | None) -> str:
        return "-" if n is None else f"{n:,}"

    rows = file_rows(info)
    width = max(len("file"), *(len(r[1]) for r in rows))
    print(f"{'split':<5}  {'file':<{width}}  {'tokens':>14}  {what:>13}")
    for split, name, tokens, docs in rows:
        print(f"{split:<5}  {name:<{width}}  {tokens:>14,}  {count(docs):>13}")
    if chat:
        print("trained tokens (the assistant's): " + ", ".join(
            f"{s['trained_tokens']:,} {split}" for split, s in info["splits"].items()))
    if lengths is not None and lengths["documents"]:
        print(f"{what[:-1]} lengths in tokens: {plural(lengths['documents'], what[:-1])}, min {lengths['min']:,}, "
              f"mean {lengths['mean']:,.1f}, max {lengths['max']:,}")
        labels = [length_label(b["low"], b["high"]) for b in lengths["bins"]]
        top = max(b["documents"] for b in lengths["bins"])
        column = max(len("tokens"), *map(len, labels))
        print(f"  {'tokens':>{column}}  {what:>13}")
        for label, b in zip(labels, lengths["bins"]):
            bar = "#" * round(HISTOGRAM_WIDTH * b["documents"] / top)
            print(f"  {label:>{column}}  {b['documents']:>13,}  {bar}".rstrip())
    first = info["first"]
    print(f"first {plural(len(first['ids']), 'token')} of {first['split']}: {' '.join(map(str, first['ids']))}")
    print(f"  {json.dumps(first['text'], ensure_ascii=False)}")
    if chat:
        print(f"  trained: {json.dumps(first['trained_text'], ensure_ascii=False)}")
    if args.out:
        from ..lab import viz

        viz.plot_lengths(lengths["bins"], args.out, what=what,
                         title=f"{info['path']}: {what[:-1]} lengths")
        print(f"wrote {args.out}")
    if args.json:
        print(json_line(info))
    return 0


def cmd_emergence(args: argparse.Namespace) -> int:
    """Watch induction heads, and in-context copying with them, form while a model trains.

    Writes data where each row repeats one segment of distinct random tokens (a fresh segment and
    length each row), trains a model of each --layers count on it (2 layers and a 1-layer control by
    default) with probes every --probe-interval steps, and writes OUT/emergence.json (the curves and
    the phase change: the first step where the best induction score reaches 0.5) and
    OUT/emergence.png. The runs are ordinary run folders, OUT/L1 and OUT/L2.

    Args (flags):
        --out DIR: a new (or empty) folder. --vocab-size, --context, --period MIN-MAX: the data.
        --steps, --probe-interval, --layers 1,2, --seed: the runs. The model and optimizer flags
        default to the lesson's settings (PyTorch's init, an untied head). --json: end with one JSON line.
    """
    from ..lab import emergence
    from ..train import ProgressBar

    fields = ("vocab_size", "context", "steps", "probe_interval", "seed", "n_head", "n_embd", "init", "tie_weights",
              "activation", "batch_size", "lr", "warmup", "weight_decay", "device")
    given = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    if args.period is not None:
        given["period"] = emergence.parse_period(args.period)
    if args.layers is not None:
        given["layers"] = emergence.parse_layers(args.layers)
    settings = emergence.EmergenceSettings(**given)
    bars = (lambda n: ()) if args.quiet else (lambda n: (ProgressBar(),))
    summary = emergence.run_emergence(args.out, settings, callbacks=bars, plot=not args.no_plot)
    print(f"{'layers':>6}  {'induction':>9}  {'prev. token':>11}  {'copy accuracy':>13}  {'phase change':>12}  "
          f"{'time':>6}")
    for r in summary["runs"]:
        change = f"step {r['phase_change_step']}" if r["phase_change_step"] is not None else "none"
        print(f"{r['n_layer']:>6}  {r['induction_score'][-1]:9.3f}  {r['previous_token_score'][-1]:11.3f}  "
              f"{100 * r['second_copy_accuracy'][-1]:12.1f}%  {change:>12}  {r['seconds']:5.1f}s")
    print(f"wrote {args.out}/{emergence.SUMMARY}" + ("" if args.no_plot else f" and {args.out}/{emergence.FIGURE}"))
    if args.json:
        print(json_line(summary))
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

    from ..lab import fewshot

    shots = fewshot.parse_shots(args.shots)
    task = fewshot.load_task(args.task, seed=args.seed)
    if args.plot:
        from ..lab.viz import check_picture

        check_picture(args.plot)  # before the evaluation, not after it
    model, tokenizer = load_model(args.run, args.device)
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
        note = f"  ({r.truncated} prompts with their answer longer than the context)" if r.truncated else ""
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
        print(json_line(report.to_dict()))
    return 0


def cmd_fewshot_data(args: argparse.Namespace) -> int:
    """Write the synthetic in-context-learning task: training text and an evaluation task file.

    OUT/train.txt holds one episode per line: letter-digit pairs such as "q7 x3 q7 b1 x3", 4 to 16
    of them over 2 to 6 letters, each episode under a fresh random mapping of letters to digits (so
    only the context can reveal what a letter means). OUT/task.jsonl is a held-out task in the
    task-file format (the same draw as `--task synthetic --seed SEED`). OUT must be new or empty.
    """
    from pathlib import Path

    from ..lab import fewshot
    from ..fileio import atomic_write, check_new_folder

    if args.episodes < 1:
        raise ConfigError("--episodes must be >= 1")
    out = Path(args.out)
    check_new_folder(out, ConfigError)  # a train.txt there may be someone's own text, not an earlier draw
    out.mkdir(parents=True, exist_ok=True)
    text = fewshot.synthetic_corpus(args.episodes, seed=args.seed)
    atomic_write(out / "train.txt", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    task = fewshot.synthetic_task(seed=args.seed)
    fewshot.write_task(task, out / "task.jsonl")
    print(f"wrote {out / 'train.txt'} ({args.episodes:,} episodes, {len(text):,} characters) and "
          f"{out / 'task.jsonl'} ({len(task.examples)} queries)")
    return 0


def add_lesson(sub: argparse._SubParsersAction) -> None:
    """`tinygpt lesson` and its flags."""
    p = sub.add_parser("lesson", help="a guided tour of the lesson's worked examples", description=cmd_lesson.__doc__)
    p.set_defaults(func=cmd_lesson)


def add_attention(sub: argparse._SubParsersAction) -> None:
    """`tinygpt attention` and its flags."""
    p = sub.add_parser("attention", help="draw attention maps for a prompt", description=cmd_attention.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder")
    p.add_argument("--prompt", required=True, help="the text whose attention to draw (at most block_size tokens)")
    p.add_argument("--layer", type=NATURAL, default=0, help="the block, from 0 (0)")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--head", type=NATURAL, help="the head, from 0 (0)")
    heads.add_argument("--all-heads", action="store_true", help="every head of the layer, in a grid")
    p.add_argument("--out", required=True, metavar="FILE", help="the picture to write (.png, .svg, .pdf)")
    add_device_flag(p)
    p.set_defaults(func=cmd_attention, hub_args=("run",))


def add_plot(sub: argparse._SubParsersAction) -> None:
    """`tinygpt plot` and its flags."""
    p = sub.add_parser("plot", help="loss curves of one or more runs", description=cmd_plot.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or their metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE", help="the picture to write (.png, .svg, .pdf)")
    p.add_argument("--title", help="a title over the plot")
    p.set_defaults(func=cmd_plot)


def add_inspect(sub: argparse._SubParsersAction) -> None:
    """`tinygpt inspect heads` and `inspect data`, and their flags."""
    p = sub.add_parser("inspect", help="look inside a run (its heads) or a data folder",
                       description="Look inside a run (inspect heads RUN) or a data folder (inspect data DIR).")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    h = what.add_parser("heads", help="score a run's heads: induction and previous-token heads",
                        description=cmd_inspect_heads.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("run", help="a run folder")
    h.add_argument("--period", type=Number("int", 2), help="the repeat's length (half the context)")
    h.add_argument("--sequences", type=POSITIVE, default=32, help="repeated random sequences (32)")
    h.add_argument("--seed", type=seed_type(), default=0, help="the sequences' draw (0)")
    h.add_argument("--threshold", type=Number("float", 0, 1), default=0.4,
                   help="the score that names a head an induction or previous-token head (0.4)")
    h.add_argument("--out", metavar="FILE", help="a heatmap of every head's two scores (.png, .svg, .pdf)")
    h.add_argument("--json", action="store_true", help="end with one JSON line")
    add_device_flag(h)
    h.set_defaults(func=cmd_inspect_heads)
    d = what.add_parser("data", help="a data folder: shards, tokens, documents, document lengths, the first tokens",
                        description=cmd_inspect_data.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("data", metavar="DIR", help="a data folder (prepare's --out)")
    d.add_argument("--tokens", type=Number("int", 0, 100_000), default=32, metavar="N",
                   help="decode the first N tokens (32)")
    d.add_argument("--out", metavar="FILE", help="a bar chart of the document lengths (.png, .svg, .pdf)")
    d.add_argument("--json", action="store_true", help="end with one JSON line")
    d.set_defaults(func=cmd_inspect_data)


def add_emergence(sub: argparse._SubParsersAction) -> None:
    """`tinygpt emergence` and its flags."""
    # the defaults as EmergenceSettings has them (tests/test_emergence.py holds the two equal): importing
    # the lab here would load the training loop for every command line
    p = sub.add_parser("emergence", help="watch induction heads form while a 2-layer model trains (about a minute)",
                       description=cmd_emergence.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for the data, runs and figure")
    p.add_argument("--vocab-size", type=Number("int", 4, 316), help="distinct tokens (64)")
    p.add_argument("--context", type=Number("int", 4, 1024), help="the models' context, block_size (32)")
    p.add_argument("--period", metavar="MIN-MAX",
                   help="each row's segment length, drawn in this range (6-16)")
    p.add_argument("--steps", type=POSITIVE, help="optimizer steps of each run (600)")
    p.add_argument("--probe-interval", type=POSITIVE, help="steps between probes (10)")
    p.add_argument("--layers", metavar="N,N", help="the runs' layer counts (1,2)")
    p.add_argument("--seed", type=seed_type(), help="the data, initialization and batch order (0)")
    m = p.add_argument_group("model and training (the lesson's settings)")
    m.add_argument("--n-head", type=POSITIVE, help="heads per layer (4)")
    m.add_argument("--n-embd", type=POSITIVE, help="width (64)")
    m.add_argument("--init", choices=["gpt2", "torch"], help="initialization (torch)")
    m.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="share the token embedding with the head (no)")
    m.add_argument("--activation", choices=["gelu", "gelu_tanh"], help="the MLP's GELU (gelu)")
    m.add_argument("--batch-size", type=POSITIVE, help="sequences per step (32)")
    m.add_argument("--lr", type=RATE, help="AdamW's rate, constant after the warmup (0.003)")
    m.add_argument("--warmup", type=NATURAL, help="linear warmup steps, at most a tenth of --steps (50)")
    m.add_argument("--weight-decay", type=Number("float", 0), help="AdamW weight decay (0)")
    add_device_flag(m, None, help="cpu, cuda, cuda:N, mps (cpu)")
    p.add_argument("--no-plot", action="store_true", help="write no emergence.png (no matplotlib needed)")
    p.add_argument("--json", action="store_true", help="end with emergence.json's summary as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_emergence)


def add_fewshot(sub: argparse._SubParsersAction) -> None:
    """`tinygpt fewshot` and its flags."""
    seed = seed_type()
    p = sub.add_parser("fewshot", help="few-shot accuracy for 0, 1, 2, ... worked examples",
                       description=cmd_fewshot.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder")
    p.add_argument("--task", required=True, metavar="FILE|synthetic", help="a task file (JSON Lines) or synthetic")
    p.add_argument("--shots", default="0,1,2,3", help="numbers of worked examples, e.g. 0,1,2,3 or 0-5 (0,1,2,3)")
    p.add_argument("--scoring", choices=("generate", "likelihood"), default="generate",
                   help="greedy answer, exact match (default), or the most likely candidate answer")
    p.add_argument("--queries", type=POSITIVE, metavar="N", help="evaluate the first N examples (default: all)")
    p.add_argument("--seed", type=seed, default=0, help="the draw of worked examples and of the synthetic task (0)")
    p.add_argument("--show-prompt", action="store_true", help="print the first query's prompt for each k")
    p.add_argument("--plot", metavar="FILE", help="draw accuracy against k (.png, .svg, .pdf)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_flag(p)
    p.set_defaults(func=cmd_fewshot, hub_args=("run",))


def add_fewshot_data(sub: argparse._SubParsersAction) -> None:
    """`tinygpt fewshot-data` and its flags."""
    seed = seed_type()
    p = sub.add_parser("fewshot-data", help="write the synthetic in-context-learning task's data",
                       description=cmd_fewshot_data.__doc__)
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for train.txt and task.jsonl")
    p.add_argument("--episodes", type=POSITIVE, default=40000, help="training episodes, each a fresh mapping (40000)")
    p.add_argument("--seed", type=seed, default=0, help="the draw of the episodes and of task.jsonl (0)")
    p.set_defaults(func=cmd_fewshot_data)
