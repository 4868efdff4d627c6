"""Fine-tuning a pretrained GPT on your own text, on the one training loop (tinygpt.train).

    finetune(from_, data, out, FinetuneConfig(...))   trains a run folder or a Hugging Face GPT-2
                                                      folder further: full, LoRA or frozen layers,
                                                      and reports what changed (finetune_report.json)
    freeze(model, embeddings=True, layers=N)          stops the token and position embeddings and the
                                                      first N blocks from training; the rest trains in full

finetune hands train() a train.Start: how to build the starting model (the base, its context cropped,
its dropout set, adapters added or layers frozen), how to load it back from a checkpoint on resume,
and, for LoRA, that checkpoints are adapter runs naming the base. LoRA's adapters live in
tinygpt.lora; adapter runs are written and read by tinygpt.checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint
from .config import FinetuneConfig, GPTConfig, TrainConfig
from .data import DataSet, load_data
from .errors import CheckpointError, ConfigError, DataError, TokenizerError
from .fileio import read_json, write_json
from .generate import generate
from .lora import apply_lora, weights_checksum
from .model import GPT
from .train import TRAIN_CONFIG, Start, TrainCallback, TrainResult, check_data_for_run, evaluate, train
from .weights import reconfigured

REPORT = "finetune_report.json"
# What the library's finetune() trains with when no TrainConfig is given: nanoGPT's GPT-2 recipe
# (a constant rate after a short warmup, few steps, frequent evaluations) rather than pretraining's.
DEFAULT_TRAIN = dict(lr_schedule="constant", warmup=10, max_iters=200, eval_interval=50, eval_iters=10,
                     weight_decay=0.0)
SAMPLE_SEED = 1234  # the report samples before and after with this seed, so the two differ only by the weights


def freeze(model: GPT, *, embeddings: bool = False, layers: int = 0) -> GPT:
    """Stop parts of a built model from training, in place: their parameters get requires_grad False.

    Frozen parameters get no gradients and no AdamW state, and stay bitwise as they are. Nothing
    that is frozen already is unfrozen.

    Args:
        model: the GPT.
        embeddings: freeze wte and wpe. A head tied to wte is the same tensor, so it freezes with
            it; an untied head keeps training.
        layers: freeze the first `layers` blocks (h.0 .. h.{layers-1}) whole: LayerNorms,
            attention and MLP. 0..n_layer.

    Returns:
        The same model.

    Raises:
        ConfigError: `layers` outside 0..n_layer.
    """
    n = model.config.n_layer
    if not (isinstance(layers, int) and not isinstance(layers, bool) and 0 <= layers <= n):
        raise ConfigError(f"freeze layers: must be an integer in 0..{n} (the model has {n} blocks), got {layers!r}")
    if embeddings:
        model.wte.requires_grad_(False)
        model.wpe.requires_grad_(False)
    for block in model.h[:layers]:
        block.requires_grad_(False)
    return model


@dataclass
class FinetuneResult:
    """What finetune() did.

    Args:
        run: the run folder (a plain run for full, an adapter run for LoRA).
        train: the training loop's result.
        report: what changed (also in RUN/finetune_report.json; see finetune()).
        merged: the plain run written with merge, else None.
    """

    run: Path
    train: TrainResult
    report: dict[str, Any]
    merged: Path | None = None


def finetune(
    from_: str | Path,
    data: str | Path,
    out: str | Path,
    config: FinetuneConfig | None = None,
    train_config: TrainConfig | None = None,
    *,
    resume: bool = False,
    merge: str | Path | None = None,
    progress: bool = False,
    callbacks: Sequence[TrainCallback] = (),
    should_stop: Callable[[int], bool] | None = None,
) -> FinetuneResult:
    """Fine-tune a pretrained model on a prepared data folder, on the same loop as train().

    Args:
        from_: the base: a tinygpt run folder or a Hugging Face GPT-2 folder (an adapter run is
            merged first; LoRA needs a full model as its base).
        data: a folder prepared with the base's tokenizer (`tinygpt prepare TEXT --tokenizer-file FROM`).
        out: the run folder: a plain run for method full, an adapter run (adapter.safetensors and
            adapter_config.json naming the base, beside train_state.pt) for lora.
        config: what trains and how (FinetuneConfig()).
        train_config: the optimization (default: DEFAULT_TRAIN's recipe). Its lr left None is the
            method's fine-tuning rate (FinetuneConfig.default_lr), far below pretraining's.
        resume: continue the run in `out` from its checkpoint (bitwise on CPU in float32).
        merge: with lora, also write the adapters folded into the base as a plain run here.
        progress, callbacks, should_stop: as for train().

    The report (RUN/finetune_report.json) holds, before and after on the data's validation split:
    loss and bits per char (char tokenizer) or per byte; the same prompts sampled with the same
    seed; the loss on a reference text (config.reference, default the base's own validation data
    when it is a tinygpt run that records it) as a measure of forgetting; trainable and total
    parameters; the process's peak memory; the time. "After" is the checkpoint kept in `out` (the
    best one with keep best).

    Raises:
        ConfigError: bad settings (a block_size longer than the base's, merge with full, ...).
        DataError: the data was prepared with another tokenizer (the message gives the prepare command).
        CheckpointError, TrainingError: as for train() and tinygpt.load.
    """
    cfg = config or FinetuneConfig()
    tcfg = train_config or TrainConfig(**DEFAULT_TRAIN)
    from_, out = Path(from_), Path(out)
    if merge is not None and cfg.method != "lora":
        raise ConfigError("merge goes with method lora: a full fine-tune is a plain run already")
    dataset = load_data(data)
    base = _load_base(from_)
    tokenizer = _base_tokenizer(from_)
    check_data_for_run(from_, dataset, tokenizer, remedy=f"prepare it with: {prepare_command(dataset, from_)}")
    model_config = _finetune_config(base.config, cfg, from_)
    texts = _report_texts(from_, dataset, cfg, tokenizer)
    before = _measure(reconfigured(base, model_config, str(from_)), texts, tokenizer, cfg)
    start = _start(from_, base, model_config, cfg)
    del base  # the training builds its own copy: do not hold two through the run
    counter = _CountParams()
    started = time.perf_counter()
    result = train(data, out, start, tcfg, resume=resume, progress=progress, callbacks=[counter, *callbacks],
                   should_stop=should_stop)
    after_model = checkpoint.load(out, merge=True)  # the kept checkpoint: with keep best, the best one
    after = _measure(after_model, texts, tokenizer, cfg)
    report = _report(from_, cfg, result, before, after, counter, time.perf_counter() - started)
    write_json(out / REPORT, report)
    merged = None
    if merge is not None:
        checkpoint.merge_run(out, merge)
        merged = Path(merge)
    return FinetuneResult(out, result, report, merged)


def read_report(run: str | Path) -> dict[str, Any]:
    """A fine-tuned run's finetune_report.json.

    Raises:
        CheckpointError: the run has none (it was not fine-tuned, or is still training) or it is not JSON.
    """
    file = Path(run) / REPORT
    if not file.is_file():
        raise CheckpointError(f"{run}: no {REPORT} (written when `tinygpt finetune` ends)")
    report = read_json(file, CheckpointError)
    if not isinstance(report, dict) or not isinstance(report.get("before"), dict):
        raise CheckpointError(f"{file}: not a fine-tuning report")
    return report


def prepare_command(dataset: DataSet, from_: Path) -> str:
    """The `tinygpt prepare` command that prepares a data folder's text again with FROM's tokenizer."""
    sources = [s.get("path") or s.get("name") for s in dataset.meta.get("sources", []) if isinstance(s, dict)]
    words = ["tinygpt", "prepare", *(sources or ["TEXT"]), "--tokenizer-file", str(from_), "--out",
             f"{dataset.path}-{from_.name}"]
    return shlex.join(words)


# ---- the starting model -----------------------------------------------------------------------


def _load_base(from_: Path) -> GPT:
    if not from_.is_dir():
        raise CheckpointError(f"{from_}: no such model folder (a tinygpt run or a Hugging Face GPT-2 folder)")
    return checkpoint.load(from_, merge=True)


def _base_tokenizer(from_: Path):
    tokenizer = checkpoint.folder_tokenizer(from_)
    if tokenizer is None:
        raise TokenizerError(f"{from_}: no tokenizer, so data prepared for it cannot be checked or sampled")
    return tokenizer


def _finetune_config(base: GPTConfig, cfg: FinetuneConfig, from_: Path) -> GPTConfig:
    """The base's architecture with fine-tuning's context (cropped, never longer) and dropout."""
    block = base.block_size if cfg.block_size is None else cfg.block_size
    if block > base.block_size:
        raise ConfigError(f"block_size: {block} is longer than {from_}'s context of {base.block_size}: "
                          "its position embedding has no rows past that")
    dropout = base.dropout if cfg.dropout is None else cfg.dropout
    return dataclasses.replace(base, block_size=block, dropout=dropout)


def _prepare(model: GPT, cfg: FinetuneConfig, *, adapters: bool) -> GPT:
    """What trains: adapters (LoRA) or everything not frozen; activation checkpointing when asked."""
    if cfg.method == "lora" and adapters:
        lora = cfg.lora
        apply_lora(model, lora.rank, lora.alpha, lora.targets, lora.dropout)
    elif cfg.method == "full":
        freeze(model, embeddings=cfg.freeze_embeddings, layers=cfg.freeze_layers)
    model.grad_checkpoint = cfg.grad_checkpoint
    return model.train()


def _start(from_: Path, base: GPT, model_config: GPTConfig, cfg: FinetuneConfig) -> Start:
    lora = cfg.method == "lora"
    if lora and checkpoint.is_adapter_run(from_):
        raise ConfigError(f"{from_} is an adapter run: LoRA needs a full model as its base (tinygpt merge it first)")

    def build() -> GPT:
        return _prepare(reconfigured(_load_base(from_), model_config, str(from_)), cfg, adapters=True)

    def load(run: Path) -> GPT:
        # an adapter run comes back with its adapters (and its base checked against the checksum)
        return _prepare(checkpoint.load(run), cfg, adapters=False)

    record = {"finetune": {**cfg.to_dict(), "from": str(from_.resolve())}}
    return Start(model_config, build, load, cfg.default_lr, adapter_base=from_ if lora else None,
                 base_checksum=weights_checksum(base) if lora else None, keep=cfg.keep, record=record)


class _CountParams(TrainCallback):
    """The trained model's parameters, trainable and in all, as the run ends."""

    def __init__(self) -> None:
        self.trainable = self.total = 0

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())


