"""What a run trained from a pretrained model reports, whatever its objective (tinygpt.finetune.tune runs
them all: finetune's next-token loss, GRPO's rewards): a model measured before and after, the run's facts
beside them, and the report read back and checked (`tinygpt report`).

    score_texts(model, texts, tokenizer, cfg)   each text's loss and bits per char or byte
    reference_text(from_, cfg, tokenizer)       the text forgetting is measured on
    make_report(...)                            the report RUN/finetune_report.json holds
    read_report(run)                            a run's report, read back and checked

"before" and "after" hold the same sections: scored texts (their loss, bits, tokens and where they are
from: "data", the validation split a fine-tuning trains beside; "reference", the text forgetting is
measured on), sections of numbers an objective names (GRPO's "held_out": the held-out prompts' reward and
accuracy), and "samples", the same prompts answered by both.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config.finetune import FinetuneConfig
from .data.folder import DataSet, load_data
from .errors import CheckpointError, DataError
from .model import GPT
from .run_folder import RunFolder
from .tokenizer.base import Tokenizer, encode_named
from .train.callbacks import TrainCallback, TrainResult
from .train.evaluation import conversations_within, evaluate, evaluate_chat


@dataclass
class Text:
    """A text a report scores a model on.

    Args:
        name: its section ("data" or "reference").
        where: where it is from, in words.
        tokens: its ids.
        chat: chat data: scored on the assistant's tokens, its first `conversations`.
        conversations: how many.
    """

    name: str
    where: str
    tokens: np.ndarray
    chat: DataSet | None = None
    conversations: int = 0


def val_text(name: str, dataset: DataSet, what: str, n: int) -> Text:
    """A data folder's validation split to score, its first n tokens; of chat data, the whole conversations
    within them (at least one), scored on the assistant's tokens as `tinygpt eval` scores chat data: a
    chat base's own data read as plain text would score its system, user and template tokens too, across
    conversations.

    Args:
        name: the section; dataset: the data folder; what: its split in words; n: the tokens scored at most.
    """
    tokens = np.asarray(dataset.val[:n])
    if not dataset.is_chat:
        return Text(name, f"{dataset.path} ({what})", tokens)
    return Text(name, f"{dataset.path} ({what}, the assistant's tokens)", tokens, dataset,
                conversations_within(dataset, n))


def reference_text(from_: Path, cfg: FinetuneConfig, tokenizer: Tokenizer) -> Text | None:
    """The text a report's forgetting is measured on: cfg.reference's file, else the base's own validation
    data where it records some, else None.

    Args:
        from_, cfg, tokenizer: the base, the settings (reference, report_tokens) and the base's tokenizer.

    Raises:
        DataError: a file that does not read, or of fewer than 2 tokens.
    """
    n = cfg.report_tokens + 1
    if cfg.reference is None:
        own = _base_val_data(from_, tokenizer)
        return val_text("reference", own, "val, the base's own data", n) if own is not None else None
    path = Path(cfg.reference)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the reference text ({getattr(e, 'strerror', None) or e})") from None
    ids = encode_named(tokenizer, text, f"--reference {path}")[:n]
    if len(ids) < 2:
        raise DataError(f"{path}: the reference text needs at least 2 tokens, it has {len(ids)}")
    return Text("reference", str(path), np.asarray(ids, dtype=np.int64))


def _base_val_data(from_: Path, tokenizer) -> DataSet | None:
    """The data a tinygpt base was trained on, when its train_config.json names a folder still there
    and prepared with the base's tokenizer; else None (a Hugging Face folder records none)."""
    folder = RunFolder(from_).trained_on(CheckpointError)
    if folder is None or not Path(folder).is_dir():
        return None
    try:
        own = load_data(folder)
        RunFolder(from_).check_data(own, tokenizer)
    except DataError:
        return None
    return own if len(own.val) >= 2 else None


def score_texts(model: GPT, texts: list[Text], tokenizer: Tokenizer, cfg: FinetuneConfig) -> dict[str, Any]:
    """Each text's loss and bits per char (a char tokenizer) or per byte under a model, by the text's name.

    Args:
        model: the model (put in eval mode).
        texts: what to score.
        tokenizer: the texts' tokenizer.
        cfg: the settings (block_size: the windows scored).
    """
    model.eval()
    out: dict[str, Any] = {}
    unit = "char" if tokenizer.kind == "char" else "byte"
    for text in texts:
        if text.chat is not None:
            result = evaluate_chat(model, text.chat, conversations=text.conversations, block_size=cfg.block_size)
            size = result["chars"] if unit == "char" else result["bytes"]
        else:
            result = evaluate(model, text.tokens, block_size=cfg.block_size)
            predicted = tokenizer.decode(text.tokens[1:].tolist())  # the first token is context, never predicted
            size = len(predicted) if unit == "char" else len(predicted.encode("utf-8"))
        out[text.name] = {"loss": result["loss"], f"bits_per_{unit}": result["nll"] / math.log(2) / max(1, size),
                          "tokens": result["tokens"], "text": text.where}
    return out


class CountParams(TrainCallback):
    """The trained model's parameters, trainable and in all, as the run ends."""

    def __init__(self) -> None:
        self.trainable = self.total = 0

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())


def peak_memory() -> int:
    """This process's peak resident memory in bytes (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def dtype_names(dtypes) -> str:
    """A model's dtypes in words: "bfloat16", or "bfloat16 and float32" where its weights mix them."""
    return " and ".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))


