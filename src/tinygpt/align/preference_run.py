"""A DPO run and a reward model's: a pretrained model trained on preference pairs by tinygpt.finetune.tune (the
run finetune makes: full or LoRA, the checksum, resume, the report) with an objective of its own; and a reward
model's score of a text.

    dpo(from_, data, out, DPOConfig(...))            FROM optimised on the pairs (tinygpt.align.dpo.DPO)
    train_reward(from_, data, out, RewardConfig())   FROM with a score for its head, trained on the pairs
                                                     (tinygpt.align.reward.BradleyTerry)
    reward_score(run, prompt, completion)            a reward model's score of one completion

Each report (RUN/finetune_report.json, `tinygpt report RUN`) holds, before and after, what the model prefers
on the validation pairs (tinygpt.align.preferences.measure_pairs); DPO's also the same prompts answered
greedily before and after and the loss on the reference text (what the alignment cost elsewhere).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint
from ..config.finetune import FinetuneConfig
from ..config.preference import DPOConfig, RewardConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet
from ..errors import ConfigError, DataError
from ..finetune import DEFAULT_TRAIN, Base, FinetuneResult, Tuning, tune
from ..generate import generate
from ..model import GPT
from ..run_folder import RunFolder
from ..tokenizer.base import encode_named
from ..tokenizer.chat import stop_ids
from ..train.callbacks import TrainCallback
from .dpo import DPO, Reference
from .pairs import preference_pairs
from .preferences import measure_pairs
from .reward import BradleyTerry, score_completions

SAMPLES = 2  # validation prompts the DPO report answers before and after, when no --prompt is given
SAMPLE_TOKENS = 32


class _OnPairs(Tuning):
    """What DPO and a reward model share: data of preference pairs, and a report of what the model prefers on
    the validation pairs, fitted to the run's window."""

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        if dataset is None or not dataset.is_preference:
            where = dataset.path if dataset is not None else "the data"
            raise DataError(f"{where} holds no preference pairs: prepare them with `tinygpt prepare FILE.jsonl "
                            f"--format preference --tokenizer-file {base.path}`")
        self.window = cfg.block_size or base.config.block_size
        self.pairs = preference_pairs(dataset, self.window)["val"]  # a split with no pair that fits refused here
        self.tokenizer = base.data_tokenizer

    def measured(self, model: GPT) -> dict[str, float]:
        """The report's section of a model: what it prefers on every validation pair."""
        found = measure_pairs(model, self.pairs, device=next(model.parameters()).device)
        return {name: float(found[name]) for name in ("accuracy", "chosen", "rejected", "margin")}


class DPOTuning(_OnPairs):
    """`tinygpt dpo`'s run: the DPO objective against the reference (config.ref_model; else FROM frozen, or a
    LoRA run's base with the adapters off), its report the validation pairs' preference accuracy and log-probs
    and the same prompts answered greedily before and after.

    Args:
        config: DPO's settings.
    """

    name = "dpo"
    title = "trained with DPO"
    sampled = "greedy"

    def __init__(self, config: DPOConfig) -> None:
        self.config = config

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        super().begin(base, dataset, cfg)
        ref = self.config.ref_model
        load = (_reference_model(Path(ref), base) if ref is not None
                else None if cfg.method == "lora" else base.reference())
        self.reference = Reference(load)
        given = [(p, encode_named(self.tokenizer, p, f"--prompt {p!r}")) for p in cfg.prompts]
        shown = [self.pairs.sides(i)[0].tolist() for i in range(min(SAMPLES, len(self.pairs)))]
        self.prompts = given or [(self.tokenizer.decode(ids), ids) for ids in shown]
        # a standard pair's answer ends at the end of text, a conversational one at the end of its turn
        eot = [self.tokenizer.eot_id] if self.tokenizer.eot_id is not None else []
        self.stops = sorted({*stop_ids(self.tokenizer), *eot})

    def measure(self, model: GPT) -> dict[str, Any]:
        return {"pairs": self.measured(model), "samples": self._answers(model)}

    def objective(self) -> Callable[..., DPO]:
        return functools.partial(DPO, config=self.config, reference=self.reference)

    def settings(self) -> dict[str, Any]:
        return self.config.to_dict()

    @torch.no_grad()
    def _answers(self, model: GPT) -> list[dict[str, str]]:
        """Each prompt's greedy answer, up to the end of text or of the turn."""
        model.eval()
        out = []
        for prompt, ids in self.prompts:
            ids = ids[-(model.config.block_size - 1):]
            new = max(1, min(SAMPLE_TOKENS, model.config.block_size - len(ids)))
            written = generate(model, torch.tensor([ids], device=next(model.parameters()).device), new, greedy=True,
                               stop_tokens=self.stops, vocab_size=self.tokenizer.vocab_size)[0, len(ids):].tolist()
            ended = [i for i, t in enumerate(written) if t in self.stops]
            out.append({"prompt": prompt, "text": self.tokenizer.decode(written[: ended[0] if ended else None])})
        return out


def _reference_model(path: Path, base: Base) -> Callable[[], GPT]:
    """--ref-model's builder, its vocabulary checked against FROM's now: the model frozen, in float32."""
    if not path.is_dir():
        raise ConfigError(f"--ref-model {path}: no such model folder (a tinygpt run or a Hugging Face folder)")
    tokenizer = checkpoint.folder_tokenizer(path)
    if tokenizer is None or tokenizer.fingerprint() != base.tokenizer.fingerprint():
        raise ConfigError(f"--ref-model {path}: its tokenizer is not FROM's ({base.path}): the reference scores the "
                          "same tokens as the policy")
    return lambda: checkpoint.load(path, merge=True).float().eval().requires_grad_(False)