# ---- the report -------------------------------------------------------------------------------


@dataclass
class _Text:
    name: str  # "data" or "reference"
    where: str
    tokens: np.ndarray


def _report_texts(from_: Path, dataset: DataSet, cfg: FinetuneConfig, tokenizer) -> list[_Text]:
    """The validation split, and the reference text (a file, or the base's own validation data)."""
    n = cfg.report_tokens + 1
    texts = [_Text("data", f"{dataset.path} (val)", np.asarray(dataset.val[:n]))]
    if cfg.reference is not None:
        path = Path(cfg.reference)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read the reference text ({getattr(e, 'strerror', None) or e})") from None
        ids = tokenizer.encode(text)[:n]
        if len(ids) < 2:
            raise DataError(f"{path}: the reference text needs at least 2 tokens, it has {len(ids)}")
        texts.append(_Text("reference", str(path), np.asarray(ids, dtype=np.int64)))
    else:
        own = _base_val_data(from_, tokenizer)
        if own is not None:
            texts.append(_Text("reference", f"{own.path} (val, the base's own data)", np.asarray(own.val[:n])))
    return texts


def _base_val_data(from_: Path, tokenizer) -> DataSet | None:
    """The data a tinygpt base was trained on, when its train_config.json names a folder still there
    and prepared with the base's tokenizer; else None (a Hugging Face folder records none)."""
    file = from_ / TRAIN_CONFIG
    saved = read_json(file, CheckpointError) if file.is_file() else None
    folder = saved.get("data") if isinstance(saved, dict) else None
    if not isinstance(folder, str) or not Path(folder).is_dir():
        return None
    try:
        own = load_data(folder)
        check_data_for_run(from_, own, tokenizer)
    except DataError:
        return None
    return own if len(own.val) >= 2 else None


