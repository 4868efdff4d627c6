"""Fine-tuning a pretrained GPT on your own text, on the one training loop (tinygpt.train).

    finetune(from_, data, out, FinetuneConfig(...))   trains a run folder or a Hugging Face GPT-2
                                                      folder further: full, LoRA or frozen layers,
                                                      and reports what changed (finetune_report.json)
    freeze(model, embeddings=True, layers=N)          stops the token and position embeddings and the
                                                      first N blocks from training; the rest trains in full
    start_model(from_, data)                          the model a fine-tuning starts from ("before")

Chat data prepared with the base's tokenizer (`prepare FILE.jsonl --format chat --tokenizer-file
FROM`) is supervised fine-tuning: the base's tokenizer plus a chat template, whose special tokens
get new embedding rows (the mean of the old ones), and the loss mask of the assistant's tokens.

finetune hands train() a train.Start: how to build the starting model (the base in float32, its
dropout set, adapters added or layers frozen), how to load it back from a checkpoint on resume, the
training window (block_size: the batches' length, never the model's context, which stays the
base's), the dtypes to save in (the base's), and, for LoRA, that checkpoints are adapter runs naming
the base. LoRA's adapters live in tinygpt.lora; adapter runs are written and read by tinygpt.checkpoint.

A base stored in bfloat16 (SmolLM2's and Qwen's published weights) trains in float32 all the same,
weights and AdamW's moments: in bfloat16 most updates at a fine-tuning rate are below half a step of
the weight they change and round away. A full run is saved in the base's dtype (its float32 weights
kept in train_state.pt for a resume); LoRA's adapters are saved in float32, as PEFT keeps them, and a
merge folds them into the base's dtype.
"""

from __future__ import annotations

import dataclasses
import json
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

