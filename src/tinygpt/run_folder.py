"""A run folder, and the one object that knows its files: RunFolder.

    RUN/config.json            the model's GPTConfig (an adapter run: its base's)
    RUN/model.safetensors      the weights (tinygpt.checkpoint writes and reads them)
    RUN/tokenizer.json         the tokenizer, when there is one
    RUN/train_state.pt         what a resume needs: step, optimizer, schedule, random streams, data position
    RUN/train_config.json      what the run trained on and with: the data folder, its tokenizer's
                               fingerprint, the TrainConfig, a fine-tune's settings (and the objective it
                               trained with, its settings under its name), notes (the ModelChoice)
    RUN/metrics.jsonl          a JSON line per step, evaluation and probe
    RUN/finetune_report.json   what a fine-tuning (or another objective trained from FROM) changed
    RUN/before-decay/          a WSD run's last step at the constant rate: a run folder of its own
    RUN/tinygpt_adapter.json   an adapter run's bookkeeping: its base's path and checksum, beside PEFT's
                               adapter_config.json and adapter_model.safetensors

A folder goes through stages: new (nothing of a run in it, or train_config.json alone: a run killed
before its first save, which starts over with the model it began with), resumable (weights and a
training state) and saved (weights alone: imported, merged, `tinygpt.save`d). RunFolder tells them
apart, reads the configs, the training state (torch.load with weights_only=True) and the adapters'
bookkeeping, keeps metrics.jsonl, and makes every check on them, each refusing in one line. Every
other module asks it for a file's path or an answer, and names none of these files itself (a layer
test holds it): tinygpt.checkpoint writes and reads the weights at the paths it gives.

The functions at the end (has_checkpoint, load_training, ...) ask one question of a folder by path,
for the callers that import them from tinygpt.train and tinygpt.checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .config.lora import LoraConfig
from .config.model import GPTConfig
from .config.train import DATA_ORDERS, OPTIMIZERS, TrainConfig
from .data.folder import DataSet, check_same_tokenizer
from .errors import CheckpointError, ConfigError, TrainingError
from .fileio import atomic_write, check_folder_path, check_regular_file, read_json, write_json
from .interop.hf import folder_config as hf_folder_config
from .interop.hf_folder import is_hf_folder
from .interop.peft import lora_from_peft
from .sizing import ModelChoice
from .weights import read_header

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
STATE = "train_state.pt"
TRAIN_CONFIG = "train_config.json"
METRICS = "metrics.jsonl"
REPORT = "finetune_report.json"
# a WSD run's checkpoint of the last step at the constant rate: a run folder of its own inside the
# run, from which a copy continues with another length (and so another decay)
BEFORE_DECAY = "before-decay"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's; what makes a folder an adapter run
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's
ADAPTER_BASE = "tinygpt_adapter.json"  # tinygpt's own: the base's path and checksum
ADAPTER_FORMAT = "tinygpt-lora"
ADAPTER_VERSION = 2
V1_WEIGHTS = "adapter.safetensors"  # version 1: tinygpt's names, its settings in adapter_config.json


@dataclasses.dataclass(frozen=True)
class AdapterRun:
    """What an adapter run's files say.

    Args:
        lora: the LoRA settings the adapters were trained with.
        base: the base model's folder, resolved (a relative path is relative to the adapter run).
        checksum: weights_checksum of the base the adapters were trained on; None for a PEFT
            adapter trained elsewhere, which carries none.
        weights: the adapters' file.
        names: each tensor's key in that file -> its tinygpt name (h.0.attn.c_attn.lora_A, ...).
    """

    lora: LoraConfig
    base: Path
    checksum: str | None
    weights: Path
    names: dict[str, str]

    @property
    def shown_base(self) -> str:
        """The base's path for messages, ".." folded away lexically (lora/../base -> base); loading
        follows the path as stored, which differs only where a symlink is in it."""
        return os.path.normpath(self.base)


class RunFolder:
    """A run folder's files, its stage, what it records and every check on it.

    Args:
        path: the folder (it need not exist yet).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.given = path  # as the caller spelled it, for the messages that name the folder so
        self.path = Path(path)

    # ---- its files -------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def weights_file(self) -> Path:
        """A full model's weights (an adapter run's adapters are adapter_weights_file)."""
        return self.path / WEIGHTS

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER

    @property
    def state_file(self) -> Path:
        return self.path / STATE

    @property
    def pending_state_file(self) -> Path:
        """Where a save writes the training state before its weights are renamed into place."""
        return self.path / (STATE + ".tmp")

    @property
    def record_file(self) -> Path:
        """train_config.json."""
        return self.path / TRAIN_CONFIG

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def report_file(self) -> Path:
        return self.path / REPORT

    @property
    def adapter_config_file(self) -> Path:
        return self.path / ADAPTER_CONFIG

    @property
    def adapter_weights_file(self) -> Path:
        return self.path / ADAPTER_WEIGHTS

    @property
    def adapter_base_file(self) -> Path:
        return self.path / ADAPTER_BASE

    @property
    def v1_weights_file(self) -> Path:
        return self.path / V1_WEIGHTS

    @property
    def before_decay(self) -> RunFolder:
        """A WSD run's checkpoint as its decay began: a run folder of its own inside this one."""
        return RunFolder(self.path / BEFORE_DECAY)

    # ---- what it holds ---------------------------------------------------------------------------

    def is_adapter_run(self) -> bool:
        """True for an adapter run: a folder holding adapter_config.json (save_adapter_run's, or a PEFT adapter's)."""
        return self.adapter_config_file.is_file()

    def _is_v1(self) -> bool:
        """An adapter run of tinygpt's first format: its adapter_config.json is tinygpt's own."""
        try:
            info = read_json(self.adapter_config_file, CheckpointError)
        except CheckpointError:
            return False
        return isinstance(info, dict) and info.get("format") == ADAPTER_FORMAT

    def trained_file(self) -> Path:
        """The file holding what a run trains: adapter_model.safetensors in an adapter run (adapter.safetensors
        in one of the first format), else model.safetensors."""
        if not self.is_adapter_run():
            return self.weights_file
        return self.v1_weights_file if self._is_v1() else self.adapter_weights_file

    def has_weights(self) -> bool:
        """Whether the folder holds a run's weights or an adapter run's adapters: a run to resume or use (a
        run killed before its first save holds none)."""
        return self.trained_file().exists()

    def weights_step(self) -> int:
        """The training step stored with a run's weights, or an adapter run's adapters (-1 when saved
        outside training)."""
        file = self.trained_file()
        step = read_header(file).get("__metadata__", {}).get("step", "-1")
        if not re.fullmatch(r"-1|[0-9]+", step):
            raise CheckpointError(f"{file}: the step in its metadata is {step!r}, not a number")
        return int(step)

    def check_new(self) -> None:
        """Refuse to start a new run in a folder that holds one: its weights, or a training state
        without them (a save renames the weights first, so that is a run whose weights were lost,
        not one killed before its first save; a new run would write over what is left of it). Refuse
        a path that cannot become a folder too: a file, or a path below one.

        Raises:
            TrainingError: naming what the folder holds, or the file in the way.
        """
        check_folder_path(self.given, TrainingError)
        if self.has_weights():
            raise TrainingError(f"{self.given} already holds a run: pass --resume to continue it, or pick another "
                                "--out")
        if self.state_file.exists() or self.pending_state_file.exists():
            raise TrainingError(f"{self.path} holds a training state but not its weights ({self.trained_file().name} "
                                "is missing): restore them to resume, or pick another --out")

    def check_empty(self, job: str) -> None:
        """Refuse the folder as that of a run `job` ("import", "merge") makes: something already
        there (anything but an empty folder), a path below a file, or where nothing can be written.

        Raises:
            CheckpointError: naming the folder.
        """
        out = self.path
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise CheckpointError(f"{out} already exists; {job} into a new folder")
        check_folder_path(out, CheckpointError)

    # ---- its configs -----------------------------------------------------------------------------

    def read_config(self) -> GPTConfig:
        """config.json as a GPTConfig, whatever else the folder holds."""
        try:
            return GPTConfig.from_dict(read_json(self.config_file, CheckpointError))
        except ConfigError as e:
            raise CheckpointError(f"{self.config_file}: {e}") from None

    def model_config(self) -> GPTConfig:
        """The architecture of the run (or adapter run) in the folder.

        Raises:
            CheckpointError: no such folder, not a run, or a config.json tinygpt does not read.
        """
        path = self.path
        if not path.is_dir():
            raise CheckpointError(f"{path}: {'a file, not a run folder' if path.exists() else 'no such run folder'}")
        if not self.config_file.exists() or not (self.weights_file.exists() or self.is_adapter_run()):
            raise CheckpointError(f"{path}: not a tinygpt run (it needs {CONFIG} and {WEIGHTS})")
        return self.read_config()

    def recorded(self) -> bool:
        """Whether the folder records a training (train_config.json): a run trained by tinygpt, or begun."""
        return self.record_file.exists()

    def _record(self, error: type[Exception]) -> Any:
        """train_config.json as read, or None where there is none."""
        return read_json(self.record_file, error) if self.record_file.is_file() else None

    def train_config(self) -> tuple[TrainConfig, str | None]:
        """The training settings the run was last trained with, and its data folder.

        Raises:
            TrainingError: no train_config.json, or one that is not valid.
        """
        saved = read_json(self.record_file, TrainingError)
        try:
            return TrainConfig.from_dict(saved["train"]), saved.get("data")
        except (KeyError, TypeError, ValueError) as e:
            raise TrainingError(f"{self.given}: {TRAIN_CONFIG} is not valid ({e})") from None

    def trained_on(self, error: type[Exception] = TrainingError) -> str | None:
        """The data folder the run recorded, or None (no record, or none named)."""
        saved = self._record(error)
        folder = saved.get("data") if isinstance(saved, dict) else None
        return folder if isinstance(folder, str) else None

    def finetune_settings(self, error: type[Exception] = TrainingError) -> dict[str, Any] | None:
        """The FinetuneConfig a run trained from FROM recorded (with its base's path and checksum), or None for
        any other folder."""
        return self.settings("finetune", error)

    def settings(self, section: str, error: type[Exception] = TrainingError) -> dict[str, Any] | None:
        """The settings train_config.json records under `section` ("finetune"; a run trained with another
        objective, its own under the objective's name: "grpo"), or None where it has none.

        Args:
            section: the key.
            error: what a train_config.json that does not read raises.
        """
        saved = self._record(error)
        settings = saved.get(section) if isinstance(saved, dict) else None
        return settings if isinstance(settings, dict) else None

    def begun_with(self) -> ModelChoice | None:
        """The ModelChoice that train_config.json recorded for a run that has no checkpoint yet (one
        killed before its first save), or None where there is no record of one.

        Raises:
            TrainingError: a recorded choice tinygpt does not read.
        """
        saved = self._record(TrainingError)
        notes = saved.get("notes") if isinstance(saved, dict) else None
        choice = notes.get("model_choice") if isinstance(notes, dict) else None
        if not isinstance(choice, dict):
            return None
        try:
            return ModelChoice.from_dict(choice)
        except ConfigError as e:
            raise TrainingError(f"{os.path.join(self.given, TRAIN_CONFIG)}: {e}") from None

    def objective(self, error: type[Exception] = TrainingError) -> str | None:
        """What a run trained from FROM optimised, by the command that trains it ("finetune", "grpo"), as
        train_config.json records it (a fine-tune run recorded before the name was: "finetune"); None for a
        run that was not trained from FROM.

        Args:
            error: what a train_config.json that does not read raises.
        """
        if self.finetune_settings(error) is None:
            return None
        name = self._record(error).get("objective", "finetune")
        return name if isinstance(name, str) else "finetune"

    def check_objective(self, command: str | None, error: type[Exception] = TrainingError) -> None:
        """A run trained from FROM continues with its own command (finetune, or its objective's), which knows its
        base, what it freezes, its window and its objective: `tinygpt train` would train it at the model's
        whole context (its base's) on the next-token loss, another objective's steps go on from its weights.

        Args:
            command: the command continuing it ("finetune", "grpo"; None: `tinygpt train`).
            error: what a refusal raises.

        Raises:
            error: naming the command that continues it.
        """
        objective = self.objective(error)
        if objective is None or objective == command:
            return
        base = (self.finetune_settings(error) or {}).get("from") or "FROM"
        data = "--data DATA" if objective in ("finetune", "dpo", "reward") else "..."
        what = {"finetune": "fine-tune", "reward": "reward-model"}.get(objective, objective)
        command = "reward train" if objective == "reward" else objective
        raise error(f"{self.given} is a {what} run: continue it with tinygpt {command} {base} {data} --out "
                    f"{self.given} --resume")

    def write_record(self, record: dict[str, Any], notes: dict[str, Any] | None, *, fresh: bool) -> None:
        """Write train_config.json: `record` and the notes, merged with those a resumed run recorded; for a
        new run (`fresh`), an empty metrics.jsonl beside it."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not fresh and self.record_file.exists():
            saved = read_json(self.record_file, TrainingError)
            previous = saved.get("notes") if isinstance(saved, dict) else None
            notes = {**(previous if isinstance(previous, dict) else {}), **(notes or {})}
        write_json(self.record_file, {**record, "notes": notes} if notes else record)
        if fresh:
            self.metrics_file.write_text("")

    def check_data(self, dataset: DataSet, tokenizer: Any = None, *, remedy: str | None = None) -> None:
        """Refuse data prepared with another tokenizer than the run's (what `train --resume` and `eval
        --data` check): the run's fingerprint is the one train_config.json recorded, else its tokenizer's.

        Args:
            dataset: the data folder (load_data).
            tokenizer: the run's tokenizer when the caller has loaded it; else read from the folder's
                tokenizer.json (a Hugging Face GPT-2 folder records nothing).
            remedy: what the message tells the user to do (see data.check_same_tokenizer).

        Raises:
            DataError: the tokenizers differ (one line naming both).
        """
        saved = self._record(TrainingError)
        recorded = saved.get("tokenizer_fingerprint") if isinstance(saved, dict) else None
        recorded = recorded if isinstance(recorded, str) else None
        if tokenizer is None and self.tokenizer_file.is_file():
            from .tokenizer.base import load_tokenizer

            tokenizer = load_tokenizer(self.path)
        check_same_tokenizer(dataset, tokenizer, str(self.path), fingerprint=recorded, remedy=remedy)

    # ---- its training state ----------------------------------------------------------------------

    def load_state(self) -> dict[str, Any]:
        """The training state of the run, matched to its weights; finishes a save cut short by a kill and
        removes the temporary files such a save leaves (the caller is about to write this run).

        Raises:
            CheckpointError: no training state, an unreadable one, or one of another step than the weights.
        """
        run, step = self.path, self.weights_step()
        # temp files of saves a kill cut short: atomic_write's (.NAME.tmp-PID), and safetensors' own (it
        # writes through a .tmpXXXXXX beside its target, the default name of Rust's tempfile crate)
        for stale in [*run.glob(".*.tmp-*"), *run.glob(".tmp??????")]:
            if stale.is_file():
                stale.unlink(missing_ok=True)
        pending = self.pending_state_file
        if pending.exists():
            try:
                candidate = _read_state(pending)
            except CheckpointError:
                candidate = None
            if isinstance(candidate, dict) and candidate.get("step") == step:
                os.replace(pending, self.state_file)  # the kill came between the two renames: roll forward
            else:
                pending.unlink()
        if not self.state_file.exists():
            raise CheckpointError(f"{run}: no {STATE}, so there is no training to resume")
        state = _read_state(self.state_file)
        if not isinstance(state, dict) or type(state.get("step")) is not int:
            raise CheckpointError(f"{self.state_file}: not a training state (no step)")
        if state["step"] != step:
            raise CheckpointError(f"{run}: training state is for step {state.get('step')} but the weights for {step}")
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a training state that train() did not write (damaged, or crafted) with a CheckpointError
        naming the field, before anything is restored from it."""

        def count(v: Any) -> bool:
            return type(v) is int and v >= 0

        def rng_state(v: Any) -> bool:
            return isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1

        def fraction(v: Any) -> bool:
            return type(v) is float and 0.0 <= v <= 1.0

        rng, opt, schedule, data = state.get("rng"), state.get("optimizer"), state.get("schedule"), state.get("data")
        checks = {
            "tokens": count(state.get("tokens")),
            "elapsed": state.get("elapsed") is None
            or type(state["elapsed"]) is float and 0 <= state["elapsed"] < math.inf,
            "max_iters": state.get("max_iters") is None or count(state.get("max_iters")),
            "begun_max_iters": state.get("begun_max_iters") is None or count(state.get("begun_max_iters")),
            "optimizer": isinstance(opt, dict) and isinstance(opt.get("state"), dict)
            and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in opt["param_groups"]),
            "scaler": state.get("scaler") is None or isinstance(state.get("scaler"), dict),
            "rng": isinstance(rng, dict) and rng_state(rng.get("torch")) and rng_state(rng.get("data")),
            "schedule": schedule is None or isinstance(schedule, dict) and fraction(schedule.get("warm"))
            and fraction(schedule.get("progress")),
            "optimizer_kind": state.get("optimizer_kind") in (None, *OPTIMIZERS),
            "master": state.get("master") is None or isinstance(state["master"], dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
                    for k, v in state["master"].items()),
            "data": data is None or isinstance(data, dict) and data.get("order") in DATA_ORDERS
            and (data["order"] == "random"
                 or all(count(data.get(k)) for k in ("position", "epoch", "shard", "offset"))),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise CheckpointError(f"{self.state_file}: not a training state tinygpt wrote ({bad[0]} is missing "
                                  "or of the wrong type)")

    def check_optimizer_state(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """The saved AdamW moments must have the shapes of the parameters they belong to: a mismatch would
        load silently and fail inside the first optimizer step."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        where = self.state_file
        if sizes != [len(g["params"]) for g in optimizer.param_groups]:
            raise CheckpointError(f"{where}: its optimizer state has parameter groups of {sizes}, this model needs "
                                  f"{[len(g['params']) for g in optimizer.param_groups]}")
        for index, moments in saved["state"].items():
            if type(index) is not int or not 0 <= index < len(params) or not isinstance(moments, dict):
                raise CheckpointError(f"{where}: its optimizer state names parameter {index!r}, which this model lacks")
            for name, t in moments.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != params[index].shape:
                    raise CheckpointError(f"{where}: optimizer {name} of parameter {index} has shape "
                                          f"{tuple(t.shape)}, the parameter {tuple(params[index].shape)}")

    # ---- its metrics and report ------------------------------------------------------------------

    def metrics_log(self) -> MetricsLog:
        """metrics.jsonl, open to append."""
        return MetricsLog(self.metrics_file)

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop metric lines logged after the checkpoint (those steps are redone), and a last
        line cut short (a full disk, a power cut)."""
        file = self.metrics_file
        if not file.exists():
            return

        def logged_step(line: str) -> int | None:
            try:
                record = json.loads(line)
            except ValueError:
                return None
            return record.get("step") if isinstance(record, dict) and type(record.get("step")) is int else None

        lines = file.read_text(errors="replace").splitlines()
        kept = [line for line in lines if (s := logged_step(line)) is not None and s <= step]
        atomic_write(file, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))

    def copy_records(self, into: RunFolder) -> None:
        """train_config.json and metrics.jsonl as they are now, into another run folder (before-decay/)."""
        into.path.mkdir(exist_ok=True)
        for mine, theirs in ((self.record_file, into.record_file), (self.metrics_file, into.metrics_file)):
            atomic_write(theirs, lambda tmp, mine=mine: shutil.copyfile(mine, tmp))

    def write_report(self, report: dict[str, Any]) -> None:
        """Keep a fine-tuning's report (finetune_report.json)."""
        write_json(self.report_file, report)

    def read_report(self) -> Any:
        """The fine-tuning report as read (tinygpt.report.read_report checks what it holds).

        Raises:
            CheckpointError: the run has none (it was not fine-tuned, or is still training) or it is not JSON.
        """
        if not self.report_file.is_file():
            raise CheckpointError(f"{self.given}: no {REPORT} (written when `tinygpt finetune` ends)")
        return read_json(self.report_file, CheckpointError)

    # ---- its adapters ----------------------------------------------------------------------------

    def adapter_run(self, base: str | os.PathLike | None = None) -> AdapterRun:
        """The settings and the base of an adapter run: a tinygpt one (PEFT's files and tinygpt_adapter.json,
        or the first format), or a PEFT adapter trained elsewhere, whose base is `base` or else its
        base_model_name_or_path when that is a folder.

        Args:
            base: the base model's folder, where it is not the one the run names.

        Raises:
            CheckpointError: a file missing, not JSON, or holding what tinygpt's LoRA does not compute; a
                PEFT adapter whose base is not given and not found.
        """
        run = self.path
        info = read_json(self.adapter_config_file, CheckpointError)
        if isinstance(info, dict) and info.get("format") == ADAPTER_FORMAT:
            found = self._read_v1(info)
            return found if base is None else dataclasses.replace(found, base=Path(base))
        checksum = None
        if self.adapter_base_file.exists():
            stored, checksum = self._read_adapter_base()
            base = run / stored if base is None else Path(base)  # an absolute stored path wins over run /
        elif base is None:  # a PEFT adapter trained elsewhere: its base where PEFT would look for it
            named = info.get("base_model_name_or_path") if isinstance(info, dict) else None
            if not (isinstance(named, str) and named and Path(named).is_dir()):
                raise CheckpointError(
                    f"{run}: a PEFT adapter with no {ADAPTER_BASE} naming its base, and its base_model_name_or_path "
                    f"{named!r} is not a folder here; give its base: tinygpt import {run} --base BASE --out RUN")
            base = Path(named)
        base = Path(base)
        weights = self.adapter_weights_file
        keys = [k for k in read_header(weights) if k != "__metadata__"]
        if self.config_file.exists():  # tinygpt's: the base's architecture, kept beside the adapters
            config = self.model_config()
        elif base.is_dir() and not RunFolder(base).is_adapter_run():
            config = hf_folder_config(base) if is_hf_folder(base) else RunFolder(base).model_config()
        else:
            raise CheckpointError(f"{run}: its base model {os.path.normpath(base)} is missing or is not a full model")
        try:
            lora, names = lora_from_peft(info, keys, config, str(run))
        except ConfigError as e:
            raise CheckpointError(f"{run}: {e}") from None
        return AdapterRun(lora=lora, base=base, checksum=checksum, weights=weights, names=names)

    def _read_adapter_base(self) -> tuple[str, str]:
        """The base's stored path and checksum from tinygpt_adapter.json, checked."""
        file = self.adapter_base_file
        bookkeeping = read_json(file, CheckpointError)
        if not isinstance(bookkeeping, dict) or bookkeeping.get("format") != ADAPTER_FORMAT:
            raise CheckpointError(f"{file}: not tinygpt's adapter bookkeeping (no \"format\": \"{ADAPTER_FORMAT}\")")
        if bookkeeping.get("version") != ADAPTER_VERSION:
            raise CheckpointError(f"{file}: version {bookkeeping.get('version')!r}; this tinygpt "
                                  f"reads version {ADAPTER_VERSION}")
        return _stored_base_info(file, bookkeeping)

    def _read_v1(self, info: dict[str, Any]) -> AdapterRun:
        file = self.adapter_config_file
        if info.get("version") != 1:
            raise CheckpointError(f"{file}: version {info.get('version')!r}; this tinygpt reads version 1 of that "
                                  f"format, and version {ADAPTER_VERSION} as PEFT's adapter_config.json")
        path, checksum = _stored_base_info(file, info)
        try:
            lora = LoraConfig.from_dict(info.get("lora"))
        except ConfigError as e:
            raise CheckpointError(f"{file}: {e}") from None
        weights = self.v1_weights_file
        names = {k: k for k in read_header(weights) if k != "__metadata__"}
        return AdapterRun(lora=lora, base=self.path / path, checksum=checksum, weights=weights, names=names)

    def write_adapter_base(self, base: Path, checksum: str) -> None:
        """Write tinygpt_adapter.json: the base's path (absolute as given, else relative to this folder, so
        that the two can move together) and the checksum of its weights."""
        stored = str(base) if base.is_absolute() else os.path.relpath(os.path.abspath(base), os.path.abspath(self.path))
        write_json(self.adapter_base_file, {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION,
                                            "base": {"path": stored, "checksum": checksum}})


class MetricsLog:
    """metrics.jsonl, one JSON line per step and per evaluation, each flushed as it is written.

    Args:
        file: the file to append to; None writes nothing (every process but rank 0).
    """

    def __init__(self, file: Path | None) -> None:
        self.path, self.file = file, open(file, "a") if file is not None else None

    def log(self, record: dict[str, Any]) -> None:
        """Append one record as a line."""
        if self.file is not None:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk: say which file
                raise OSError(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _stored_base_info(file: Path, info: Any) -> tuple[str, str]:
    """The base's stored path and checksum from tinygpt's bookkeeping (either format's), checked."""
    base = info.get("base") if isinstance(info, dict) else None
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and base["path"]
            and isinstance(base.get("checksum"), str)):
        raise CheckpointError(f"{file}: \"base\" must hold the base model's \"path\" and \"checksum\"")
    return base["path"], base["checksum"]


def _read_state(file: Path) -> dict[str, Any]:
    check_regular_file(file, CheckpointError)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or an object that weights_only refuses to build
        # torch's message spans lines and suggests weights_only=False, which would run the file's code:
        # keep the reason only
        text = str(e)
        found = re.search(r"WeightsUnpickler error: \s*(.*?)(?: Please use|\n\n|$)", text, re.DOTALL)
        reason = found.group(1).strip() if found else (text.strip().splitlines() or [type(e).__name__])[0]
        if "GLOBAL" in reason:
            reason += ": the file asks to build objects other than tensors and plain data, which tinygpt never does"
        raise CheckpointError(f"{file}: unreadable training state ({reason})") from None


# ---- one question of a folder by path ------------------------------------------------------------


def has_checkpoint(run: str | os.PathLike) -> bool:
    """Whether a run folder holds weights (or an adapter run's adapters) to resume from (a run killed
    before its first save holds none)."""
    return RunFolder(run).has_weights()


def is_adapter_run(path: str | os.PathLike) -> bool:
    """True for an adapter run: a folder holding adapter_config.json (save_adapter_run's, or a PEFT adapter's)."""
    return RunFolder(path).is_adapter_run()


def weights_step(path: str | os.PathLike) -> int:
    """The training step stored with a run's weights, or an adapter run's adapters (-1 when saved
    outside training)."""
    return RunFolder(path).weights_step()


def load_config(path: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a run folder (or an adapter run: its base's); see RunFolder.model_config."""
    return RunFolder(path).model_config()


def load_training(run: str | os.PathLike) -> dict[str, Any]:
    """The training state of a run, matched to its weights; see RunFolder.load_state."""
    return RunFolder(run).load_state()


def read_train_config(run: str | os.PathLike) -> tuple[TrainConfig, str | None]:
    """The training settings a run was last trained with, and its data folder."""
    return RunFolder(run).train_config()


def read_adapter_config(run: str | os.PathLike, base: str | os.PathLike | None = None) -> AdapterRun:
    """The settings and the base of an adapter run; see RunFolder.adapter_run.

    Args:
        run: the adapter run's folder.
        base: the base model's folder, where it is not the one the run names.
    """
    return RunFolder(run).adapter_run(base)


def check_data_for_run(run: str | os.PathLike, dataset: DataSet, tokenizer: Any = None, *,
                       remedy: str | None = None) -> None:
    """Refuse data prepared with another tokenizer than the run's; see RunFolder.check_data.

    Args:
        run: a run folder (or a Hugging Face GPT-2 folder, which records nothing).
        dataset: the data folder (load_data).
        tokenizer: the run's tokenizer when the caller has loaded it.
        remedy: what the message tells the user to do.
    """
    RunFolder(run).check_data(dataset, tokenizer, remedy=remedy)
