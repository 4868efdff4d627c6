"""Looking inside models and data: `tinygpt attention`, `plot` (loss curves), `inspect heads` (induction and
previous-token heads) and `inspect data` (a data folder's shards, documents and tokens). The lab's experiments
(lesson, emergence, few-shot) are cli/lab.py's."""

from __future__ import annotations

import argparse

from ..calc.units import plural
from ..errors import ConfigError
from .common import NATURAL, POSITIVE, Number, add_device_flag, json_line, load_model, seed_type, utf8_flag

HISTOGRAM_WIDTH = 40  # characters of the longest bar of `inspect data`'s histogram


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
    """Plot train and val loss against steps, tokens and wall-clock time from runs' metrics.jsonl, overlaid; for
    runs trained against rewards (tinygpt grpo), the reward, the held-out accuracy and pass@k, and the KL.

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
    rewarded = any("reward" in m.logged for m in runs)  # trained against rewards (GRPO): its own curves
    (viz.plot_rewards if rewarded else viz.plot_loss)(runs, args.out, title=args.title)
    for m in runs:
        steps, accuracy = m.series("val_accuracy" if "val_accuracy" in m.logged else "val_reward")
        last = (f", held-out {'accuracy' if 'val_accuracy' in m.logged else 'reward'} {accuracy[-1]:.4f} at step "
                f"{steps[-1]}" if rewarded and accuracy else
                f", val loss {m.val_loss[-1]:.4f} at step {m.eval_steps[-1]}" if m.val_loss else "")
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
    what = {"chat": "conversations", "preference": "pairs"}.get(info["content"], "documents")
    lengths = info["lengths"]
    if args.out and not (lengths and lengths["documents"]):
        raise ConfigError(f"--out: {args.data} has no {what[:-1]} lengths to draw "
                          + ("(no separator between its documents)" if lengths is None else f"(no {what})"))
    eot = (f"documents separated by token {info['eot_id']} {json.dumps(info['eot_token'], ensure_ascii=False)}"
           if info["eot_id"] is not None else f"a {what[:-1]} a document" if what != "documents"
           else "no separator between documents: their lengths are unknown")
    print(f"{info['path']}: {info['content']}, {info['tokenizer']} tokenizer (vocab "
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
    for side, text in first.get("pair", {}).items():
        print(f"  first pair's {side}: {json.dumps(text, ensure_ascii=False)}")
    if args.out:
        from ..lab import viz

        viz.plot_lengths(lengths["bins"], args.out, what=what,
                         title=f"{info['path']}: {what[:-1]} lengths")
        print(f"wrote {args.out}")
    if args.json:
        print(json_line(info))
    return 0


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
