"""The README and the documentation site's pages, run as a new user runs them: their Python snippets and
the values their comments claim, the output of the params/chinchilla examples, the flags of every command
they show, the few-shot task file, the lesson figures they quote, the commands error messages recommend,
and what the commands leave in the repository."""

import argparse
import ast
import importlib
import io
import json
import re
import shlex
import shutil
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import tinygpt
from tinygpt import cli, kernels
from tinygpt.lab import fewshot, lesson
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.errors import DataError, SweepError
from tinygpt.lab.sweep import load_fit
from tinygpt.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The README and every page of the documentation site: a user runs the commands of all of them."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass
class Block:
    lang: str
    page: str  # relative to the repository
    line: int  # of the opening fence, from 1
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def readme_blocks(lang: str | None = None) -> list[Block]:
    """The fenced blocks of every page (an indented fence, inside a list item, is dedented)."""
    blocks = []
    for page in pages():
        name, current, indent = str(page.relative_to(ROOT)), None, 0
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            fence = re.match(r"^(\s*)```(\w*)\s*$", line)
            if current is None and fence:
                current, indent = Block(fence.group(2), name, n, ""), len(fence.group(1))
            elif current is not None and fence and not fence.group(2):
                blocks.append(current)
                current = None
            elif current is not None:
                current.text += line[indent:] + "\n"
        assert current is None, f"{current.where}: a block that is never closed"
    return [b for b in blocks if lang is None or b.lang == lang]


def readme_section(heading: str) -> str:
    """A section's prose, from whichever page holds it, with its lines joined (a line break inside a
    sentence becomes one space)."""
    holding = [t for t in (p.read_text(encoding="utf-8") for p in pages()) if heading + "\n" in t]
    assert len(holding) == 1, f"{len(holding)} pages hold the heading {heading!r}"
    text = holding[0]
    start = text.index(heading + "\n")
    end = text.find("\n#", start + len(heading))
    return re.sub(r"\n[ \t]*", " ", text[start : end if end != -1 else None])


def command_args(command: str) -> list[str]:
    """The arguments after `tinygpt` (or `-m tinygpt`) in a README command line; comments dropped."""
    words = shlex.split(command, comments=True)
    at = next(i for i, w in enumerate(words) if w.endswith("/tinygpt") or w == "tinygpt" and (i == 0 or words[i - 1] == "-m"))
    return words[at + 1 :]


def assert_parses(command: str) -> None:
    """The command's flags are ones `tinygpt` accepts, with every required one given."""
    try:
        cli.build_parser().parse_args(command_args(command))
    except SystemExit as e:
        raise AssertionError(f"`{command}` does not parse (exit {e.code})") from None


# ---- Python snippets ---------------------------------------------------------------------------

# Every ```python block of the README, named by a piece of code only it holds: it runs here (with
# the fixture that gives it what it needs, or None), or it is skipped for the reason given. A new
# block fails test_every_python_block_is_run_or_skipped until it is added to one of the two.
RUN = {
    'GPTConfig.from_preset("lesson")': None,
    "from tinygpt.calc import": None,
    "viz.attention_weights(model, ids)": "fewshot_demo_run",
    "GPT2LMHeadModel.from_pretrained": "hf_mine",
    "def correct(prompts, completions, answer": None,
}
SKIP = {
    "from openai import OpenAI": "needs a running `tinygpt serve`; tests/test_server.py drives the openai client",
    "echo=True, logprobs=3, max_tokens=0": "needs a running `tinygpt serve`; tests/test_server.py scores a prompt the same way",
    "save_adapter_run(model, \"runs/demo-lora\"": "trains on make demo's run and data; tests/test_lora.py makes the same calls",
    "emergence.run_emergence(": "trains for a minute; tests/test_emergence.py runs the lab and probes its heads",
    "PeftModel.from_pretrained(": "needs make demo's runs; tests/test_peft.py loads an adapter run in PEFT the same way",
    'tinygpt.finetune("hf/gpt2"': "needs GPT-2 downloaded; tests/test_finetune.py makes the same calls on a tiny model",
    "response_format=Person": "needs a running `tinygpt serve`; tests/test_structured_server.py parses such models",
    "def add(a: int, b: int)": "needs a running `tinygpt serve`; tests/test_structured_server.py runs a tool loop",
    'regex=r"[0-9]{4}': "needs a trained run; tests/test_constrain.py makes the same calls on a tiny model",
    "prompt_lookup=3)   # or draft=small_model": "needs a model and a prompt; tests/test_speculative.py makes the "
                                                 "same calls on tiny ones",
}


