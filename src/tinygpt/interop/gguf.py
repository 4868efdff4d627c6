"""GGUF export: a tinygpt model as one file that llama.cpp runs, architecture "gpt2", or for the llama
layout "llama", "qwen2" or "qwen3" (the Hugging Face model_type it exports as).

The file holds what llama.cpp's own converter (convert_hf_to_gguf.py) writes for that architecture: its
hyperparameters (`gpt2.*`, `llama.*`, ...), the tokenizer (`tokenizer.ggml.*`: a byte-level BPE, or for
a SentencePiece-style tokenizer llama's SPM vocabulary with scores and byte tokens), the chat template,
and the tensors under llama.cpp's names, taken from the `gguf` package's own name map (GPT-2: token_embd,
position_embd, blk.N.attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down, output_norm, output;
the llama layout: blk.N.attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_gate, ffn_up,
ffn_down, and rope_freqs for Llama 3's rope scaling). Weights keep nn.Linear's (out, in) layout, which is
the layout llama.cpp's converter produces when it transposes GPT-2's Conv1D weights. A tied head is
stored once, as token_embd, which llama.cpp then also uses as the output layer.

llama.cpp turns a "llama" model's query and key pairs as GPT-J did, dimensions (2i, 2i + 1), where
Hugging Face's and tinygpt's turn (i, i + D/2): the q and k projections' rows are reordered head by
head to match (the converter's permute); qwen2 and qwen3 turn (i, i + D/2) in llama.cpp too, unchanged.

Needs the `gguf` package (the hf extra): `pip install 'tinygpt[hf]'`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.model import GPTConfig
from ..errors import CheckpointError, ConfigError, MissingDependencyError
from ..fileio import atomic_write, check_output_file
from .hf_gpt2 import check_gpt2_computes, gpt2_shapes, gpt2_tensors
from .hf_llama import check_exportable, expected_shapes, hf_name, model_type, to_hf_state_dict
from .hf_tokenizer import byte_level_vocab
from ..model import GPT, rope_frequencies
from ..tokenizer.base import Tokenizer
from ..tokenizer.hf import HFTokenizer

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


# llama.cpp's names (tokenizer.ggml.pre) for the pre-tokenizers of the family's byte-level BPEs, as its
# converter tells them apart: by the regex that splits text before BPE (and SmolLM2's by its digits)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
SPLITS = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}


def gguf_arch(config: GPTConfig) -> str:
    """llama.cpp's architecture for a model: gpt2, or for the llama layout llama, qwen2 or qwen3."""
    return "gpt2" if config.arch == "gpt2" else model_type(config)


def gguf_tensor_names(config: GPTConfig) -> dict[str, str]:
    """Source tensor name -> llama.cpp's GGUF tensor name, for every tensor the file holds: tinygpt's
    names for GPT-2, Hugging Face's for the llama layout (what the gguf package's map is keyed by)."""
    gguf = _gguf()
    arch = gguf_arch(config)
    table = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, arch.upper()), config.n_layer)
    keys = gpt2_shapes(config) if arch == "gpt2" else [hf_name(k) for k in expected_shapes(config)]
    names = {}
    for key in keys:
        module, suffix = key.rsplit(".", 1)
        new = table.get_name(module)
        if new is None:  # pragma: no cover - a gguf release that renamed the architecture's tensors
            raise RuntimeError(f"gguf has no {arch} tensor name for {module}")
        names[key] = f"{new}.{suffix}"
    return names


def _gelu_note(config: GPTConfig) -> list[str]:
    if config.arch == "gpt2" and config.activation == "gelu":
        return ["llama.cpp computes GPT-2's MLP with the tanh approximation of GELU and this model uses exact "
                "GELU, so its outputs there differ slightly from tinygpt's"]
    return []


