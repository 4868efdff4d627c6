"""Fine-tuning a pretrained GPT: what trains. (LoRA's adapters live in tinygpt.lora.)

    freeze(model, embeddings=True, layers=N)   stops the token and position embeddings and the
                                               first N blocks from training; the rest trains in full
"""

from __future__ import annotations

from .errors import ConfigError
from .model import GPT


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
