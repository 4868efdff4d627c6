"""The calculators' answers as plain data (for --json) and as readable tables (for the terminal)."""

from __future__ import annotations

from typing import Any

from ..config.lora import LoraConfig
from ..config.model import PRESETS, GPTConfig
from .chinchilla import CHINCHILLA_FIT, ChinchillaPlan, LossFit
from .flops import flops_per_token, inference_flops_per_token, six_n
from .memory import kv_cache_bytes, training_memory
from .params import count_params, trainable_params
from .units import dtype_bytes, dtype_name, format_bytes, format_count, format_flops, plural

GPT2_FAMILY = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def model_report(
    config: GPTConfig,
    *,
    name: str = "custom",
    batch_size: int = 1,
    seq_len: int | None = None,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    freeze_embeddings: bool = False,
    freeze_layers: int = 0,
    grad_checkpoint: bool = False,
) -> dict[str, Any]:
    """Everything the calculators know about one architecture, as JSON-ready data.

    Args:
        config: the architecture.
        name: what to call it (a preset name, a run folder).
        batch_size: sequences per batch for the KV cache and the training activations.
        seq_len: training sequence length (default block_size).
        dtype: compute dtype: activations, KV cache and inference weights.
        lora, freeze_embeddings, freeze_layers: the training method the "trainable" figures and the
            training memory are for (default: full training; see calc.params.trainable_params).
        grad_checkpoint: the training memory with each block's activations recomputed in backward.

    Returns:
        A dict whose "total" is the parameter count (of the model without adapters).
    """
    dtype = dtype_name(dtype)
    counts = count_params(config)
    flops = flops_per_token(config, seq_len)
    T = flops.seq_len
    method = dict(lora=lora, freeze_embeddings=freeze_embeddings, freeze_layers=freeze_layers)
    trainable = trainable_params(config, **method)
    memory = training_memory(config, batch_size, T, dtype=dtype, grad_checkpoint=grad_checkpoint, **method)
    return {
        "name": name,
        "config": config.to_dict(),
        "total": counts.total,
        "non_embedding": counts.non_embedding,
        "params": counts.to_dict(),
        "trainable": trainable.to_dict(),
        "flops_per_token": {
            "convention": "matmuls only, 2 FLOPs per multiply-add, attention over all seq_len positions",
            **flops.to_dict(),
            "six_n": six_n(config),
            "inference_context": config.block_size,
            "inference_kv_cache": inference_flops_per_token(config),
            "inference_no_cache": inference_flops_per_token(config, kv_cache=False),
        },
        "memory": {
            "dtype": dtype,
            "batch_size": batch_size,
            "kv_cache_bytes_per_token": kv_cache_bytes(config, dtype=dtype),
            "kv_cache_bytes_full_context": kv_cache_bytes(
                config, config.block_size, batch_size=batch_size, dtype=dtype
            ),
            "inference_weight_bytes": counts.total * dtype_bytes(dtype),
            "training": memory.to_dict(),
        },
    }


def _describe(config: GPTConfig) -> str:
    head = "head tied to wte" if config.tie_weights else "untied head"
    bias = "biases" if config.bias else "q/k/v biases" if config.qkv_bias else "no biases"
    dropout = f", dropout {config.dropout:g}" if config.dropout > 0 else ""
    heads = plural(config.n_head, "head")
    if config.kv_heads != config.n_head or config.head_size is not None:
        heads = f"{heads} of {config.head_dim} ({config.kv_heads} for keys and values)"
    family = ""
    if config.arch != "gpt2":
        positions = (f"rotary positions (theta {config.rope_theta:,.0f}"
                     + (f", {config.rope_scaling} scaling x{config.rope_factor:g}" if config.rope_scaling != "none"
                        else "") + ")" if config.positions == "rope" else "learned positions")
        family = (f"; llama layout: {positions}, {'RMSNorm' if config.norm == 'rmsnorm' else 'LayerNorm'}, "
                  f"{config.mlp} MLP{', qk-norm' if config.qk_norm else ''}")
    return (
        f"{plural(config.n_layer, 'layer')}, {heads}, n_embd {config.n_embd}, "
        f"vocab {config.vocab_size:,}, context {config.block_size:,}{family}; {bias}, {head}{dropout}"
    )


