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
      "lora", "finetune", "report", "fastpath", "speculative", "interop.*", "align.*")),
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


# The structure's limits (DESIGN: a function reads in one sitting, a module holds one topic)
FUNCTION_LINES, MODULE_LINES, CLI_MODULE_LINES = 80, 700, 350


def over_limits(files: dict[str, Path]) -> list[str]:
    """Each function longer than FUNCTION_LINES (its def to its last line, docstring included) and each module
    longer than its limit (a command-line module CLI_MODULE_LINES, any other MODULE_LINES) among `files`
    (module name -> source), as messages."""
    found = []
    for module, file in files.items():
        text = file.read_text()
        lines = len(text.splitlines())
        limit = CLI_MODULE_LINES if module.split(".")[0] == "cli" else MODULE_LINES
        if lines > limit:
            found.append(f"tinygpt.{module}: {lines} lines (at most {limit})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    found.append(f"tinygpt.{module}:{node.lineno} {node.name}: {length} lines (at most {FUNCTION_LINES})")
    return found


def test_the_structure_keeps_its_limits():
    """No function over 80 lines, no command-line module over 350, no other module over 700, with no
    exceptions (issue 56): a topic that outgrows its module becomes a package of topic modules."""
    found = over_limits({**MODULES, "__init__": PACKAGE / "__init__.py"})
    assert not found, "split these:\n" + "\n".join(found)


def test_the_limits_catch_what_they_are_for(tmp_path):
    def source(name: str, text: str) -> Path:
        (tmp_path / name).write_text(text)
        return tmp_path / name

    def function(lines: int) -> str:  # a def line, then lines - 1 of body
        return "def f():\n" + "    x = 0\n" * (lines - 1)

    files = {"model": source("a.py", function(80)), "weights": source("b.py", function(81)),
             "cli.train": source("c.py", "x = 0\n" * 350), "cli.serve": source("d.py", "x = 0\n" * 351),
             "server.app": source("e.py", "x = 0\n" * 700), "data.text": source("f.py", "x = 0\n" * 351 * 2)}
    assert over_limits(files) == ["tinygpt.weights:1 f: 81 lines (at most 80)",
                                  "tinygpt.cli.serve: 351 lines (at most 350)",
                                  "tinygpt.data.text: 702 lines (at most 700)"]


# A run folder's files (tinygpt.run_folder's docstring lists them), and the first format's adapters
RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "train_state.pt", "train_config.json",
             "metrics.jsonl", "finetune_report.json", "tinygpt_adapter.json", "before-decay", "adapter_config.json",
             "adapter_model.safetensors", "adapter.safetensors")
HF_FILES = {"config.json", "model.safetensors", "tokenizer.json"}  # a Hugging Face model folder's
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}  # a PEFT adapter's
# (modules, the names they may spell): see test_only_the_run_folder_names_its_files for why
RUN_FILES_ELSEWHERE = (
    (r"interop(\..*)?", HF_FILES | PEFT_FILES),
    (r"tokenizer\..*", {"tokenizer.json"}),
    (r"data(\..*)?", {"tokenizer.json", "config.json"}),
)
_AS_PATH = re.compile(r"(?:.*/)?\.?(%s)(?:\.[\w.-]*)?" % "|".join(map(re.escape, RUN_FILES)))


def _run_file(value: object) -> str | None:
    """The run folder's file a string literal names as a path ("metrics.jsonl", "RUN/train_config.json",
    "train_state.pt.tmp"), or None (any other text, a message or help that mentions one among its words)."""
    found = _AS_PATH.fullmatch(value) if isinstance(value, str) else None
    return found.group(1) if found else None


