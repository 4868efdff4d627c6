"""Hugging Face GPT-2 interchange: logits parity both ways, tokenizers, pipelines, greedy decoding,
the CLI, and bad folders. Needs the hf extra (transformers)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import make_text

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install 'tinygpt[hf]'")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_tokenizer import GPT2_TEXTS, reference_encoding, write_gpt2_files  # noqa: E402

import tinygpt  # noqa: E402
from tinygpt import GPT, GPTConfig, TrainConfig, generate  # noqa: E402
from tinygpt.errors import CheckpointError, TokenizerError  # noqa: E402
from tinygpt.checkpoint import import_hf  # noqa: E402
from tinygpt.interop.hf_gpt2 import TRANSPOSED, export_hf, hf_shapes, to_transformers  # noqa: E402
from tinygpt.interop.hf_tokenizer import load_hf_tokenizer, ranks_to_merges  # noqa: E402
from tinygpt.tokenizer import EOT, GPT2Tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
TOL = 1e-4


def assert_clean_error(r, *fragments):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@torch.no_grad()
def perturb(module, scale=0.1, seed=0):
    """Move every parameter away from its init (LayerNorm ones/zeros, zero biases), so a tensor that
    is dropped or left at its default shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


def random_hf_model(tie=True, activation="gelu_new"):
    """A GPT2LMHeadModel of odd sizes: no dimension is a power of two, heads of width 6."""
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=23, n_embd=30, n_layer=3, n_head=5, activation_function=activation,
        layer_norm_epsilon=1e-6, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    perturb(model)
    return model


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


# ---- transformers -> tinygpt ------------------------------------------------------------------


@pytest.mark.parametrize("tie, activation", [(True, "gelu_new"), (False, "gelu"), (True, "gelu_pytorch_tanh")])
def test_transformers_to_tinygpt_logits(tmp_path, tie, activation):
    hf = random_hf_model(tie, activation)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    idx = torch.randint(0, 37, (3, 23))
    ref = hf_logits(hf, idx)

    model = tinygpt.load(tmp_path / "hf")  # a Hugging Face folder, read directly
    c = model.config
    assert (c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd) == (37, 23, 3, 5, 30)
    assert c.tie_weights is tie and c.layer_norm_eps == 1e-6
    assert c.activation == ("gelu" if activation == "gelu" else "gelu_tanh")
    assert (model(idx) - ref).abs().max() < TOL
    assert (model.lm_head.weight is model.wte.weight) is tie

    imported, tokenizer = import_hf(tmp_path / "hf", tmp_path / "run")
    assert tokenizer is None
    assert "model_type" not in json.loads((tmp_path / "run" / "config.json").read_text())
    assert (tinygpt.load(tmp_path / "run")(idx) - ref).abs().max() < TOL
    # the perturbation matters: GPT-2's logits move by far more than the tolerance without it
    assert (model(idx) - hf_logits(transformers.GPT2LMHeadModel(hf.config).eval(), idx)).abs().max() > 100 * TOL


def test_original_gpt2_key_spelling_and_mask_buffers(tmp_path):
    """The first GPT-2 checkpoints name tensors without "transformer." and carry the causal mask."""
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(3):
        bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 23, 23))
    save_file(bare, tmp_path / "hf" / "model.safetensors")
    idx = torch.randint(0, 37, (2, 9))
    assert (tinygpt.load(tmp_path / "hf")(idx) - hf_logits(hf, idx)).abs().max() < TOL


def test_sharded_safetensors(tmp_path):
    hf = random_hf_model(tie=False)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="8KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    idx = torch.randint(0, 37, (2, 9))
    assert (tinygpt.load(tmp_path / "hf")(idx) - hf_logits(hf, idx)).abs().max() < TOL


# ---- tinygpt -> transformers ------------------------------------------------------------------