def _rows(rows: list[tuple[str, str, str]]) -> list[str]:
    return [f"  {label:<34}{value:>18}  {note}".rstrip() for label, value, note in rows]


def render_model_report(report: dict[str, Any]) -> str:
    """The table `tinygpt params` prints for a report from `model_report`."""
    cfg = GPTConfig.from_dict(report["config"])
    p, f, m = report["params"], report["flops_per_token"], report["memory"]
    L, T, total = cfg.n_layer, f["seq_len"], p["total"]

    def share(n: int) -> str:
        return f"{100 * n / total:5.1f}%"

    lines = [f"{report['name']}: {_describe(cfg)}", "", "Parameters"]
    lines += _rows([
        ("token embedding (wte)", f"{p['token_embedding']:,}", share(p["token_embedding"])),
        ("position embedding (wpe)", f"{p['position_embedding']:,}", share(p["position_embedding"]))
        if cfg.positions == "learned" else ("position embedding", "none", "rotary positions"),
        (f"attention x {L}", f"{p['attention']:,}", share(p["attention"])),
        (f"MLP ({'4x' if cfg.mlp == 'gelu' and cfg.mlp_width == 4 * cfg.n_embd else f'{cfg.mlp}, {cfg.mlp_width:,}'}"
         f" wide) x {L}", f"{p['mlp']:,}", share(p["mlp"])),
        (f"{'layer norms' if cfg.norm == 'layernorm' else 'RMSNorms'} x {2 * L + 1}", f"{p['layer_norm']:,}",
         share(p["layer_norm"])),
        ("LM head", "tied to wte" if p["tied"] else f"{p['head']:,}", "" if p["tied"] else share(p["head"])),
        ("total", f"{total:,}", f"({format_count(total)})"),
        ("non-embedding", f"{p['non_embedding']:,}", share(p["non_embedding"])),
        ("biases (included above)", f"{p['biases']:,}", ""),
    ])
    lines += ["", f"FLOPs per token (matmuls, 2 per multiply-add; attention over all {T:,} positions)"]
    lines += _rows([
        ("forward", format_flops(f["forward"]), "2·(matmul weights + d·V) + 4·L·T·d"
         if cfg.n_head * cfg.head_dim == cfg.n_embd else "2·(matmul weights + d·V) + 4·L·T·n_head·head_dim"),
        ("  attention projections", format_flops(f["attention_proj"]), ""),
        ("  attention scores and values", format_flops(f["attention"]), ""),
        ("  MLP", format_flops(f["mlp"]), ""),
        ("  LM head", format_flops(f["head"]), ""),
        ("training (forward + backward)", format_flops(f["training"]), "3x forward"),
        ("6N rule of thumb", format_flops(f["six_n"]), f"{f['six_n'] / f['training']:.2f}x the count above"),
        (f"inference, KV cache, context {f['inference_context']:,}", format_flops(f["inference_kv_cache"]), ""),
        (f"inference, no cache, context {f['inference_context']:,}", format_flops(f["inference_no_cache"]),
         "the whole context recomputed"),
    ])
    t = m["training"]
    batch = m["batch_size"]
    lines += ["", f"Inference memory ({m['dtype']})"]
    lines += _rows([
        ("KV cache per token", format_bytes(m["kv_cache_bytes_per_token"]), "2 x n_layer x n_embd values"
         if cfg.kv_heads == cfg.n_head and cfg.head_size is None else "2 x n_layer x n_kv_head x head_dim values"),
        (f"KV cache, {cfg.block_size:,} tokens x batch {batch}", format_bytes(m["kv_cache_bytes_full_context"]), ""),
        ("weights for inference", format_bytes(m["inference_weight_bytes"]), ""),
    ])
    autocast = t["dtype"] != t["param_dtype"]
    tr = report["trainable"]
    method = "" if tr["method"] == "full" else f", {tr['method']}"
    if method:
        lines += ["", f"Trainable parameters ({tr['method']})"]
        lines += _rows([
            *([("adapters (added)", f"{tr['adapters']:,}", "rank x (in + out) per adapted matrix")]
              if tr["adapters"] else []),
            ("trainable", f"{tr['trainable']:,}", f"{100 * tr['trainable'] / tr['total']:.2f}% of {tr['total']:,}"),
            ("frozen", f"{tr['frozen']:,}", "no gradients, no AdamW state"),
        ])
    lines += [
        "",
        f"Training with AdamW (batch {t['batch_size']} x {t['seq_len']:,} tokens, {t['dtype']} activations, "
        f"{t['param_dtype']} weights{', autocast' if autocast else ''}{method}"
        f"{', activations recomputed block by block' if t['grad_checkpoint'] else ''})",
    ]
    lines += _rows([
        ("weights", format_bytes(t["weights"]), ""),
        ("gradients", format_bytes(t["gradients"]), "trainable parameters only" if method else ""),
        ("AdamW moments (2)", format_bytes(t["optimizer"]), "trainable parameters only" if method else ""),
        ("activations saved for backward", format_bytes(t["activations"]),
         "each block's input, and one block rebuilt at a time" if t["grad_checkpoint"] else
         "for what trains" if method else ""),
        *([("autocast weight copies", format_bytes(t["autocast_weights"]), "")] if autocast else []),
        ("total", format_bytes(t["total"]), ""),
        *([("peak, as the loss runs", format_bytes(t["peak"]),
            "its workspace beside what is saved, few weight gradients")]
          if t["peak"] > t["total"] else []),
    ])
    return "\n".join(lines)


