"""Speculative decoding against plain decoding at batch 1 (issue 60): tokens per second with and without it,
the share of proposed tokens that stood, per weight format, on a target and drafts trained here.

Each model learns the same text for the same minutes, with `tinygpt train`'s default recipe (the modern block,
Muon, warmup-stable-decay): the first --chars characters of the python-stdlib corpus (this interpreter's standard
library, read in place, in file order; character tokens). The target is 5 x 384 (9.1M parameters: 35.9 MB of
float32 Linear weights, more than the 32 MiB last-level cache of the 2-core AMD EPYC Zen 3 this was written on),
the drafts 3 x 128, 12.5 times smaller: one trained on the text as the target was, one distilled from the target
(the KL divergence from the target's next-token distributions to its own, at every position of the same text:
train.objectives.Distill; the target's forward pass is part of its minutes). The cases, each plain and
speculative:

  code, prompt lookup   greedy; the prompt is the start of a standard-library file the models never saw, which
                        they continue: input-grounded text, where the reply repeats its input (--prompt-lookup 3)
  code, trained draft   the same prompt, the draft trained on the text proposing
  code, distilled draft   the same, the draft distilled from the target proposing
  code, distilled draft, sampled   the same at temperature 0.8: greedy text from models trained for minutes
                        soon repeats itself, which a draft predicts well; sampled text does not
  code, int4 copy as draft   the same, the float32 target itself in int4 proposing (a sixth of its bytes)
  text, random draft    greedy, from an English sentence, a draft of the draft's shape with random weights
                        proposing: next to nothing stands, what speculating costs where it cannot pay
  text, prompt lookup, sampled   at temperature 0.8 from the same sentence (open-ended text, as a chat's),
                        proposals from the text

Each case runs plain and speculative one after the other in each of --rounds interleaved rounds (plain first in
every other round), on the threads generate chooses; the table gives the medians. The ratio is of decoding's
time, from the first new token (which the prompt's pass gives, the same in both) to the last, as llama.cpp's
speculative example reports its speed: a draft's reading of the prompt falls in it. The whole calls' ratio, the
prompt's pass included, is beside it. The runs and the data stay in --work, so a second run measures without
training again (delete it to retrain).

    .venv/bin/python benchmarks/speculative.py [--minutes 10] [--rounds 15] [--new-tokens 160] [--cases ...]
        [--formats ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

import tinygpt
from tinygpt.calc import count_params
from tinygpt.data.sources import python_stdlib_root
from tinygpt.device import last_level_cache
from tinygpt.interop.quantize import FORMATS
from tinygpt.lab.bench.machine import load_average, machine
from tinygpt.speculative import SpeculationStats, weight_bytes

TARGET = dict(n_layer=5, n_head=6, n_embd=384, block_size=384)
DRAFT = dict(n_layer=3, n_head=2, n_embd=128, block_size=384)
TEXT = "The history of the city begins in the year when the first traders came up the river, and"
LOOKUP = 3
# --cases' names for them
CASES = {"code, prompt lookup": "lookup", "code, trained draft": "draft", "code, distilled draft": "distilled",
         "code, distilled draft, sampled": "distilled-sampled", "code, int4 copy as draft": "int4-draft",
         "text, random draft": "random", "text, prompt lookup, sampled": "sampled"}
PROMPT = 200  # characters of the code prompt: with --new-tokens, within the models' 384 positions (no sliding)


def stdlib_files() -> list[Path]:
    """The standard library's .py files in a fixed order (site-packages and tests' fixtures aside)."""
    root = python_stdlib_root()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > 0)


def corpus(work: Path, chars: int) -> tuple[Path, str]:
    """The training text (the first `chars` characters of the files, in order) and a code prompt from the first
    unseen file long enough: its first function, PROMPT characters."""
    text, prompt = [], None
    total = 0
    for path in stdlib_files():
        try:
            body = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if total < chars:
            text.append(body)
            total += len(body)
        elif "\ndef " in body and len(body) > 4000:
            start = body.index("\ndef ") + 1
            prompt = body[start : start + PROMPT]
            break
    work.mkdir(parents=True, exist_ok=True)
    path = work / "stdlib.txt"
    path.write_text("".join(text)[:chars], encoding="utf-8")
    return path, prompt


def trained(work: Path, data: Path, name: str, shape: dict, minutes: float, log,
            teacher: tinygpt.GPT | None = None) -> tinygpt.GPT:
    """The run work/name, trained for `minutes` on data unless it is there already, with `tinygpt train`'s
    default recipe (the modern block, Muon, warmup-stable-decay: the most a CPU's minutes buy): on the text's
    next tokens, or with a teacher to give its next-token distributions (train.objectives.Distill)."""
    from tinygpt.config import DEFAULT_LR
    from tinygpt.lab.recipes import recipe_configs
    from tinygpt.train import Start
    from tinygpt.train.objectives import Distill

    run = work / name
    if not (run / "config.json").exists():
        vocab = teacher.config.vocab_size if teacher is not None else tinygpt.load_tokenizer(data).vocab_size
        cfg, settings = recipe_configs("modern", vocab, shape, dict(max_time=60 * minutes, eval_interval=10**6,
                                                                     eval_iters=4))
        how = "training" if teacher is None else "distilling"
        log(f"{how} {name} ({count_params(cfg).total:,} parameters) for {minutes:g} minutes")
        start = cfg if teacher is None else Start(cfg, lambda: tinygpt.GPT(cfg), tinygpt.load, DEFAULT_LR,
                                                  objective=functools.partial(Distill, teacher=teacher))
        result = tinygpt.train(data, run, start, settings)
        if teacher is not None:
            log(f"  {result.step:,} steps, {result.tokens:,} tokens, KL divergence from the target "
                f"{result.train_loss:.3f}")
        else:
            val = f"{result.val_loss:.3f}" if result.val_loss is not None else "not evaluated"
            log(f"  {result.step:,} steps, {result.tokens:,} tokens, val loss {val}")
    return tinygpt.load(run).eval()


def timed(model, idx: torch.Tensor, n: int, sampling: dict, speculation: dict) -> tuple[float, float, object]:
    """One generate call of n new tokens: its seconds, the seconds of its decoding (from the first new token, which
    the prompt's pass gives, to the last: a draft's reading of the prompt falls in them), and its speculation
    figures (None without)."""
    seen, first = [], []

    def observe(step) -> None:
        if not first:
            first.append(time.perf_counter())
            seen.append(step.speculation)

    start = time.perf_counter()
    tinygpt.generate(model, idx, n, observer=observe, **sampling, **speculation)
    end = time.perf_counter()
    return end - start, end - first[0], seen[0]


def measure(base, drafts: dict, tokenizer, prompt: str, fmt: str, args, log) -> list[dict]:
    """Every case of one weight format (those --cases names), plain and speculative one after the other in each
    of the interleaved rounds: the median of each one's decoding tokens/s (after the first token, as llama.cpp's
    speculative example reports them) and of the rounds' ratios, of decoding and of the whole calls (the prompt's
    pass, the same in both, included). The two calls of a round ran within a second of each other, so a busy
    spell of the machine falls on both."""
    target = tinygpt.quantize(copy.deepcopy(base), fmt)
    draft, distilled, noise = (tinygpt.quantize(copy.deepcopy(drafts[m]), fmt) if drafts[m] is not None else None
                               for m in ("draft", "distilled", "noise"))
    code, text = (torch.tensor([tokenizer.encode(p)]) for p in (prompt, TEXT))
    greedy, sampled = dict(greedy=True), dict(temperature=0.8, generator=None)
    cases = {
        "code, prompt lookup": (code, greedy, dict(prompt_lookup=LOOKUP)),
        "code, trained draft": (code, greedy, dict(draft=draft)),
        "code, distilled draft": (code, greedy, dict(draft=distilled)),
        "code, distilled draft, sampled": (code, sampled, dict(draft=distilled)),
    }
    if fmt == "fp32":  # the target itself in 4 bits, a sixth of its bytes (in the other formats it fits the L3)
        cases["code, int4 copy as draft"] = (code, greedy, dict(draft=tinygpt.quantize(copy.deepcopy(base), "int4")))
    cases.update({"text, random draft": (text, greedy, dict(draft=noise)),
                  "text, prompt lookup, sampled": (text, sampled, dict(prompt_lookup=LOOKUP))})
    cases = {case: v for case, v in cases.items() if CASES[case] in args.cases}
    runs: dict[str, list[tuple[tuple, tuple]]] = {case: [] for case in cases}
    for r in range(args.rounds):
        for case, (idx, sampling, speculation) in cases.items():
            pair = {}
            for how in ("plain", "speculative") if r % 2 == 0 else ("speculative", "plain"):  # either goes first
                if "generator" in sampling:
                    sampling = dict(sampling, generator=torch.Generator().manual_seed(0))
                settings = speculation if how == "speculative" else {}
                timed(target, idx[:, :8], 2, sampling, settings)  # warm up: plans, the threads' verdict, allocations
                pair[how] = timed(target, idx, args.new_tokens, sampling, settings)
            runs[case].append((pair["plain"], pair["speculative"]))
    rows = []
    for case, measured in runs.items():
        decoding = [plain[1] / fast[1] for plain, fast in measured]
        whole = [plain[0] / fast[0] for plain, fast in measured]
        stats = SpeculationStats()  # every round's, added up: how much a round speculates follows its clock
        for _, fast in measured:
            stats.add(fast[2])
        rows.append({"format": fmt, "case": case,
                     "plain_tokens_per_s": (args.new_tokens - 1) / statistics.median(p[1] for p, _ in measured),
                     "speculative_tokens_per_s": (args.new_tokens - 1) / statistics.median(f[1] for _, f in measured),
                     "ratio": statistics.median(decoding), "ratios": [round(r, 3) for r in decoding],
                     "whole_call_ratio": statistics.median(whole),
                     **{f"speculation_{k}": v for k, v in stats.to_dict().items()}})
        r = rows[-1]
        low, _, high = statistics.quantiles(decoding, n=4) if len(decoding) > 1 else decoding * 3
        log(f"{fmt:5s} {case:28s} plain {r['plain_tokens_per_s']:7.1f} tokens/s  speculative "
            f"{r['speculative_tokens_per_s']:7.1f}  {r['ratio']:.2f}x (quartiles {low:.2f}-{high:.2f}; "
            f"whole calls {r['whole_call_ratio']:.2f}x)  {stats.describe()}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| format | case | plain, tokens/s | speculative, tokens/s | ratio (median) | whole calls | accepted | "
             "tokens per target step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = r["speculation_acceptance_rate"]
        lines.append(f"| {r['format']} | {r['case']} | {r['plain_tokens_per_s']:,.1f} | "
                     f"{r['speculative_tokens_per_s']:,.1f} | {r['ratio']:.2f}x | {r['whole_call_ratio']:.2f}x | "
                     f"{'-' if rate is None else f'{rate:.0%}'} | {r['speculation_tokens_per_step'] or 1:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training time of each model (10)")
    parser.add_argument("--chars", type=int, default=20_000_000, help="characters of the corpus to train on")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (15)")
    parser.add_argument("--new-tokens", type=int, default=160, help="tokens each generate call adds (160)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="weight formats to measure (all)")
    parser.add_argument("--cases", default=",".join(CASES.values()),
                        help=f"cases to measure, by name (all: {','.join(CASES.values())})")
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/tinygpt/speculative-bench"),
                        help="where the data and the runs are kept between runs")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    args.cases = set(args.cases.split(","))

    def log(line: str) -> None:
        print(line, flush=True)

    work = Path(args.work)
    text, prompt = corpus(work, args.chars)
    data = work / "data"
    if not (data / "meta.json").exists():
        tinygpt.prepare([str(text)], data, tokenizer="char")
    target = trained(work, data, "target", TARGET, args.minutes, log)
    draft = trained(work, data, "draft", DRAFT, args.minutes, log)
    distilled_draft = trained(work, data, "distilled", DRAFT, args.minutes, log, teacher=target) \
        if {"distilled", "distilled-sampled"} & args.cases else None
    torch.manual_seed(0)
    # the draft's shape with random weights, its head untied (a tied one would propose the last token again,
    # which a looping text accepts): a draft that is almost never right
    noise = tinygpt.GPT(dataclasses.replace(draft.config, tie_weights=False, init="torch")).eval()
    tokenizer = tinygpt.load_tokenizer(data)
    info = machine(torch.device("cpu"))
    cache = last_level_cache()
    log(f"{info['processor']}, {info['cores']} cores, L3 {cache / 2**20 if cache else '?'} MiB, torch {info['torch']}, "
        f"load {info['load_average']}; target {count_params(target.config).total:,} parameters "
        f"({weight_bytes(target) / 1e6:.1f} MB of float32 Linear weights), draft {count_params(draft.config).total:,}")
    rows = []
    drafts = dict(draft=draft, distilled=distilled_draft, noise=noise)
    for fmt in args.formats.split(","):
        rows += measure(target, drafts, tokenizer, prompt, fmt, args, log)
    log(f"load at the end {load_average()}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": {**info, "load_average_end": load_average(),
                                                           "last_level_cache": cache}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