CONFIGS = {
    "tied-tanh": GPTConfig(vocab_size=53, block_size=19, n_layer=3, n_head=3, n_embd=21, layer_norm_eps=1e-5),
    "lesson-untied-exact": GPTConfig.from_preset("lesson"),
    "no-bias": GPTConfig(vocab_size=29, block_size=11, n_layer=2, n_head=2, n_embd=14, bias=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tinygpt_to_transformers_logits(tmp_path, name):
    config = CONFIGS[name]
    model = GPT(config).eval()
    perturb(model, seed=1)
    idx = torch.randint(0, config.vocab_size, (3, config.block_size))
    with torch.no_grad():
        ours = model(idx)

    export_hf(model, None, tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["model_type"] == "gpt2" and saved["architectures"] == ["GPT2LMHeadModel"]
    assert saved["activation_function"] == ("gelu" if config.activation == "gelu" else "gelu_new")
    assert saved["tie_word_embeddings"] is config.tie_weights
    assert saved["layer_norm_epsilon"] == config.layer_norm_eps
    assert saved["n_positions"] == saved["n_ctx"] == config.block_size
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in stored) is (not config.tie_weights)
    assert {k: tuple(v.shape) for k, v in stored.items()} == hf_shapes(config)  # biases included, even if zero
    block = stored["transformer.h.0.attn.c_attn.weight"]
    assert tuple(block.shape) == (config.n_embd, 3 * config.n_embd)  # Conv1D layout: (in, out)

    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert (hf_logits(hf, idx) - ours).abs().max() < TOL
    assert (hf_logits(to_transformers(model), idx) - ours).abs().max() < TOL
    # and back again
    assert (tinygpt.load(tmp_path / "hf")(idx) - ours).abs().max() < TOL


def test_transposed_list_is_every_matrix_but_embeddings_and_head():
    shapes = hf_shapes(CONFIGS["tied-tanh"])
    matrices = {k.split(".", 3)[-1] for k, s in shapes.items() if len(s) == 2 and ".h." in k}
    assert matrices == set(TRANSPOSED)


# ---- trained runs: tokenizers, pipeline, greedy decoding --------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A char run and a BPE run, each trained for a few dozen steps (seconds)."""
    from tinygpt.data import prepare

    root = tmp_path_factory.mktemp("hf-runs")
    (root / "text.txt").write_text(make_text() + "un café à 3 € 😀\n")
    prepare([str(root / "text.txt")], root / "bpe-data", tokenizer="bpe", vocab_size=320)
    prepare([str(root / "text.txt")], root / "char-data", tokenizer="char")
    out = {}
    for kind in ("char", "bpe"):
        vocab = json.loads((root / f"{kind}-data" / "meta.json").read_text())["vocab_size"]
        config = GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=2, n_embd=32)
        train_cfg = TrainConfig(max_iters=60, batch_size=8, lr=1e-2, warmup=5, eval_interval=1000, eval_iters=1,
                                device="cpu", seed=3)
        tinygpt.train(root / f"{kind}-data", root / kind, config, train_cfg, progress=False)
        out[kind] = root / kind
    return out


TEXTS = [
    make_text(5, seed=11),
    "the cat  sees\n\n  a dog.",
    "",
    " ",
]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_exported_run_tokenizer_pipeline_and_greedy(runs, tmp_path, kind):
    run, out = runs[kind], tmp_path / "hf"
    model, tok = tinygpt.checkpoint.load_run(run, "cpu")
    export_hf(model, tok, out)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = TEXTS + (["un café à 3 € 😀", f"a{EOT}b"] if kind == "bpe" else ["un café à 3 € 😀"])
    for text in texts:
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text), text
        assert hf_tok.decode(ids) == text
    if kind == "bpe":
        assert hf_tok.eos_token == EOT and hf_tok.eos_token_id == tok.eot_id
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eot_id
    else:
        assert hf_tok.eos_token is None and json.loads((out / "config.json").read_text())["eos_token_id"] is None

    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    result = pipe("the cat", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert result.startswith("the cat") and len(result) > len("the cat")

    # greedy decoding: the same tokens from tinygpt and from transformers on the exported weights
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    prompt = torch.tensor([tok.encode("the old king")])
    n = model.config.block_size - prompt.shape[1]
    ours = generate(model, prompt, n, greedy=True)[0].tolist()
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt))[0].tolist()
    if tok.eot_id is not None and tok.eot_id in theirs[prompt.shape[1]:]:  # transformers stops at EOS
        cut = theirs.index(tok.eot_id, prompt.shape[1]) + 1
        ours, theirs = ours[:cut], theirs[:cut]
    assert theirs == ours
    assert len(set(ours[prompt.shape[1]:])) > 1  # a trained model, not one repeated token

    # and back: an exported folder imports to the same model and tokenizer
    back, back_tok = import_hf(out, tmp_path / "back")
    assert back_tok.kind == tok.kind and all(back_tok.encode(t) == tok.encode(t) for t in texts)
    idx = torch.tensor([tok.encode(TEXTS[0])[:32]])
    assert (back(idx) - model(idx)).abs().max() < TOL


