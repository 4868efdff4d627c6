import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import tinygpt.calc as calc
from tinygpt import GPT, ConfigError, GPTConfig, KVCache
from tinygpt.calc import CHINCHILLA_FIT, compute_optimal, count_params, flops_per_token
from tinygpt.config import PRESETS, LoraConfig
from tinygpt.model import lm_loss
from tinygpt.throughput import measure_training_throughput

VARIANTS = [dict(tie_weights=t, bias=b) for t in (True, False) for b in (True, False)]
# the llama layout: SwiGLU, grouped-query attention, qk-norm, q/k/v biases, a wider head, untied, learned
# positions with a GELU MLP and LayerNorm
LLAMA = [dict(arch="llama"), dict(arch="llama", n_kv_head=2, qk_norm=True, qkv_bias=True, tie_weights=False),
         dict(arch="llama", n_kv_head=1, head_size=32, intermediate_size=100, dropout=0.1),
         dict(arch="llama", mlp="gelu", norm="layernorm", bias=True, positions="learned")]


def _name(v: dict) -> str:
    return ",".join(f"{k}={x}" for k, x in v.items())


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64), **overrides})


def _by_part(model: GPT) -> dict[str, int]:
    """The built model's parameters grouped like ParamCounts, each tensor once (a tied head is wte)."""
    parts = dict.fromkeys(("token_embedding", "position_embedding", "attention", "mlp", "layer_norm", "head"), 0)
    biases = 0
    for name, p in model.named_parameters():  # a shared tensor is yielded once, under wte
        part = ("token_embedding" if name.startswith("wte") else "position_embedding" if name.startswith("wpe")
                else "head" if name.startswith("lm_head") else "attention" if ".attn." in name
                else "mlp" if ".mlp." in name else "layer_norm")
        parts[part] += p.numel()
        biases += p.numel() if name.endswith("bias") else 0
    return {**parts, "biases": biases}


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"tie={v['tie_weights']},bias={v['bias']}")
@pytest.mark.parametrize("preset", list(PRESETS))
def test_counts_equal_the_built_model(preset, variant):
    cfg = GPTConfig.from_preset(preset, **variant)
    with torch.device("meta"):
        model = GPT(cfg)
    counts = count_params(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters()) == model.num_params()
    got = _by_part(model)
    assert {k: getattr(counts, k) for k in got} == got
    matmul = sum(p.numel() for n, p in model.named_parameters() if n.startswith("h.") and p.dim() == 2)
    assert counts.matmul_weights == matmul
    positions = model.wpe.weight.numel() if model.wpe is not None else 0
    assert counts.non_embedding == counts.total - model.wte.weight.numel() - positions - got["head"]


@pytest.mark.parametrize("variant", LLAMA, ids=_name)
def test_counts_of_the_llama_layout_equal_the_built_model(variant):
    cfg = tiny_config(**variant)
    model = GPT(cfg)
    counts = count_params(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert {k: getattr(counts, k) for k in _by_part(model)} == _by_part(model)
    assert counts.matmul_weights == sum(p.numel() for n, p in model.named_parameters()
                                        if n.startswith("h.") and p.dim() == 2)
    shapes = calc.projections(cfg)
    for name, (fan_in, fan_out) in shapes.items():
        layer = model.h[0].get_submodule(name)
        assert (layer.in_features, layer.out_features) == (fan_in, fan_out)
    assert {n.rsplit(".", 1)[0].split(".", 2)[2] for n, p in model.named_parameters()
            if n.startswith("h.0.") and p.dim() == 2} == set(shapes)


# The published config.json of each family preset, as the Hub serves it (the fields that shape the
# model): transformers builds each one, and tinygpt's preset must count what it counts.
PUBLISHED = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rope_theta=100000, tie_word_embeddings=True), 134_515_008),
    "smollm2-360m": ("llama", dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                   num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                                   rope_theta=100000, tie_word_embeddings=True), 361_821_120),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, tie_word_embeddings=True), 494_032_768),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, rope_theta=1000000, tie_word_embeddings=True),
                   596_049_920),
    "tinyllama-1.1b": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                     tie_word_embeddings=False), 1_100_048_384),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192)),
                     1_235_814_400),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_family_presets_count_what_transformers_builds_from_the_published_configs(preset):
    transformers = pytest.importorskip("transformers")
    model_type, fields, published = PUBLISHED[preset]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = GPT(GPTConfig.from_preset(preset))
    hf_total = sum(p.numel() for p in hf.parameters())  # a tied head is one tensor there too
    assert count_params(GPTConfig.from_preset(preset)).total == hf_total == published
    assert sum(p.numel() for p in ours.parameters()) == published


