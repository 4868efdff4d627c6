"""The lab's experiments: `tinygpt lesson` (a tour of the lesson's worked examples), `emergence` (the lab that
watches induction heads form while a model trains), `fewshot` (accuracy against the number of worked examples in
the prompt) and `fewshot-data` (the synthetic in-context-learning task)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .common import NATURAL, POSITIVE, RATE, Number, add_device_flag, json_line, load_model, seed_type


def cmd_lesson(args: argparse.Namespace) -> int:
    """Walk through the lesson's worked examples with tinygpt's own objects."""
    from ..lab import lesson

    for text in lesson.tour():
        print(text)
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
    from ..train.callbacks import ProgressBar

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