from . import checkpoint, distributed
from .config.finetune import FinetuneConfig
from .config.model import GPTConfig
from .config.train import TrainConfig
from .data.folder import DataSet, load_data
from .device import resolve_device
from .errors import CheckpointError, ConfigError, DataError, TokenizerError
from .generate import generate
from .lora import apply_lora, check_rank, weights_checksum
from .model import GPT, grow_vocab
from .run_folder import RunFolder
from .tokenizer.base import Tokenizer, encode_named
from .tokenizer.chat import render_chat_prompt, stop_ids, with_chat_template
from .train.callbacks import TrainCallback, TrainResult
from .train.evaluation import conversations_within, evaluate, evaluate_chat
from .train.loop import train
from .train.run import Start
from .weights import reconfigured

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
        embeddings: freeze wte and wpe (where positions are learned). A head tied to wte is the same tensor, so it freezes with
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
        if model.wpe is not None:  # rotary positions have none
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
        data: a folder prepared with the base's tokenizer (`tinygpt prepare TEXT --tokenizer-file FROM`),
            or chat data prepared with it (`tinygpt prepare FILE.jsonl --format chat --tokenizer-file
            FROM`): the base's tokenizer plus a chat template, whose special tokens come after the
            base's vocabulary. The model's wte and lm_head then grow by those tokens
            (tinygpt.model.grow_vocab: each new row starts as the mean embedding), training counts
            the assistant's tokens only (the loss mask), and the run's tokenizer carries the
            template, so `serve`, `chat` and `export` of the run use it. Growing needs the
            embeddings to train: method lora and freeze_embeddings are refused then.
        out: the run folder: a plain run for method full, an adapter run (PEFT's adapter_config.json and
            adapter_model.safetensors, tinygpt_adapter.json naming the base, beside train_state.pt) for lora.
        config: what trains and how (FinetuneConfig()).
        train_config: the optimization (default: DEFAULT_TRAIN's recipe). Its lr left None is the
            method's fine-tuning rate (FinetuneConfig.default_lr), far below pretraining's.
        resume: continue the run in `out` from its checkpoint (bitwise on CPU, a bfloat16 base's too).
        merge: with lora, also write the adapters folded into the base as a plain run here.
        progress, callbacks, should_stop: as for train().

    The report (RUN/finetune_report.json) holds, before and after on the data's validation split in
    windows of config.block_size: loss (on chat data the assistant's tokens' only) and bits per char
    (char tokenizer) or per byte; the same prompts sampled with the same seed (on chat data, replies);
    the loss on a reference text (config.reference, default the base's own validation data when it is
    a tinygpt run that records it) as a measure of forgetting; trainable and total parameters; peak
    memory; the time; the dtypes. "After" is the checkpoint kept in `out` as saved (kept_step: its step),
    with keep best the one of the lowest validation loss, FROM's own at step 0 included: when no step
    beats FROM, `out` holds FROM itself (a full run its weights, an adapter run its adapters at zero).

    Raises:
        ConfigError: bad settings (a block_size longer than the base's, merge with full, lora on chat
            data that adds tokens, ...).
        DataError: the data was prepared with another tokenizer (the message gives the prepare command).
        CheckpointError, TrainingError: as for train() and tinygpt.load.
    """
    cfg = config or FinetuneConfig()
    tcfg = train_config or TrainConfig(**DEFAULT_TRAIN)
    from_, out, folder = Path(from_), Path(out), RunFolder(out)
    _check_settings(cfg, tcfg, from_, out, merge)
    # under torchrun every process fine-tunes its slice of each batch (train() joins the job); each
    # measures the same "before" and "after", and rank 0 alone writes the report and the merged run
    with distributed.process_group(resolve_device(tcfg.device), tcfg.dist_timeout) as ctx:
        dataset = load_data(data)
        base = _Base.of(from_, dataset, cfg)
        base_checksum = weights_checksum(base.model)  # hashed once (every weight): a resume checks its base by it
        model_config = (_check_resume(out, from_, base_checksum, cfg, base.config) if resume and folder.has_weights()
                        else base.config)
        measure = _Measure.of(from_, dataset, cfg, base)  # its prompts refused here, before any measuring or training
        dtypes = {name: t.dtype for name, t in base.model.state_dict().items()}  # the base's, to save the run in
        start = _start(from_, base_checksum, model_config, cfg, base.new_ids, dtypes)
        before = measure(_shaped(base.model, model_config, from_, base.new_ids))
        del base  # the training builds its own copy: do not hold two through the run
        counter, started = _CountParams(), time.perf_counter()
        result = train(data, out, start, tcfg, resume=resume, progress=progress, callbacks=[counter, *callbacks],
                       should_stop=should_stop)
        ctx.barrier()  # rank 0 has written the checkpoint the others read
        after = measure(checkpoint.load(out, merge=True))  # the kept checkpoint: with keep best, the best one
        report = _report(from_, cfg, result, before, after, counter, time.perf_counter() - started,
                         folder.weights_step(), _dtype_names(dtypes.values()))
        if ctx.is_main:
            folder.write_report(report)
            if merge is not None:
                checkpoint.merge_run(out, merge)
        ctx.barrier()
    return FinetuneResult(out, result, report, Path(merge) if merge is not None else None)


def start_model(from_: str | Path, data: str | Path, config: FinetuneConfig | None = None) -> tuple[GPT, Tokenizer]:
    """The model finetune() starts from, and the data's tokenizer: the base with its dropout set and
    (chat data) its vocabulary grown as fine-tuning does, in eval mode, in its own dtype. What a
    comparison of a model before and after fine-tuning measures as "before".

    Args:
        from_, data, config: as for finetune().

    Raises:
        As finetune() does for a base or data it refuses.
    """
    from_ = Path(from_)
    base = _Base.of(from_, load_data(data), config or FinetuneConfig())
    return _shaped(base.model, base.config, from_, base.new_ids).eval(), base.data_tokenizer


def read_report(run: str | Path) -> dict[str, Any]:
    """A fine-tuned run's finetune_report.json.

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


# What a report holds, as read_report checks it: a key ending "?" may be absent; "bits_per_*" is
# one key of that prefix (bits_per_char or bits_per_byte); a list is a list of its one item's shape.
_NUMBER, _COUNT = (int, float), int
_SCORE = {"loss": _NUMBER, "bits_per_*": _NUMBER, "tokens": _COUNT, "text": str}
_MEASURED = {"data": _SCORE, "reference?": _SCORE, "samples": [{"prompt": str, "text": str}]}
_REPORT_SHAPE = {
    "from": str, "method": str, "keep": str, "steps": _COUNT, "tokens": _COUNT, "before": _MEASURED,
    "after": _MEASURED, "params": {"trainable": _COUNT, "total": _COUNT}, "memory": {"peak_rss_bytes": _COUNT},
    "seconds": _NUMBER, "train_seconds": _NUMBER, "kept_step?": _COUNT, "dtype?": {"base": str, "saved": str},
}


def _report_mismatch(report: dict[str, Any]) -> str | None:
    """What before and after measure differently (a text one has and the other not, another unit), or None."""
    before, after = report["before"], report["after"]
    if ("reference" in before) != ("reference" in after):
        return f"{'after' if 'reference' in before else 'before'}.reference is missing"
    for name in before.keys() & {"data", "reference"}:
        if [k for k in before[name] if k.startswith("bits_per_")] != [k for k in after[name] if k.startswith("bits_per_")]:
            return f"before.{name} and after.{name} count bits in different units"
    return None


def _report_error(value: Any, shape: Any = None, where: str = "") -> str | None:
    """What in a report does not have its shape (_REPORT_SHAPE), in words, or None."""
    shape = _REPORT_SHAPE if shape is None else shape
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        for key, inner in shape.items():
            name, optional = key.rstrip("?"), key.endswith("?")
            if name.endswith("*"):  # one key of this prefix
                found = [k for k in value if k.startswith(name[:-1])]
                if len(found) != 1:
                    return f"{where}.{name} is {'missing' if not found else 'given twice'}"
                name = found[0]
            if name not in value:
                if optional:
                    continue
                return f"{(where + '.' if where else '') + name} is missing"
            wrong = _report_error(value[name], inner, (where + "." if where else "") + name)
            if wrong is not None:
                return wrong
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where} is not a list"
        return next((w for i, v in enumerate(value) if (w := _report_error(v, shape[0], f"{where}[{i}]"))), None)
    if isinstance(value, bool) or not isinstance(value, shape):
        kind = "a string" if shape is str else "a whole number" if shape is int else "a number"
        return f"{where} is not {kind} ({json.dumps(value)[:40]})"
    return None


def prepare_command(dataset: DataSet, from_: Path) -> str:
    """The `tinygpt prepare` command that prepares a data folder's text (or conversations) again with
    FROM's tokenizer."""
    sources = [s.get("path") or s.get("name") for s in dataset.meta.get("sources", []) if isinstance(s, dict)]
    chat = ["--format", "chat"] if dataset.is_chat else []
    words = ["tinygpt", "prepare", *(sources or ["FILE.jsonl" if chat else "TEXT"]), *chat, "--tokenizer-file",
             str(from_), "--out", f"{dataset.path}-{from_.name}"]
    return shlex.join(words)


def data_tokenizer_for(from_: Path, dataset: DataSet, tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer a data folder was prepared with, when a model folder may train on it: FROM's own,
    or (chat data) FROM's extended by the data's chat template, its special tokens after FROM's
    vocabulary, exactly as `prepare --format chat --tokenizer-file FROM` makes it.

    Args:
        from_: the model folder (for the messages).
        dataset: the data folder (load_data).
        tokenizer: FROM's tokenizer.

    Raises:
        DataError: any other tokenizer (the message gives the prepare command).
    """
    try:
        RunFolder(from_).check_data(dataset, tokenizer, remedy=f"prepare it with: {prepare_command(dataset, from_)}")
        return tokenizer
    except DataError:
        template = dataset.tokenizer.chat_template if dataset.is_chat else None
        if template is None or dataset.fingerprints.isdisjoint(with_chat_template(tokenizer, template).fingerprints()):
            raise
    return dataset.tokenizer


# ---- the starting model -----------------------------------------------------------------------


def _check_settings(cfg: FinetuneConfig, tcfg: TrainConfig, from_: Path, out: Path, merge: str | Path | None) -> None:
    """Refuse what the settings cannot do together, before anything is loaded."""
    if merge is not None and cfg.method != "lora":
        raise ConfigError("merge goes with method lora: a full fine-tune is a plain run already")
    if cfg.method == "lora" and tcfg.optimizer == "muon":
        raise ConfigError("--optimizer muon trains whole weight matrices; LoRA's low-rank adapters train with "
                          "adamw (or fine-tune with --method full)")
    if merge is not None:  # before the training, not after it
        checkpoint.check_merge_target(merge, out, from_)


@dataclass
class _Base:
    """What a fine-tuning starts from: the base model as stored, its tokenizer, the data's (the base's, or
    with a chat template's tokens after it: new_ids), and the model config fine-tuning trains."""

    model: GPT
    tokenizer: Tokenizer
    data_tokenizer: Tokenizer
    new_ids: range
    config: GPTConfig

    @classmethod
    def of(cls, from_: Path, dataset: DataSet, cfg: FinetuneConfig) -> _Base:
        model = _load_base(from_)
        tokenizer = _base_tokenizer(from_)
        data_tokenizer = data_tokenizer_for(from_, dataset, tokenizer)
        new_ids = range(tokenizer.vocab_size, data_tokenizer.vocab_size)  # a chat template's tokens, if it adds them
        return cls(model, tokenizer, data_tokenizer, new_ids, _finetune_config(model.config, cfg, from_, new_ids))


def _load_base(from_: Path) -> GPT:
    if not from_.is_dir():
        raise CheckpointError(f"{from_}: no such model folder (a tinygpt run or a Hugging Face GPT-2 folder)")
    return checkpoint.load(from_, merge=True)


def _base_tokenizer(from_: Path):
    tokenizer = checkpoint.folder_tokenizer(from_)
    if tokenizer is None:
        raise TokenizerError(f"{from_}: no tokenizer, so data prepared for it cannot be checked or sampled")
    return tokenizer


def _finetune_config(base: GPTConfig, cfg: FinetuneConfig, from_: Path, new_ids: range) -> GPTConfig:
    """The base's architecture, its context included, with fine-tuning's dropout and its vocabulary
    grown to cover `new_ids` (the tokens chat data adds after the base tokenizer's). cfg.block_size,
    the training window, must fit in that context."""
    if cfg.block_size is not None and cfg.block_size > base.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} is longer than {from_}'s context of {base.block_size}: "
                          "it bounds the training window within the model's context")
    dropout = base.dropout if cfg.dropout is None else cfg.dropout
    added = len(new_ids)
    if added > 0 and cfg.method == "lora":
        # the adapters would be saved without the new rows, and the frozen base has none for them
        raise ConfigError(f"method lora keeps {from_}'s vocabulary, but the data adds {added} tokens (its chat "
                          "template's) that need new embedding rows to train: fine-tune with --method full "
                          "(--freeze-layers N trains less), or LoRA from a model whose tokenizer has the template")
    if added > 0 and cfg.freeze_embeddings:
        raise ConfigError(f"--freeze-embeddings would keep the {added} tokens the data adds (its chat template's) at "
                          "one shared mean embedding, so the model could not tell them apart: drop it "
                          "(--freeze-layers N still freezes the blocks)")
    if cfg.method == "lora":  # before anything is measured or built
        check_rank(base, cfg.lora, "--lora-rank")
    vocab = max(base.vocab_size, new_ids.stop)
    return dataclasses.replace(base, dropout=dropout, vocab_size=vocab)


