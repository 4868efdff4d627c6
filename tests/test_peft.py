"""Adapter runs in Hugging Face PEFT's format, checked with PEFT itself: PeftModel.from_pretrained loads a
tinygpt adapter run onto the base's Hugging Face export and computes tinygpt's logits (not the bare
base's: PEFT loads mismatched keys with a warning and computes the base), merge_and_unload equals
`tinygpt merge`, and an adapter PEFT trained loads in tinygpt with PEFT's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft", reason="peft is not installed (the dev extra)")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

import tinygpt  # noqa: E402
from tinygpt import CheckpointError, GPT, GPTConfig  # noqa: E402
from tinygpt.checkpoint import merge_run, read_adapter_config, save_adapter_run  # noqa: E402
from tinygpt.interop.hf import export_hf  # noqa: E402
from tinygpt.lora import adapter_state_dict, apply_lora  # noqa: E402
from tinygpt.tokenizer import CharTokenizer  # noqa: E402

TOL = 1e-5


CHARS = "abcdefghijklmnopqrstuvwxyz .,"
# per architecture: the tinygpt model, the LoRA targets tinygpt trains, PEFT's target_modules for an
# adapter PEFT trains (GPT-2's c_proj is both attention's and the MLP's) and the tinygpt targets they are
ARCHS = {
    "gpt2": (dict(), "attn,mlp", ["c_attn", "c_proj"], ("attn.c_attn", "attn.c_proj", "mlp.c_proj")),
    "llama": (dict(arch="llama", n_kv_head=1, intermediate_size=48, tie_weights=False), "q_proj,v_proj,down_proj",
              ["q_proj", "o_proj", "gate_proj"], ("attn.q_proj", "attn.o_proj", "mlp.gate_proj")),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def world(request, tmp_path_factory):
    """A tiny random model of each architecture as a tinygpt run (base/) and as its Hugging Face export (hf/)."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    tokenizer = CharTokenizer(CHARS)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32,
                          **ARCHS[request.param][0]))
    tinygpt.save(model, root / "base", tokenizer)
    export_hf(model, tokenizer if request.param == "gpt2" else None, root / "hf")
    return request.param, root


def hf_base(root):
    return transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()


def logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return (out.logits if hasattr(out, "logits") else out).float()


def gap(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, len(CHARS), (2, 24), generator=torch.Generator().manual_seed(3))


def test_peft_loads_a_tinygpt_adapter_run_with_its_logits_and_merges_as_tinygpt_does(world, idx):
    arch, root = world
    model = apply_lora(tinygpt.load(root / "base"), rank=4, alpha=12.0, targets=ARCHS[arch][1])
    g = torch.Generator().manual_seed(1)
    for t in adapter_state_dict(model).values():  # B starts at zero: give the adapters a visible effect
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    run = save_adapter_run(model, root / "lora", root / "base")
    ours = logits(tinygpt.load(run), idx)

    wrapped = peft.PeftModel.from_pretrained(hf_base(root), run).eval()
    settings = wrapped.peft_config["default"]
    assert settings.fan_in_fan_out == (arch == "gpt2")  # GPT-2's Conv1D holds (in, out); Linear (out, in)
    assert settings.r == 4 and settings.lora_alpha == 12
    assert gap(logits(hf_base(root), idx), ours) > 0.1  # the adapters matter: the bare base is far off
    assert gap(logits(wrapped, idx), ours) < TOL

    merged = merge_run(run, root / "merged")[0]
    assert gap(logits(wrapped.merge_and_unload(), idx), logits(merged, idx)) < TOL


@pytest.fixture(scope="module")
def peft_trained(world):
    """An adapter PEFT trained itself on the Hugging Face export (rsLoRA), saved by save_pretrained:
    adapter_config.json and adapter_model.safetensors, nothing of tinygpt's."""
    arch, root = world
    torch.manual_seed(5)
    settings = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ARCHS[arch][2], use_rslora=True,
                               task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(hf_base(root), settings)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=5e-2)
    tokens = torch.randint(0, len(CHARS), (4, 17), generator=torch.Generator().manual_seed(4))
    for _ in range(5):
        loss = wrapped(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    wrapped.save_pretrained(root / "trained")
    return root / "trained", wrapped.eval()


def test_a_peft_trained_adapter_loads_with_peft_logits(world, peft_trained, idx, cli):
    arch, root = world
    folder, wrapped = peft_trained
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    theirs = logits(wrapped, idx)
    assert gap(theirs, logits(hf_base(root), idx)) > 0.01  # trained: not the base
    # its base_model_name_or_path is the Hugging Face folder, found as PEFT would find it
    info = read_adapter_config(folder)
    assert info.base == root / "hf" and info.checksum is None
    assert info.lora.targets == ARCHS[arch][3] and info.lora.rank == 4
    assert gap(logits(tinygpt.load(folder), idx), theirs) < TOL
    assert gap(logits(tinygpt.load(folder, merge=True), idx), theirs) < TOL

    # `tinygpt import` makes it an adapter run like tinygpt's own, on a base given by --base (the
    # tinygpt run of the same weights here); `merge` takes the PEFT folder as it is
    r = cli("import", folder, "--base", root / "base", "--out", root / "imported")
    assert r.returncode == 0, r.stderr
    assert "imported the PEFT adapter" in r.stdout and "LoRA r=4" in r.stdout
    imported = root / "imported"
    assert read_adapter_config(imported).checksum is not None  # from now on the base is checked
    assert gap(logits(tinygpt.load(imported), idx), theirs) < TOL
    r = cli("merge", folder, "--out", root / "merged-peft")
    assert r.returncode == 0, r.stderr
    assert gap(logits(tinygpt.load(root / "merged-peft"), idx), theirs) < TOL
    if arch == "gpt2":  # sample takes the PEFT folder, its tokenizer the base's
        r = cli("sample", folder, "--prompt", "the cat", "--greedy", "--max-new-tokens", "8", "--device", "cpu")
        assert r.returncode == 0, r.stderr
        tokenizer = tinygpt.load_tokenizer(root / "base")
        want = tinygpt.generate(tinygpt.load(folder, merge=True), torch.tensor([tokenizer.encode("the cat")]), 8,
                                greedy=True)[0].tolist()
        assert r.stdout == tokenizer.decode(want) + "\n"


def test_peft_adapters_tinygpt_does_not_compute_are_refused(world, peft_trained, tmp_path, cli):
    gpt2 = world[1]
    folder = tmp_path / "adapter"
    shutil.copytree(peft_trained[0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())

    def edit(**changes):
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))

    edit(base_model_name_or_path="nowhere/gpt2")  # a hub name, say: the base must be given
    r = cli("sample", folder, "--prompt", "a")
    assert r.returncode != 0 and "--base BASE" in r.stderr and "Traceback" not in r.stderr
    edit(modules_to_save=["lm_head"])
    with pytest.raises(CheckpointError, match="modules_to_save"):
        tinygpt.load(folder, base=gpt2 / "hf")
    edit()
    tensors = load_file(folder / "adapter_model.safetensors")  # PEFT's layers_to_transform: some blocks only
    save_file({k: v for k, v in tensors.items() if ".1." not in k}, folder / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match="blocks alike"):
        tinygpt.load(folder, base=gpt2 / "hf")
