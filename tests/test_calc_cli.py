"""`tinygpt params` and `tinygpt chinchilla`, run in-process through cli.main (and once as a real process)."""

import json
import subprocess
import sys

import pytest

from tinygpt import GPTConfig
from tinygpt.cli import main


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_params_table_and_json(capsys):
    code, out, _ = run(capsys, "params", "--preset", "gpt2")
    assert code == 0
    assert "124,439,808" in out and "tied to wte" in out and "KV cache per token" in out and "AdamW" in out
    code, out, _ = run(capsys, "params", "--preset", "gpt2", "--json")
    report = last_json(out)
    assert report["total"] == 124_439_808 and report["params"]["tied"] is True
    assert report["flops_per_token"]["training"] == 3 * report["flops_per_token"]["forward"]
    assert report["memory"]["kv_cache_bytes_per_token"] == 2 * 12 * 768 * 4


def test_params_flags_build_the_lessons_model(capsys):
    args = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--vocab-size", "50", "--block-size", "8"]
    _, out, _ = run(capsys, "params", *args, "--no-tie", "--json")
    assert last_json(out)["total"] == 107_008
    _, out, _ = run(capsys, "params", *args, "--no-tie", "--no-bias", "--json")
    assert last_json(out)["params"]["biases"] == 0
    _, out, _ = run(capsys, "params", *args)
    assert out.startswith("custom: 2 layers, 4 heads, n_embd 64")
    _, out, _ = run(capsys, "params", "--n-layer", "1", "--n-head", "1", "--n-embd", "16", "--vocab-size", "50")
    assert out.startswith("custom: 1 layer, 1 head, n_embd 16")  # once "1 layers, 1 heads"


def test_params_of_a_run_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPTConfig.from_preset("baby").to_dict()))
    _, out, _ = run(capsys, "params", str(tmp_path), "--json")
    assert last_json(out)["total"] == 10_770_816
    _, out, _ = run(capsys, "params", str(tmp_path), "--no-tie", "--json")
    assert last_json(out)["total"] == 10_770_816 + 65 * 384


def test_params_batch_and_dtype_move_the_memory(capsys):
    _, out, _ = run(capsys, "params", "--preset", "stretch", "--json")
    one = last_json(out)["memory"]
    _, out, _ = run(capsys, "params", "--preset", "stretch", "--batch-size", "8", "--dtype", "bfloat16", "--json")
    eight = last_json(out)["memory"]
    assert eight["kv_cache_bytes_per_token"] * 2 == one["kv_cache_bytes_per_token"]
    assert eight["training"]["activations"] > 3 * one["training"]["activations"]
    assert eight["training"]["weights"] == one["training"]["weights"]  # float32 master weights either way


def test_params_for_lora_and_frozen_layers(capsys):
    from tinygpt.calc import trainable_params
    from tinygpt.config import LoraConfig

    gpt2 = ["--preset", "gpt2", "--batch-size", "4", "--seq-len", "256"]
    _, out, _ = run(capsys, "params", *gpt2, "--json")
    full = last_json(out)
    assert full["trainable"] == {"method": "full", "total": 124_439_808, "trainable": 124_439_808, "adapters": 0,
                                 "frozen": 0}
    code, out, _ = run(capsys, "params", *gpt2, "--lora-rank", "8", "--lora-targets", "attn,mlp", "--json")
    lora = last_json(out)
    want = trainable_params(GPTConfig.from_preset("gpt2"), lora=LoraConfig(rank=8, targets="attn,mlp"))
    assert code == 0 and lora["trainable"] == want.to_dict() and lora["trainable"]["trainable"] == 1_179_648
    assert lora["total"] == 124_439_808  # the model's own count; the adapters are in "trainable"
    t, f = lora["memory"]["training"], full["memory"]["training"]
    assert t["gradients"] == 4 * 1_179_648 and t["optimizer"] == 8 * 1_179_648
    assert t["weights"] == f["weights"] + 4 * 1_179_648 and t["activations"] < f["activations"]
    assert t["total"] - t["activations"] < 0.27 * (f["total"] - f["activations"])  # ~4 bytes a weight, not 16
    _, out, _ = run(capsys, "params", *gpt2, "--lora-rank", "8", "--lora-targets", "attn,mlp")
    assert "LoRA r=8, alpha 8 on attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj" in out
    assert "1,179,648" in out and "0.94% of 125,619,456" in out and "trainable parameters only" in out
    _, out, _ = run(capsys, "params", "--preset", "gpt2", "--lora-alpha", "32", "--json")  # any --lora-* turns it on
    assert last_json(out)["trainable"]["method"] == "LoRA r=8, alpha 32 on attn.c_attn"

    _, out, _ = run(capsys, "params", *gpt2, "--freeze-layers", "10", "--freeze-embeddings", "--json")
    frozen = last_json(out)["trainable"]
    assert frozen["method"] == "full, embeddings and blocks 0-9 frozen" and frozen["trainable"] == 14_177_280
    _, out, _ = run(capsys, "params", *gpt2, "--freeze-layers", "1")
    assert "Trainable parameters (full, block 0 frozen)" in out
    _, out, _ = run(capsys, "params", "--preset", "gpt2")
    assert "Trainable parameters" not in out  # full training shows what it always showed


def test_family_table_matches_the_built_models(capsys):
    code, out, _ = run(capsys, "params", "--family")
    assert code == 0
    for n in ("124,439,808", "354,823,168", "774,030,080", "1,557,611,200"):
        assert n in out
    _, out, _ = run(capsys, "params", "--family", "--json")
    rows = last_json(out)["family"]
    assert [r["total"] for r in rows] == [124_439_808, 354_823_168, 774_030_080, 1_557_611_200]


