"""The serve tutorial's lm-evaluation-harness recipe, run as written against a tiny run: the tutorial's
export and serve commands, then its lm_eval command line with only the port, the tasks (two of our own,
no download) and the output folder changed. lm-eval is no dependency of tinygpt (it pins its own
`datasets` and more; the tutorial installs it in an environment of its own), so this runs where
TINYGPT_LM_EVAL names that environment's `lm_eval`, or one is on PATH, and is skipped elsewhere
(two lm-eval runs: 1-3 minutes on a busy 2-core machine)."""

import glob
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_text
from server_util import wait_for
from test_readme import command_args, readme_blocks
from test_server_cli import free_port

import tinygpt
from tinygpt import cli

LM_EVAL = os.environ.get("TINYGPT_LM_EVAL") or shutil.which("lm_eval")
pytestmark = pytest.mark.skipif(not LM_EVAL or not shutil.which("curl"),
                                reason="lm-eval is not installed (set TINYGPT_LM_EVAL to its lm_eval), or no curl")

# make_text's words
SUBJECTS = ["the cat", "a dog", "my friend", "the old king", "a small bird"]
VERBS = ["sees", "likes", "follows", "draws", "finds"]
OBJECTS = ["the moon", "a red apple", "the river", "two stones", "a quiet song"]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
output_type: {kind}
test_split: test
doc_to_text: "{{{{context}}}}"
{fields}
metadata:
  version: 1.0
"""


def write_tasks(folder: Path, docs: int = 12) -> None:
    """A multiple-choice task and a loglikelihood task (as lambada is) whose contexts, eight lines of
    the training corpus' kind, run past the 32-token context."""
    rng = random.Random(0)

    def line() -> str:
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."

    folder.mkdir()
    mc, ll = [], []
    for _ in range(docs):
        story = "\n".join(line() for _ in range(8))
        subject, verb, thing = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
        mc.append({"context": f"{story}\n{subject} {verb}", "label": 0,
                   "choices": [f"{thing}.", f"{rng.choice(VERBS)}.", f"{rng.choice(SUBJECTS)}."]})
        head, last = thing.rsplit(" ", 1)
        ll.append({"context": f"{story}\n{subject} {verb} {head}", "target": f" {last}."})
    for name, rows, kind, fields in (
            ("tiny_mc", mc, "multiple_choice",
             'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc'),
            ("tiny_ll", ll, "loglikelihood",
             'doc_to_target: "{{target}}"\nmetric_list:\n  - metric: perplexity\n  - metric: acc')):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(TASK.format(name=name, file=folder / f"{name}.jsonl", kind=kind,
                                                         fields=fields))


def encode_pair(tok, context: str, answer: str) -> tuple[list[int], list[int]]:
    """The context's and the answer's tokens as lm-eval splits them: the pair encoded whole, the
    context's trailing spaces moved to the answer."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, answer = context[:-spaces], context[-spaces:] + answer
    whole, ctx = tok.encode(context + answer), tok.encode(context)
    return ctx, whole[len(ctx):]


def answer_logprob(model, ctx: list[int], answer: list[int], *, sliding: bool) -> float:
    """The answer's log-probability computed directly: each token from the block_size tokens before it
    (sliding), or all of them in one window of the last block_size + 1 tokens, as lm-eval's hf model
    scores an answer on a model of that length."""
    ids, block = ctx + answer, model.config.block_size
    total = 0.0
    with torch.no_grad():
        for t in range(len(ctx), len(ids)):
            start = max(0, t - block) if sliding else max(0, len(ids) - 1 - block)
            total += torch.log_softmax(model(torch.tensor([ids[start:t]]))[0, -1].float(), -1)[ids[t]].item()
    return total


def scored(out: Path) -> list[tuple[str, str, float]]:
    """(context, answer, log-probability) of every request lm-eval logged under `out`."""
    found = []
    for file in sorted(glob.glob(str(out / "*" / "samples_*.jsonl"))):
        for sample in map(json.loads, Path(file).read_text().splitlines()):
            for args, resp in zip(sample["arguments"].values(), sample["resps"]):
                found.append((args["arg_0"], args["arg_1"], float(resp[0][0])))
    return found


def test_the_tutorials_lm_eval_recipe_runs_and_scores_as_the_model_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(make_text())
    tinygpt.prepare([str(tmp_path / "text.txt")], tmp_path / "data", tokenizer="bpe", vocab_size=300)
    tok = tinygpt.load_tokenizer(tmp_path / "data")
    torch.manual_seed(0)
    model = tinygpt.GPT(tinygpt.GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2,
                                          n_embd=32, init="torch")).eval()
    tinygpt.save(model, tmp_path / "runs" / "stdlib", tok)
    write_tasks(tmp_path / "tasks")

    serve, commands = [b.text for b in readme_blocks("bash") if "tinygpt serve runs/stdlib" in b.text
                       and "--format hf" in b.text], [b.text for b in readme_blocks("bash")
                                                      if "lm_eval --model local-completions" in b.text]
    assert len(serve) == 1 and len(commands) == 1
    export, start = (command_args(line) for line in serve[0].splitlines())
    assert export[:2] == ["export", "runs/stdlib"] and start == ["serve", "runs/stdlib"]
    assert cli.main(export) == 0

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", *start, "--port", str(port), "--device", "cpu",
                             "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        wait_for(up, timeout=180, interval=0.2)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()

        def lm_eval(command: str, out: str) -> list[tuple[str, str, float]]:
            for old, new in (("http://127.0.0.1:8000", f"http://127.0.0.1:{port}"), ("~/lm-eval/bin/lm_eval", LM_EVAL),
                             ("--tasks lambada_openai,hellaswag",
                              f"--tasks tiny_mc,tiny_ll --include_path tasks --output_path {out} --log_samples")):
                assert old in command
                command = command.replace(old, new)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
            r = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            assert "tiny_mc" in r.stdout and "perplexity" in r.stdout  # lm-eval's table
            return scored(tmp_path / out)

        # as written: max_length = block_size + 2, each answer in one window, as lm-eval's hf model scores it
        recipe = lm_eval(commands[0], "recipe")
        # lm-eval's default max_length: whole prompts, over twice the context, scored by the sliding window
        whole = lm_eval(commands[0].replace(",max_length=$((CONTEXT + 2))", ""), "whole")
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(recipe) == len(whole) == 12 * 3 + 12
    for results, sliding in ((recipe, False), (whole, True)):
        for context, answer, got in results:
            ctx, ans = encode_pair(tok, context, answer)
            assert len(ctx) + len(ans) > 2 * 32
            assert got == pytest.approx(answer_logprob(model, ctx, ans, sliding=sliding), abs=1e-4), (sliding, context)
