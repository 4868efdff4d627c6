"""Training: the one loop, and what a step optimises as an object beside it. A module a topic:

- `loop`: train(), the loop itself, read in one sitting.
- `run`: the run as it trains (Run: the model, its optimizer, a phase a method), its settings checked
  before anything is written, and Start, a model built elsewhere (fine-tuning).
- `objectives`: what a step optimises (Objective): NextToken on text, Masked on chat data (SFT), Distill (a
  teacher's distributions on text). A new training method (preference pairs, a reward model, rollouts) is a
  new objective there.
- `state`: what a checkpoint keeps beside the weights, and how a resume puts it back.
- `evaluation`: a model scored on held-out text for the commands and reports (evaluate, evaluate_chat).
- `pacing`: a time budget's pace, and SIGINT/SIGTERM.
- `callbacks`: TrainCallback's hooks, RunStart, ProgressBar, TrainResult.

The batches a run draws are tinygpt.data.batches' (Batches, Stream).

A run folder's files, and every check on them, are tinygpt.run_folder's. The names below are what users
import from tinygpt.train; tinygpt's own modules import from the topic module.
"""

from ..run_folder import check_data_for_run, has_checkpoint, read_train_config
from .callbacks import TrainCallback, TrainResult
from .evaluation import eval_report, evaluate
from .loop import train
from .objectives import batch_loss
from .run import Start

__all__ = [
    "train",
    "TrainResult",
    "Start",
    "TrainCallback",
    "evaluate",
    "eval_report",
    "has_checkpoint",
    "check_data_for_run",
    "read_train_config",
    "batch_loss",
]
