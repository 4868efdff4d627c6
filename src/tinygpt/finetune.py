"""Fine-tuning a pretrained GPT on your own text, on the one training loop (tinygpt.train), and the run
every command that trains a pretrained model shares, whatever it optimises.

    finetune(from_, data, out, FinetuneConfig(...))   trains a run folder or a Hugging Face GPT-2
                                                      folder further: full, LoRA or frozen layers,
                                                      and reports what changed (finetune_report.json)
    tune(from_, data, out, tuning, ...)               the same run with another objective (a Tuning:
                                                      GRPO's rollouts, DPO's pairs), its own report
    freeze(model, embeddings=True, layers=N)          stops the token and position embeddings and the
                                                      first N blocks from training; the rest trains in full
    start_model(from_, data)                          the model a fine-tuning starts from ("before")

Chat data prepared with the base's tokenizer (`prepare FILE.jsonl --format chat --tokenizer-file
FROM`) is supervised fine-tuning: the base's tokenizer plus a chat template, whose special tokens
get new embedding rows (the mean of the old ones), and the loss mask of the assistant's tokens.

tune hands train() a train.Start: how to build the starting model (the base in float32, its
dropout set, adapters added or layers frozen), how to load it back from a checkpoint on resume, the
training window (block_size: the batches' length, never the model's context, which stays the
base's), the dtypes to save in (the base's), for LoRA that checkpoints are adapter runs naming the
base, and the Tuning's objective, whose name train_config.json records so that only its own command
resumes the run. LoRA's adapters live in tinygpt.lora; adapter runs are written and read by
tinygpt.checkpoint; the report is tinygpt.report's.

A base stored in bfloat16 (SmolLM2's and Qwen's published weights) trains in float32 all the same,
weights and AdamW's moments: in bfloat16 most updates at a fine-tuning rate are below half a step of
the weight they change and round away. A full run is saved in the base's dtype (its float32 weights
kept in train_state.pt for a resume); LoRA's adapters are saved in float32, as PEFT keeps them, and a
merge folds them into the base's dtype.
"""

from __future__ import annotations

