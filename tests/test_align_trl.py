"""tinygpt's preference losses against Hugging Face TRL's trainers, which are the reference (DESIGN: TRL's losses
as the reference a parity test holds tinygpt to): a small Qwen2-shaped model exported to Hugging Face, a batch of
pairs of different lengths, and TRL's DPOTrainer (its own tokenization, its per-sequence log-probs, its sigmoid,
ipo, hinge and robust losses and its metrics), with an explicit reference model and with a LoRA policy whose
reference is its base (PEFT's adapters switched off); and TRL's RewardTrainer's Bradley-Terry loss with a margin
and centering, its scores read at the token transformers' *ForSequenceClassification reads them at."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
trl = pytest.importorskip("trl", reason="trl is not installed (the dev extra)")
peft = pytest.importorskip("peft", reason="peft is not installed (the dev extra)")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (the dev extra)")

from tinygpt import GPT, GPTConfig  # noqa: E402
from tinygpt.align.dpo import METRICS, dpo_losses, dpo_metrics, pair_logps  # noqa: E402
from tinygpt.align.reward import reward_loss, reward_metrics, scores  # noqa: E402
from tinygpt.config.preference import DPO_LOSSES  # noqa: E402
from tinygpt.data.batches import Pairs  # noqa: E402
from tinygpt.data.folder import load_data  # noqa: E402
from tinygpt.data.preference import prepare_preference  # noqa: E402
from tinygpt.interop.hf import export_hf  # noqa: E402
from tinygpt.interop.peft import to_peft_state_dict  # noqa: E402
from tinygpt.lora import adapter_state_dict, adapters_off, apply_lora  # noqa: E402
from tinygpt.tokenizer.bpe import BPETokenizer  # noqa: E402

TOL = 1e-5
BETA = 0.1
SMOOTHING = 0.2  # robust's share of flipped labels
TEXT = "the sky is blue and the grass is green, a cat sat on the mat, what colour is the sea? " * 40
ROWS = [  # different prompt and completion lengths, so padding and masks matter
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green and red.", "margin": 0.5},
    {"prompt": "A cat sat on the", "chosen": " mat", "rejected": " sea, what colour", "margin": 0.0},
    {"prompt": "grass", "chosen": " is green, a cat sat", "rejected": " is blue", "margin": 2.0},
]
QWEN2 = dict(arch="llama", qkv_bias=True, n_kv_head=1, intermediate_size=48, tie_weights=False)


def small(vocab: int, seed: int, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=2, n_embd=32, **{**QWEN2, **overrides}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A BPE tokenizer, a policy and a reference as tinygpt models and their Hugging Face exports, the pairs
    prepared by tinygpt and the same rows as a datasets.Dataset for TRL."""
    root = tmp_path_factory.mktemp("trl")
    tok = BPETokenizer.train([TEXT], 300)
    policy, ref = small(tok.vocab_size, 0).eval(), small(tok.vocab_size, 1).eval()
    export_hf(policy, tok, root / "policy")
    export_hf(ref, tok, root / "ref")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    prepare_preference(root / "pairs.jsonl", root / "data", tokenizer_file=root / "policy", val_fraction=0)
    pairs = Pairs.of(load_data(root / "data"), "train", 64)
    # TRL closes a standard completion by appending eos_token as text: the tokenizer must read it as the token
    hf_tok = transformers.AutoTokenizer.from_pretrained(root / "policy", split_special_tokens=False)
    return root, tok, policy, ref, pairs, hf_tok


def trainer(world, model, ref_model, **options):
    root, *_, hf_tok = world
    args = trl.DPOConfig(output_dir=str(root / "out"), beta=BETA, use_cpu=True, bf16=False, report_to=[],
                         save_strategy="no", per_device_train_batch_size=len(ROWS))
    rows = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "margin"} for r in ROWS])
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=rows, processing_class=hf_tok,
                          **options)


def trl_loss(dpo, model, batch, loss: str) -> tuple[float, dict[str, float]]:
    """TRL's loss of one batch for a loss type, and the metrics it logged for it."""
    dpo.loss_types, dpo.label_smoothing = [loss], SMOOTHING if loss == "robust" else 0.0
    dpo._metrics["train"].clear()
    with torch.no_grad():
        value = dpo._compute_loss(model, batch, False)
    return float(value), {k: v[-1] for k, v in dpo._metrics["train"].items()}