def python_block(marker: str) -> Block:
    found = [b for b in readme_blocks("python") if marker in b.text]
    assert len(found) == 1, f"{len(found)} python blocks of the pages hold {marker!r}"
    return found[0]


def test_every_python_block_is_run_or_skipped():
    for block in readme_blocks("python"):
        markers = [m for m in (*RUN, *SKIP) if m in block.text]
        assert len(markers) == 1, f"{block.where}: a python block to run here or skip with a reason"
    for marker in (*RUN, *SKIP):
        python_block(marker)


def claimed_value(comment: str | None):
    """The Python literal a `# value` comment starts with ("# 2680677120 bytes" -> 2680677120), else None."""
    if comment is None:
        return None
    words = comment.lstrip("#").split()
    for n in range(len(words), 0, -1):
        text = " ".join(words[:n])
        try:
            return ast.literal_eval(text), text
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
    return None


def agrees(actual, claimed, written: str) -> bool:
    """Equal, with a float compared to as many significant digits as the README writes."""
    if isinstance(claimed, float):
        digits = len(re.sub(r"^[-+]?0*\.?0*", "", re.split(r"[eE]", written)[0]).replace(".", ""))
        return f"{float(actual):.{max(1, digits)}g}" == f"{claimed:.{max(1, digits)}g}"
    return actual == claimed


def run_snippet(source: str, where: str) -> int:
    """Run a snippet statement by statement; a statement whose last line ends in a `# value` comment
    (a bare expression, or print(expression)) must evaluate to that value. Returns how many were checked."""
    comments = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    namespace: dict = {"__name__": "__readme__"}
    checked = 0
    for stmt in ast.parse(source).body:
        claim = claimed_value(comments.get(stmt.end_lineno))
        if claim is None:
            exec(compile(ast.Module([stmt], type_ignores=[]), where, "exec"), namespace)
            continue
        expr = stmt.value if isinstance(stmt, ast.Expr) else None
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "print"
                and len(expr.args) == 1):
            expr = expr.args[0]
        assert expr is not None, f"{where}, line {stmt.end_lineno}: a value comment on a statement with no value"
        actual = eval(compile(ast.Expression(expr), where, "eval"), namespace)
        value, written = claim
        assert agrees(actual, value, written), (
            f"{where}, line {stmt.end_lineno}: `{ast.unparse(expr)}` is {actual!r}; the README says {written}")
        checked += 1
    return checked


@pytest.mark.parametrize("marker", list(RUN))
def test_readme_python_block_runs_and_prints_what_it_says(marker, request, tmp_path, monkeypatch):
    block = python_block(marker)
    fixture = RUN[marker]
    if fixture == "hf_mine":
        pytest.importorskip("transformers")
    monkeypatch.chdir(request.getfixturevalue(fixture) if fixture else tmp_path)
    checked = run_snippet(block.text, block.where)
    if marker in ('GPTConfig.from_preset("lesson")', "from tinygpt.calc import"):
        assert checked >= 2  # the blocks whose printed numbers are the point


