"""Everything tinygpt does, on the Llama family: a tiny random LlamaForCausalLM (grouped-query attention,
Llama 3's rope scaling, an untied head) saved by transformers with a SmolLM2-shaped tokenizer and a chat
template that marks the replies (tests/hf_family.py), used as FROM by finetune (full, LoRA by Hugging
Face's names, frozen, chat SFT), sample (the cache, --trace, int8 and int4), chat, serve, eval, attention
and params, each checked against transformers where it has the same thing."""

import json
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family as H  # noqa: E402

import tinygpt  # noqa: E402
import tinygpt.calc as calc  # noqa: E402
from tinygpt.checkpoint import load_run  # noqa: E402
from tinygpt.cli import main  # noqa: E402
from tinygpt.cli.finetune import format_report  # noqa: E402
from tinygpt.config import LoraConfig, SampleConfig  # noqa: E402
from tinygpt.data import load_data  # noqa: E402
from tinygpt.errors import ConfigError  # noqa: E402
from tinygpt.generate import generate  # noqa: E402
from tinygpt.interop.quantize import quantize  # noqa: E402
from tinygpt.lora import apply_lora, weights_checksum  # noqa: E402
from tinygpt.tokenizer import stop_ids  # noqa: E402

CHATS = [H.CONVERSATIONS[0], H.CONVERSATIONS[1]]
USER = [{"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The folder, its text and chat data prepared with its tokenizer, and transformers' model and tokenizer."""
    root = tmp_path_factory.mktemp("family")
    folder = H.make_folder(root / "smollm-shaped", "llama", "smollm", tied=False, seed=3)
    (root / "text.txt").write_text("\n".join(H.CORPUS))
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 10))
    for source, out, extra in (("text.txt", "data", ()), ("chats.jsonl", "chat", ("--format", "chat"))):
        assert main(["prepare", str(root / source), *extra, "--tokenizer-file", str(folder), "--out",
                     str(root / out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return dict(root=root, folder=folder, data=root / "data", chat=root / "chat", hf=hf,
                hf_tok=transformers.AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def base(world):
    return load_run(world["folder"], "cpu")


FT = ("--max-iters", 4, "--batch-size", 2, "--block-size", 32, "--lr", 1e-2, "--eval-iters", 1, "--quiet")


def test_lora_by_hugging_faces_names_trains_the_adapters_alone_and_merges(world, base, tmp_path, cli):
    model, _ = base
    run, merged = tmp_path / "lora", tmp_path / "merged"
    r = cli("finetune", world["folder"], "--data", world["data"], "--out", run, "--method", "lora",
            "--lora-targets", "q_proj,v_proj", "--merge", merged, *FT, "--lr", 1e-3)
    assert r.returncode == 0, r.stderr
    adapted = tinygpt.load(run)  # the adapters as their own layers, on the base
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {f"h.{i}.attn.{m}.lora_{x}" for i in range(2) for m in ("q_proj", "v_proj") for x in "AB"}
    assert weights_checksum(adapted) == weights_checksum(model)  # the base's weights untouched
    assert all(bool(p.detach().any()) for n, p in adapted.named_parameters() if n.endswith("lora_B"))  # trained
    idx = torch.randint(0, 400, (2, 20))
    with torch.no_grad():  # in float64, so that what differs is the merge, not the order of float32 sums
        torch.testing.assert_close(tinygpt.load(merged).double()(idx), adapted.double()(idx), atol=1e-5, rtol=0)
    lora = LoraConfig(targets="q_proj,v_proj").resolved_for(model.config)
    counts = calc.trainable_params(model.config, lora=lora)
    assert counts.trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert counts.adapters == 2 * 8 * ((32 + 32) + (32 + 16))  # 2 blocks, rank 8, q (32 -> 32) and v (32 -> 16: GQA)


def test_lora_targets_by_group_and_by_name_resolve_to_the_layouts_projections(base, tmp_path):
    config = base[0].config
    attn = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert LoraConfig(targets="attn,mlp").resolved_for(config).targets == attn + mlp
    assert LoraConfig(targets="mlp,k_proj").resolved_for(config).targets == ("attn.k_proj",) + mlp
    assert LoraConfig().resolved_for(config).targets == ("attn.q_proj", "attn.v_proj")  # PEFT's default for Llama
    with pytest.raises(ConfigError, match="attn.c_attn is not a projection of this model's blocks .llama layout"):
        LoraConfig(targets="c_attn").resolved_for(config)
    qwen3 = apply_lora(tinygpt.load(H.make_folder(tmp_path / "qwen3", "qwen3", "qwen")), targets="mlp")
    assert {n.rsplit(".", 1)[0] for n, p in qwen3.named_parameters() if p.requires_grad} == {
        f"h.{i}.{m}" for i in range(2) for m in mlp}


def test_full_finetune_with_frozen_parts_and_recomputation(world, base, tmp_path, cli):
    run = tmp_path / "frozen"
    r = cli("finetune", world["folder"], "--data", world["data"], "--out", run, "--freeze-layers", 1,
            "--freeze-embeddings", "--grad-checkpoint", *FT)
    assert r.returncode == 0, r.stderr
    before, after = base[0].state_dict(), tinygpt.load(run).state_dict()
    for name, t in before.items():
        frozen = name.startswith(("h.0.", "wte."))
        assert torch.equal(t, after[name]) is frozen, name


def _bfloat16_and_its_float32_twin(folder, root):
    """The folder with its weights rounded to bfloat16, saved in bfloat16 and (the same values) in float32."""
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    twins = []
    for dtype in (torch.bfloat16, torch.float32):
        twin = root / str(dtype).removeprefix("torch.")
        shutil.copytree(folder, twin)
        save_file({k: v.to(torch.bfloat16).to(dtype) for k, v in weights.items()}, twin / "model.safetensors",
                  metadata={"format": "pt"})
        twins.append(twin)
    return twins


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_bfloat16_folder_fine_tunes_as_far_as_its_float32_twin(world, tmp_path, method):
    # once: the bfloat16 weights (and LoRA's adapters) trained in place, where most of AdamW's updates at a
    # fine-tuning rate are below half a step of the weight and round away: here the validation loss moved 2%
    # (full) and 71% (LoRA) as far as the twin's
    from safetensors.torch import load_file

    bf16, f32 = _bfloat16_and_its_float32_twin(world["folder"], tmp_path)
    cfg = tinygpt.FinetuneConfig(method=method, block_size=64)
    train = tinygpt.TrainConfig(lr_schedule="constant", warmup=10, max_iters=200, eval_interval=200, eval_iters=1,
                                weight_decay=0.0, batch_size=4)
    runs = [tinygpt.finetune(base, world["data"], tmp_path / f"run-{base.name}", cfg, train) for base in (bf16, f32)]
    moved = [r.report["after"]["data"]["loss"] - r.report["before"]["data"]["loss"] for r in runs]
    assert moved[1] < -0.05 and moved[0] <= 0.8 * moved[1], moved
    # both trained the same float32 weights alike: the bfloat16 run is saved in FROM's dtype, the twin's run
    # rounded; LoRA's adapters are saved in float32 (as PEFT keeps them), the twin's exactly
    saved = "float32" if method == "lora" else "bfloat16"
    assert runs[0].report["dtype"] == {"base": "bfloat16", "saved": saved}
    kept = "the adapters saved in float32 over FROM's bfloat16" if method == "lora" else "saved in bfloat16, FROM's"
    assert f"trained in float32, {kept}" in "\n".join(format_report(runs[0].report))
    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    ours, twins = (load_file(r.run / name) for r in runs)
    assert ours.keys() == twins.keys() and {str(t.dtype) for t in ours.values()} == {f"torch.{saved}"}
    assert all(torch.equal(ours[k], twins[k].to(ours[k].dtype)) for k in ours)


def test_grad_checkpoint_gives_the_same_gradients(tmp_path):
    model = tinygpt.load(H.make_folder(tmp_path / "qwen2", "qwen2", "qwen")).train()  # q/k/v biases too
    idx = torch.randint(0, 400, (2, 24))

    def grads(recompute: bool):
        model.grad_checkpoint = recompute
        model.zero_grad(set_to_none=True)
        model(idx).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_chat_sft_masks_exactly_the_assistants_spans_and_trains(world, tmp_path, cli):
    data = load_data(world["chat"])
    tokens, masks, starts = data.train, data.masks["train"], list(data.starts["train"]) + [len(data.train)]
    # every conversation of the split, in order, is transformers' ids with its assistant mask
    want = {json.dumps(c): world["hf_tok"].apply_chat_template(c, return_dict=True, return_assistant_tokens_mask=True)
            for c in CHATS}
    seen = set()
    for s, e in zip(starts[:-1], starts[1:]):
        ids, mask = tokens[s:e].tolist(), masks[s:e].astype(int).tolist()
        match = [k for k, w in want.items() if w["input_ids"] == ids]
        assert len(match) == 1, ids
        assert mask == want[match[0]]["assistant_masks"]
        seen.add(match[0])
    assert len(seen) == 2
    run = tmp_path / "sft"
    r = cli("finetune", world["folder"], "--data", world["chat"], "--out", run, *FT, "--block-size", 64)
    assert r.returncode == 0 and "the assistant's tokens" in r.stdout, r.stderr
    r = cli("chat", run, "--prompt", "Hello there!", "--max-new-tokens", 6, "--temperature", 0)
    assert r.returncode == 0, r.stderr


def _hf_reply(world, messages, n):
    hf, hf_tok = world["hf"], world["hf_tok"]
    ids = torch.tensor([hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)])
    # the embedding's rows past the tokenizer's (padding, as Qwen's) are no token tinygpt samples
    padding = list(range(len(hf_tok), hf.config.vocab_size))
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      pad_token_id=hf_tok.pad_token_id, suppress_tokens=padding,
                      eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))
    return out[0, ids.shape[1]:].tolist()


def test_chat_and_the_servers_chat_completions_answer_as_transformers_generates(world, base, cli):
    model, tok = base
    want = [t for t in _hf_reply(world, USER, 12) if t != tok.special_ids()["<|im_end|>"]]
    r = cli("chat", world["folder"], "--prompt", USER[0]["content"], "--max-new-tokens", 12, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    # the terminal gets control characters as escapes (chat shows them so, the server's answer keeps them)
    shown = re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", tok.decode(want))
    assert r.stdout.rstrip("\n") == shown
    from fastapi.testclient import TestClient

    from tinygpt.server import create_app

    with TestClient(create_app(model, tok, model_name="family")) as client:
        reply = client.post("/v1/chat/completions", json=dict(model="family", messages=USER, max_tokens=12,
                                                              temperature=0)).json()
    assert reply["choices"][0]["message"]["content"] == tok.decode(want)
    assert reply["usage"]["completion_tokens"] == len(want) + (len(want) < 12)  # the end of turn counted


def test_continuous_batching_decodes_what_generate_decodes_alone(base):
    import threading

    from tinygpt.server.scheduler import Scheduler, Sequence

    model, tok = base
    prompts, lengths = ["The quick", "Hello there! How", "x", "def add(a, b):\n", "Numbers: 0 1"], [9, 30, 4, 17, 12]
    text, done, left = [""] * 5, threading.Event(), [5]

    def emit(event):
        assert event.error is None, event.error
        text[event.index] += event.text
        if event.finish_reason:
            left[0] -= 1
            if not left[0]:
                done.set()

    sched = Scheduler(model, tok, max_concurrency=2, max_queue=8)
    try:
        sched.submit([Sequence(prompt=tok.encode(p), max_tokens=n, sampling=SampleConfig(temperature=0), emit=emit,
                               index=i) for i, (p, n) in enumerate(zip(prompts, lengths))])
        assert done.wait(60)
    finally:
        sched.stop()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        ids = torch.tensor([tok.encode(p)])
        alone = generate(model, ids, n, greedy=True, vocab_size=tok.vocab_size)  # the tokenizer's ids, not padding
        assert text[i] == tok.decode(alone[0, ids.shape[1]:].tolist()), i
    assert sched.counters["peak_batch"] == 2


def test_eval_is_transformers_loss_on_the_same_windows(world, cli):
    r = cli("eval", world["folder"], "--data", world["data"])
    assert r.returncode == 0, r.stderr
    loss = float(r.stdout.split("loss ")[1].split()[0])
    tokens = torch.from_numpy(load_data(world["data"]).val.astype(np.int64))
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, 128):  # the windows of block_size + 1 tokens eval takes
            window = tokens[s:s + 129][None]
            out = world["hf"](window, labels=window)
            nll, n = nll + float(out.loss) * (window.shape[1] - 1), n + window.shape[1] - 1
    assert loss == pytest.approx(nll / n, abs=1e-4)


# int4 (16 levels over each group of 32 weights) moves this random model's logits (init std 0.3) far more
# than a trained model's, so its closeness to float is tests/test_quantize's, each layer against its
# dequantized weights; here decoding with the cache must compute what the quantized model computes whole
@pytest.mark.parametrize("fmt, to_float", [("int8", 0.15), ("int4", None)])
def test_int8_and_int4_decode_with_the_cache_what_the_whole_forward_computes(world, fmt, to_float):
    import copy

    from tinygpt.generate import decode_step, prefill
    from tinygpt.kv_cache import KVCache

    model = tinygpt.load(world["folder"])
    idx = torch.tensor([world["hf_tok"]("The quick brown fox jumps over the lazy dog.")["input_ids"]])
    with torch.no_grad():
        ref = model(idx)[0]
        q = quantize(copy.deepcopy(model), fmt)
        whole = q(idx)[0].float()
        cache = KVCache.for_model(q, 1)
        steps = [prefill(q, idx[:, :4], cache)[0]]  # the prompt, then one token a step as decoding goes
        steps += [decode_step(q, idx[:, p], cache, p)[0] for p in range(4, idx.shape[1])]
    scale = float(ref.abs().max())
    # one row a step takes the int8 x int8 kernel, a whole prompt the dequantized weights: not bitwise
    for p, logits in enumerate(steps, start=3):
        assert float((logits.float() - whole[p]).abs().max()) < 0.15 * scale, p
    if to_float is not None:
        assert float((whole - ref).abs().max()) < to_float * scale
    assert generate(q, idx, 8, greedy=True).shape == (1, idx.shape[1] + 8)


def test_attention_maps_equal_transformers_and_the_trace_shows_the_greedy_choice(world, base, tmp_path, cli):
    model, tok = base
    idx = torch.tensor([world["hf_tok"]("Hello there! How are you?")["input_ids"]])
    with torch.no_grad():
        _, ours = model(idx, return_attention=True)
        theirs = world["hf"](idx, output_attentions=True).attentions
    for a, b in zip(ours, theirs):
        assert a.shape == (1, 4, idx.shape[1], idx.shape[1])  # every query head, n_kv_head shared below
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    r = cli("attention", world["folder"], "--prompt", "Hello there", "--all-heads", "--layer", 1,
            "--out", tmp_path / "a.png")
    assert r.returncode == 0 and (tmp_path / "a.png").stat().st_size > 0, r.stderr
    r = cli("sample", world["folder"], "--prompt", "The quick", "--max-new-tokens", 3, "--greedy", "--trace")
    assert r.returncode == 0, r.stderr
    ids = torch.tensor([tok.encode("The quick")])
    chosen = [int(line.rsplit("(id ", 1)[1].rstrip(")")) for line in r.stdout.splitlines()
              if line.strip().startswith("chosen:")]
    assert chosen == generate(model, ids, 3, greedy=True, vocab_size=tok.vocab_size)[0, ids.shape[1]:].tolist()


def test_params_of_the_folder_count_what_transformers_built(world, cli):
    r = cli("params", world["folder"], "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["total"] == world["hf"].num_parameters() == sum(p.numel() for p in world["hf"].parameters())
    # transformers leaves out the embedding alone; tinygpt's non-embedding count (Kaplan's) the untied head too
    head = world["hf"].lm_head.weight.numel()
    assert report["non_embedding"] + head == world["hf"].num_parameters(exclude_embeddings=True)
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(world["folder"])
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    trainable, _ = adapted.get_nb_trainable_parameters()
    r = cli("params", world["folder"], "--json", "--lora-rank", 4, "--lora-targets", "q_proj,v_proj,down_proj")
    assert json.loads(r.stdout)["trainable"]["trainable"] == trainable


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache of the test's own, offline (no test may download)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_offline_is_one_line_with_the_download_command_and_nothing_written(world, hub_cache, tmp_path, cli):
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    written = [tmp_path / "ft", tmp_path / "data", tmp_path / "m.gguf", tmp_path / "imported", tmp_path / "a.png"]
    for args in (("finetune", repo, "--data", world["data"], "--out", written[0]), ("sample", repo),
                 ("prepare", world["root"] / "text.txt", "--tokenizer-file", repo, "--out", written[1]),
                 ("export", repo, "--format", "gguf", "--out", written[2]), ("import", repo, "--out", written[3]),
                 ("chat", repo, "--prompt", "Hi"), ("serve", repo), ("eval", repo, "--data", world["data"]),
                 ("attention", repo, "--prompt", "Hi", "--out", written[4]), ("params", repo),
                 ("fewshot", repo, "--task", "synthetic")):
        r = cli(*args)
        assert r.returncode != 0 and r.stderr.count("\n") == 1, (args[0], r.stderr)
        assert "offline, and it is not in the cache" in r.stderr, (args[0], r.stderr)
        assert (f"hf download {repo} --include '*.safetensors' --include '*.json' --include '*.jinja' "
                "--local-dir hf/SmolLM2-135M-Instruct") in r.stderr
    assert not any(path.exists() for path in written)
    # a missing run is a missing run, never a repository
    r = cli("sample", tmp_path / "runs" / "mine")
    assert r.returncode != 0 and "hf download" not in r.stderr


def test_a_hub_id_in_the_cache_is_used_offline_as_its_folder(world, base, hub_cache, cli):
    import shutil

    repo, commit = "tinygpt-tests/tiny-smollm", "0" * 40
    snapshot = hub_cache / "models--tinygpt-tests--tiny-smollm" / "snapshots" / commit
    shutil.copytree(world["folder"], snapshot)  # the layout huggingface_hub keeps a download in
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    model, tok = base
    r = cli("sample", repo, "--prompt", "The quick", "--max-new-tokens", 5, "--greedy")
    assert r.returncode == 0, r.stderr
    ids = torch.tensor([tok.encode("The quick")])
    assert r.stdout.rstrip("\n") == tok.decode(generate(model, ids, 5, greedy=True, vocab_size=tok.vocab_size)[0].tolist())


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    from hf_cli import fetched_patterns

    from tinygpt.interop.hub import download_command, looks_like_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_like_hub_id("Qwen/Qwen2.5-0.5B")
    # a path here, or under a folder here, is never a repository; nor is what the Hub cannot name
    for text in ("runs/mine", "runs", "gpt2", "a/b/c", str(tmp_path / "x" / "y"), "../up", "owner/name.", "a/..b"):
        assert not looks_like_hub_id(text), text
    command = download_command("Qwen/Qwen3-0.6B")
    assert command == ("hf download Qwen/Qwen3-0.6B --include '*.safetensors' --include '*.json' --include '*.jinja' "
                       "--local-dir hf/Qwen3-0.6B")
    # hf's own parser reads every pattern: after one --include, a second word was a file name and the weights
    # ('*.safetensors') were never fetched
    assert fetched_patterns(command, monkeypatch) == ["*.safetensors", "*.json", "*.jinja"]
