"""The Llama family from Hugging Face folders: tiny random models built with transformers' own config
classes and saved by it, a tokenizer and chat template made here (tests/hf_family.py), against
transformers itself: logits, greedy generation with the KV cache, tokenizer ids, chat ids, SFT masks;
and every refusal in one line with nothing written."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family as H  # noqa: E402

from tinygpt.checkpoint import load_run  # noqa: E402
from tinygpt.errors import CheckpointError, TokenizerError  # noqa: E402
from tinygpt.generate import generate  # noqa: E402
from tinygpt.tokenizer import HFTokenizer, load_tokenizer, render_chat, render_chat_prompt, stop_ids  # noqa: E402

# (model_type, tokenizer style, tied): each family as its Hub folder has it, tied and untied
FOLDERS = {
    "llama-3": ("llama", "llama3", False),  # GQA, Llama 3's rope scaling, an untied head
    "tinyllama": ("llama", "zephyr", False),  # SentencePiece-style BPE with byte fallback, a BOS
    "smollm2": ("llama", "smollm", True),  # tied, the template marks replies with {% generation %}
    "qwen2.5": ("qwen2", "qwen", True),  # q/k/v biases, one key/value head
    "qwen3": ("qwen3", "qwen", False),  # qk-norm, heads wider than hidden / heads
}
TEXTS = ["Hello there! How are you?", "  two spaces, é and 🙂 (bytes the vocabulary never saw: ű)", "x"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-family")
    return {name: H.make_folder(root / name, kind, style, tied=tied, seed=i)
            for i, (name, (kind, style, tied)) in enumerate(FOLDERS.items())}


@pytest.fixture(scope="module")
def loaded(folders):
    """tinygpt's model and tokenizer, transformers' model and tokenizer, for each folder."""
    out = {}
    for name, folder in folders.items():
        model, tok = load_run(folder, "cpu")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        out[name] = (model, tok, hf, transformers.AutoTokenizer.from_pretrained(folder))
    return out


@pytest.mark.parametrize("name", FOLDERS)
def test_logits_equal_transformers(loaded, name):
    model, tok, hf, hf_tok = loaded[name]
    assert model.config.arch == "llama" and isinstance(tok, HFTokenizer)
    assert model.config.tie_weights == FOLDERS[name][2]
    idx = torch.tensor([hf_tok(TEXTS[0] + " " + TEXTS[1])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FOLDERS)
def test_greedy_generation_with_the_cache_equals_generate(loaded, name):
    model, tok, hf, hf_tok = loaded[name]
    idx = torch.tensor([hf_tok("The quick brown")["input_ids"]])
    want = hf.generate(idx, max_new_tokens=24, do_sample=False, pad_token_id=tok.eot_id)
    got = generate(model, idx, 24, greedy=True, stop_tokens=stop_ids(tok))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("name", FOLDERS)
def test_text_and_chat_ids_equal_the_tokenizer_and_apply_chat_template(loaded, name):
    _, tok, _, hf_tok = loaded[name]
    for text in TEXTS:  # text as transformers encodes it, its BOS where the folder's tokenizer adds one
        before, after = tok.added_ids
        assert before + tok.encode(text) + after == hf_tok(text)["input_ids"], text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert tok.decode_bytes(ids).decode().lstrip() == text.lstrip()  # what streaming writes, token by token
    for conversation in H.CONVERSATIONS:
        for prompt in (False, True):
            want = hf_tok.apply_chat_template(conversation, add_generation_prompt=prompt, return_dict=False)
            if prompt:
                assert render_chat_prompt(tok, conversation) == want
            elif conversation[-1]["role"] == "assistant":
                assert render_chat(tok, conversation).ids == want


def test_the_loss_mask_covers_exactly_the_assistants_replies(loaded):
    # marked with {% generation %}: the mask is transformers' own assistant mask
    _, tok, _, hf_tok = loaded["smollm2"]
    for conversation in H.CONVERSATIONS[:2]:
        rendered = render_chat(tok, conversation)
        want = hf_tok.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
        assert rendered.ids == want["input_ids"] and rendered.mask == want["assistant_masks"]
    # unmarked (Qwen's ChatML): each reply found by rendering up to it and through it, its end of turn with it
    _, tok, _, _ = loaded["qwen2.5"]
    conversation = H.CONVERSATIONS[1]
    rendered = render_chat(tok, conversation)
    learned = [i for i, m in zip(rendered.ids, rendered.mask) if m]
    replies = "".join(m["content"] + "<|im_end|>\n" for m in conversation if m["role"] == "assistant")
    assert tok.decode(learned) == replies
    assert len(rendered.mask) == len(rendered.ids) and rendered.mask[0] == 0


def test_generation_config_eos_ids_and_the_end_of_turn_stop_generation(tmp_path):
    folder = H.make_folder(tmp_path / "q", "qwen2", "qwen", stop=["<|im_end|>", "<|endoftext|>"])
    _, tok = load_run(folder, "cpu")
    special = tok.special_ids()
    assert stop_ids(tok) == {special["<|im_end|>"], special["<|endoftext|>"]}
    _, llama = load_run(H.make_folder(tmp_path / "l", "llama", "llama3", stop=["<|end_of_text|>"]), "cpu")
    # the template's end of turn stops a reply though generation_config names another id
    assert stop_ids(llama) == {llama.special_ids()["<|end_of_text|>"], llama.special_ids()["<|eot_id|>"]}


def test_shards_and_bfloat16_load_as_stored(tmp_path, loaded):
    folder = H.make_folder(tmp_path / "sharded", "qwen3", "qwen", tied=False, dtype=torch.bfloat16, shard="40KB",
                           seed=4)
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    model, _ = load_run(folder, "cpu")
    assert model.wte.weight.dtype == torch.bfloat16  # as stored: no float32 copy made at load
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    idx = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model.float()(idx), hf.float()(idx).logits, atol=1e-4, rtol=0)


def test_import_keeps_the_tokenizer_and_template_whole(folders, loaded, tmp_path, cli):
    run = tmp_path / "run"
    r = cli("import", folders["tinyllama"], "--out", run)
    assert r.returncode == 0, r.stderr
    saved = load_tokenizer(run)
    _, tok, _, hf_tok = loaded["tinyllama"]
    assert saved.fingerprint() == tok.fingerprint() and saved.kind == "hf"
    assert render_chat_prompt(saved, H.CONVERSATIONS[1]) == hf_tok.apply_chat_template(
        H.CONVERSATIONS[1], add_generation_prompt=True, return_dict=False)
    assert json.loads((run / "config.json").read_text())["arch"] == "llama"
    r = cli("sample", run, "--prompt", "Hello", "--max-new-tokens", 8, "--greedy")
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr


def test_the_public_load_tokenizer_opens_the_folders_load_opens(folders, loaded, tmp_path):
    # once tinygpt.load opened a Hugging Face folder and tinygpt.load_tokenizer refused it ("no format:
    # tinygpt-tokenizer")
    import shutil

    import tinygpt

    for name in ("smollm2", "tinyllama"):
        tok = tinygpt.load_tokenizer(folders[name])
        assert tok.kind == "hf" and tok.fingerprint() == loaded[name][1].fingerprint()
        assert tok.encode(TEXTS[0]) == loaded[name][3].encode(TEXTS[0], add_special_tokens=False)
    run = tmp_path / "run"
    tinygpt.save(loaded["qwen3"][0], run, loaded["qwen3"][1])  # a run and its tokenizer.json, as before
    assert tinygpt.load_tokenizer(run).fingerprint() == tinygpt.load_tokenizer(run / "tokenizer.json").fingerprint() \
        == loaded["qwen3"][1].fingerprint()
    bare = tmp_path / "bare"  # a folder load opens without a tokenizer: one line says so
    bare.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(folders["qwen3"] / file, bare / file)
    assert tinygpt.load(bare).config.arch == "llama"
    with pytest.raises(TokenizerError, match="no tokenizer.json in") as e:
        tinygpt.load_tokenizer(bare)
    assert "\n" not in str(e.value)


def _assert_one_line(r, *fragments):
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("edit, named", [
    (dict(model_type="mistral"), "model_type='mistral'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_scaling.rope_type='yarn'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts=8), "num_experts"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
])
def test_config_fields_tinygpt_does_not_compute_are_refused(folders, tmp_path, cli, edit, named):
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in folders["qwen2.5"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    r = cli("import", folder, "--out", tmp_path / "run")
    _assert_one_line(r, named)
    assert not (tmp_path / "run").exists()
    # the same line wherever the folder is FROM
    _assert_one_line(cli("export", folder, "--format", "gguf", "--out", tmp_path / "m.gguf"), named)
    _assert_one_line(cli("sample", folder, "--max-new-tokens", 2), named)
    assert not (tmp_path / "m.gguf").exists()


def test_a_missing_shard_a_vocabulary_too_big_and_a_raising_template_are_refused(tmp_path, cli):
    folder = H.make_folder(tmp_path / "sharded", "llama", "llama3", shard="40KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].unlink()
    _assert_one_line(cli("import", folder, "--out", tmp_path / "a"), "not in the folder", shards[-1].name)
    assert not (tmp_path / "a").exists()
    with pytest.raises(CheckpointError, match="not in the folder"):
        load_run(folder, "cpu")

    small = H.make_folder(tmp_path / "small", "qwen2", "qwen")
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 64  # the weights cut to fit, the tokenizer left as it was
    (small / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(small / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:64].contiguous()
    save_file(tensors, small / "model.safetensors", metadata={"format": "pt"})
    _assert_one_line(cli("import", small, "--out", tmp_path / "b"), "tokenizer has", "64")
    assert not (tmp_path / "b").exists()

    raising = H.make_folder(tmp_path / "raising", "qwen2", "qwen")
    (raising / "chat_template.jinja").write_text("{{ raise_exception('this template takes no system message') }}")
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": H.CONVERSATIONS[0]}) + "\n")
    r = cli("prepare", tmp_path / "chats.jsonl", "--format", "chat", "--tokenizer-file", raising,
            "--out", tmp_path / "data")
    _assert_one_line(r, "this template takes no system message")
    assert not (tmp_path / "data").exists()
    with pytest.raises(TokenizerError, match="not valid Jinja"):
        (raising / "chat_template.jinja").write_text("{% for m in messages %}")
        load_run(raising, "cpu")