def gguf_notes(model: GPT, tokenizer: Tokenizer) -> list[str]:
    """What a llama.cpp user should know about this model's GGUF file (empty when nothing)."""
    notes = _gelu_note(model.config)
    if isinstance(tokenizer, HFTokenizer):
        if _vocab(tokenizer, _gguf())[1] == "default":
            notes.append("llama.cpp has no name for this tokenizer's pre-tokenizer, so it splits text with its default "
                         "regex: its token ids for a text may differ from tinygpt's")
        return notes
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
    out = Path(out)
    _check_export(model, tokenizer, out, dtype)
    config = model.config
    arch = gguf_arch(config)
    kind, pre, tokens, types, merges, scores = _vocab(tokenizer, gguf)
    # llama.cpp sizes the vocabulary by the token list: rows past the tokenizer's get unused fillers
    for i in range(len(tokens), config.vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
        if scores is not None:
            scores.append(-1e9)
    if kind == "gpt2":
        merges = merges or [INERT_MERGE]
    tensors = _arrays(model, arch, dtype)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(name or out.stem)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "float16" else gguf.LlamaFileType.ALL_F32)
        _add_hyperparameters(writer, config, arch, gguf)
        writer.add_vocab_size(config.vocab_size)
        writer.add_tokenizer_model(kind)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if scores is not None:
            writer.add_token_scores(scores)
        if kind == "gpt2":
            writer.add_token_merges([f"{a} {b}" for a, b in merges])
        _special_ids(writer, tokenizer)
        for tensor_name, array in tensors.items():
            writer.add_tensor(tensor_name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(out, write)
    return out


def _check_export(model: GPT, tokenizer: Tokenizer, out: Path, dtype: str) -> None:
    """Refuse, before anything is written, a dtype, a path, a model or a tokenizer llama.cpp's file cannot take."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    check_output_file(out, CheckpointError)  # a folder, a path below a file, or where nothing can be written
    if out.exists() and not _is_gguf(out):  # an earlier export is replaced; nothing else is
        raise CheckpointError(f"{out} exists and is not a GGUF file; give a new path to write")
    config = model.config
    if config.head == "reward":
        raise ConfigError("a reward model has no language-model head, which a GGUF file's model is: export it with "
                          "--format hf (a sequence classifier transformers loads)")
    arch = gguf_arch(config)
    if arch == "gpt2":
        check_gpt2_computes(config, "llama.cpp's gpt2")
    else:
        check_exportable(config, f"llama.cpp's {arch}")
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}")


def _arrays(model: GPT, arch: str, dtype: str) -> dict[str, np.ndarray]:
    """The model's tensors by llama.cpp's names, as the file stores them: the matrices in `dtype`, norms and
    biases (and rope_freqs) in float32."""
    names = gguf_tensor_names(model.config)
    arrays = {}
    for key, t in (gpt2_tensors(model) if arch == "gpt2" else _llama_tensors(model, arch)).items():
        half = dtype == "float16" and t.dim() == 2
        arrays[names[key] if key in names else key] = t.to(torch.float16 if half else torch.float32).numpy()
    return arrays


def _add_hyperparameters(writer: Any, config: GPTConfig, arch: str, gguf: Any) -> None:
    """The architecture's keys (gpt2.*, llama.*, qwen2.*, qwen3.*), as llama.cpp's converter writes them."""
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    if arch == "gpt2":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        return
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.layer_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_factor)


def _special_ids(writer: Any, tokenizer: Tokenizer) -> None:
    """BOS, EOS, end of turn, whether llama.cpp adds a BOS, and the chat template."""
    if isinstance(tokenizer, HFTokenizer):  # a pretrained model's, as its folder has them
        before, _ = tokenizer.added_ids
        bos = before[0] if before else tokenizer.bos_id
        if bos is not None:
            writer.add_bos_token_id(bos)
        if tokenizer.eot_id is not None:
            writer.add_eos_token_id(tokenizer.eot_id)
        for token, add in ((tokenizer.config.get("unk_token"), writer.add_unk_token_id),
                           (tokenizer.config.get("pad_token"), writer.add_pad_token_id)):
            i = tokenizer.hf_tokenizer.token_to_id(token) if token is not None else None
            if i is not None:
                add(i)
        if tokenizer.chat_template is not None:
            writer.add_chat_template(tokenizer.chat_template.source)
            ends = [i for i in tokenizer.stop_token_ids if i != tokenizer.eot_id]
            if ends:
                writer.add_eot_token_id(ends[0])
        writer.add_add_bos_token(bool(before))
        return
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


def _vocab(tokenizer: Tokenizer, gguf: Any) -> tuple[str, str | None, list[str], list[Any], list[tuple[str, str]],
                                                      list[float] | None]:
    """(tokenizer.ggml.model, its pre, tokens by id, token types, merges, scores) for llama.cpp.

    tinygpt's own kinds and a pretrained byte-level BPE are "gpt2" BPEs with merges; a SentencePiece-style
    BPE with byte fallback (TinyLlama's) is llama's SPM vocabulary: "▁"-spelled pieces, <0xNN> byte tokens,
    and scores that make llama.cpp's merge-the-best-pair loop take BPE's merges in their order (a piece's
    score is minus the rank of the merge that makes it).
    """
    if not isinstance(tokenizer, HFTokenizer):
        tokens, merges, special = byte_level_vocab(tokenizer)
        types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
        return "gpt2", "gpt-2", tokens, types, merges, None  # GPT-2's pre-tokenizer regex, as tinygpt's BPE uses
    data = tokenizer.to_dict()["tokenizer"]
    model = data["model"]
    added = {t["id"]: t for t in data.get("added_tokens") or [] if isinstance(t, dict)}
    tokens = [""] * tokenizer.vocab_size
    for token, i in model["vocab"].items():
        tokens[i] = token
    for i, t in added.items():
        tokens[i] = t["content"]
    for i, t in enumerate(tokens):  # ids no token has (gaps in a vocabulary): unused, with a unique spelling
        tokens[i] = t or f"[UNUSED{i}]"
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or []]

    def kind_of(i: int) -> Any:
        if i in added:
            return gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
        return gguf.TokenType.NORMAL if tokens[i] in model["vocab"] else gguf.TokenType.UNUSED

    if not model.get("byte_fallback"):  # byte-level
        types = [kind_of(i) for i in range(len(tokens))]
        return "gpt2", _pre_name(data.get("pre_tokenizer")), tokens, types, merges, None
    made = {a + b: rank for rank, (a, b) in enumerate(merges)}
    scores = [-float(made.get(t, 0)) for t in tokens]
    types = []
    for i, t in enumerate(tokens):
        if model.get("unk_token") == t:
            types.append(gguf.TokenType.UNKNOWN)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(kind_of(i))
    return "llama", None, tokens, types, [], scores


def _pre_name(pre: Any) -> str:
    """llama.cpp's name for a byte-level BPE's pre-tokenizer ("default": one it has no name for)."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds[:1] == ["Split"] and kinds[1:] == ["ByteLevel"] and not steps[1].get("use_regex", True):
        return SPLITS.get((steps[0].get("pattern") or {}).get("Regex"), "default")
    return "default"


def _llama_tensors(model: GPT, arch: str) -> dict[str, torch.Tensor]:
    """The llama layout's tensors by Hugging Face name, q and k reordered for llama.cpp's "llama" rotation
    (see the module docstring), and Llama 3's rope scaling as rope_freqs.weight: each frequency's divisor."""
    config = model.config
    tensors = to_hf_state_dict(model.state_dict(), config)
    if arch == "llama":
        for key, t in tensors.items():
            if key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                heads = config.n_head if ".q_proj." in key else config.kv_heads
                tensors[key] = _interleave(t, heads)
    if config.rope_scaling == "llama3":
        plain = rope_frequencies(dataclasses.replace(config, rope_scaling="none"))
        tensors["rope_freqs.weight"] = plain / rope_frequencies(config)
    return tensors


def _interleave(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias) from halves (i, i + D/2) to pairs (2i, 2i + 1), per head."""
    rows = t.shape[0]
    return t.reshape(heads, 2, rows // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
