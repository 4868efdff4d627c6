import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from tinygpt import GPT, GPTConfig
from tinygpt.checkpoint import CheckpointError, load, load_training, save, save_training
from tinygpt.fileio import atomic_write


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16), **kw}))


@pytest.mark.parametrize("kw", [{}, dict(tie_weights=False, bias=False, activation="gelu", init="torch")])
def test_save_load_round_trip(tmp_path, kw):
    model = tiny(**kw)
    save(model, tmp_path / "run")
    loaded = load(tmp_path / "run")
    assert not loaded.training
    assert loaded.config == model.config
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    if model.config.tie_weights:
        assert loaded.lm_head.weight is loaded.wte.weight
    idx = torch.randint(0, 23, (2, 8))
    assert torch.equal(model.eval()(idx), loaded(idx))


def test_no_temp_files_left(tmp_path):
    save(tiny(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_not_a_run(tmp_path):
    with pytest.raises(CheckpointError, match="no such run folder"):
        load(tmp_path / "missing")
    (tmp_path / "text.txt").write_text("x")  # a file that exists is not "no such" anything
    with pytest.raises(CheckpointError, match="a file, not a run folder"):
        load(tmp_path / "text.txt")
    with pytest.raises(CheckpointError, match="not a tinygpt run"):
        load(tmp_path)


def test_truncated_weights(tmp_path):
    save(tiny(), tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load(tmp_path)


def test_config_not_json(tmp_path):
    save(tiny(), tmp_path)
    for text in ("{not json", '{"n_layer": ' + "9" * 5000 + "}", "[" * 100_000):  # the last two: int's digit
        (tmp_path / "config.json").write_text(text)                                # limit, deep nesting
        with pytest.raises(CheckpointError, match="not valid JSON"):
            load(tmp_path)


def test_config_disagrees_with_weights(tmp_path):
    save(tiny(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_embd": 32}))
    with pytest.raises(CheckpointError, match="disagrees with the weights"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    with pytest.raises(CheckpointError, match="n_layer=3 but the weights hold 2 layers"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layers": 3}))
    with pytest.raises(CheckpointError, match="unknown key"):
        load(tmp_path)


def test_nonfinite_weights_refused_unless_allowed(tmp_path):
    model = tiny()
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    save(model, tmp_path)
    with pytest.raises(CheckpointError, match="NaN"):
        load(tmp_path)
    assert torch.isnan(load(tmp_path, allow_nonfinite=True).h[0].mlp.c_fc.weight[0, 0])


def test_pickle_named_as_weights_is_refused(tmp_path):
    save(tiny(), tmp_path)
    torch.save({"x": torch.zeros(1)}, tmp_path / "model.safetensors")  # a zip/pickle, not safetensors
    with pytest.raises(CheckpointError):
        load(tmp_path)


def test_failed_write_leaves_previous_file(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def broken(tmp):
        tmp.write_text("partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(target, broken)
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_training_state_pair_and_roll_forward(tmp_path):
    model = tiny()
    save_training(tmp_path, model, {"step": 5, "x": torch.ones(2)})
    assert load_training(tmp_path)["step"] == 5
    # a kill between the weights' rename and the state's: the new state waits as .tmp
    save(model, tmp_path, step=6)
    torch.save({"step": 6, "x": torch.zeros(2)}, tmp_path / "train_state.pt.tmp")
    state = load_training(tmp_path)
    assert state["step"] == 6 and not (tmp_path / "train_state.pt.tmp").exists()
    # a stale temp state (the kill came before the weights were replaced) is discarded
    torch.save({"step": 7}, tmp_path / "train_state.pt.tmp")
    assert load_training(tmp_path)["step"] == 6
    assert not (tmp_path / "train_state.pt.tmp").exists()
    # what a kill inside a save leaves beside the checkpoint: atomic_write's and safetensors' temp files
    for name in (".model.safetensors.tmp-4242", ".tmpGKlEPn"):
        (tmp_path / name).write_bytes(b"half a file")
    (tmp_path / "notes.tmp").write_text("the user's")
    assert load_training(tmp_path)["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name) == ["notes.tmp"]


def test_mismatched_pair_is_refused(tmp_path):
    model = tiny()
    save_training(tmp_path, model, {"step": 5})
    save(model, tmp_path, step=9)
    with pytest.raises(CheckpointError, match="step 5 but the weights for 9"):
        load_training(tmp_path)


def test_extra_tensor_is_refused(tmp_path):
    model = tiny()
    save(model, tmp_path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors["evil"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected"):
        load(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_weights_get_the_mode_of_the_runs_other_files(tmp_path, umask):
    # safetensors writes through a mkstemp file (0600): model.safetensors was 0600 beside 0644 files
    old = os.umask(umask)
    try:
        save(tiny(), tmp_path / "run")
        save_training(tmp_path / "run", tiny(), {"step": 1})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "run").iterdir()}
    assert modes == dict.fromkeys(["config.json", "model.safetensors", "train_state.pt"], 0o666 & ~umask)