def test_value_comments_are_read_as_values():
    assert claimed_value("# 2680677120 bytes") == (2680677120, "2680677120")
    assert claimed_value("# [5, 12, 3]") == ([5, 12, 3], "[5, 12, 3]")
    assert claimed_value("# the lesson's TinyGPT") is None
    assert claimed_value("# (n_layer, n_head, T, T); rows sum to 1") is None
    assert agrees(1.4e12, 1.4e12, "1.4e12") and agrees(1.3863e12, 1.4e12, "1.4e12")
    assert not agrees(1.3e12, 1.4e12, "1.4e12") and not agrees(3813139200, 2680677120, "2680677120")
    with pytest.raises(AssertionError, match="the README says 4"):
        run_snippet("x = 2\nx + 1  # 4\n", "snippet")


def _trained_run(data: Path, out: Path, **model) -> Path:
    vocab = int(json.loads((data / "meta.json").read_text())["vocab_size"])
    config = GPTConfig(**{**dict(vocab_size=vocab, block_size=32, n_layer=2, n_head=2, n_embd=32), **model})
    tinygpt.train(data, out, config, TrainConfig(max_iters=30, eval_interval=15, eval_iters=2, batch_size=8,
                                                 device="cpu"), progress=False)
    return out


@pytest.fixture
def fewshot_demo_run(tmp_path):
    """What `make fewshot-demo` leaves in runs/fewshot-demo/run, in small: a run trained on the synthetic text."""
    pytest.importorskip("matplotlib")
    (tmp_path / "train.txt").write_text(fewshot.synthetic_corpus(300), encoding="utf-8")
    tinygpt.prepare([str(tmp_path / "train.txt")], tmp_path / "data")
    _trained_run(tmp_path / "data", tmp_path / "runs" / "fewshot-demo" / "run")
    return tmp_path


@pytest.fixture
def hf_mine(tmp_path, char_data):
    """hf/mine as `tinygpt export runs/mine --format hf --out hf/mine` writes it."""
    run = _trained_run(char_data, tmp_path / "runs" / "mine", block_size=64)
    assert cli.main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf" / "mine")]) == 0
    return tmp_path


# ---- console examples: the output of the deterministic commands, the flags of all ----------------

# Console commands whose output is this machine's (measured, or from a trained run): shown, not compared.
MEASURED = {
    "tinygpt train": "trains a model for minutes; the losses, speeds and sizing are the machine's",
    "tinygpt sample": "needs a trained run",
    "tinygpt eval": "needs a trained run",
    "tinygpt chinchilla --time": "measures this machine's FLOP/s",
}


def console_commands() -> list[tuple[Block, str, str]]:
    """(block, command, the output shown under it) for every `$ ` line of the README's console blocks."""
    out = []
    for block in readme_blocks("console"):
        for chunk in re.split(r"^\$ ", block.text, flags=re.M)[1:]:
            command, _, shown = chunk.partition("\n")
            out.append((block, command, shown))
    return out


def test_every_console_command_is_compared_or_measured():
    for block, command, _ in console_commands():
        deterministic = re.match(r"tinygpt (params|chinchilla)\b", command) and "--time" not in command
        assert deterministic or any(command.startswith(m) for m in MEASURED), (
            f"{block.where}: `{command}`: compare its output here or list it in MEASURED")


@pytest.mark.parametrize("command", [c for _, c, _ in console_commands()
                                     if re.match(r"tinygpt (params|chinchilla)\b", c) and "--time" not in c])
def test_readme_params_and_chinchilla_output_is_the_commands(command, capsys):
    shown = next(s for _, c, s in console_commands() if c == command)
    assert cli.main(command_args(command)) == 0
    got = "\n".join(line.rstrip() for line in capsys.readouterr().out.splitlines()).strip("\n")
    want = "\n".join(line.rstrip() for line in shown.splitlines()).strip("\n")
    # a line of "..." stands for lines of the output the README leaves out; the rest is shown in order
    pieces = [p.strip("\n") for p in re.split(r"^\.\.\.$", want, flags=re.M)]
    if len(pieces) == 1:
        assert got == want
        return
    assert got.startswith(pieces[0]) and got.endswith(pieces[-1]), f"{command}: output differs from the README's"
    at = len(pieces[0])
    for piece in pieces[1:-1]:
        found = got.find(piece, at)
        assert found >= 0, f"{command}: the README shows {piece!r}, which the output lacks"
        at = found + len(piece)