def _shaped(model: GPT, config: GPTConfig, from_: Path, new_ids: range) -> GPT:
    """A base model under fine-tuning's config: its dropout set (its context cropped only to resume a
    run that cropped it), its vocabulary grown
    to config's (tinygpt.model.grow_vocab). Every new token's row starts as the mean of the base's rows,
    also where the base's vocabulary was padded past its tokenizer's and the row exists already
    (a padding row was only ever taught never to be written)."""
    same_vocab = dataclasses.replace(config, vocab_size=model.config.vocab_size)
    model = reconfigured(model, same_vocab, str(from_))
    old = model.config.vocab_size
    padded = range(new_ids.start, min(new_ids.stop, old))
    with torch.no_grad():
        for weight in {id(w): w for w in (model.wte.weight, model.lm_head.weight)}.values():  # a tied head once
            weight[padded.start : padded.stop] = weight.mean(dim=0)
    return grow_vocab(model, config.vocab_size)


def _prepare(model: GPT, cfg: FinetuneConfig, *, adapters: bool) -> GPT:
    """What trains: adapters (LoRA) or everything not frozen, in float32 whatever the base stores (new
    adapters too); activation checkpointing when asked."""
    model = model.float()
    if cfg.method == "lora" and adapters:
        lora = cfg.lora
        apply_lora(model, lora.rank, lora.alpha, lora.targets, lora.dropout)
    elif cfg.method == "full":
        freeze(model, embeddings=cfg.freeze_embeddings, layers=cfg.freeze_layers)
    model.grad_checkpoint = cfg.grad_checkpoint
    return model.train()


