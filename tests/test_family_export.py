"""Exports of the Llama family: `tinygpt export --format hf` back to the folder transformers loads (logits
within 1e-4, the tokenizer and chat template as they came) and `--format gguf` to llama.cpp's llama, qwen2
and qwen3 architectures, checked against transformers by a forward pass written here from llama.cpp's
semantics (its tensor names, GPT-J-style pair rotation for "llama", NeoX-style halves for qwen2/qwen3,
rope_freqs for Llama 3's scaling); a merged LoRA run exports both ways; and a from-scratch `train --arch
llama` run goes end to end. Where llama-cpp-python is installed, llama.cpp itself loads the file and its
greedy tokens are transformers'."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import hf_family as H  # noqa: E402

import tinygpt  # noqa: E402
from tinygpt.checkpoint import load_run  # noqa: E402
from tinygpt.interop.gguf import gguf_tensor_names  # noqa: E402

# (model_type, tokenizer style, tied)
KINDS = {"llama": ("llama", "llama3", False), "qwen2": ("qwen2", "qwen", True), "qwen3": ("qwen3", "qwen", False),
         "tinyllama": ("llama", "zephyr", True)}
TEXT = "Hello there! How are you? The quick brown fox."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-export")
    return {name: H.make_folder(root / name, kind, style, tied=tied, seed=i)
            for i, (name, (kind, style, tied)) in enumerate(KINDS.items())}


def _logits(folder, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return hf(ids).logits[0]


def _field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def llama_cpp_forward(path, ids: list[int]) -> torch.Tensor:
    """Logits of a GGUF llama / qwen2 / qwen3 file for `ids`, computed as llama.cpp computes them, from the
    file alone: its hyperparameters and tensors by llama.cpp's names."""
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    w = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in r.tensors}
    heads, kv = _field(r, f"{arch}.attention.head_count"), _field(r, f"{arch}.attention.head_count_kv")
    D, eps = _field(r, f"{arch}.attention.key_length"), _field(r, f"{arch}.attention.layer_norm_rms_epsilon")
    base, T = _field(r, f"{arch}.rope.freq_base"), len(ids)
    freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D) / w.get("rope_freqs.weight", torch.ones(1))
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freq  # (T, D/2)
    cos, sin = angle.cos().float(), angle.sin().float()

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x):  # (H, T, D): llama turns pairs (2i, 2i + 1), qwen2/qwen3 (NeoX) halves (i, i + D/2)
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    x = w["token_embd.weight"][ids]
    n_layer = _field(r, f"{arch}.block_count")
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0) for n in "qkv")
        q, k, v = (t.reshape(T, -1, D).transpose(0, 1) for t in (q, k, v))
        if p + "attn_q_norm.weight" in w:
            q, k = norm(q, w[p + "attn_q_norm.weight"]), norm(k, w[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(1, 2)) / D ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        x = x + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T


@pytest.mark.parametrize("name", KINDS)
def test_hf_and_gguf_exports_compute_what_transformers_computes(folders, name, tmp_path, cli):
    folder = folders[name]
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = hf_tok(TEXT)["input_ids"]
    want = _logits(folder, torch.tensor([ids]))
    r = cli("export", folder, "--format", "hf", "--out", tmp_path / "hf")
    assert r.returncode == 0 and transformers.AutoConfig.from_pretrained(folder).architectures[0] in r.stdout, r.stderr
    torch.testing.assert_close(_logits(tmp_path / "hf", torch.tensor([ids])), want, atol=1e-4, rtol=0)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert again(TEXT)["input_ids"] == ids
    for chat in H.CONVERSATIONS:
        assert again.apply_chat_template(chat, add_generation_prompt=True) == hf_tok.apply_chat_template(
            chat, add_generation_prompt=True)
    assert load_run(tmp_path / "hf", "cpu")[1].fingerprint() == load_run(folder, "cpu")[1].fingerprint()

    r = cli("export", folder, "--format", "gguf", "--out", tmp_path / "m.gguf")
    arch = KINDS[name][0]
    assert r.returncode == 0 and f"architecture {arch}" in r.stdout, r.stderr
    torch.testing.assert_close(llama_cpp_forward(tmp_path / "m.gguf", ids), want, atol=1e-4, rtol=0)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    model, tok = load_run(folder, "cpu")
    names = gguf_tensor_names(model.config)  # the gguf package's own map for the architecture
    assert {t.name for t in reader.tensors} == set(names.values()) | (
        {"rope_freqs.weight"} if model.config.rope_scaling == "llama3" else set())
    vocab = hf_tok.convert_ids_to_tokens(list(range(len(hf_tok))))
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    assert tokens[:len(vocab)] == vocab and len(tokens) == model.config.vocab_size
    assert _field(reader, "tokenizer.ggml.model") == ("llama" if name == "tinyllama" else "gpt2")
    assert _field(reader, "tokenizer.ggml.eos_token_id") == hf_tok.eos_token_id
    assert _field(reader, "tokenizer.chat_template") == (folder / "chat_template.jinja").read_text()
    assert bool(_field(reader, "tokenizer.ggml.add_bos_token")) == (hf_tok("a")["input_ids"][0] == hf_tok.bos_token_id)
    half = tmp_path / "half.gguf"
    assert cli("export", folder, "--format", "gguf", "--dtype", "float16", "--out", half).returncode == 0
    torch.testing.assert_close(llama_cpp_forward(half, ids), want, atol=5e-2, rtol=0)


def _exports_compute_the_model(model, tok, run, tmp_path, cli, text=TEXT):
    """`export` of run both ways: transformers' logits and the GGUF's, as llama.cpp computes them, equal
    the tinygpt model's."""
    ids = tok.encode(text)
    with torch.no_grad():
        want = model.float()(torch.tensor([ids]))[0]
    assert cli("export", run, "--format", "hf", "--out", tmp_path / "x-hf").returncode == 0
    torch.testing.assert_close(_logits(tmp_path / "x-hf", torch.tensor([ids])), want, atol=1e-4, rtol=0)
    r = cli("export", run, "--format", "gguf", "--out", tmp_path / "x.gguf")
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(llama_cpp_forward(tmp_path / "x.gguf", ids), want, atol=1e-4, rtol=0)


def test_a_merged_lora_run_of_the_family_exports_both_ways(folders, tmp_path, cli):
    folder = folders["qwen3"]
    (tmp_path / "text.txt").write_text("\n".join(H.CORPUS))
    assert cli("prepare", tmp_path / "text.txt", "--tokenizer-file", folder, "--out", tmp_path / "data").returncode == 0
    r = cli("finetune", folder, "--data", tmp_path / "data", "--out", tmp_path / "lora", "--method", "lora",
            "--lora-targets", "attn,mlp", "--merge", tmp_path / "merged", "--max-iters", 3, "--batch-size", 2,
            "--block-size", 32, "--lr", 1e-2, "--eval-iters", 1, "--quiet")
    assert r.returncode == 0, r.stderr
    merged, tok = load_run(tmp_path / "merged", "cpu")
    base = load_run(folder, "cpu")[0]
    assert any(not torch.equal(a, b) for a, b in zip(merged.state_dict().values(), base.state_dict().values()))
    _exports_compute_the_model(merged, tok, tmp_path / "merged", tmp_path, cli)
    # the adapter run itself exports merged, the same weights
    assert cli("export", tmp_path / "lora", "--format", "hf", "--out", tmp_path / "lora-hf").returncode == 0
    ids = torch.tensor([tok.encode(TEXT)])
    torch.testing.assert_close(_logits(tmp_path / "lora-hf", ids), _logits(tmp_path / "x-hf", ids), atol=1e-5, rtol=0)


def test_block_size_bounds_the_training_window_and_the_run_its_merge_and_exports_keep_the_bases_context(
        folders, tmp_path, cli):
    # once: --block-size 32 became the run's context: its merge, its Hugging Face export (max_position_embeddings,
    # under Llama 3's rope scaling), its GGUF (context_length) and the server, which cut a longer prompt to 32
    from fastapi.testclient import TestClient

    from tinygpt.server import create_app

    folder = folders["llama"]
    (tmp_path / "text.txt").write_text("\n".join(H.CORPUS))
    assert cli("prepare", tmp_path / "text.txt", "--tokenizer-file", folder, "--out", tmp_path / "data").returncode == 0
    train = ("--max-iters", 2, "--batch-size", 2, "--block-size", 32, "--lr", 1e-2, "--eval-iters", 1, "--quiet")
    r = cli("finetune", folder, "--data", tmp_path / "data", "--out", tmp_path / "lora", "--method", "lora",
            "--merge", tmp_path / "merged", *train)
    assert r.returncode == 0, r.stderr
    assert cli("finetune", folder, "--data", tmp_path / "data", "--out", tmp_path / "full", *train).returncode == 0
    hf_config = json.loads((folder / "config.json").read_text())
    context = hf_config["max_position_embeddings"]
    assert context == 128
    for run in ("lora", "merged", "full"):
        assert load_run(tmp_path / run, "cpu")[0].config.block_size == context, run
    for run in ("lora", "full"):  # each step trained 2 windows of 32 tokens
        steps = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["tokens"] for r in steps if "loss" in r] == [64, 128], run
    assert cli("export", tmp_path / "merged", "--format", "hf", "--out", tmp_path / "hf").returncode == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == context
    assert exported["rope_parameters"] == hf_config["rope_parameters"]  # Llama 3's scaling, its original context 16
    assert cli("export", tmp_path / "full", "--format", "gguf", "--out", tmp_path / "m.gguf").returncode == 0
    assert _field(gguf.GGUFReader(tmp_path / "m.gguf"), "llama.context_length") == context
    model, tok = load_run(tmp_path / "lora", "cpu")
    prompt = " ".join(H.CORPUS[:4])
    assert 32 < len(tok.encode(prompt)) < context - 4
    with TestClient(create_app(model, tok, model_name="lora")) as client:
        usage = client.post("/v1/completions", json=dict(model="lora", prompt=prompt, max_tokens=4)).json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode(prompt)) and "prompt_tokens_truncated" not in usage