import dataclasses
import shlex
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
from .model import GPT, grow_vocab, score_head
from .report import CountParams, Text, dtype_names, make_report, reference_text, score_texts, val_text
from .run_folder import RunFolder
from .tokenizer.base import Tokenizer, encode_named
from .tokenizer.chat import render_chat_prompt, stop_ids, with_chat_template
from .train.callbacks import TrainCallback, TrainResult
from .train.loop import train
from .train.objectives import Objective
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
    """What finetune() (or tune(), for another objective) did.

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


class Tuning:
    """What a command that trains FROM under fine-tuning's settings (FinetuneConfig: full or LoRA, frozen
    parts, keep, the report's reference text) brings to the run tune() makes: its objective and what its
    report measures. Its defaults are finetune's (the data's own objective: the next-token loss); finetune's
    report (_Finetune) and the other objectives (GRPO's, DPO's, a reward model's) are subclasses, each of those
    in its own module.

    tune() calls begin once FROM is loaded and its tokenizer checked, so that what depends on FROM is
    settled and refused there, before anything is measured or written; measure on the base and then on
    the checkpoint kept; and hands train() the data (trains_on), the objective and the settings to record.

    Attributes:
        name: the command that trains it, and the key of its settings in train_config.json and the report:
            a run is resumed by its own command only.
        title: what the report says was done ("fine-tuned", "trained with GRPO").
        sampled: how the report's samples were written ("same seed", "greedy").
        head: the head of the model the run trains: "lm", FROM's own, or "reward", FROM with its head
            replaced by a new score (tinygpt.model.score_head): a reward model.
    """

    name = "finetune"
    title = "fine-tuned"
    sampled = "same seed"
    head = "lm"

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        """Settle, and refuse, what depends on FROM: prompts its tokenizer cannot write, completions longer
        than its context. Nothing by default.

        Args:
            base: what the run starts from (its tokenizer, its model as stored).
            dataset: the data folder tune() was given (load_data), or None.
            cfg: the fine-tuning settings.
        """

    def measure(self, model: GPT) -> dict[str, Any]:
        """The report's sections of one model, before or after (tune() adds the reference text's): scored texts
        (tinygpt.report.score_texts), sections of numbers of the objective's own, and "samples", a list of
        {"prompt", "text"}, the same prompts before and after.

        Args:
            model: the model, which it may put in eval mode.
        """
        raise NotImplementedError

    def trains_on(self, data: str | Path | DataSet | None) -> str | Path | DataSet:
        """What train() trains on: the data tune() was given by default, else a DataSet of the objective's
        own (GRPO's prompts)."""
        if data is None:
            raise ConfigError(f"{self.name} needs data to train on")
        return data

    def objective(self) -> Callable[..., Objective] | None:
        """What a step optimises, as Start.objective takes it; None: the data's own (the next-token loss,
        masked on chat data)."""
        return None

    def settings(self) -> dict[str, Any] | None:
        """The objective's settings, JSON-ready, which train_config.json and the report keep under its name."""
        return None


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
    return tune(from_, data, out, _Finetune(), config, train_config, resume=resume,
                merge=merge, progress=progress, callbacks=callbacks, should_stop=should_stop)


def tune(
    from_: str | Path,
    data: str | Path | None,
    out: str | Path,
    tuning: Tuning,
    config: FinetuneConfig | None = None,
    train_config: TrainConfig | None = None,
    *,
    resume: bool = False,
    merge: str | Path | None = None,
    progress: bool = False,
    callbacks: Sequence[TrainCallback] = (),
    should_stop: Callable[[int], bool] | None = None,
) -> FinetuneResult:
    """Train a pretrained model under fine-tuning's settings with a Tuning's objective, on the same loop as
    train(), and report what changed: finetune() with the next-token loss, and every command that trains
    FROM with another objective with its own.

    Args:
        from_: the base: a tinygpt run folder or a Hugging Face folder.
        data: a data folder prepared with the base's tokenizer (chat data: with a chat template's tokens
            after it), or None for an objective that brings its own (Tuning.trains_on).
        out: the run folder: a plain run for method full, an adapter run for lora.
        tuning: the objective and what its report measures.
        config: what trains and how (FinetuneConfig()).
        train_config: the optimization (default: DEFAULT_TRAIN's recipe), its lr left None the method's
            fine-tuning rate.
        resume: continue the run in `out` from its checkpoint; a run of another objective is refused.
        merge: with lora, also write the adapters folded into the base as a plain run here.
        progress, callbacks, should_stop: as for train().

    The report (RUN/finetune_report.json; tinygpt.report.make_report) holds the tuning's measures of the
    base and of the checkpoint kept, the loss on the reference text (forgetting), the objective's name
    and settings, and the run's facts: the method, the steps, parameters, peak memory, time and dtypes.

    Raises:
        ConfigError: bad settings, what the tuning refuses, a run of another objective to resume.
        DataError: the data was prepared with another tokenizer.
        CheckpointError, TrainingError: as for train() and tinygpt.load.
    """
    cfg = config or FinetuneConfig()
    tcfg = train_config or TrainConfig(**DEFAULT_TRAIN)
    from_, out, folder = Path(from_), Path(out), RunFolder(out)
    _check_settings(cfg, tcfg, from_, out, merge)
    # under torchrun every process fine-tunes its slice of each batch (train() joins the job); each
    # measures the same "before" and "after", and rank 0 alone writes the report and the merged run
    with distributed.process_group(resolve_device(tcfg.device), tcfg.dist_timeout) as ctx:
        dataset = load_data(data) if data is not None else None
        base = Base.of(from_, dataset, cfg)
        if base.config.head == "reward" and tuning.head == "lm":
            raise ConfigError(f"{from_} is a reward model (a score for a text, no next token): tinygpt {tuning.name} "
                              f"trains a language model; a reward model scores GRPO's completions (--reward {from_})")
        base_checksum = weights_checksum(base.model)  # hashed once (every weight): a resume checks its base by it
        config = base.config if tuning.head == "lm" else dataclasses.replace(base.config, head=tuning.head,
                                                                              tie_weights=False)
        model_config = (_check_resume(out, from_, base_checksum, cfg, config, tuning.name)
                        if resume and folder.has_weights() else config)
        tuning.begin(base, dataset, cfg)  # what it refuses is refused here, before any measuring or training
        reference = reference_text(from_, cfg, base.tokenizer) if tuning.head == "lm" else None  # a score has no loss
        measure = _with_reference(tuning, reference, base.tokenizer, cfg)
        dtypes = {name: t.dtype for name, t in base.model.state_dict().items()}  # the base's, to save the run in
        start = _make_start(from_, base_checksum, model_config, cfg, base.new_ids, dtypes, tuning)
        before = measure(_shaped(base.model, model_config, from_, base.new_ids))
        del base  # the training builds its own copy: do not hold two through the run
        counter, started = CountParams(), time.perf_counter()
        result = train(tuning.trains_on(data), out, start, tcfg, resume=resume, progress=progress,
                       callbacks=[counter, *callbacks], should_stop=should_stop)
        ctx.barrier()  # rank 0 has written the checkpoint the others read
        after = measure(checkpoint.load(out, merge=True))  # the kept checkpoint: with keep best, the best one
        settings = tuning.settings()
        about = {"objective": tuning.name, "title": tuning.title, "sampled": tuning.sampled,
                 **({tuning.name: settings} if settings is not None else {})}
        report = make_report(from_, cfg, about, result, before, after, counter, time.perf_counter() - started,
                             folder.weights_step(), dtype_names(dtypes.values()))
        if ctx.is_main:
            folder.write_report(report)
            if merge is not None:
                checkpoint.merge_run(out, merge)
        ctx.barrier()
    return FinetuneResult(out, result, report, Path(merge) if merge is not None else None)


def _with_reference(tuning: Tuning, reference: Text | None, tokenizer: Tokenizer,
                    cfg: FinetuneConfig) -> Callable[[GPT], dict[str, Any]]:
    """The tuning's measure of a model, with the reference text's loss (forgetting) before the samples."""

    def measure(model: GPT) -> dict[str, Any]:
        own = tuning.measure(model)
        samples = own.pop("samples")
        scored = score_texts(model, [reference], tokenizer, cfg) if reference is not None else {}
        return {**own, **scored, "samples": samples}

    return measure


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
    base = Base.of(from_, load_data(data), config or FinetuneConfig())
    return _shaped(base.model, base.config, from_, base.new_ids).eval(), base.data_tokenizer


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
class Base:
    """What a run trained from FROM starts from.

    Args:
        path: FROM.
        model: the base model as stored.
        tokenizer: its tokenizer.
        data_tokenizer: the data's: the base's, or with a chat template's tokens after it (new_ids).
        new_ids: those tokens' ids.
        config: the model config the run trains (fine-tuning's dropout, the vocabulary grown).
    """

    path: Path
    model: GPT
    tokenizer: Tokenizer
    data_tokenizer: Tokenizer
    new_ids: range
    config: GPTConfig

    @classmethod
    def of(cls, from_: Path, dataset: DataSet | None, cfg: FinetuneConfig) -> Base:
        """FROM, and the data folder it trains on (None: data of FROM's own tokenizer, such as GRPO's prompts)."""
        model = _load_base(from_)
        tokenizer = _base_tokenizer(from_)
        data_tokenizer = data_tokenizer_for(from_, dataset, tokenizer) if dataset is not None else tokenizer
        new_ids = range(tokenizer.vocab_size, data_tokenizer.vocab_size)  # a chat template's tokens, if it adds them
        config = _finetune_config(model.config, cfg, from_, new_ids)
        return cls(from_, model, tokenizer, data_tokenizer, new_ids, config)

    def reference(self) -> Callable[[], GPT]:
        """How to build the model the run starts from again, frozen, in eval mode and float32: the reference
        a KL term or a log-ratio compares the policy with in a full run (a LoRA run's is its base with the
        adapters off). The builder holds no model: none is kept until it is called."""
        path, config, new_ids = self.path, dataclasses.replace(self.config, dropout=0.0), self.new_ids
        return lambda: _shaped(_load_base(path), config, path, new_ids).float().eval().requires_grad_(False)


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
    (a padding row was only ever taught never to be written). A config with a reward head: the language
    model shaped so, then its head replaced by a score (score_head)."""
    scored = config.head != model.config.head
    same_vocab = dataclasses.replace(config, vocab_size=model.config.vocab_size)
    if scored:  # shaped as the language model it is made from, then given its score
        same_vocab = dataclasses.replace(same_vocab, head=model.config.head, tie_weights=model.config.tie_weights)
    model = reconfigured(model, same_vocab, str(from_))
    old = model.config.vocab_size
    padded = range(new_ids.start, min(new_ids.stop, old))
    with torch.no_grad():
        for weight in {id(w): w for w in (model.wte.weight, model.lm_head.weight)}.values():  # a tied head once
            weight[padded.start : padded.stop] = weight.mean(dim=0)
    model = grow_vocab(model, config.vocab_size)
    return score_head(model) if scored else model


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


def _check_resume(out: Path, from_: Path, base_checksum: str, cfg: FinetuneConfig, config: GPTConfig,
                  command: str) -> GPTConfig:
    """A resumed run trained from FROM is one of `command`'s, and keeps its method, what it trains, its window
    and its base: anything else is refused before the run is touched (a pretraining run would be trained
    on at another rate and its weights replaced, another objective's steps would go on from its weights;
    the adapters or weights trained so far are of that shape, on that base's weights). The model config it
    trains: `config`, or the run's own where it differs only by a shorter context, a run fine-tuned before
    --block-size stopped cropping the context (its checkpoint has that shape; a GPT-2 run's position
    embedding is cropped).

    Raises:
        ConfigError: naming the setting, the base, or the command that continues the run.
    """
    folder = RunFolder(out)
    saved = folder.finetune_settings(ConfigError)
    if saved is None:
        raise ConfigError(f"{out} is not a fine-tune run (its {folder.record_file.name} has no finetune settings): "
                          "continue it with tinygpt train --resume, or fine-tune into a new folder")
    folder.check_objective(command, ConfigError)
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


def _make_start(from_: Path, base_checksum: str | None, model_config: GPTConfig, cfg: FinetuneConfig,
                new_ids: range, dtypes: dict[str, torch.dtype], tuning: Tuning) -> Start:
    """The Start tune() hands train(): the model built (the base in float32, adapters added or layers frozen)
    and loaded back on resume, its rate, what it keeps, the tuning's objective and the settings recorded
    (the objective's name, so that only its command resumes the run); for LoRA, adapter runs naming the base."""
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

    settings = tuning.settings()
    record = {"finetune": {**cfg.to_dict(), "from": str(from_.resolve()), "base_checksum": base_checksum},
              "objective": tuning.name, **({tuning.name: settings} if settings is not None else {})}
    return Start(model_config, build, load, cfg.default_lr, adapter_base=from_ if lora else None,
                 base_checksum=base_checksum, keep=cfg.keep, record=record, window=cfg.block_size,
                 dtypes=None if lora else dtypes,  # LoRA saves its adapters as trained, in float32
                 objective=tuning.objective())


# ---- finetune's report: the validation split and the samples -----------------------------------


class _Finetune(Tuning):
    """finetune's own: the data's objective (the next-token loss, masked on chat data); its report scores the
    validation split (in windows of block_size, on chat data the assistant's tokens) and samples the same
    prompts with the same seed (on chat data, replies)."""

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        self.text = val_text("data", dataset, "val", cfg.report_tokens + 1)
        self.prompts = _sample_prompts(self.text, base.data_tokenizer, cfg)  # refused here, before any measuring
        self.tokenizer, self.cfg = base.data_tokenizer, cfg

    def measure(self, model: GPT) -> dict[str, Any]:
        scored = score_texts(model, [self.text], self.tokenizer, self.cfg)
        return {**scored, "samples": _samples(model, self.text, self.prompts, self.tokenizer, self.cfg)}


def _sample_prompts(text: Text, tokenizer, cfg: FinetuneConfig) -> list[tuple[str, list[int]]]:
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
def _samples(model: GPT, text: Text, prompts: list[tuple[str, list[int]]], tokenizer,
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