def test_cli_sample_and_eval_read_a_hf_folder(runs, tmp_path, cli):
    hf = tmp_path / "hf"
    r = cli("export", runs["char"], "--format", "hf", "--out", hf)
    assert r.returncode == 0, r.stderr
    assert "Hugging Face GPT2LMHeadModel" in r.stdout and "char tokenizer" in r.stdout
    args = ["--prompt", "the cat", "--greedy", "--max-new-tokens", "30", "--device", "cpu"]
    from_run, from_hf = cli("sample", runs["char"], *args), cli("sample", hf, *args)
    assert from_hf.returncode == 0, from_hf.stderr
    assert from_hf.stdout == from_run.stdout and len(from_hf.stdout) > 30
    text = tmp_path / "t.txt"
    text.write_text(make_text(30, seed=5))
    evals = [cli("eval", path, "--text", text, "--json", "--device", "cpu") for path in (runs["char"], hf)]
    assert [json.loads(r.stdout.splitlines()[-1]) for r in evals][0]["loss"] == pytest.approx(
        json.loads(evals[1].stdout.splitlines()[-1])["loss"], abs=1e-5)
    r = cli("eval", hf, "--device", "cpu")
    assert_clean_error(r, "--data", "--text")
    r = cli("params", hf, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total"] == tinygpt.load(hf).num_params()
    r = cli("import", hf, "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert "char tokenizer" in r.stdout
    assert (tmp_path / "run" / "tokenizer.json").exists()


# ---- GPT-2's own BPE --------------------------------------------------------------------------


def test_gpt2_vocab_and_merges_folder_uses_tiktoken(tmp_path):
    vocab, ranks = write_gpt2_files(tmp_path / "hf")
    ref = reference_encoding(ranks)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=16, n_embd=12, n_layer=1, n_head=2)).eval()
    hf.save_pretrained(tmp_path / "hf")
    tok = load_hf_tokenizer(tmp_path / "hf")
    assert isinstance(tok, GPT2Tokenizer) and tok.eot_id == vocab[EOT]
    assert all(tok.encode(t) == ref.encode_ordinary(t) for t in GPT2_TEXTS)

    model, tok = import_hf(tmp_path / "hf", tmp_path / "run")
    assert tinygpt.load_tokenizer(tmp_path / "run").kind == "gpt2"
    # exported again: GPT-2's two files plus a tokenizer.json that transformers encodes with identically
    export_hf(model, tok, tmp_path / "again")
    assert (tmp_path / "again" / "vocab.json").exists() and (tmp_path / "again" / "merges.txt").exists()
    assert json.loads((tmp_path / "again" / "vocab.json").read_text()) == vocab
    assert all(load_hf_tokenizer(tmp_path / "again").encode(t) == ref.encode_ordinary(t) for t in GPT2_TEXTS)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    for text in GPT2_TEXTS:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ref.encode_ordinary(text), text
        assert hf_tok.decode(ref.encode_ordinary(text)) == text
    # exporting another run over it leaves no GPT-2 files behind to be read in place of its tokenizer
    chars = tinygpt.tokenizer.CharTokenizer.from_text("abc ")
    export_hf(GPT(GPTConfig(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=4)), chars, tmp_path / "again")
    assert not (tmp_path / "again" / "vocab.json").exists() and not (tmp_path / "again" / "merges.txt").exists()
    assert load_hf_tokenizer(tmp_path / "again").kind == "char"


def test_ranks_to_merges_recovers_bpe_training_order():
    from tinygpt.tokenizer import BPETokenizer

    from tinygpt.tokenizer.bpe import token_bytes as _token_bytes

    bpe = BPETokenizer.train([make_text(200)], 300)
    data = json.loads(bpe.hf_tokenizer.to_str())

    ranks = {_token_bytes(t): i for t, i in data["model"]["vocab"].items() if t != EOT}
    want = [(_token_bytes(a), _token_bytes(b)) for a, b in data["model"]["merges"]]
    assert ranks_to_merges(ranks) == want


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture
def hf_folder(tmp_path):
    random_hf_model().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_not_an_architecture_tinygpt_reads(hf_folder):
    edit_config(hf_folder, model_type="mistral")
    with pytest.raises(CheckpointError, match="model_type='mistral' is not supported .*gpt2, llama, qwen2, qwen3"):
        tinygpt.load(hf_folder)
    edit_config(hf_folder, model_type="llama")  # GPT-2's weights under a Llama config: its tensors are not there
    with pytest.raises(CheckpointError, match="hf"):
        tinygpt.load(hf_folder)


