"""GGUF export: a tinygpt model as one file that llama.cpp runs, architecture "gpt2".

The file holds what llama.cpp's own GPT-2 converter writes: the `gpt2.*` hyperparameters, the
tokenizer as a byte-level BPE (`tokenizer.ggml.*`), and the tensors under llama.cpp's names
(token_embd, position_embd, blk.N.attn_norm, blk.N.attn_qkv, blk.N.attn_output, blk.N.ffn_norm,
blk.N.ffn_up, blk.N.ffn_down, output_norm, output), taken from the `gguf` package's own name map.
Weights keep nn.Linear's (out, in) layout, which is the layout llama.cpp's converter produces
when it transposes GPT-2's Conv1D weights. A tied head is stored once, as token_embd, which
llama.cpp then also uses as the output layer.

Needs the `gguf` package (the hf extra): `pip install 'tinygpt[hf]'`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import GPTConfig
from ..errors import CheckpointError, ConfigError, MissingDependencyError
from ..fileio import atomic_write, check_output_file
from .hf_gpt2 import check_gpt2_computes, gpt2_shapes, gpt2_tensors
from .hf_tokenizer import byte_level_vocab
from ..model import GPT
from ..tokenizer import Tokenizer

ARCH = "gpt2"
DTYPES = ("float32", "float16")
# llama.cpp ends generation at token 11 of a "gpt2" vocabulary that names no end-of-text token.
LLAMA_CPP_DEFAULT_EOS = 11
# llama.cpp refuses a "gpt2" tokenizer without merges, and GGUF cannot hold an empty array. A
# vocabulary that needs none (a char tokenizer over ASCII) gets this one: it joins two 0xC0 bytes,
# which never occur in UTF-8 text, so it never applies.
INERT_MERGE = ("À", "À")


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("the gguf package is not installed: pip install 'tinygpt[hf]'") from None
    return gguf


def gguf_tensor_names(config: GPTConfig) -> dict[str, str]:
    """tinygpt parameter name -> llama.cpp's GGUF tensor name, for every tensor the file holds."""
    gguf = _gguf()
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT2, config.n_layer)
    names = {}
    for key in gpt2_shapes(config):
        module, suffix = key.rsplit(".", 1)
        new = table.get_name(module)
        if new is None:  # pragma: no cover - a gguf release that renamed GPT-2's tensors
            raise RuntimeError(f"gguf has no GPT-2 tensor name for {module}")
        names[key] = f"{new}.{suffix}"
    return names


def gguf_notes(model: GPT, tokenizer: Tokenizer) -> list[str]:
    """What a llama.cpp user should know about this model's GGUF file (empty when nothing)."""
    notes = []
    if model.config.activation == "gelu":
        notes.append(
            "llama.cpp computes GPT-2's MLP with the tanh approximation of GELU and this model uses exact "
            "GELU, so its outputs there differ slightly from tinygpt's"
        )
    if tokenizer.eot_id is None and tokenizer.chat_template is None and tokenizer.vocab_size > LLAMA_CPP_DEFAULT_EOS:
        token = tokenizer.decode([LLAMA_CPP_DEFAULT_EOS])
        notes.append(
            f"the vocabulary has no end-of-text token, so llama.cpp stops at token {LLAMA_CPP_DEFAULT_EOS} "
            f"({token!r}); run it with --ignore-eos"
        )
    return notes


def _is_gguf(path: Path) -> bool:
    """Whether path is a regular file that starts as every GGUF file does."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def export_gguf(
    model: GPT,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    dtype: str = "float32",
    name: str | None = None,
) -> Path:
    """Write the model and its tokenizer as a GGUF file for llama.cpp.

    Args:
        model: the GPT.
        tokenizer: its tokenizer (char, bpe or gpt2), stored as a byte-level BPE.
        out: the .gguf file; replaced atomically if it exists.
        dtype: "float32", or "float16" for the matrices (norms and biases stay float32, as llama.cpp wants).
        name: general.name (default: the file's stem).

    Returns:
        The file.
    """
    gguf = _gguf()
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    out = Path(out)
    check_output_file(out, CheckpointError)  # a folder, a path below a file, or where nothing can be written
    if out.exists() and not _is_gguf(out):  # an earlier export is replaced; nothing else is
        raise CheckpointError(f"{out} exists and is not a GGUF file; give a new path to write")
    config = model.config
    check_gpt2_computes(config, "llama.cpp's gpt2")
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}")

    tokens, merges, special = byte_level_vocab(tokenizer)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    # llama.cpp sizes the vocabulary by the token list: rows past the tokenizer's get unused fillers
    for i in range(len(tokens), config.vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    merges = merges or [INERT_MERGE]
    names = gguf_tensor_names(config)
    tensors = {}
    for key, t in gpt2_tensors(model).items():
        half = dtype == "float16" and t.dim() == 2
        tensors[names[key]] = t.to(torch.float16 if half else torch.float32).numpy()

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), ARCH)
        writer.add_name(name or out.stem)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "float16" else gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # GPT-2's pre-tokenizer regex, as tinygpt's BPE uses
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
        if tokenizer.eot_id is not None:
            writer.add_bos_token_id(tokenizer.eot_id)
            writer.add_eos_token_id(tokenizer.eot_id)
        if tokenizer.chat_template is not None:  # llama.cpp's chat renders it and stops at the end of turn
            end = tokenizer.special_ids()[tokenizer.chat_template.end]
            writer.add_chat_template(tokenizer.chat_template.jinja())
            writer.add_eot_token_id(end)
            if tokenizer.eot_id is None:
                writer.add_eos_token_id(end)
        writer.add_add_bos_token(False)
        for tensor_name, array in tensors.items():
            writer.add_tensor(tensor_name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(out, write)
    return out