def _check_resume(out: Path, from_: Path, base_checksum: str, cfg: FinetuneConfig, config: GPTConfig) -> GPTConfig:
    """A resumed fine-tune is a fine-tune run, and keeps its method, what it trains, its window and its base:
    anything else is refused before the run is touched (a pretraining run would be trained on at
    another rate and its weights replaced; the adapters or weights trained so far are of that
    shape, on that base's weights). The model config it trains: `config`, or the run's own where it
    differs only by a shorter context, a run fine-tuned before --block-size stopped cropping the
    context (its checkpoint has that shape; a GPT-2 run's position embedding is cropped).

    Raises:
        ConfigError: naming the setting, or the base.
    """
    folder = RunFolder(out)
    saved = folder.finetune_settings(ConfigError)
    if saved is None:
        raise ConfigError(f"{out} is not a fine-tune run (its {folder.record_file.name} has no finetune settings): "
                          "continue it with tinygpt train --resume, or fine-tune into a new folder")
    now = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.to_dict().items()}
    keys = ("method", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout") if saved.get("method") == "lora" \
        else ("method", "freeze_embeddings", "freeze_layers")
    for key in (*keys, "block_size"):  # the training window, which the model's config no longer records
        if key in saved and saved[key] != now[key]:
            raise ConfigError(f"{out} was fine-tuned with {key} {saved[key]!r}, not {now[key]!r}: "
                              "drop the setting to resume it")
    # the base's checksum as the run recorded it (an adapter run's own config names it too)
    expected = saved.get("base_checksum")
    if expected is None and folder.is_adapter_run():
        expected = folder.adapter_run().checksum
    if expected is not None and expected != base_checksum:
        raise ConfigError(f"{from_} is not the base {out} was fine-tuned from: resume it from that base")
    saved = folder.model_config()
    if saved.block_size < config.block_size and saved == dataclasses.replace(config, block_size=saved.block_size):
        return saved
    return config


def _start(from_: Path, base_checksum: str | None, model_config: GPTConfig, cfg: FinetuneConfig,
           new_ids: range, dtypes: dict[str, torch.dtype]) -> Start:
    lora = cfg.method == "lora"
    if lora and RunFolder(from_).is_adapter_run():
        raise ConfigError(f"{from_} is an adapter run: LoRA needs a full model as its base (tinygpt merge it first)")

    def build() -> GPT:
        return _prepare(_shaped(_load_base(from_), model_config, from_, new_ids), cfg, adapters=True)

    def load(run: Path) -> GPT:
        # an adapter run comes back with its adapters, on the base given now (checked against the checksum),
        # in float32 from the start so that its float32 adapters are not rounded to a bfloat16 base's
        model = checkpoint.load_adapter_run(run, base=from_, dtype=torch.float32) if lora else checkpoint.load(run)
        return _prepare(model, cfg, adapters=False)

    record = {"finetune": {**cfg.to_dict(), "from": str(from_.resolve()), "base_checksum": base_checksum}}
    return Start(model_config, build, load, cfg.default_lr, adapter_base=from_ if lora else None,
                 base_checksum=base_checksum, keep=cfg.keep, record=record, window=cfg.block_size,
                 dtypes=None if lora else dtypes)  # LoRA saves its adapters as trained, in float32


class _CountParams(TrainCallback):
    """The trained model's parameters, trainable and in all, as the run ends."""

    def __init__(self) -> None:
        self.trainable = self.total = 0

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())