def test_published_sizes():
    family = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
    totals = {name: count_params(GPTConfig.from_preset(name)).total for name in family}
    assert totals == {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                      "gpt2-xl": 1_557_611_200}
    assert count_params(GPTConfig.from_preset("lesson")).total == 107_008
    # The chapter's "tying saves ~38M parameters" for a 50K vocabulary at width 768.
    assert count_params(GPTConfig(tie_weights=False)).total - totals["gpt2"] == 50257 * 768


@pytest.mark.parametrize("variant", VARIANTS + LLAMA, ids=_name)
@pytest.mark.parametrize("seq_len", [32, 19])
def test_training_flops_match_torch_flop_counter(variant, seq_len):
    cfg = tiny_config(**variant)
    model = GPT(cfg)
    B = 2
    idx = torch.randint(0, cfg.vocab_size, (B, seq_len))
    # The explicit attention path runs as matmuls the counter sees (CPU's fused kernel it does not count).
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(idx, return_attention=True)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(idx, return_attention=True)
        lm_loss(logits, idx).backward()
    training = counter.get_total_flops()
    ours = flops_per_token(cfg, seq_len)
    assert ours.forward * B * seq_len == pytest.approx(forward, rel=0.05)
    assert ours.training * B * seq_len == pytest.approx(training, rel=0.05)
    assert calc.training_flops(cfg, B * seq_len, seq_len) == ours.training * B * seq_len


def test_inference_flops_match_the_counter_with_and_without_a_cache():
    cfg = tiny_config()
    model = GPT(cfg).eval()
    t = 20
    idx = torch.randint(0, cfg.vocab_size, (1, t))
    cache = KVCache(cfg.n_layer, 1, cfg.n_head, t, cfg.head_dim)
    with torch.no_grad():
        model(idx[:, : t - 1], cache, torch.arange(t - 1))
        with FlopCounterMode(display=False) as counter:
            model(idx[:, t - 1 :], cache, torch.arange(t - 1, t), return_attention=True)
        cached = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            model(idx, return_attention=True)
        uncached = counter.get_total_flops()
    assert calc.inference_flops_per_token(cfg, t) == pytest.approx(cached, rel=0.05)
    assert calc.inference_flops_per_token(cfg, t, kv_cache=False) == pytest.approx(uncached, rel=0.05)


