"""The emergence lab: an induction head, and in-context copying with it, appearing while a model trains.

The data is made so that only in-context learning can lower the loss: each row is one segment of
distinct random tokens (a fresh segment and a fresh length for every row) repeated to fill the
context, so the first copy is noise and everything after it can be read off the context. A 2-layer
model learns this abruptly: for a while the loss stays near a unigram model's, then within a few
hundred steps a layer-1 head becomes a previous-token head, a layer-2 head an induction head, and
the second copy's loss falls to near zero. A 1-layer model trained alike is the control: with no
earlier layer to tell each position its previous token, it forms no induction head.

`run_emergence` writes the data, trains both (ordinary run folders, probed with tinygpt.lab.probes),
and returns (and writes) emergence.json's summary; `tinygpt emergence` is its command.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config.model import GPTConfig
from ..config.train import TrainConfig
from ..data.text import prepare
from ..errors import ConfigError
from ..fileio import check_new_folder, write_json
from ..tokenizer.char import CharTokenizer
from ..train.callbacks import TrainCallback
from ..train.loop import train
from . import probes, viz

# the data's characters: letters and digits first, then ASCII's other printable ones, then Latin-1's
# and Latin Extended-A's (none of them white space, so every token is visible in an attention map)
ALPHABET = "".join(dict.fromkeys(
    string.ascii_letters + string.digits
    + "".join(chr(c) for c in range(33, 0x180) if chr(c).isprintable() and not chr(c).isspace())))
SUMMARY = "emergence.json"
FIGURE = "emergence.png"
# Rows a context long would put a row boundary inside almost every window drawn at a random offset:
# the tail of one segment before the start of the next, whose tokens then recur with the wrong
# successor. Measured here (2 layers, defaults): no induction head in 600 steps with such rows,
# one at step ~280 with rows of four contexts.
ROW_CONTEXTS = 4
MAX_TOKENS = 8_000_000  # the data's size at most (64 MB of int64 ids while it is written)
MAX_CONTEXT = 1024
THRESHOLD = 0.5  # the phase change: the first probe where the best induction score reaches this


@dataclass(frozen=True)
class EmergenceSettings:
    """What the lab trains; the defaults show the phase change in about a minute on a laptop CPU.

    Args:
        vocab_size: distinct tokens (characters of ALPHABET), 4..len(ALPHABET).
        context: the models' block_size.
        period: (shortest, longest) segment: each row repeats one of a length drawn in this range;
            2 <= shortest <= longest <= context // 2 (two copies at least).
        steps: optimizer steps of each run.
        probe_interval: steps between probes.
        layers: the runs, by their number of layers (each trains in DIR/L<n>).
        seed: the data, the models' initialization and the batch order.
        n_head, n_embd: the models' heads and width.
        init, tie_weights, activation: as GPTConfig (the lesson's settings by default: PyTorch's
            init, an untied head, exact GELU).
        batch_size, lr, warmup, weight_decay, beta2: the optimizer's (AdamW, constant rate after
            the warmup).
        device: where to train.
    """

    vocab_size: int = 64
    context: int = 32
    period: tuple[int, int] = (6, 16)
    steps: int = 600
    probe_interval: int = 10
    layers: tuple[int, ...] = (1, 2)
    seed: int = 0
    n_head: int = 4
    n_embd: int = 64
    init: str = "torch"
    tie_weights: bool = False
    activation: str = "gelu"
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.0
    beta2: float = 0.98
    device: str = "cpu"

    def __post_init__(self) -> None:
        lo, hi = self.period
        if not 4 <= self.vocab_size <= len(ALPHABET):
            raise ConfigError(f"--vocab-size must be 4..{len(ALPHABET)}, got {self.vocab_size}")
        if not 4 <= self.context <= MAX_CONTEXT:
            raise ConfigError(f"--context must be 4..{MAX_CONTEXT}, got {self.context}")
        if not 2 <= lo <= hi:
            raise ConfigError(f"--period MIN-MAX needs 2 <= MIN <= MAX, got {lo}-{hi}")
        if 2 * hi > self.context:
            raise ConfigError(f"--period {lo}-{hi}: two copies of {hi} tokens do not fit a context of "
                              f"{self.context}; use a --context of {2 * hi} or more")
        if hi > self.vocab_size:
            raise ConfigError(f"--period {lo}-{hi}: a segment of {hi} distinct tokens needs a vocabulary of "
                              f"{hi} or more, not {self.vocab_size}")
        if not self.layers or min(self.layers) < 1 or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"--layers: distinct layer counts >= 1, got {','.join(map(str, self.layers))}")

    def model(self, n_layer: int) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.context, n_layer=n_layer, n_head=self.n_head,
                         n_embd=self.n_embd, bias=True, tie_weights=self.tie_weights, activation=self.activation,
                         init=self.init)

    def training(self) -> TrainConfig:
        return TrainConfig(batch_size=self.batch_size, lr=self.lr, warmup=self.warmup, lr_schedule="constant",
                           max_iters=self.steps, weight_decay=self.weight_decay, beta2=self.beta2,
                           eval_interval=self.steps, eval_iters=10, seed=self.seed, device=self.device,
                           dtype="float32")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {**d, "period": list(self.period), "layers": list(self.layers)}


def parse_period(text: str) -> tuple[int, int]:
    """'6-16' -> (6, 16); '8' -> (8, 8)."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--period: expected MIN-MAX such as 6-16, got {text!r}") from None