class RewardTuning(_OnPairs):
    """`tinygpt reward train`'s run: FROM with a score for its head (trained in full: the score is new), the
    Bradley-Terry objective; its report the validation pairs' accuracy and scores before and after.

    Args:
        config: the reward model's settings.
    """

    name = "reward"
    title = "trained a reward model"
    sampled = "scores"
    head = "reward"

    def __init__(self, config: RewardConfig) -> None:
        self.config = config

    def begin(self, base: Base, dataset: DataSet | None, cfg: FinetuneConfig) -> None:
        if cfg.method != "full":
            raise ConfigError("a reward model trains with --method full: its score layer is new, and LoRA would "
                              "leave it frozen at its random start")
        super().begin(base, dataset, cfg)

    def measure(self, model: GPT) -> dict[str, Any]:
        return {"pairs": self.measured(model), "samples": []}

    def objective(self) -> Callable[..., BradleyTerry]:
        return functools.partial(BradleyTerry, config=self.config)

    def settings(self) -> dict[str, Any]:
        return self.config.to_dict()


def dpo(
    from_: str | Path, data: str | Path, out: str | Path, config: DPOConfig | None = None,
    finetune_config: FinetuneConfig | None = None, train_config: TrainConfig | None = None, *,
    resume: bool = False, merge: str | Path | None = None, progress: bool = False,
    callbacks: Sequence[TrainCallback] = (), should_stop: Callable[[int], bool] | None = None,
) -> FinetuneResult:
    """Direct preference optimisation of FROM on preference pairs, on the same loop as train() and finetune().

    Args:
        from_: the base: a tinygpt run folder or a Hugging Face folder.
        data: pairs prepared with FROM's tokenizer (`tinygpt prepare FILE.jsonl --format preference
            --tokenizer-file FROM`).
        out: the run folder: a plain run for method full, an adapter run for lora.
        config: DPO's settings (DPOConfig()); a resumed run's must be those it was trained with.
        finetune_config: what trains (full or LoRA, frozen parts, keep), the pairs' max_length (block_size)
            and the report's reference text and prompts (FinetuneConfig()).
        train_config: the optimization (finetune's recipe by default); batch_size counts pairs.
        resume, merge, progress, callbacks, should_stop: as for finetune().

    Raises:
        DataError: data that are not preference pairs (and what finetune() refuses of data).
        ConfigError: DPO settings other than a resumed run's (and what finetune() refuses of settings).
        CheckpointError, TrainingError: as for finetune().
    """
    config = config or DPOConfig()
    _check_settings(out, resume, "dpo", config.to_dict())
    return tune(from_, data, out, DPOTuning(config), finetune_config, train_config or TrainConfig(**DEFAULT_TRAIN),
                resume=resume, merge=merge, progress=progress, callbacks=callbacks, should_stop=should_stop)


def train_reward(
    from_: str | Path, data: str | Path, out: str | Path, config: RewardConfig | None = None,
    finetune_config: FinetuneConfig | None = None, train_config: TrainConfig | None = None, *,
    resume: bool = False, progress: bool = False, callbacks: Sequence[TrainCallback] = (),
    should_stop: Callable[[int], bool] | None = None,
) -> FinetuneResult:
    """Train a reward model: FROM with its language-model head replaced by a score, on preference pairs, with
    the Bradley-Terry loss (TRL's RewardTrainer's), on the same loop as finetune().

    Args:
        from_, data, out: as for dpo(); the run is a reward model (config.json's head "reward").
        config: the reward model's settings (RewardConfig()); a resumed run's must be those it was trained with.
        finetune_config: method full (LoRA is refused), frozen parts, keep, max_length (block_size).
        train_config, resume, progress, callbacks, should_stop: as for dpo().

    Raises:
        DataError, ConfigError, CheckpointError, TrainingError: as for dpo(); ConfigError for method lora.
    """
    config = config or RewardConfig()
    _check_settings(out, resume, "reward", config.to_dict())
    return tune(from_, data, out, RewardTuning(config), finetune_config, train_config or TrainConfig(**DEFAULT_TRAIN),
                resume=resume, progress=progress, callbacks=callbacks, should_stop=should_stop)


def _check_settings(out: str | Path, resume: bool, name: str, settings: dict[str, Any]) -> None:
    """A resumed run goes on with the settings it was trained with: another beta or loss would change what
    its steps optimise."""
    folder = RunFolder(Path(out))
    saved = folder.settings(name, ConfigError) if resume and folder.has_weights() else None
    for key, value in (saved or {}).items():
        if settings.get(key) != value:
            raise ConfigError(f"{out} was trained with {key} {value!r}, not {settings.get(key)!r}: drop the setting "
                              "to resume it")


@torch.no_grad()
def reward_score(run: str | Path, prompt: str, completion: str, device: str = "cpu") -> float:
    """A reward model's score of a completion to a prompt: its output at the text's last token, the text
    written as training wrote a standard pair's side (the prompt and the completion, without the end of
    text; its last block_size tokens where it is longer).

    Args:
        run: a reward model (`tinygpt reward train`'s run, or a Hugging Face *ForSequenceClassification).
        prompt, completion: the texts.
        device: where to score.

    Raises:
        ConfigError: a language model, not a reward model; TokenizerError: text its vocabulary cannot write.
    """
    model, tokenizer = checkpoint.load_run(run, device)
    if model.config.head != "reward":
        raise ConfigError(f"{run} is a language model, not a reward model: train one with `tinygpt reward train`")
    if not prompt + completion:
        raise ConfigError("nothing to score: the prompt and completion are empty")
    return float(score_completions(model.eval(), tokenizer, [prompt], [completion])[0])