# ---- the report -------------------------------------------------------------------------------


@dataclass
class _Measure:
    """What the report measures a model on, before and after: the texts, the prompts sampled, the data's
    tokenizer (_measure)."""

    texts: list[_Text]
    prompts: list[tuple[str, list[int]]]
    tokenizer: Tokenizer
    cfg: FinetuneConfig

    @classmethod
    def of(cls, from_: Path, dataset: DataSet, cfg: FinetuneConfig, base: _Base) -> _Measure:
        texts = _report_texts(from_, dataset, cfg, base.tokenizer)
        return cls(texts, _sample_prompts(texts[0], base.data_tokenizer, cfg), base.data_tokenizer, cfg)

    def __call__(self, model: GPT) -> dict[str, Any]:
        return _measure(model, self.texts, self.prompts, self.tokenizer, self.cfg)


@dataclass
class _Text:
    name: str  # "data" or "reference"
    where: str
    tokens: np.ndarray
    chat: DataSet | None = None  # chat data: scored on the assistant's tokens, its first `conversations`
    conversations: int = 0


def _report_texts(from_: Path, dataset: DataSet, cfg: FinetuneConfig, tokenizer) -> list[_Text]:
    """The validation split, and the reference text (a file, or the base's own validation data)."""
    n = cfg.report_tokens + 1
    texts = [_val_text("data", dataset, "val", n)]
    if cfg.reference is not None:
        path = Path(cfg.reference)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read the reference text ({getattr(e, 'strerror', None) or e})") from None
        ids = encode_named(tokenizer, text, f"--reference {path}")[:n]
        if len(ids) < 2:
            raise DataError(f"{path}: the reference text needs at least 2 tokens, it has {len(ids)}")
        texts.append(_Text("reference", str(path), np.asarray(ids, dtype=np.int64)))
    else:
        own = _base_val_data(from_, tokenizer)
        if own is not None:
            texts.append(_val_text("reference", own, "val, the base's own data", n))
    return texts


