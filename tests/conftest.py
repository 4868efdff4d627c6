import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # test helpers such as lesson_reference

# The test models are tiny: one thread is faster than two, and two spin badly on a busy machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(0)


@pytest.fixture
def cli(capsys):
    """tinygpt's main() in this process, answering as subprocess.run does (returncode, stdout, stderr):
    a failure that escaped as a traceback fails the test; a process of its own would cost seconds for
    torch's import each time (the tests of the real process start one)."""
    from tinygpt.cli import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def make_text(n_lines: int = 600, seed: int = 0) -> str:
    """A small synthetic corpus with learnable structure (tests make their own data)."""
    import random

    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old king", "a small bird"]
    verbs = ["sees", "likes", "follows", "draws", "finds"]
    objects = ["the moon", "a red apple", "the river", "two stones", "a quiet song"]
    return "".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n" for _ in range(n_lines))


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """A prepared character-level data folder built from make_text()."""
    from tinygpt.data import prepare

    root = tmp_path_factory.mktemp("corpus")
    (root / "text.txt").write_text(make_text())
    prepare([str(root / "text.txt")], root / "data", tokenizer="char")
    return root / "data"


# ---- the server tests' tiny model (test_server, test_server_scheduler, test_playground) ----------
# A random 2-layer GPT over printable ASCII (server_util.tiny_model) and its char tokenizer, one per
# test module. A module that needs another model defines its own `model` fixture, which wins.


@pytest.fixture(scope="module")
def model():
    from server_util import tiny_model

    return tiny_model(block_size=32)


@pytest.fixture(scope="module")
def tok():
    from server_util import tiny_tokenizer

    return tiny_tokenizer()


# ---- figures: numbers a test measures for docs/RELIABILITY.md, listed at the end of the run ------

_FIGURES: list[dict] = []


@pytest.fixture
def figure(request):
    """record(name, value, detail="") keeps a measured figure; with TINYGPT_FIGURES=FILE they are also
    appended to FILE as JSON lines (`make reliability` does this). A figure travels in its test's
    report, so that the figures of tests run by xdist's workers reach the summary too."""

    def record(name: str, value, detail: str = "") -> None:
        request.node.user_properties.append(
            ("figure", {"test": request.node.nodeid, "figure": name, "value": value, "detail": detail}))

    return record


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the report that carries what setup, the test and teardown recorded
        _FIGURES.extend(value for key, value in report.user_properties if key == "figure")


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("figures")
    for f in _FIGURES:
        terminalreporter.write_line(f"{f['figure']}: {f['value']}" + (f"  ({f['detail']})" if f["detail"] else ""))
    if os.environ.get("TINYGPT_FIGURES"):
        with open(os.environ["TINYGPT_FIGURES"], "a") as out:
            for f in _FIGURES:
                out.write(json.dumps(f) + "\n")