def test_a_llama_trained_from_scratch_goes_end_to_end(tmp_path, cli):
    from fastapi.testclient import TestClient

    from tinygpt.data import resolve_sources
    from tinygpt.server import create_app

    (stdlib,) = resolve_sources(["python-stdlib"])  # the built-in corpus: a few of its files
    files = [d.path for d in stdlib.documents if d.path.name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    assert len(files) >= 3
    r = cli("prepare", *files, "--tokenizer", "bpe", "--vocab-size", 300, "--out", tmp_path / "data")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    r = cli("train", "--data", tmp_path / "data", "--out", run, "--arch", "llama", "--n-layer", 2, "--n-head", 4,
            "--n-kv-head", 2, "--n-embd", 32, "--block-size", 32, "--batch-size", 4, "--max-iters", 30,
            "--eval-interval", 15, "--eval-iters", 2, "--lr", 3e-3, "--quiet")
    assert r.returncode == 0, r.stderr
    assert tinygpt.load(run).config.arch == "llama"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]
    r = cli("sample", run, "--prompt", "def ", "--max-new-tokens", 20, "--greedy")
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr
    r = cli("eval", run)
    assert r.returncode == 0 and "loss" in r.stdout, r.stderr
    model, tok = load_run(run, "cpu")
    with TestClient(create_app(model, tok, model_name="scratch")) as client:
        reply = client.post("/v1/completions", json=dict(model="scratch", prompt="def ", max_tokens=8, temperature=0))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    _exports_compute_the_model(model, tok, run, tmp_path, cli, text="def wrap(text, width=70):\n    return")


