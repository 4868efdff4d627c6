"""Chat: templates and special tokens, chat data and its loss mask, SFT in the training loop."""

import pytest
import torch

from tinygpt.config import GPTConfig
from tinygpt.errors import ChatError, TokenizerError
from tinygpt.model import GPT, grow_vocab
from tinygpt.tokenizer import (
    EOT,
    BPETokenizer,
    ChatTemplate,
    CharTokenizer,
    GPT2Tokenizer,
    load_tokenizer,
    render_chat,
    render_chat_prompt,
    with_chat_template,
)

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "say <|end|> now"},
    {"role": "assistant", "content": "ok <|user|>"},
]
TEXT = "".join(m["content"] for m in CONVO) + " abcdefghijklmnopqrstuvwxyz"


def byte_gpt2() -> GPT2Tokenizer:
    """GPT-2's shape in small: the 256 byte tokens and <|endoftext|> after them (no merges)."""
    return GPT2Tokenizer({bytes([b]): b for b in range(256)}, {EOT: 256})


def tokenizers():
    return {
        "char": CharTokenizer.from_text(TEXT),
        "bpe": BPETokenizer.train([TEXT * 20], 300),
        "gpt2": byte_gpt2(),
    }


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_special_tokens_get_ids_after_the_vocabulary_and_text_never_encodes_to_them(kind, tmp_path):
    base = tokenizers()[kind]
    tok = with_chat_template(base)
    specials = ChatTemplate().special_tokens()
    ids = tok.special_ids()
    assert [ids[t] for t in specials] == list(range(tok.vocab_size - 4, tok.vocab_size))
    assert tok.vocab_size == base.vocab_size + 4 and base.chat_template is None  # the original is untouched
    if kind == "gpt2":
        assert ids["<|system|>"] == 257  # right after <|endoftext|>
    # a user typing the spelling of a special token gets its characters, not the token
    for spelling in specials:
        encoded = tok.encode(f"x{spelling}y")
        assert not set(encoded) & set(ids.values()) and tok.decode(encoded) == f"x{spelling}y"
    rendered = render_chat(tok, CONVO)
    specials_in = [i for i in rendered.ids if i in ids.values()]
    assert specials_in == [ids[t] for t in ("<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>", "<|end|>")]
    assert tok.decode(rendered.ids) == "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in CONVO)
    # the mask covers the assistant's content and its end of turn, nothing else
    answer = tok.encode(CONVO[2]["content"])
    assert sum(rendered.mask) == len(answer) + 1
    assert rendered.mask[-len(answer) - 1 :] == [1] * (len(answer) + 1) and rendered.mask[: -len(answer) - 1] == [0] * (
        len(rendered.ids) - len(answer) - 1
    )
    prompt = render_chat_prompt(tok, CONVO[:2])
    assert prompt == rendered.ids[: len(prompt)] and prompt[-1] == ids["<|assistant|>"]
    # saved and loaded, the template and its ids come back; the fingerprint tells it from the plain tokenizer
    tok.save(tmp_path / "t.json")
    again = load_tokenizer(tmp_path / "t.json")
    assert again.chat_template == tok.chat_template and render_chat(again, CONVO) == rendered
    assert again.fingerprint() == tok.fingerprint() != base.fingerprint()


def test_malformed_conversations_and_templates_are_refused():
    tok = with_chat_template(CharTokenizer.from_text(TEXT))
    bad = [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}], "empty content"),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ]
    for messages, why in bad:
        with pytest.raises(ChatError, match=why):
            render_chat(tok, messages)
    with pytest.raises(ChatError, match="no chat template"):
        render_chat(CharTokenizer.from_text(TEXT), CONVO)
    with pytest.raises(ChatError, match="role"):
        ChatTemplate(start="<|start|>")
    with pytest.raises(TokenizerError):  # content outside a char vocabulary
        render_chat(tok, [{"role": "user", "content": "ZZZ"}, {"role": "assistant", "content": "a"}])
    data = tok.to_dict()
    data["specials"] = data["specials"][:-1]
    data["vocab_size"] -= 1
    with pytest.raises(TokenizerError, match="not special tokens"):
        from tinygpt.tokenizer import tokenizer_from_dict

        tokenizer_from_dict(data)


@pytest.mark.parametrize("tie", [True, False])
def test_grow_vocab_adds_mean_rows_and_keeps_the_old_logits(tie):
    cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=tie)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 20, (2, 8))
    before = model(idx)
    old_wte, old_head = model.wte.weight.clone(), model.lm_head.weight.clone()
    grow_vocab(model, 24)
    assert model.config.vocab_size == 24 and model.wte.weight.shape == (24, 16) == model.lm_head.weight.shape
    assert torch.equal(model.wte.weight[:20], old_wte)
    assert torch.allclose(model.wte.weight[20:], old_wte.mean(0).expand(4, -1))
    assert torch.allclose(model.lm_head.weight[20:], old_head.mean(0).expand(4, -1))
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert torch.allclose(model(idx)[..., :20], before, atol=1e-6)  # old tokens' logits unchanged
    assert {n for n, p in model.named_parameters()} >= {"wte.weight"}  # the optimizer sees the new tensors
    with pytest.raises(ValueError):
        grow_vocab(model, 10)