def readme_commands() -> list[str]:
    """Every tinygpt command line of the README's bash and console blocks (continuations joined), and
    every whole command (`.venv/bin/...`) in a table's cell."""
    commands = [c for _, c, _ in console_commands()]
    for page in pages():
        for row in page.read_text(encoding="utf-8").splitlines():
            if row.startswith("|"):
                commands += re.findall(r"`(\.venv/bin/(?:tinygpt|torchrun) [^`]+)`", row)
    for block in readme_blocks("bash"):
        for line in block.text.replace("\\\n", " ").splitlines():
            if re.search(r"(^|/|-m )tinygpt ", line.split("#")[0]):
                commands.append(line.strip())
    return commands


def test_every_readme_command_parses():
    commands = readme_commands()
    assert len(commands) > 30 and any("torchrun" in c for c in commands)
    for command in commands:
        assert_parses(command)


def test_every_command_the_readme_shows_has_help(capsys):
    for name in sorted({command_args(c)[0] for c in readme_commands()}):
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0 and f"usage: tinygpt {name}" in capsys.readouterr().out


def test_what_the_readme_commands_write_is_ignored_by_git():
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    outs = set()
    for command in readme_commands():
        args = command_args(command)
        outs |= {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--out" and not args[i + 1].startswith("/")}
    outs |= set(re.findall(r'"(\w+\.png)"', python_block("viz.attention_weights(model, ids)").text))
    assert {"attention.png", "head.png", "loss.png", "hf/mine", "mine.gguf", "runs/demo", "data/stdlib"} <= outs
    for out in sorted(outs):
        r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", out], capture_output=True)
        assert r.returncode == 0, f"{out}, which a README command writes, is not in .gitignore"


# ---- prepare: the shakespeare advice, and a default --out -------------------------------------------

def test_offline_shakespeare_advice_is_a_command_that_runs(tmp_path, monkeypatch):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError) as e:
        tinygpt.prepare(["shakespeare"], tmp_path / "data")
    advice = re.findall(r"`(tinygpt prepare [^`]+)`", str(e.value))
    readme = re.findall(r"offline, download it elsewhere and run `(tinygpt prepare [^`]+)`",
                        readme_section("## Prepare your data"))
    assert advice and advice == readme, (advice, readme)
    assert_parses(advice[0])


def test_prepare_without_out_writes_data_named_after_the_first_source(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "shakespeare.txt").write_text("First Citizen:\nBefore we proceed any further.\n" * 20)
    (tmp_path / "my-folder").mkdir()
    (tmp_path / "my-folder" / "a.txt").write_text("some notes to learn from\n" * 20)
    assert cli.main(["prepare", "path/to/shakespeare.txt"]) == 0
    assert capsys.readouterr().out.startswith("prepared data/shakespeare in ")
    assert cli.main(["prepare", "my-folder/", "path/to/shakespeare.txt"]) == 0
    assert capsys.readouterr().out.startswith("prepared data/my-folder in ")
    for name in ("shakespeare", "my-folder"):
        assert (tmp_path / "data" / name / "meta.json").is_file()
    assert cli.default_data_folder("python-stdlib") == str(Path("data/python-stdlib"))


# ---- fewshot-data's help, the task-file example -------------------------------------------------