def test_flops_conventions():
    cfg = GPTConfig.from_preset("gpt2")
    f = flops_per_token(cfg)
    d, L, T, V = 768, 12, 1024, 50257
    N = count_params(cfg).matmul_weights + d * V
    assert f.forward == 2 * N + 4 * L * T * d
    assert f.training == 6 * N + 12 * L * T * d == 3 * f.forward == f.forward + f.backward
    assert calc.six_n(cfg) == 6 * 124_439_808
    with pytest.raises(ConfigError, match="seq_len"):
        flops_per_token(cfg, 2048)
    with pytest.raises(ConfigError, match="tokens"):
        calc.training_flops(cfg, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", [{}, dict(arch="llama", n_kv_head=1, head_size=32)], ids=_name)
def test_kv_cache_bytes_equal_the_real_cache(dtype, variant):
    cfg = tiny_config(n_layer=3, **variant)
    cache = KVCache(cfg.n_layer, 5, cfg.kv_heads, cfg.block_size, cfg.head_dim, dtype=getattr(torch, dtype))
    real = cache.k.nbytes + cache.v.nbytes
    with torch.device("meta"):
        model = GPT(cfg)  # what generation allocates: float32 here
    assert KVCache.bytes_for_model(model, 5) == calc.kv_cache_bytes(cfg, cfg.block_size, batch_size=5)
    assert calc.kv_cache_bytes(cfg, cfg.block_size, batch_size=5, dtype=dtype) == real
    assert calc.kv_cache_bytes(cfg, dtype=dtype) * cfg.block_size * 5 == real
    # GPT-2 small: 2 x 12 layers x 768 values x 4 bytes = 72 KiB a token
    assert calc.kv_cache_bytes(GPTConfig()) == 73_728


def _saved_bytes(model: GPT, idx: torch.Tensor, dtype: str) -> int:
    """Bytes of the tensors autograd saves for backward (parameters excluded) in the training loop's
    forward pass (the loss from the model's fused head)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    # the estimate is PyTorch's operations' (a GPU, a CPU without tinygpt's kernels): on the kernels the modern
    # block keeps less (a norm its input and rstd, SwiGLU its two inputs), so there it is an upper bound
    from tinygpt import kernels

    modern = {name: getattr(kernels, name) for name in ("trains_rms_norm", "trains_rotary", "trains_swiglu")}
    try:
        for name in modern:
            setattr(kernels, name, lambda *a: False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            model(idx, targets=idx.roll(1, dims=1))
    finally:
        for name, f in modern.items():
            setattr(kernels, name, f)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("overrides", [{}, dict(dropout=0.1), dict(tie_weights=False, bias=False, n_head=2), *LLAMA],
                         ids=_name)
def test_activation_estimate_matches_what_autograd_saves(dtype, overrides):
    cfg = tiny_config(**overrides)
    model = GPT(cfg).train()
    B, T = 3, 24
    real = _saved_bytes(model, torch.randint(0, cfg.vocab_size, (B, T)), dtype)
    memory = calc.training_memory(cfg, B, T, dtype=dtype)
    assert memory.activations + memory.autocast_weights == pytest.approx(real, rel=0.01)
    assert (memory.autocast_weights > 0) == (dtype == "bfloat16")


@pytest.mark.parametrize("overrides", [{}, dict(dropout=0.1)])
def test_activation_estimate_past_the_matmul_attention_limit(overrides, monkeypatch):
    # bf16 training on a CPU uses the matmul attention path only for small T x T scores: past the
    # limit it is SDPA again, and the estimate follows
    from tinygpt import model as model_module
    from tinygpt.config import model as config
    from tinygpt.calc import memory

    # one number, defined in config: each module reads its own binding of it, so both are patched
    assert memory.MATH_ATTENTION_MAX_SCORES is model_module.MATH_ATTENTION_MAX_SCORES is config.MATH_ATTENTION_MAX_SCORES
    monkeypatch.setattr(memory, "MATH_ATTENTION_MAX_SCORES", 100)
    monkeypatch.setattr(model_module, "MATH_ATTENTION_MAX_SCORES", 100)
    cfg = tiny_config(**overrides)
    model = GPT(cfg).train()
    real = _saved_bytes(model, torch.randint(0, cfg.vocab_size, (3, 24)), "bfloat16")
    m = calc.training_memory(cfg, 3, 24, dtype="bfloat16")
    assert m.activations + m.autocast_weights == pytest.approx(real, rel=0.01)


def test_training_memory_parts():
    cfg = GPTConfig.from_preset("gpt2")
    m = calc.training_memory(cfg, 4, 512, dtype="bf16")
    n = 124_439_808
    assert (m.weights, m.gradients, m.optimizer) == (4 * n, 4 * n, 8 * n)  # float32 master weights under autocast
    assert m.total == m.weights + m.gradients + m.optimizer + m.activations + m.autocast_weights
    assert m.dtype == "bfloat16" and m.param_dtype == "float32"
    # activations grow linearly with the batch, beside a fixed part shared by every row: the
    # positions and the head's float32 gradient, which the fused loss makes in the forward pass
    a1, a2, a4 = (calc.activation_bytes(cfg, b, 512) for b in (1, 2, 4))
    assert a4 - a2 == 2 * (a2 - a1) and 2 * a1 - a2 == 8 * 512 + 4 * 768 * 50257
    with pytest.raises(ConfigError, match="batch_size"):
        calc.training_memory(cfg, 0)
    with pytest.raises(ConfigError, match="dtype"):
        calc.training_memory(cfg, 1, dtype="int3")



@pytest.mark.parametrize("method", [dict(), dict(freeze_layers=2), dict(freeze_embeddings=True, freeze_layers=1),
                                    dict(lora=LoraConfig(rank=4)), dict(grad_checkpoint=True)])
def test_memory_of_any_depth_is_arithmetic_not_a_loop(method):
    # the estimate used to build a tuple per block: `tinygpt params --n-layer 10**18` took the
    # machine's memory; blocks alike are a count now, and every block past the frozen ones adds the same
    def at(n_layer):
        return calc.training_memory(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=8, vocab_size=10),
                                    2, dtype="float32", **method)
    per_block = at(4).activations - at(3).activations
    assert per_block > 0 and at(5).activations - at(4).activations == per_block
    deep = at(10**18)
    assert deep.activations == at(4).activations + (10**18 - 4) * per_block


METHODS = [
    dict(),
    dict(lora=LoraConfig(rank=4, targets="c_attn")),
    dict(lora=LoraConfig(rank=2, alpha=16, targets="attn,mlp")),
    dict(lora=LoraConfig(rank=3, targets="attn.c_proj,mlp.c_fc")),
    dict(freeze_embeddings=True),
    dict(freeze_layers=1),
    dict(freeze_embeddings=True, freeze_layers=2),
    dict(freeze_layers=3),
]


# METHODS' LoRA targets on GPT-2 -> the like ones of the llama layout (q, k and v; attention and MLP; the
# output projection and the MLP's input)
LLAMA_LORA = {("attn.c_attn",): "q_proj,k_proj,v_proj", ("attn", "mlp"): "attn,mlp",
              ("attn.c_proj", "mlp.c_fc"): "o_proj,gate_proj,up_proj"}


def _apply(model: GPT, method: dict) -> GPT:
    from tinygpt.finetune import freeze
    from tinygpt.lora import apply_lora

    if method.get("lora"):
        lora = method["lora"]
        return apply_lora(model, lora.rank, lora.alpha, lora.targets)
    return freeze(model, embeddings=method.get("freeze_embeddings", False), layers=method.get("freeze_layers", 0))


@pytest.mark.parametrize("variant", VARIANTS + [dict(LLAMA[1], dropout=0.0)], ids=_name)
@pytest.mark.parametrize("method", METHODS, ids=lambda m: calc.trainable_params(tiny_config(n_layer=3), **m).method)
def test_trainable_params_equal_the_built_model_with_the_method_applied(variant, method):
    if variant.get("arch") == "llama" and "lora" in method:  # the same choices, by the llama layout's names
        lora = method["lora"]
        method = dict(lora=dataclasses.replace(lora, targets=LLAMA_LORA[lora.targets]))
    cfg = tiny_config(n_layer=3, **variant)
    model = _apply(GPT(cfg), method)
    counts = calc.trainable_params(cfg, **method)
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert counts.adapters == (counts.total - count_params(cfg).total)
    # training memory: weights of everything, gradients and AdamW's moments of what trains only
    m = calc.training_memory(cfg, 2, 16, **method)
    assert m.weights == 4 * counts.total
    assert (m.gradients, m.optimizer) == (4 * counts.trainable, 8 * counts.trainable)
    # activations: what autograd keeps for what trains, nothing where no gradient is needed
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    for dtype in ("float32", "bfloat16"):
        est = calc.training_memory(cfg, 2, 16, dtype=dtype, **method)
        real = _saved_bytes(model.train(), idx, dtype)
        assert est.activations + est.autocast_weights == pytest.approx(real, rel=0.01), dtype
    assert m.activations <= calc.training_memory(cfg, 2, 16).activations


def test_trainable_params_published_and_refused():
    gpt2 = GPTConfig.from_preset("gpt2")
    # PEFT's print_trainable_parameters() for GPT-2 with its default LoRA (r=8 on c_attn)
    lora = calc.trainable_params(gpt2, lora=LoraConfig())
    assert (lora.trainable, lora.total) == (294_912, 124_734_720)
    assert f"{100 * lora.trainable / lora.total:.4f}" == "0.2364"
    assert lora.method == "LoRA r=8, alpha 8 on attn.c_attn"
    assert calc.trainable_params(gpt2).trainable == 124_439_808
    frozen = calc.trainable_params(gpt2, freeze_embeddings=True, freeze_layers=10)
    assert frozen.method == "full, embeddings and blocks 0-9 frozen"
    assert frozen.trainable == 2 * 7_087_872 + 2 * 768  # two blocks and ln_f (the tied head is wte: frozen)
    with pytest.raises(ConfigError, match="LoRA already freezes"):
        calc.trainable_params(gpt2, lora=LoraConfig(), freeze_layers=1)
    with pytest.raises(ConfigError, match="0..12"):
        calc.trainable_params(gpt2, freeze_layers=13)
    m = calc.training_memory(gpt2, 4, 256, lora=LoraConfig(targets="attn,mlp"))
    full = calc.training_memory(gpt2, 4, 256)
    assert m.gradients + m.optimizer < (full.gradients + full.optimizer) / 50


def test_chinchilla_published_cases():
    gopher_budget = compute_optimal(flops=5.76e23)  # Gopher's compute: Chinchilla is 70B on 1.4T
    assert gopher_budget.params == pytest.approx(69.3e9, rel=0.005)
    assert gopher_budget.tokens == pytest.approx(1.39e12, rel=0.005)
    assert gopher_budget.tokens == 20 * gopher_budget.params
    chinchilla = compute_optimal(params=70e9)
    assert chinchilla.tokens == pytest.approx(1.4e12) and chinchilla.flops == pytest.approx(5.88e23)
    assert compute_optimal(tokens=1.4e12).params == pytest.approx(70e9)
    # L(N, D) = 1.69 + 406.4 / N^0.34 + 410.7 / D^0.28, worked by hand for Chinchilla
    assert chinchilla.loss == pytest.approx(1.69 + 406.4 / 70e9**0.34 + 410.7 / 1.4e12**0.28)
    assert chinchilla.loss == pytest.approx(1.937, abs=0.001)
    # Gopher (280B on 300B tokens) spent about as much compute for a worse predicted loss
    assert CHINCHILLA_FIT.loss(280e9, 300e9) > chinchilla.loss
    # Two budgets that agree are accepted; a different ratio plans Gopher's own run
    assert compute_optimal(params=70e9, tokens=1.4e12, flops=5.88e23).params == 70e9
    gopher = compute_optimal(params=280e9, tokens=300e9, tokens_per_param=300 / 280)
    assert gopher.flops == pytest.approx(5.04e23)


def test_the_fits_own_optimum_minimises_its_loss():
    C = 1e21
    N, D = CHINCHILLA_FIT.optimal(C)
    assert 6 * N * D == pytest.approx(C)
    best = CHINCHILLA_FIT.loss(N, D)
    for scale in (0.8, 1.25):  # along the same compute: N up, D down or the reverse
        assert CHINCHILLA_FIT.loss(N * scale, D / scale) > best


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "give a budget"),
        (dict(flops=0), "flops"),
        (dict(params=-70e9), "params"),
        (dict(tokens=math.nan), "tokens"),
        (dict(flops=math.inf), "flops"),
        (dict(flops=1e21, params=1e9), "disagree"),
        (dict(params=280e9, tokens=300e9), "disagree"),
        (dict(flops=1e21, tokens_per_param=0), "tokens_per_param"),
        (dict(params=1e300), "overflow"),  # C = 6 N D is past a float: printed as Infinity before
        (dict(params=70e9, tokens_per_param=1e300), "overflow"),
    ],
)
def test_chinchilla_bad_budgets(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        compute_optimal(**kwargs)


def test_parse_count_and_formats():
    assert calc.parse_count("70B") == 70e9 and calc.parse_count("1.4T") == 1.4e12
    assert calc.parse_count("5.76e23") == 5.76e23 and calc.parse_count("124M") == 124e6
    assert calc.parse_count("1,000") == 1000
    for bad in ("abc", "-1", "0", "1e400", "nan", "12 parsecs"):
        with pytest.raises(ConfigError, match="--x"):
            calc.parse_count(bad, "--x")
    assert calc.format_count(124_439_808) == "124M" and calc.format_count(1.386e12) == "1.39T"
    assert [calc.plural(n, "step") for n in (0, 1, 2, 4113)] == ["0 steps", "1 step", "2 steps", "4,113 steps"]
    assert calc.format_bytes(73_728) == "72 KiB" and calc.format_flops(5.76e23) == "5.76e+23 FLOP"


def test_calc_never_imports_torch():
    # L0: the calculators are arithmetic on a config; they import only config, errors and each other.
    for path in Path(calc.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [("." * node.level) + (node.module or "")]
            else:
                continue
            for module in modules:
                assert not module.split(".")[0] in ("torch", "numpy"), (path.name, module)
                if module.startswith(".."):
                    assert module == "..errors" or module.split(".")[2] == "config", (path.name, module)


def test_importing_calc_and_the_configs_loads_no_torch():
    # The README promises "pure Python, no torch": that must hold through the package's __init__ too.
    code = ("import sys\nimport tinygpt.calc, tinygpt.calc.report\nfrom tinygpt import GPTConfig, TrainConfig, ConfigError\n"
            "GPTConfig.from_preset('baby')\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_measured_throughput_is_consistent():
    cfg = tiny_config(block_size=16)
    t = measure_training_throughput(cfg, batch_size=2, steps=2, warmup=1, device="cpu")
    assert t.flops_per_second > 0 and t.tokens_per_second > 0
    assert t.flops_per_second == pytest.approx(t.tokens_per_second * flops_per_token(cfg, 16).training)
    assert t.tokens_per_second == pytest.approx(2 * 16 / t.step_seconds)
    assert t.params == count_params(cfg).total and t.to_dict()["config"]["n_layer"] == 2
    with pytest.raises(ConfigError, match="device"):
        measure_training_throughput(cfg, device="tpu")
