"""DPO as an objective of the one training loop (tinygpt.align.dpo.DPO): at step 0, with the reference the
policy (a frozen copy, or a LoRA policy's adapters off), every loss is its value at a zero margin (sigmoid's
log 2) and every implicit reward zero; the reference's log-probs precomputed equal those computed a step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.align.dpo import DPO, Reference
from tinygpt.config.preference import DPOConfig
from tinygpt.config.train import TrainConfig
from tinygpt.data.folder import load_data
from tinygpt.data.preference import prepare_preference
from tinygpt.distributed import Dist
from tinygpt.lora import apply_lora
from tinygpt.tokenizer.bpe import BPETokenizer

TEXT = "the sky is blue and the grass is green, a cat sat on the mat, what colour is the sea? " * 40
PAIRS = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in (
    ("The sky is", " blue.", " green and red."), ("A cat sat", " on the mat", " on"), ("grass", " is green", " is blue"),
    ("the sea is", " blue", " a cat"), ("what colour", " is the sea", " sat"), ("the mat", " is red", " is a cat sat"),
)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("dpo")
    tok = BPETokenizer.train([TEXT], 300)
    tok.save(root / "bpe.json")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    prepare_preference(root / "pairs.jsonl", root / "data", tokenizer_file=root / "bpe.json", val_fraction=0.34)
    return load_data(root / "data")


def model(vocab: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=2, n_embd=32))


ZERO_MARGIN = {"sigmoid": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * 0.1)) ** 2, "robust": math.log(2)}


@pytest.mark.parametrize("how", ["frozen copy", "adapters off", "precomputed"])
@pytest.mark.parametrize("loss", list(ZERO_MARGIN))
def test_at_step_0_with_the_policy_for_reference_the_loss_is_its_zero_margin_value_and_every_reward_zero(data, how,
                                                                                                        loss):
    policy = model(data.tokenizer.vocab_size)
    if how == "adapters off":
        apply_lora(policy, rank=4)
    reference = Reference(None if how == "adapters off" else lambda: copy.deepcopy(policy))
    config = DPOConfig(loss=loss, sft_weight=0.0, precompute_ref=how == "precomputed",
                       label_smoothing=0.1 if loss == "robust" else 0.0)
    cfg = TrainConfig(batch_size=3, eval_iters=2)
    dpo = DPO(data, cfg, 64, Dist(torch.device("cpu")), config=config, reference=reference)
    value, metrics = dpo.loss(policy, dpo.draw(policy))
    assert value.item() == pytest.approx(ZERO_MARGIN[loss], abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[name].item() == pytest.approx(0.0, abs=1e-6), name
    # a tie is no win; precomputed log-probs, from batches padded otherwise, may differ in the last bit
    assert metrics["rewards/accuracies"].item() == 0 or how == "precomputed"
    assert metrics["logps/chosen"].item() < 0
    record = dpo.evaluate(policy.eval(), None)
    assert record["val_loss"] == pytest.approx(ZERO_MARGIN[loss], abs=1e-6)
    assert record["val_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert 0 <= record["val_preference_accuracy"] <= 1