def _val_text(name: str, dataset: DataSet, what: str, n: int) -> _Text:
    """A data folder's validation split to score, its first n tokens; of chat data, the whole conversations
    within them (at least one), scored on the assistant's tokens as `tinygpt eval` scores chat data: a
    chat base's own data read as plain text would score its system, user and template tokens too, across
    conversations."""
    tokens = np.asarray(dataset.val[:n])
    if not dataset.is_chat:
        return _Text(name, f"{dataset.path} ({what})", tokens)
    return _Text(name, f"{dataset.path} ({what}, the assistant's tokens)", tokens, dataset,
                 conversations_within(dataset, n))


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


def _measure(model: GPT, texts: list[_Text], prompts: list[tuple[str, list[int]]], tokenizer,
             cfg: FinetuneConfig) -> dict[str, Any]:
    """Loss and bits per char/byte on each text, and the samples, for one model."""
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
    out["samples"] = _samples(model, texts[0], prompts, tokenizer, cfg)
    return out


def _sample_prompts(text: _Text, tokenizer, cfg: FinetuneConfig) -> list[tuple[str, list[int]]]:
    """(prompt, ids) to sample: the prompts given, else the validation text's start. On chat data a
    prompt is a user's message, and the default the first validation conversation up to its reply.

    Raises:
        ConfigError: a prompt the vocabulary cannot write, naming it.
    """
    val = text.tokens
    given = [(p, encode_named(tokenizer, p, f"--prompt {p!r}")) for p in cfg.prompts]
    if text.chat is None:
        start = tokenizer.decode(val[: min(8, len(val) - 1)].tolist())
        return given or [(start, tokenizer.encode(start))]
    if given:  # each a user's message, its text checked above
        return [(p, render_chat_prompt(tokenizer, [{"role": "user", "content": p}])) for p, _ in given]
    first = int(np.argmax(text.chat.masks["val"] > 0))  # the reply's first token; its start token is before it
    ids = np.asarray(val[:first]).tolist()
    return [(tokenizer.decode(ids), ids)]


