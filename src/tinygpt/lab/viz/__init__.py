"""Pictures: attention maps, loss curves, few-shot accuracy, document lengths (and scaling plots).

matplotlib is an optional dependency (`pip install 'tinygpt[viz]'`), imported inside the
functions that draw. Figures are built with matplotlib's object API (`Figure`, no pyplot), so
nothing here touches a global backend or opens a window: saving renders with Agg. Every picture
is written atomically, so a failed save never leaves half a PNG where an old one was.

A module a kind of picture (`attention`, `curves` with the `metrics` they read, `induction` for the
probes, `preference` for the curves of runs on preference pairs, `charts`, `scaling`, on the shared
`figures`); `tinygpt.lab.viz` gives every one of them, as
the tutorials and the commands use it.
"""

from .attention import attention_weights, plot_attention, token_labels
from .charts import plot_fewshot, plot_lengths
from .curves import plot_loss, plot_recipes, plot_rewards
from .figures import FORMATS, check_picture
from .induction import PROBE_PANELS, draw_probes, plot_emergence, plot_head_scores
from .metrics import RunMetrics, read_metrics
from .preference import PAIR_PANELS, draw_pairs
from .scaling import draw_isoflops, draw_loss_vs_flops, draw_optimal_scaling, plot_scaling

__all__ = [
    "FORMATS", "check_picture", "attention_weights", "token_labels", "plot_attention", "RunMetrics", "read_metrics",
    "plot_loss", "plot_recipes", "plot_rewards", "PROBE_PANELS", "draw_probes", "plot_head_scores", "plot_emergence",
    "plot_fewshot", "plot_lengths", "PAIR_PANELS", "draw_pairs", "draw_loss_vs_flops", "draw_isoflops",
    "draw_optimal_scaling", "plot_scaling",
]