def run_file_sites(modules: dict[str, Path] = MODULES) -> list[tuple[str, int, str]]:
    """(module, line, file) wherever tinygpt's code names a run folder's file: a string literal that is its
    name, or a constant bound to one (where it is read, imported, or read as module.NAME), but for the
    names RUN_FILES_ELSEWHERE lets a module spell. Docstrings are prose, and left out."""
    trees = {m: ast.parse(f.read_text()) for m, f in modules.items()}
    constants = {(m, target.id): _run_file(node.value.value) for m, tree in trees.items() for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and _run_file(node.value.value) for target in node.targets if isinstance(target, ast.Name)}
    sites = set()
    for module, tree in trees.items():
        names = {n: f for (m, n), f in constants.items() if m == module}  # this module's constants, and imported
        aliases = {}  # local name -> tinygpt module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (source := _resolve(module, node)) is not None:
                for alias in node.names:
                    if (source, alias.name) in constants:
                        names[alias.asname or alias.name] = constants[source, alias.name]
                        sites.add((module, node.lineno, constants[source, alias.name]))
                    elif f"{source}.{alias.name}".strip(".") in modules:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}".strip(".")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tinygpt.") and alias.asname:
                        aliases[alias.asname] = alias.name.removeprefix("tinygpt.")
        docstrings = {id(body[0].value) for node in ast.walk(tree) if isinstance(node, (
            ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (body := node.body)
            and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Constant) and id(node) not in docstrings:
                name = _run_file(node.value)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                name = names.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                name = constants.get((aliases[node.value.id], node.attr))
            if name is not None:
                sites.add((module, node.lineno, name))
    return sorted((m, line, name) for m, line, name in sites
                  if not any(re.fullmatch(where, m) and name in allowed for where, allowed in RUN_FILES_ELSEWHERE))


def test_only_the_run_folder_names_its_files():
    """A run folder's files are named in tinygpt.run_folder alone: every other module asks a RunFolder for
    a path (folder.metrics_file) or an answer (folder.has_weights()), so what a run folder holds, and every
    check on it, is in one place (issue 56). A name counts where code uses it as a path: a string literal
    that is the name (or a path ending in it), or a constant bound to one, read, imported or read as
    module.NAME; a message or a help text that mentions a file among its words is prose, as docstrings are.

    What else may spell some of these names, and why:
    - interop.*: config.json, model.safetensors and tokenizer.json are a Hugging Face model folder's own
      files, adapter_config.json and adapter_model.safetensors a PEFT adapter's (DESIGN 14: the ecosystem's
      formats as they are); interop reads and writes those formats. Not tinygpt's own files
      (train_state.pt, train_config.json, metrics.jsonl, tinygpt_adapter.json, ...).
    - tokenizer.*: tokenizer.json is a tokenizer's own file in whatever folder carries one (a run, a data
      folder, a Hugging Face folder), which the tokenizer package saves and loads.
    - data, data.*: a data folder holds its own tokenizer.json (beside meta.json, which is the data's and no
      run's), and `prepare --tokenizer-file` tells a Hugging Face folder by its config.json before it
      asks interop to read it.
    """
    elsewhere = [f"tinygpt.{module}:{line} names {name}" for module, line, name in run_file_sites()
                 if module != "run_folder"]
    assert not elsewhere, "ask tinygpt.run_folder.RunFolder instead:\n" + "\n".join(elsewhere)


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
    ("cli.train", "return Path(run) / \"train_config.json\"\n", {"run files"}),  # a name spelled
    ("lab.sweep", "return f\"{run}/metrics.jsonl\"\n", {"run files"}),  # a path ending in one
    ("finetune", "from .run_folder import REPORT\n    return REPORT\n", {"run files"}),  # a constant imported
    ("lab.viz.metrics", "from ... import run_folder\n    return run_folder.METRICS\n", {"run files"}),  # read
    ("interop.hf_gpt2", "return out / \"train_state.pt\"\n", {"run files"}),  # interop: HF's and PEFT's only
    ("interop.hf_gpt2", "return out / \"config.json\"\n", set()),  # Hugging Face's own
    ("cli.finetune", "raise ValueError(\"no finetune_report.json here\")\n", set()),  # a message's prose
])
def test_the_checks_catch_what_they_are_for(module, line, caught, monkeypatch, tmp_path):
    file = tmp_path / MODULES[module].name
    file.write_text(MODULES[module].read_text() + "\n\ndef _probe():\n    " + line)
    monkeypatch.setitem(MODULES, module, file)
    checks = {"higher": test_no_module_imports_a_higher_layer, "torch": test_the_foundation_imports_no_torch,
              "private": test_no_module_takes_a_private_name_of_another, "cycle": test_there_is_no_import_cycle,
              "run files": test_only_the_run_folder_names_its_files}
    failed = set()
    for name, check in checks.items():
        try:
            check()
        except AssertionError:
            failed.add(name)
    assert failed == caught