def test_dpo_losses_and_log_probs_equal_trl_with_an_explicit_reference(world):
    root, tok, policy, ref, pairs, _ = world
    hf_policy = transformers.AutoModelForCausalLM.from_pretrained(root / "policy").train()  # no dropout: mode only
    hf_ref = transformers.AutoModelForCausalLM.from_pretrained(root / "ref").eval()
    dpo = trainer(world, hf_policy, hf_ref)
    examples = [dpo.train_dataset[i] for i in range(len(ROWS))]
    for i, e in enumerate(examples):  # TRL's tokenization: the same prompt, completions and end of text
        assert [e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]] == [s.tolist() for s in pairs.sides(i)]
    batch = dpo.data_collator(examples)
    ids, mask = pairs.get(torch.arange(len(ROWS)))
    assert torch.equal(batch["input_ids"] * batch["attention_mask"], ids)
    assert torch.equal(batch["completion_mask"], mask)
    with torch.no_grad():
        chosen, rejected, chosen_tokens, rejected_tokens = pair_logps(policy, ids, mask)
        ref_chosen, ref_rejected, _, _ = pair_logps(ref, ids, mask)
        theirs = dpo.compute_ref_log_probs(hf_policy, batch)
    assert torch.allclose(torch.cat([chosen, rejected]), torch.cat(theirs), atol=TOL, rtol=0)
    for loss in DPO_LOSSES:
        value, logged = trl_loss(dpo, hf_policy, batch, loss)
        mine = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=BETA, loss=loss,
                          label_smoothing=SMOOTHING if loss == "robust" else 0.0, chosen_tokens=chosen_tokens,
                          rejected_tokens=rejected_tokens).mean()
        assert abs(mine.item() - value) < TOL, loss
        metrics = dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, BETA)
        for name in METRICS:
            assert abs(metrics[name].item() - logged[name]) < TOL, (loss, name)


def test_a_lora_policy_s_reference_is_its_base_with_the_adapters_off_as_trl_and_peft_take_it(world):
    root, tok, policy, _, pairs, _ = world
    lora = apply_lora(small(tok.vocab_size, 0), rank=4, alpha=8, targets="q_proj,v_proj,down_proj")
    with torch.no_grad():  # adapters that change the model, so that switching them off matters
        for t in adapter_state_dict(lora).values():
            t.copy_(torch.randn_like(t) * 0.1)
    # TRL's LoRA reference is the base with the adapters off where it adds the adapters itself (a peft_config)
    settings = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "policy")
    dpo = trainer(world, base, None, peft_config=settings)
    wrapped = dpo.model.train()
    result = peft.set_peft_model_state_dict(wrapped, to_peft_state_dict(adapter_state_dict(lora), lora.config))
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    batch = dpo.data_collator([dpo.train_dataset[i] for i in range(len(ROWS))])
    ids, mask = pairs.get(torch.arange(len(ROWS)))
    lora.eval()
    with torch.no_grad():
        chosen, rejected, chosen_tokens, rejected_tokens = pair_logps(lora, ids, mask)
        with adapters_off(lora):
            ref_chosen, ref_rejected, _, _ = pair_logps(lora, ids, mask)
        base_chosen, base_rejected, _, _ = pair_logps(policy, ids, mask)
    assert torch.equal(ref_chosen, base_chosen) and torch.equal(ref_rejected, base_rejected)  # the base, exactly
    assert (chosen - base_chosen).abs().max() > 1e-2  # and the adapters do change the policy
    for loss in ("sigmoid", "ipo"):
        value, logged = trl_loss(dpo, wrapped, batch, loss)
        mine = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=BETA, loss=loss,
                          chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens).mean()
        assert abs(mine.item() - value) < TOL, loss
        metrics = dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, BETA)
        for name in METRICS:
            assert abs(metrics[name].item() - logged[name]) < TOL, (loss, name)


def test_the_reward_loss_with_a_margin_and_centering_equals_trl_s_reward_trainer(world):
    root, tok, *_, pairs, hf_tok = world
    model = small(tok.vocab_size, 2, head="reward").eval()
    export_hf(model, tok, root / "reward")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(root / "reward").train()
    args = trl.RewardConfig(output_dir=str(root / "rout"), use_cpu=True, bf16=False, report_to=[],
                            save_strategy="no", center_rewards_coefficient=0.01, per_device_train_batch_size=len(ROWS))
    rows = datasets.Dataset.from_list(ROWS)
    rt = trl.RewardTrainer(model=hf, args=args, train_dataset=rows, processing_class=hf_tok)
    batch = rt.data_collator([rt.train_dataset[i] for i in range(len(ROWS))])
    with torch.no_grad():
        theirs = float(rt.compute_loss(hf, dict(batch)))
        ids, last, margins = pairs.scored(torch.arange(len(ROWS)))
        chosen, rejected = scores(model, ids, last).chunk(2)
    assert margins.tolist() == [r["margin"] for r in ROWS]
    assert abs(reward_loss(chosen, rejected, margins, center=0.01).item() - theirs) < TOL
    logged = {k: v[-1] for k, v in rt._metrics["train"].items()}
    for name, value in reward_metrics(chosen, rejected).items():
        assert abs(value.item() - logged[name]) < TOL, name