@pytest.mark.parametrize("changes, message", [
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"n_inner": 64}, "n_inner=64"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"n_head": 7}, "not divisible"),
])
def test_configs_tinygpt_cannot_compute(hf_folder, changes, message):
    edit_config(hf_folder, **changes)
    with pytest.raises(CheckpointError, match=message):
        tinygpt.load(hf_folder)


def test_missing_tensor(hf_folder):
    tensors = load_file(hf_folder / "model.safetensors")
    del tensors["transformer.h.2.mlp.c_fc.bias"]
    save_file(tensors, hf_folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lack transformer\.h\.2\.mlp\.c_fc\.bias"):
        tinygpt.load(hf_folder)
    edit_config(hf_folder, tie_word_embeddings=False)  # an untied config needs lm_head.weight too
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        tinygpt.load(hf_folder)


def test_shapes_disagree_with_config(hf_folder):
    edit_config(hf_folder, vocab_size=40)
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight has shape \(37, 30\).*needs \(40, 30\)"):
        tinygpt.load(hf_folder)
    edit_config(hf_folder, vocab_size=37, n_layer=2)
    with pytest.raises(CheckpointError, match=r"n_layer=2 but the weights hold 3 layers"):
        tinygpt.load(hf_folder)


def test_pickle_only_folder_is_refused_unread(tmp_path, hf_folder, cli):
    (hf_folder / "model.safetensors").unlink()
    (hf_folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not even read")
    with pytest.raises(CheckpointError, match="pickle.*save_pretrained"):
        tinygpt.load(hf_folder)
    r = cli("import", hf_folder, "--out", tmp_path / "run")
    assert_clean_error(r, "pytorch_model.bin, a pickle", "safetensors")
    assert not (tmp_path / "run").exists()


def test_unsupported_tokenizer_and_cli_refusals(tmp_path, hf_folder, runs, cli):
    (hf_folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}))
    with pytest.raises(TokenizerError, match="Unigram tokenizer is not supported"):
        load_hf_tokenizer(hf_folder)
    # export never writes over a run or a foreign folder, and names the problem in one line
    run = runs["char"]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert_clean_error(cli("export", run, "--format", "hf", "--out", run), "--out must not be")
    for target in ("model.safetensors", "sub/model.gguf"):  # the run's own weights, once overwritten by GGUF
        assert_clean_error(cli("export", run, "--format", "gguf", "--out", run / target), "nor inside it")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert_clean_error(cli("export", run, "--format", "hf", "--out", tmp_path / "other"), "not empty")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert_clean_error(cli("import", hf_folder, "--out", run), "already exists")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    if Path("/proc").is_dir():  # nothing can be written there: said so, where once mkdir's bare errno 2 was
        for fmt, out in (("hf", "/proc/hf"), ("gguf", "/proc/model.gguf")):
            assert_clean_error(cli("export", run, "--format", fmt, "--out", out), "cannot write in /proc")
        assert_clean_error(cli("import", hf_folder, "--out", "/proc/run"), "cannot write in /proc")
    assert_clean_error(cli("sample", tmp_path / "other"), "not a tinygpt run")


def test_hand_edited_config_and_tokenizer_files_are_one_line_errors(tmp_path):
    from tinygpt.interop.hf_gpt2 import config_from_hf
    from tinygpt.interop.hf_tokenizer import save_hf_tokenizer
    from tinygpt.tokenizer import CharTokenizer

    good = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}
    for edit in ({"activation_function": ["gelu_new"]}, {"n_embd": None, "n_inner": 128}):
        with pytest.raises(CheckpointError, match="hand/config.json"):
            config_from_hf({**good, **edit}, "hand/config.json")
    save_hf_tokenizer(CharTokenizer.from_text("abc\n"), tmp_path, 16)
    original = json.loads((tmp_path / "tokenizer.json").read_text())
    edits = [lambda d: d.update(model=[1]), lambda d: d["model"].update(vocab=list(d["model"]["vocab"])),
             lambda d: d["model"]["vocab"].update(a="x"), lambda d: d.update(added_tokens=[{"special": True}]),
             lambda d: d.update(added_tokens=["x"])]
    for edit in edits:
        data = json.loads(json.dumps(original))
        edit(data)
        (tmp_path / "tokenizer.json").write_text(json.dumps(data))
        with pytest.raises(TokenizerError, match="tokenizer.json"):
            load_hf_tokenizer(tmp_path)