def make_report(from_: Path, cfg: FinetuneConfig, about: dict[str, Any], result: TrainResult, before: dict,
                after: dict, counter: CountParams, seconds: float, kept_step: int, base_dtype: str) -> dict[str, Any]:
    """A run's report: what it is (its objective, its settings), its facts (the method, the checkpoint kept,
    steps and tokens, parameters, peak memory, time, dtypes), before and after, and each scored text's
    change in loss (the reference's is the forgetting).

    Args:
        from_, cfg: the base and the fine-tuning settings.
        about: the objective's name, title and its samples' kind, and its settings under its name.
        result, counter: the loop's result and the parameters counted at its end.
        before, after: the measures of the base and of the checkpoint kept.
        seconds: this invocation's time; kept_step: the checkpoint's step; base_dtype: dtype_names of FROM's.
    """
    change = {name: after[name]["loss"] - before[name]["loss"] for name in before
              if isinstance(before[name], dict) and "loss" in before[name]}
    memory: dict[str, Any] = {"peak_rss_bytes": peak_memory()}
    if torch.cuda.is_available():
        memory["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return {
        "from": str(from_), **about, "method": cfg.method, "keep": cfg.keep, "kept_step": kept_step,
        "steps": result.step, "stopped": result.stopped, "tokens": result.tokens, "before": before, "after": after,
        "loss_change": change, "forgetting": change.get("reference"),
        "params": {"trainable": counter.trainable, "total": counter.total},
        # a resumed run's whole time: the earlier invocations' training, and this one's training and measuring
        "memory": memory, "seconds": seconds + result.total_elapsed - result.elapsed,
        "train_seconds": result.total_elapsed,
        # trained in float32 whatever FROM stores; saved in FROM's dtype, LoRA's adapters in float32
        "dtype": {"base": base_dtype, "saved": "float32" if cfg.method == "lora" else base_dtype},
    }


def read_report(run: str | Path) -> dict[str, Any]:
    """A run's finetune_report.json, as `tinygpt finetune` (or another command training FROM) wrote it.

    Args:
        run: the run folder.

    Raises:
        CheckpointError: the run has none (it was not fine-tuned, or is still training) or it is not JSON.
    """
    folder = RunFolder(run)
    report, file = folder.read_report(), folder.report_file
    if not isinstance(report, dict) or not isinstance(report.get("before"), dict):
        raise CheckpointError(f"{file}: not a fine-tuning report")
    wrong = _report_error(report) or _report_mismatch(report)
    if wrong is not None:
        raise CheckpointError(f"{file}: an incomplete or edited fine-tuning report: {wrong}")
    return report


# What a report holds, as read_report checks it: a key ending "?" may be absent; "bits_per_*" is one key
# of that prefix (bits_per_char or bits_per_byte); "*" is every key not named beside it; a list is a list
# of its one item's shape.
_NUMBER, _COUNT = (int, float), int
_SCORE = {"loss": _NUMBER, "bits_per_*": _NUMBER, "tokens": _COUNT, "text": str}
_MEASURED = {"data?": _SCORE, "reference?": _SCORE, "samples": [{"prompt": str, "text": str}],
             "*": {"*": _NUMBER}}  # an objective's own sections: numbers by name
_REPORT_SHAPE = {
    "from": str, "objective?": str, "title?": str, "sampled?": str, "method": str, "keep": str, "steps": _COUNT,
    "tokens": _COUNT, "before": _MEASURED, "after": _MEASURED, "params": {"trainable": _COUNT, "total": _COUNT},
    "memory": {"peak_rss_bytes": _COUNT}, "seconds": _NUMBER, "train_seconds": _NUMBER, "kept_step?": _COUNT,
    "dtype?": {"base": str, "saved": str},
}


def _report_mismatch(report: dict[str, Any]) -> str | None:
    """What before and after measure differently (a section one has and the other not, another unit), or
    None; a fine-tuning's report measures its data."""
    before, after = report["before"], report["after"]
    for name in sorted(before.keys() ^ after.keys()):
        return f"{'after' if name in before else 'before'}.{name} is missing"
    if report.get("objective", "finetune") == "finetune" and "data" not in before:
        return "before.data is missing"
    def units(score: dict[str, Any]) -> list[str]:
        return [k for k in score if k.startswith("bits_per_")]

    for name in before.keys() & {"data", "reference"}:
        if units(before[name]) != units(after[name]):
            return f"before.{name} and after.{name} count bits in different units"
    return None


def _report_error(value: Any, shape: Any = None, where: str = "") -> str | None:
    """What in a report does not have its shape (_REPORT_SHAPE), in words, or None."""
    shape = _REPORT_SHAPE if shape is None else shape
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        named = set()
        for key, inner in shape.items():
            name, optional = key.rstrip("?"), key.endswith("?")
            if name == "*":
                continue
            if name.endswith("*"):  # one key of this prefix
                found = [k for k in value if k.startswith(name[:-1])]
                if len(found) != 1:
                    return f"{where}.{name} is {'missing' if not found else 'given twice'}"
                name = found[0]
            named.add(name)
            if name not in value:
                if optional:
                    continue
                return f"{(where + '.' if where else '') + name} is missing"
            wrong = _report_error(value[name], inner, (where + "." if where else "") + name)
            if wrong is not None:
                return wrong
        others = [k for k in value if k not in named] if "*" in shape else []
        return next((w for k in others if (w := _report_error(value[k], shape["*"], f"{where}.{k}"))), None)
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where} is not a list"
        return next((w for i, v in enumerate(value) if (w := _report_error(v, shape[0], f"{where}[{i}]"))), None)
    if isinstance(value, bool) or not isinstance(value, shape):
        kind = "a string" if shape is str else "a whole number" if shape is int else "a number"
        return f"{where} is not {kind} ({json.dumps(value)[:40]})"
    return None