@pytest.mark.parametrize("name", KINDS)
def test_llama_cpp_loads_the_gguf_and_generates_transformers_greedy_tokens(folders, name, tmp_path, cli):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'tinygpt[llama]')")
    folder = folders[name]
    assert cli("export", folder, "--format", "gguf", "--out", tmp_path / "m.gguf").returncode == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = hf_tok(TEXT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=hf_tok.eos_token_id,
                       eos_token_id=None)[0, len(ids):].tolist()
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=128, n_threads=1, verbose=False)
    assert llm.tokenize(TEXT.encode(), add_bos=True, special=False) == ids  # the same tokenizer, BOS as transformers
    got = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        got.append(token)
        if len(got) == len(want):
            break
    assert got == want


@pytest.mark.parametrize("settings, named", [
    (dict(positions="learned"), "positions is 'learned'"),
    (dict(mlp="gelu"), "mlp is 'gelu'"),
    (dict(norm="layernorm"), "norm is 'layernorm'"),
    (dict(qk_norm=True, qkv_bias=True), "qk-norm and q/k/v biases alone"),
])
def test_a_llama_layout_no_hugging_face_class_or_llama_cpp_architecture_has_is_refused_in_one_line(
        settings, named, tmp_path, cli):
    from tinygpt import GPT, GPTConfig
    from tinygpt.tokenizer import CharTokenizer

    model = GPT(GPTConfig(arch="llama", vocab_size=30, block_size=16, n_layer=1, n_head=2, n_embd=16, **settings))
    tinygpt.save(model, tmp_path / "run", CharTokenizer([chr(97 + i) for i in range(26)]))
    for fmt, out in (("hf", tmp_path / "hf"), ("gguf", tmp_path / "m.gguf")):
        r = cli("export", tmp_path / "run", "--format", fmt, "--out", out)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and named in r.stderr, r.stderr
        assert not out.exists()