def test_chinchilla_budgets(capsys):
    _, out, _ = run(capsys, "chinchilla", "--flops", "5.76e23", "--json")
    plan = last_json(out)
    assert {"params", "tokens", "flops", "loss"} <= set(plan)
    assert plan["params"] == pytest.approx(69.3e9, rel=0.005) and plan["tokens"] == pytest.approx(1.39e12, rel=0.005)
    _, out, _ = run(capsys, "chinchilla", "--params", "70B", "--json")
    assert last_json(out)["tokens"] == pytest.approx(1.4e12)
    _, out, _ = run(capsys, "chinchilla", "--params", "70B", "--tokens", "1.4T", "--json")
    assert last_json(out)["loss"] == pytest.approx(1.937, abs=0.001)
    code, out, _ = run(capsys, "chinchilla", "--tokens", "1.4T")
    assert code == 0 and "70B" in out and "predicted loss" in out


def test_chinchilla_time_measures_this_machine(capsys):
    code, out, _ = run(capsys, "chinchilla", "--time", "1h30m", "--json")
    assert code == 0
    plan = last_json(out)
    measured = plan["measured"]
    assert plan["seconds"] == 5400 and measured["flops_per_second"] > 0 and measured["device"] in ("cpu", "cuda")
    assert plan["flops"] == pytest.approx(measured["flops_per_second"] * 5400)
    assert plan["tokens"] == pytest.approx(20 * plan["params"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["chinchilla"], "give a budget"),
        (["chinchilla", "--flops", "0"], "--flops"),
        (["chinchilla", "--flops=-1e20"], "--flops"),
        (["chinchilla", "--params", "-70"], "--params"),
        (["chinchilla", "--params", "lots"], "--params"),
        (["chinchilla", "--tokens", "nan"], "--tokens"),
        (["chinchilla", "--flops", "1e21", "--params", "1e9"], "disagree"),
        (["chinchilla", "--time", "0s"], "--time"),
        (["chinchilla", "--time", "ten minutes"], "--time"),
        (["chinchilla", "--time", "10m", "--flops", "1e20"], "--time"),
        (["chinchilla", "--flops", "1e20", "--dtype", "bfloat16"], "--time"),
        (["chinchilla", "--flops", "1e20", "--tokens-per-param", "-3"], "--tokens-per-param"),
        (["params", "--n-layer", "two"], "--n-layer"),
        (["params", "--n-layer", "0"], "--n-layer"),
        (["params", "--n-head", "5"], "n_head"),
        (["params", "--preset", "gpt5"], "unknown preset"),
        (["params", "--preset", "gpt2", "somewhere"], "not both"),
        (["params", "/nonexistent/run"], "no such run"),
        (["params", "--batch-size", "0"], "--batch-size"),
        (["params", "--seq-len", "4096"], "seq_len"),
        (["params", "--family", "--preset", "gpt2"], "--family"),
        (["params", "--family", "--lora-rank", "8"], "--family"),
        (["params", "--lora-rank", "0"], "--lora-rank"),
        (["params", "--lora-rank", "eight"], "--lora-rank"),
        (["params", "--lora-alpha", "big"], "--lora-alpha"),
        (["params", "--lora-targets", "c_proj"], "ambiguous"),
        (["params", "--lora-targets", "q_proj"], "attn.q_proj is not a projection of this model's blocks"),
        (["params", "--lora-targets", "qkv"], "unknown target"),
        (["params", "--freeze-layers", "13"], "0..12"),
        (["params", "--freeze-layers", "2", "--lora-rank", "8"], "LoRA already freezes"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tinygpt: error: ") and message in err


def test_a_broken_run_config_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"n_layers": 3}')
    code, _, err = run(capsys, "params", str(tmp_path))
    assert code == 2 and "n_layers" in err
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run(capsys, "params", str(tmp_path))
    assert code == 2 and "not valid JSON" in err


def test_real_process_exit_codes():
    r = subprocess.run([sys.executable, "-m", "tinygpt", "chinchilla", "--flops", "-5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    r = subprocess.run([sys.executable, "-m", "tinygpt", "params", "--preset", "gpt2-xl", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["total"] == 1_557_611_200


def test_params_with_grad_checkpoint_keeps_each_blocks_input_and_one_block(capsys):
    import dataclasses

    from tinygpt.calc import training_memory

    gpt2 = ["--preset", "gpt2", "--batch-size", "4", "--seq-len", "256", "--json"]
    _, out, _ = run(capsys, "params", *gpt2)
    full = last_json(out)["memory"]["training"]
    _, out, _ = run(capsys, "params", *gpt2, "--grad-checkpoint")
    t = last_json(out)["memory"]["training"]
    cfg = GPTConfig.from_preset("gpt2")
    one, two = (training_memory(dataclasses.replace(cfg, n_layer=n), 4, 256).activations for n in (1, 2))
    block = two - one  # a block's saved tensors
    # what the blocks kept goes from 12 blocks' saved tensors to 12 inputs (4 x 256 x 768 float32) and one block
    assert full["activations"] - t["activations"] == 11 * block - 12 * 4 * 256 * 768 * 4
    assert t["grad_checkpoint"] and t["recomputed"] == block and t["weights"] == full["weights"]
    _, out, _ = run(capsys, "params", *gpt2[:-1], "--grad-checkpoint")
    assert "activations recomputed block by block" in out and "one block rebuilt at a time" in out
