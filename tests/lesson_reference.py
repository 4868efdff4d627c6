"""An independent re-implementation of the lesson's TinyGPT, used as the oracle in tests.

It follows the lesson's structure (module names and the order modules are created, hence the
order random numbers are drawn) and its arithmetic, written out separately from tinygpt.
"""

import math

import torch
import torch.nn as nn


class RefAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = (z.reshape(b, t, self.heads, dh).permute(0, 2, 1, 3) for z in self.qkv(x).split(d, dim=-1))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        s = s.masked_fill(torch.tril(torch.ones(t, t)) == 0, float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return self.proj(y.permute(0, 2, 1, 3).reshape(b, t, d))


class RefBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = RefAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RefTinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(RefBlock(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.context = context

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def ref_greedy(model: RefTinyGPT, start: torch.Tensor, new: int) -> torch.Tensor:
    tokens = start.clone()
    for _ in range(new):
        logits = model(tokens[:, -model.context :])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


# tinygpt's GPT-2 names for the reference's parameters
NAME_MAP = [
    ("tok.", "wte."),
    ("pos.", "wpe."),
    ("blocks.", "h."),
    (".ln1.", ".ln_1."),
    (".ln2.", ".ln_2."),
    (".attn.qkv.", ".attn.c_attn."),
    (".attn.proj.", ".attn.c_proj."),
    (".ffn.0.", ".mlp.c_fc."),
    (".ffn.2.", ".mlp.c_proj."),
    ("ln.", "ln_f."),
    ("head.", "lm_head."),
]


def tinygpt_name(ref_name: str) -> str:
    for old, new in NAME_MAP:
        if ref_name.startswith(old) or (old.startswith(".") and old in ref_name):
            ref_name = ref_name.replace(old, new, 1)
    return ref_name
