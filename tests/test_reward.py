"""Reward models: the one GPT with a score for its head (GPTConfig.head "reward"), exported as its family's
*ForSequenceClassification that transformers loads with the same scores, read back by tinygpt, and refused
in one line by what needs a language model's head (sampling, chat, serving, GGUF)."""

from __future__ import annotations

import pytest
import torch

import tinygpt
from tinygpt import GPT, GPTConfig
from tinygpt.align.reward import scores
from tinygpt.interop.hf import export_hf, load_hf
from tinygpt.tokenizer.bpe import BPETokenizer

TEXT = "the sky is blue and the grass is green, a cat sat on the mat, what colour is the sea? " * 40
FAMILIES = {"gpt2": {}, "qwen2": dict(arch="llama", qkv_bias=True, n_kv_head=1, intermediate_size=48),
            "qwen3": dict(arch="llama", qk_norm=True, n_kv_head=1, intermediate_size=48)}


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train([TEXT], 300)


def reward_model(vocab: int, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=2, n_embd=32, head="reward",
                         tie_weights=False, **overrides)).eval()


def padded(tok, texts):
    """Texts as rows right-padded with the end of text (transformers' padding for a reward model) and their last
    token's index."""
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    return torch.tensor([r + [tok.eot_id] * (width - len(r)) for r in rows]), torch.tensor([len(r) - 1 for r in rows])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_reward_model_s_export_scores_as_transformers_sequence_classifier_does(tok, family, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    model = reward_model(tok.vocab_size, **FAMILIES[family])
    export_hf(model, tok, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"gpt2": "GPT2", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family] + \
        "ForSequenceClassification"
    ids, last = padded(tok, ["the sky is blue", "a cat", "what colour is the sea? the grass is green"])
    with torch.no_grad():
        mine = scores(model, ids, last)
        theirs = hf(ids, attention_mask=(torch.arange(ids.shape[1]) <= last[:, None]).long()).logits[:, 0]
        back = scores(load_hf(tmp_path / "hf"), ids, last)  # tinygpt reads the classifier back as a reward model
    assert (mine - theirs).abs().max().item() < 1e-4
    assert torch.equal(mine, back)
    assert not (tmp_path / "hf" / "generation_config.json").exists()


def test_a_reward_model_has_a_score_and_no_language_model_head():
    model = reward_model(50)
    assert not hasattr(model, "lm_head") and model.score.weight.shape == (1, 32)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 1)
    with pytest.raises(ValueError, match="no language-model head"):
        model(torch.zeros(1, 5, dtype=torch.long), targets=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(tinygpt.ConfigError, match="tie_weights"):
        GPTConfig(head="reward")


def test_sample_chat_serve_and_gguf_refuse_a_reward_run_in_one_line(tok, tmp_path, cli):
    tinygpt.save(reward_model(tok.vocab_size), tmp_path / "reward", tok)
    for args in (("sample", "--prompt", "the"), ("chat",), ("serve",),
                 ("export", "--format", "gguf", "--out", tmp_path / "reward.gguf")):
        r = cli(args[0], tmp_path / "reward", *args[1:])
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and "reward model" in r.stderr, args
        assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "reward.gguf").exists()
