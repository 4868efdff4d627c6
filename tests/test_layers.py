"""The package's import layers, read from the sources (ast, nothing executed).

Each module belongs to one layer and imports only from its own layer or the ones below, at the top
of the file or inside a function alike (a lazy import still ties two modules together). The README's
"How the code is laid out" section shows this table; a test holds the two equal.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tinygpt"

# lowest first: (layer, what it holds, its modules; a name ending in ".*" is a whole folder)
LAYERS = (
    ("foundation", "configs, errors and the arithmetic of scale; no torch",
     ("config.*", "errors", "calc.*")),
    ("tensors and text", "files, devices, tokenizers, the KV and prompt caches, sampling and its grammars, tool calls, "
     "tinygpt's CPU kernels",
     ("fileio", "device", "tokenizer.*", "kv_cache", "prompt_cache", "sampling", "constrain", "toolcalls", "kernels")),
    ("model", "the GPT and its weight files", ("model", "weights")),
    ("workflows", "generation, data, training and fine-tuning, time-budget sizing, run folders, interchange, "
     "preferences and rewards",
     ("generate", "data.*", "optim", "throughput", "sizing", "train.*", "distributed", "run_folder", "checkpoint",
      "lora", "finetune", "fastpath", "interop.*", "align.*")),
    ("the lab", "experiments built on the workflows: the lesson's tools, probes, sweeps, benchmarks", ("lab.*",)),
    ("front ends", "the HTTP server and the command line", ("server.*", "cli.*", "__main__")),
)
NO_TORCH = 0  # layers up to this one import no torch


def _module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(f): f for f in sorted(PACKAGE.rglob("*.py"))}
MODULES.pop("")  # tinygpt/__init__.py: the facade that names each public object's home, imported lazily


def layer_of(module: str) -> int:
    for i, (_, _, members) in enumerate(LAYERS):
        for m in members:
            if module == m or (m.endswith(".*") and (module == m[:-2] or module.startswith(m[:-1]))):
                return i
    raise AssertionError(f"tinygpt.{module} is in no layer: add it to LAYERS (and the README's table)")


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """The tinygpt module an ImportFrom reads from ('' for the package itself), or None for others."""
    if node.level == 0:
        name = node.module or ""
        if name != "tinygpt" and not name.startswith("tinygpt."):
            return None
        return name.removeprefix("tinygpt").removeprefix(".")
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str):
    """(imported module, imported name or None, line) for every import of a tinygpt module, lazy ones too.
    Imports under `if TYPE_CHECKING:` are for type checkers only and run never."""
    tree = ast.parse(MODULES[module].read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tinygpt."):
                    yield alias.name.removeprefix("tinygpt."), None, node.lineno
                elif alias.name.split(".")[0] == "torch":
                    yield "torch", None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] == "torch":
                yield "torch", None, node.lineno
                continue
            target = _resolve(module, node)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in MODULES:  # `from . import sampling`: the module itself
                    yield sub, None, node.lineno
                else:
                    yield target, alias.name, node.lineno


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module in MODULES:
        mine = layer_of(module)
        for target, _, line in imports(module):
            if target in MODULES and layer_of(target) > mine:
                wrong.append(f"tinygpt.{module}:{line} ({LAYERS[mine][0]}) imports tinygpt.{target} "
                             f"({LAYERS[layer_of(target)][0]})")
    assert not wrong, "\n".join(wrong)


def test_the_foundation_imports_no_torch():
    wrong = [f"tinygpt.{m}:{line}" for m in MODULES if layer_of(m) <= NO_TORCH
             for target, _, line in imports(m) if target == "torch"]
    assert not wrong, "these import torch: " + ", ".join(wrong)


def test_there_is_no_import_cycle():
    edges, seen, cycles = graph(), {}, []

    def visit(module: str, path: list[str]) -> None:  # depth first; seen: 1 on the path, 2 done
        seen[module] = 1
        for target in sorted(edges[module]):
            if seen.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [module, target]))
            elif target not in seen:
                visit(target, path + [module])
        seen[module] = 2

    for module in sorted(MODULES):
        if module not in seen:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_takes_a_private_name_of_another():
    wrong = []
    for module in MODULES:
        imported = {}  # local name -> where it came from, for `Name._private` below
        for target, name, line in imports(module):
            if target == "torch" or target == module:
                continue
            if name is not None and _private(name):
                wrong.append(f"tinygpt.{module}:{line} imports {name} from tinygpt.{target}")
            if name is not None:
                imported[name] = target
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in imported):
                wrong.append(f"tinygpt.{module}:{node.lineno} reads {node.value.id}.{node.attr} "
                             f"(from tinygpt.{imported[node.value.id]})")
    assert not wrong, "\n".join(wrong)


TOPIC_PACKAGES = ("config", "data")  # packages of topic modules, whose __init__ gives the names users import


def test_tinygpt_takes_each_name_from_its_topic_module():
    # `tinygpt.config` and `tinygpt.data` give the names users import; tinygpt's own modules import from the module
    # that defines each (config.model, data.folder, ...), so that each package's list stays the users' (issue 56)
    wrong = [f"tinygpt.{module}:{line} imports {name} from tinygpt.{target}" for module in MODULES
             if module not in TOPIC_PACKAGES for target, name, line in imports(module)
             if target in TOPIC_PACKAGES and name is not None]
    assert not wrong, "\n".join(wrong)


def test_the_readme_shows_the_layers():
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## How the code is laid out\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "the README has no 'How the code is laid out' section"
    table = [line for line in section.group(1).splitlines() if line.startswith("| ") and "---" not in line][1:]
    shown = [tuple(cell.strip() for cell in row.strip("|").split("|")) for row in table]
    expected = [(str(i), name, ", ".join(f"`{m}`" for m in members), holds)
                for i, (name, holds, members) in reversed(list(enumerate(LAYERS)))]
    assert shown == expected


@pytest.mark.parametrize("module, line, caught", [
    ("model", "from .train import train\n", {"higher", "cycle"}),  # train imports model
    ("config", "import torch\n", {"torch"}),
    ("config.train", "import torch\n", {"torch"}),  # each of the package's modules is the foundation's
    ("config.lora", "from ..model import GPT\n", {"higher"}),
    ("sampling", "from .tokenizer import _byte_to_unicode\n", {"private"}),
    ("interop.hf_tokenizer", "from ..tokenizer import GPT2Tokenizer\n    return GPT2Tokenizer._ranks\n", {"private"}),
    ("checkpoint", "from .train import train\n", {"cycle"}),  # one layer, but train imports checkpoint
    ("sizing", "from .lab.fewshot import read_task\n", {"higher"}),  # the workflows never reach into the lab
    ("data.batches", "from ...lab.fewshot import read_task\n", {"higher"}),  # nor does any module of data's
])
def test_the_checks_catch_what_they_are_for(module, line, caught, monkeypatch, tmp_path):
    file = tmp_path / MODULES[module].name
    file.write_text(MODULES[module].read_text() + "\n\ndef _probe():\n    " + line)
    monkeypatch.setitem(MODULES, module, file)
    checks = {"higher": test_no_module_imports_a_higher_layer, "torch": test_the_foundation_imports_no_torch,
              "private": test_no_module_takes_a_private_name_of_another, "cycle": test_there_is_no_import_cycle}
    failed = set()
    for name, check in checks.items():
        try:
            check()
        except AssertionError:
            failed.add(name)
    assert failed == caught