@torch.no_grad()
def _samples(model: GPT, text: _Text, prompts: list[tuple[str, list[int]]], tokenizer,
             cfg: FinetuneConfig) -> list[dict[str, str]]:
    block = model.config.block_size
    stops = sorted(stop_ids(tokenizer)) if text.chat is not None else None  # a reply ends its turn
    samples = []
    for prompt, ids in prompts:
        # the prompt's end, with room to write: in a short context at least half of it is the prompt's,
        # or a chat prompt would lose its question
        ids = ids[-max(1, block - min(cfg.sample_tokens, block // 2)):]
        if not ids:
            continue
        g = torch.Generator().manual_seed(SAMPLE_SEED)
        new = max(1, min(cfg.sample_tokens, block - len(ids)))
        out = generate(model, torch.tensor([ids]), new, temperature=0.8, top_k=40, generator=g,
                       vocab_size=tokenizer.vocab_size, stop_tokens=stops)
        written = out[0, len(ids):].tolist()
        if stops and any(t in stops for t in written):  # up to the end of the turn, which is not text
            written = written[: min(written.index(t) for t in stops if t in written)]
        samples.append({"prompt": prompt, "text": tokenizer.decode(written)})
    return samples


def peak_memory() -> int:
    """This process's peak resident memory in bytes (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _report(from_: Path, cfg: FinetuneConfig, result: TrainResult, before: dict, after: dict, counter: _CountParams,
            seconds: float, kept_step: int, base_dtype: str) -> dict[str, Any]:
    change = {name: after[name]["loss"] - before[name]["loss"] for name in before if name != "samples"}
    memory: dict[str, Any] = {"peak_rss_bytes": peak_memory()}
    if torch.cuda.is_available():
        memory["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return {
        "from": str(from_), "method": cfg.method, "keep": cfg.keep, "kept_step": kept_step, "steps": result.step,
        "stopped": result.stopped,
        "tokens": result.tokens, "before": before, "after": after, "loss_change": change,
        "forgetting": change.get("reference"),
        "params": {"trainable": counter.trainable, "total": counter.total},
        # a resumed run's whole time: the earlier invocations' training, and this one's training and measuring
        "memory": memory, "seconds": seconds + result.total_elapsed - result.elapsed,
        "train_seconds": result.total_elapsed,
        # trained in float32 whatever FROM stores; saved in FROM's dtype, LoRA's adapters in float32
        "dtype": {"base": base_dtype, "saved": "float32" if cfg.method == "lora" else base_dtype},
    }


def _dtype_names(dtypes) -> str:
    """A model's dtypes in words: "bfloat16", or "bfloat16 and float32" where its weights mix them."""
    return " and ".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