def test_fewshot_data_help_describes_the_file_it_writes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["fewshot-data", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one episode per line" in help_text and "letter-digit pairs" in help_text
    assert "key: color" not in help_text and "blank lines" not in help_text
    assert cli.main(["fewshot-data", "--out", str(tmp_path), "--episodes", "50"]) == 0
    lines = (tmp_path / "train.txt").read_text().splitlines()
    assert len(lines) == 50 and all(re.fullmatch(r"[a-z]\d( [a-z]\d)*", line) for line in lines)
    example = re.search(r'letter-digit pairs such as "([^"]+)"', help_text).group(1)
    assert re.fullmatch(r"[a-z]\d( [a-z]\d)*", example)


def test_readme_task_file_runs_as_shown(tmp_path, capsys):
    block = next(b for b in readme_blocks("json") if '"template"' in b.text)
    task_file = tmp_path / "capitals.jsonl"
    task_file.write_text(block.text, encoding="utf-8")
    task = fewshot.read_task(task_file)
    shots = re.search(r"`tinygpt fewshot RUN --task FILE\.jsonl --shots ([\d,]+)", readme_section(
        "## Few-shot prompting, measured")).group(1)
    tokenizer = CharTokenizer.from_text(block.text + "\n" + task.template + task.separator)
    torch.manual_seed(0)
    model = tinygpt.GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16))
    tinygpt.save(model, tmp_path / "run", tokenizer)
    for scoring in ("generate", "likelihood"):
        code = cli.main(["fewshot", str(tmp_path / "run"), "--task", str(task_file), "--shots", shots,
                         "--scoring", scoring, "--quiet", "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        report = json.loads(captured.out.splitlines()[-1])
        assert [r["shots"] for r in report["results"]] == [int(k) for k in shots.split(",")]
        assert all(r["total"] == len(task.examples) for r in report["results"])


# ---- the lesson's figures ---------------------------------------------------------------------------

LESSON_CPU = "AVX2"  # the README quotes `tinygpt lesson` as this kind of CPU prints it


def _as_printed(digits: int, x: float) -> str:
    return f"{x:.{digits}f}"  # as `tinygpt lesson` prints them: 3 decimals for the mask, 2 for decoding


@pytest.fixture(scope="module")
def pitfalls():
    pit = lesson.causal_mask_pitfall()
    return pit, {s.label: s for s in lesson.decoding_pitfall(pit.runs["masked"], prompt=pit.prompt)}


def test_readme_quotes_the_lessons_figures(pitfalls):
    cpu = torch.backends.cpu.get_cpu_capability()
    if cpu != LESSON_CPU or kernels.lowbit() is None:
        pytest.skip(f"the README quotes an {LESSON_CPU} CPU's figures with tinygpt's kernels; this one runs PyTorch's "
                    f"{cpu} kernels{'' if kernels.lowbit() else ' and its GELU'}, whose float32 results differ in the "
                    "last bits, and 300 Adam steps make that visible")
    pit, samples = pitfalls
    prose = readme_section("## The lesson's pitfalls")
    assert f"on an {LESSON_CPU} CPU" in prose

    def quoted(pattern: str) -> tuple[str, ...]:
        found = re.search(pattern, prose)
        assert found, f"the README's lesson section no longer says {pattern!r}"
        return found.groups()

    assert quoted(r"collapses \((\S+) against (\S+)\)") == (_as_printed(3, pit.train_loss["unmasked"]),
                                                           _as_printed(3, pit.train_loss["masked"]))
    assert quoted(r"its loss is (\S+) against (\S+),") == (_as_printed(3, pit.last_loss["unmasked"]),
                                                          _as_printed(3, pit.last_loss["masked"]))
    unmasked, masked = quoted(r"greedy generation gives `'(.+?) ?\.\.\.'` where the masked model writes `'(.+?) ?\.\.\.'`")
    assert repr(pit.samples["unmasked"])[1:].startswith(unmasked) and repr(pit.samples["masked"])[1:].startswith(masked)
    greedy, t08, top_p, t2 = (samples[k] for k in ("greedy", "temperature 0.8", "top-p 0.9", "temperature 2.0"))
    assert quoted(r"greedy loops \((\S+) distinct, loss (\S+);") == (_as_printed(2, greedy.distinct4), _as_printed(2, greedy.loss))
    assert quoted(r"vary \((\S+), (\S+)\) while staying plausible to the model \(loss (\S+), (\S+)\)") == (
        _as_printed(2, t08.distinct4), _as_printed(2, top_p.distinct4), _as_printed(2, t08.loss), _as_printed(2, top_p.loss))
    assert quoted(r"noise \((\S+) distinct, loss (\S+)\)") == (_as_printed(2, t2.distinct4), _as_printed(2, t2.loss))
    lines = [line for line in greedy.text.split("\n") if len(line) > 10]
    assert len(lines) > len(set(lines))  # "its lines come back word for word"


def test_readme_lesson_intro_counts_the_lessons_model():
    intro = readme_section("## The lesson's worked examples")
    assert f"TinyGPT's {lesson.lesson_model().num_params():,} parameters" in intro


# ---- error messages that recommend a command ------------------------------------------------------

def test_missing_sweep_advice_is_a_command_that_runs(tmp_path):
    with pytest.raises(SweepError) as e:
        load_fit(tmp_path)
    advice = re.findall(r"`(tinygpt sweep [^`]+)`", str(e.value))
    assert advice
    assert_parses(advice[0])


def test_eval_of_a_folder_without_data_says_so(tmp_path, capsys):
    text = "a few words of text to score\n" * 4
    tokenizer = CharTokenizer.from_text(text)
    tinygpt.save(tinygpt.GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=2,
                                       n_embd=16)), tmp_path / "mine", tokenizer)
    assert cli.main(["eval", str(tmp_path / "mine")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinygpt: error: ")
    assert "no data of its own" in err and "--data DIR" in err and "--text FILE" in err
    (tmp_path / "new.txt").write_text(text)
    assert cli.main(["eval", str(tmp_path / "mine"), "--text", str(tmp_path / "new.txt")]) == 0


# ---- commands and library names in the prose ---------------------------------------------------------

OTHER_PROGRAMS = {"hf"}  # Hugging Face's command line, which the paths table names beside tinygpt's commands


def prose_spans(page: Path) -> list[str]:
    """The backticked spans of a page's prose, fenced blocks left out."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def command_flags() -> dict[str, dict[str, argparse.Action]]:
    """Every command's options by flag; a command with commands of its own (`inspect`) has theirs too."""
    def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
        found = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= options(sub)
            found |= dict.fromkeys(action.option_strings, action)
        return found

    (commands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: options(sub) for name, sub in commands.choices.items()}


def named_command_problem(span: str, commands: dict[str, dict[str, argparse.Action]]) -> str | None:
    """What is wrong with a span that names a command (`tinygpt NAME ...`, or `NAME --flag ...`): a command
    that does not exist, a flag it lacks, a value outside the flag's choices; None where nothing is, or where
    the span names no command."""
    words = span.split()
    if words[0] in ("tinygpt", ".venv/bin/tinygpt") and len(words) > 1:
        words = words[1:]
    elif not (len(words) > 1 and words[1].startswith("--")):
        return None
    if not re.fullmatch(r"[a-z][a-z0-9/-]*", words[0]):  # a placeholder: `tinygpt COMMAND --help`
        return None
    flags = {}
    for name in words[0].split("/"):  # `tinygpt sample/eval DIR`: either
        if name not in commands:
            return f"`{span}`: tinygpt has no command {name!r}"
        flags |= commands[name]
    for flag, value in zip(words[1:], [*words[2:], ""]):
        if flag.startswith("-") and flag.split("=")[0] not in flags:
            return f"`{span}`: `tinygpt {words[0]}` has no flag {flag}"
        choices = flags[flag].choices if flag in flags else None
        if choices and re.fullmatch(r"[a-z0-9|.-]+", value) and not set(value.split("|")) <= set(map(str, choices)):
            return f"`{span}`: {flag} takes {', '.join(map(str, choices))}, not {value}"
    return None


def test_commands_named_in_the_prose_exist_with_the_flags_it_gives_them():
    commands = command_flags()
    problems = [f"{page.relative_to(ROOT)}: {problem}" for page in pages() for span in prose_spans(page)
                if (problem := named_command_problem(span, commands))]
    assert not problems, "\n".join(problems)
    assert named_command_problem("finetune --method full|freeze", commands)  # the rule sees what it is for
    assert named_command_problem("tinygpt calc", commands) and not named_command_problem("tinygpt params", commands)


def test_the_readme_s_paths_table_names_only_commands_that_exist():
    """Each row of "What you can do with it" names further commands in its cells, bare (`plot`); a cell said
    that `params` and `calc` count any config, and tinygpt has no calc command (tinygpt.calc is the library)."""
    commands = command_flags()
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## What you can do with it\n"):]
    rows = [line for line in section[: section.index("\n## ")].splitlines() if line.startswith("|")]
    spans = [s for row in rows for s in re.findall(r"`([^`]+)`", row)]
    # a whole command (`tinygpt prepare`, `.venv/bin/...`) is checked with the rest of the prose
    named = [s for s in spans if re.fullmatch(r"[a-z][a-z0-9-]*", s.split()[0]) and s.split()[0] != "tinygpt"]
    assert len(named) >= 5
    unknown = [s for s in named if s.split()[0] not in commands | dict.fromkeys(OTHER_PROGRAMS)]
    assert not unknown, f"the README's paths table names commands tinygpt lacks: {unknown}"
    assert not [p for s in named if s.split()[0] in commands and (p := named_command_problem(f"tinygpt {s}", commands))]


def resolves(name: str) -> bool:
    """Whether a dotted name (`tinygpt.train.TrainCallback`) is a module or something a module holds."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for part in parts[n:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_library_names_in_the_prose_exist():
    spans = [span for page in pages() for span in prose_spans(page)]
    names = {name for span in spans for name in re.findall(r"\btinygpt(?:\.\w+)+", span)}
    assert len(names) > 20 and resolves("tinygpt.calc") and not resolves("tinygpt.calc.no_such_function")
    assert not sorted(name for name in names if not resolves(name))


def test_the_performance_page_opens_with_what_its_benchmark_runs_printed():
    """The table the performance page leads with is the ratios `tinygpt bench` printed: each row's, to two
    decimals, those of the run (docs/bench-*.json) it links."""
    page = ROOT / "docs" / "PERFORMANCE.md"
    lead = page.read_text(encoding="utf-8").split("\n## ")[0]
    rows = [line for line in lead.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 4
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        run = json.loads((page.parent / re.search(r"\((bench-[\w-]+\.json)\)", cells[-1]).group(1)).read_text())

        def ratios(*patterns: str) -> str:
            picked = [[r["ratio"] for r in run["ratios"] if re.fullmatch(pattern, r["name"])] for pattern in patterns]
            assert all(len(p) == 1 for p in picked), (cells[0], patterns)
            return " / ".join(f"{p[0]:.2f}" for p in picked)

        formats = ("f32", "f16", "q8_0", "q4_0")
        assert cells[1] == ratios(*(rf"decode baby b1: tinygpt .+ / llama\.cpp {f}" for f in formats)), cells[0]
        assert cells[2] == ratios(*(rf"decode gpt2-4k b1: tinygpt .+ / llama\.cpp {f}" for f in formats)), cells[0]
        assert cells[3] == ratios(*(rf"train {m} \w+: tinygpt best / transformers best" for m in ("char", "gpt2")))


# ---- the README's links: the docs site checks its own (mkdocs build --strict); GitHub shows the README --

def heading_anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub and MkDocs' toc both spell them."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    heads = re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-") for h in heads}


def test_every_link_of_the_readme_resolves():
    text = re.sub(r"^```.*?^```", "", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert target.suffix == ".md" and anchor in heading_anchors(target), (
                f"README.md links to {link}: {target.name} has no heading with that anchor")


def test_heading_anchors_are_spelled_as_github_spells_them(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Train, sample, evaluate\n## The lesson's pitfalls\n```\n# not a heading\n```\n"
                    "### `tinygpt serve` and GGUF\n")
    assert heading_anchors(page) == {"train-sample-evaluate", "the-lessons-pitfalls", "tinygpt-serve-and-gguf"}