def parse_layers(text: str) -> tuple[int, ...]:
    """'1,2' -> (1, 2)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--layers: expected layer counts such as 1,2, got {text!r}") from None


def repeated_segments(rows: int, length: int, vocab_size: int, period: tuple[int, int],
                      rng: np.random.Generator) -> np.ndarray:
    """(rows, length) token ids: each row one segment of distinct random tokens, of a length drawn
    uniformly in `period`, repeated (and cut) to fill the row."""
    lo, hi = period
    out = np.empty((rows, length), dtype=np.int64)
    for r, p in enumerate(rng.integers(lo, hi + 1, size=rows)):
        out[r] = np.resize(rng.choice(vocab_size, size=p, replace=False), length)
    return out


def write_data(out: str | Path, settings: EmergenceSettings, rows: int | None = None) -> Path:
    """Write the repeated-segment text (DIR/text/train.txt) and its prepared data folder (DIR/data).

    Each row repeats its segment over ROW_CONTEXTS contexts; rows follow one another with no
    separator and training draws windows at random offsets, so most windows lie inside one row
    (a repeat that starts at any phase of its segment) and the rest straddle two.

    Args:
        rows: how many rows (default: one for every ROW_CONTEXTS windows the training draws, up to
            MAX_TOKENS tokens in all: a longer run sees rows again, each at other offsets).

    Returns:
        the data folder.
    """
    out = Path(out)
    length = ROW_CONTEXTS * settings.context
    rows = rows or max(1000, min(settings.steps * settings.batch_size // ROW_CONTEXTS, MAX_TOKENS // length))
    rng = np.random.default_rng(settings.seed)
    ids = repeated_segments(rows, length, settings.vocab_size, settings.period, rng)
    chars = np.array(list(ALPHABET[:settings.vocab_size]))
    text_file = out / "text" / "train.txt"
    text_file.parent.mkdir(parents=True, exist_ok=True)
    text_file.write_text("".join(chars[ids.reshape(-1)]), encoding="utf-8")
    tokenizer = CharTokenizer(ALPHABET[:settings.vocab_size])
    prepare([str(text_file)], out / "data", tokenizer=tokenizer, val_fraction=0.1)
    return out / "data"


def run_emergence(
    out: str | Path,
    settings: EmergenceSettings | None = None,
    *,
    callbacks: Callable[[int], Sequence[TrainCallback]] = lambda n_layer: (),
    plot: bool = True,
) -> dict[str, Any]:
    """The lab: write the data, train one probed run per entry of settings.layers, summarize, draw.

    Args:
        out: a new (or empty) folder: data/ and text/ (the data), L<n>/ (each run folder),
            emergence.json (the summary) and emergence.png (the figure, with matplotlib).
        settings: EmergenceSettings().
        callbacks: the extra TrainCallbacks of the run with n layers (a progress bar, say).
        plot: draw emergence.png.

    Returns:
        emergence.json's content: {"settings": {...}, "runs": [{"n_layer", "run", "steps",
        "second_copy_loss", "second_copy_accuracy", "induction_score", "previous_token_score",
        "icl_score", "phase_change_step", "seconds"}, ...]}.
    """
    settings = settings or EmergenceSettings()
    out = Path(out)
    check_new_folder(out, ConfigError)
    if plot:
        viz.check_picture(out / FIGURE)
    data = write_data(out, settings)
    runs = []
    for n_layer in settings.layers:
        folder = out / f"L{n_layer}"
        probe = probes.Probes(settings.probe_interval, data=data, period=settings.period[1], seed=settings.seed)
        result = train(data, folder, settings.model(n_layer), settings.training(),
                       callbacks=[probe, *callbacks(n_layer)], notes={"emergence": settings.to_dict()})
        metrics = viz.read_metrics(folder)
        runs.append({"n_layer": n_layer, "run": str(folder), **probes.summarize(metrics.probes, THRESHOLD),
                     "seconds": round(result.elapsed, 2)})
    summary = {"settings": settings.to_dict(), "runs": runs}
    write_json(out / SUMMARY, summary)
    if plot:
        viz.plot_emergence([viz.read_metrics(r["run"], name=f"{r['n_layer']} layer{'s' * (r['n_layer'] > 1)}")
                            for r in runs], out / FIGURE, marks=[r["phase_change_step"] for r in runs],
                           title=_title(settings))
    return summary


def _title(settings: EmergenceSettings) -> str:
    lo, hi = settings.period
    return (f"induction heads forming: vocabulary {settings.vocab_size}, context {settings.context}, "
            f"segments of {lo}-{hi} distinct tokens repeated")
