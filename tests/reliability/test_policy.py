"""Policy: nothing in the package can unpickle a file or run text as code.

An AST scan of every module under src/tinygpt: no pickle/marshal/shelve/dill loads, no torch.load
without weights_only=True, no numpy load with allow_pickle=True, no eval/exec. The scanner is
itself tested on snippets that break each rule, so a scan that finds nothing means something.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinygpt

pytestmark = pytest.mark.reliability

PACKAGE = Path(tinygpt.__file__).parent
UNPICKLERS = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    """`torch.serialization.load` for an attribute chain, '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def violations(source: str, where: str = "<snippet>") -> list[str]:
    """Every place in `source` that could unpickle data or execute text, as 'where:line: why'."""
    found = []
    aliases: dict[str, str] = {}  # a local name -> the module or function it stands for

    def flag(node: ast.AST, why: str) -> None:
        found.append(f"{where}:{node.lineno}: {why}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name
                if a.name.split(".")[0] in UNPICKLERS:
                    flag(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if root in UNPICKLERS:
                    flag(node, f"imports {a.name} from {node.module}")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        keywords = {k.arg: k.value for k in node.keywords}
        if None in keywords and full.split(".")[0] in ("torch", "numpy", "np"):
            flag(node, f"{full}(**...) hides its keywords")
        elif full in ("torch.load", "torch.serialization.load"):
            if not _is_true(keywords.get("weights_only", ast.Constant(None))):
                flag(node, "torch.load without weights_only=True")
        elif full in ("numpy.load", "np.load") and _is_true(keywords.get("allow_pickle", ast.Constant(None))):
            flag(node, "numpy load with allow_pickle=True")
        elif full in ("eval", "exec", "builtins.eval", "builtins.exec", "compile"):
            flag(node, f"{full}() runs text as code")
        elif full.split(".")[0] in UNPICKLERS and full.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler"):
            flag(node, f"{full}() unpickles")
    return found


@pytest.mark.parametrize(
    "snippet, why",
    [
        ("import pickle\npickle.load(open('f', 'rb'))", "unpickles"),
        ("import pickle as p\np.loads(b'')", "unpickles"),
        ("from pickle import loads\nloads(b'')", "imports loads from pickle"),
        ("import torch\ntorch.load('f')", "without weights_only=True"),
        ("import torch\ntorch.load('f', weights_only=False)", "without weights_only=True"),
        ("import torch as T\nT.load('f', map_location='cpu')", "without weights_only=True"),
        ("from torch import load\nload('f')", "without weights_only=True"),
        ("import torch\ntorch.serialization.load('f')", "without weights_only=True"),
        ("import torch\nkw = {}\ntorch.load('f', **kw)", "hides its keywords"),
        ("import numpy as np\nnp.load('f', allow_pickle=True)", "allow_pickle"),
        ("eval('1 + 1')", "runs text as code"),
        ("exec('x = 1')", "runs text as code"),
        ("import marshal\nmarshal.loads(b'')", "marshal"),
    ],
)
def test_the_scanner_catches_each_rule(snippet, why):
    found = violations(snippet)
    assert found and any(why in f for f in found), found


def test_the_scanner_accepts_safe_calls():
    safe = ("import torch, json, numpy as np\nfrom safetensors import safe_open\n"
            "torch.load('f', map_location='cpu', weights_only=True)\njson.loads('{}')\nnp.load('f.npy')\n"
            "model.eval()\n")
    assert violations(safe) == []


def test_the_package_never_unpickles_or_execs():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20  # the whole package, server included
    found = [v for f in files for v in violations(f.read_text(encoding="utf-8"), str(f.relative_to(PACKAGE)))]
    assert found == []
    # the one torch.load there is reads the training state, with weights_only=True
    assert any("weights_only=True" in f.read_text() for f in files)