def _measure(model: GPT, texts: list[_Text], tokenizer, cfg: FinetuneConfig) -> dict[str, Any]:
    """Loss and bits per char/byte on each text, and the samples, for one model."""
    model.eval()
    out: dict[str, Any] = {}
    unit = "char" if tokenizer.kind == "char" else "byte"
    for text in texts:
        result = evaluate(model, text.tokens)
        predicted = tokenizer.decode(text.tokens[1:].tolist())  # the first token is context, never predicted
        size = len(predicted) if unit == "char" else len(predicted.encode("utf-8"))
        out[text.name] = {"loss": result["loss"], f"bits_per_{unit}": result["nll"] / math.log(2) / max(1, size),
                          "tokens": result["tokens"], "text": text.where}
    out["samples"] = _samples(model, texts[0].tokens, tokenizer, cfg)
    return out


@torch.no_grad()
def _samples(model: GPT, val: np.ndarray, tokenizer, cfg: FinetuneConfig) -> list[dict[str, str]]:
    prompts = list(cfg.prompts) or [tokenizer.decode(val[: min(8, len(val) - 1)].tolist())]
    block = model.config.block_size
    samples = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)[-max(1, block - cfg.sample_tokens):]  # the prompt's end, with room to write
        if not ids:
            continue
        g = torch.Generator().manual_seed(SAMPLE_SEED)
        new = max(1, min(cfg.sample_tokens, block - len(ids)))
        out = generate(model, torch.tensor([ids]), new, temperature=0.8, top_k=40, generator=g,
                       vocab_size=tokenizer.vocab_size)
        samples.append({"prompt": prompt, "text": tokenizer.decode(out[0, len(ids):].tolist())})
    return samples


def peak_memory() -> int:
    """This process's peak resident memory in bytes (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _report(from_: Path, cfg: FinetuneConfig, result: TrainResult, before: dict, after: dict, counter: _CountParams,
            seconds: float) -> dict[str, Any]:
    change = {name: after[name]["loss"] - before[name]["loss"] for name in before if name != "samples"}
    memory: dict[str, Any] = {"peak_rss_bytes": peak_memory()}
    if torch.cuda.is_available():
        memory["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return {
        "from": str(from_), "method": cfg.method, "keep": cfg.keep, "steps": result.step, "stopped": result.stopped,
        "tokens": result.tokens, "before": before, "after": after, "loss_change": change,
        "forgetting": change.get("reference"),
        "params": {"trainable": counter.trainable, "total": counter.total},
        "memory": memory, "seconds": seconds, "train_seconds": result.elapsed,
    }