def family_report(dtype: str = "float32") -> list[dict[str, Any]]:
    """One row per GPT-2 size: shape, parameters, FLOPs per token and KV-cache bytes per token."""
    rows = []
    for name in GPT2_FAMILY:
        cfg = GPTConfig.from_preset(name)
        counts = count_params(cfg)
        rows.append({
            "name": name,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_embd": cfg.n_embd,
            "d_ff": 4 * cfg.n_embd,
            "total": counts.total,
            "non_embedding": counts.non_embedding,
            "training_flops_per_token": flops_per_token(cfg).training,
            "kv_cache_bytes_per_token": kv_cache_bytes(cfg, dtype=dtype),
            "chinchilla_tokens": 20 * counts.total,
        })
    return rows


def render_family(rows: list[dict[str, Any]], dtype: str = "float32") -> str:
    """The GPT-2 family as a table."""
    header = (f"{'model':<12}{'layers':>7}{'heads':>6}{'d_model':>8}{'d_ff':>6}{'parameters':>15}"
              f"{'non-embedding':>15}{'train/token':>13}{'KV/token':>11}{'20N tokens':>11}")
    lines = [f"GPT-2 family (vocab {PRESETS['gpt2']['vocab_size']:,}, context 1,024, tied head; "
             f"KV cache in {dtype_name(dtype)})", header]
    for r in rows:
        lines.append(
            f"{r['name']:<12}{r['n_layer']:>7}{r['n_head']:>6}{r['n_embd']:>8}{r['d_ff']:>6}{r['total']:>15,}"
            f"{r['non_embedding']:>15,}{format_flops(r['training_flops_per_token']):>13}"
            f"{format_bytes(r['kv_cache_bytes_per_token']):>11}{format_count(r['chinchilla_tokens']):>11}"
        )
    return "\n".join(lines)


def render_plan(plan: ChinchillaPlan, source: str, fit: LossFit = CHINCHILLA_FIT) -> str:
    """The table `tinygpt chinchilla` prints for a plan; `source` says where the budget came from."""
    law = f"L = {fit.E:g} + {fit.A:g}/N^{fit.alpha:g} + {fit.B:g}/D^{fit.beta:g}"
    lines = [f"Compute-optimal by Chinchilla's rule (C = 6·N·D, D = {plan.tokens_per_param:g}·N), from {source}"]
    lines += _rows([
        ("parameters N", format_count(plan.params), f"{plan.params:,.0f}"),
        ("training tokens D", format_count(plan.tokens), f"{plan.tokens:,.0f}"),
        ("compute C", f"{plan.flops:.3g} FLOP", ""),
        ("predicted loss", f"{plan.loss:.3f}", f"nats/token, Hoffmann et al.'s fit {law}"),
    ])
    lines += [
        "",
        f"The fit's own optimum for the same compute: N {format_count(plan.fit_params)}, "
        f"D {format_count(plan.fit_tokens)} ({plan.fit_tokens / plan.fit_params:.0f} tokens per parameter), "
        f"loss {plan.fit_loss:.3f}.",
        "The loss is for the paper's data and tokenizer: a guide to how loss moves with scale, not a number "
        "to expect on your text.",
    ]
    return "\n".join(lines)
