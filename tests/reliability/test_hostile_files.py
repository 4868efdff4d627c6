"""Hostile run folders: crafted files that must each be refused with tinygpt's own error, without
running code, without changing anything in the folder, within a memory bound.

Every case is a copy of a good run (or Hugging Face folder) with one file replaced. Each is refused
twice: by the library (a TinyGPTError subclass, one line) and by the command line (one line on
stderr, a non-zero exit, no traceback), the latter in one fresh process that also measures the
peak memory of every command (tests/reliability/hostile_worker.py). The pickle payloads would
write MARKER if they ever ran; a control unpickles one to show that they do.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tinygpt
from tinygpt.checkpoint import load_run
from tinygpt.config import GPTConfig, TrainConfig
from tinygpt.errors import TinyGPTError
from tinygpt.train import train
from tinygpt.weights import MAX_HEADER_BYTES

pytestmark = pytest.mark.reliability

WORKER = Path(__file__).with_name("hostile_worker.py")
MB = 1024 * 1024


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


@dataclass
class Case:
    name: str
    folder: Path
    command: str  # sample | resume | import | sample-ok
    expect: str  # a fragment of the one-line error


# ---- writing crafted files ----------------------------------------------------------------------


def split_st(file: Path) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_st(file: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def edit_header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        header, data = split_st(folder / "model.safetensors")
        edit(header)
        write_st(folder / "model.safetensors", header, data)

    return damage


def raw_header(raw: bytes, data: bytes = b"") -> Callable[[Path], None]:
    return lambda folder: write_st(folder / "model.safetensors", raw, data)


def overlap(h: dict) -> None:
    second = h[by_offset(h)[1]]
    second["data_offsets"] = [o - 4 for o in second["data_offsets"]]


def gap(folder: Path) -> None:
    header, data = split_st(folder / "model.safetensors")
    first, *rest = by_offset(header)
    end = header[first]["data_offsets"][1]
    for name in rest:
        header[name]["data_offsets"] = [o + 8 for o in header[name]["data_offsets"]]
    write_st(folder / "model.safetensors", header, data[:end] + bytes(8) + data[end:])


def duplicate_key(folder: Path) -> None:
    header, data = split_st(folder / "model.safetensors")
    name = by_offset(header)[0]
    raw = json.dumps(header).encode()
    raw = raw[:-1] + b", " + json.dumps(name).encode() + b": " + json.dumps(header[name]).encode() + b"}"
    write_st(folder / "model.safetensors", raw, data)


def trailing(folder: Path) -> None:
    header, data = split_st(folder / "model.safetensors")
    write_st(folder / "model.safetensors", header, data + bytes(16))


def truncated(folder: Path) -> None:
    header, data = split_st(folder / "model.safetensors")
    write_st(folder / "model.safetensors", header, data[:-16])


def huge_header(folder: Path) -> None:
    """A header length of 150 MB in a file that really is that long (sparse: no disk used)."""
    n = 150 * MB
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 64)


def dense_header(folder: Path) -> None:
    """A header just under the size limit packed with tiny (valid, zero-byte) tensor entries."""
    parts, size, i = [], 2, 0
    while True:
        entry = f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
        if size + len(entry) + 1 > MAX_HEADER_BYTES:
            break
        parts.append(entry)
        size += len(entry) + 1
        i += 1
    write_st(folder / "model.safetensors", ("{" + ",".join(parts) + "}").encode(), b"")


def fifo(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        os.mkfifo(folder / name)

    return damage


def symlink(name: str, target: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to(target)

    return damage


def as_directory(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()


def set_weight(name: str, value: float) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        header, _ = split_st(folder / "model.safetensors")
        from safetensors.torch import load_file

        tensors = load_file(folder / "model.safetensors")
        tensors[name][0, 0] = value
        save_file(tensors, str(folder / "model.safetensors"), metadata=header["__metadata__"])

    return damage


def retype_weights(folder: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    tensors["wte.weight"] = tensors["wte.weight"].to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))


def edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        from safetensors.torch import load_file

        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))

    return damage


def edit_json(name: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        data = edit(data) or data
        (folder / name).write_text(json.dumps(data))

    return damage


def write(name: str, content: bytes | str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    return damage


def edit_state(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        state = torch.load(folder / "train_state.pt", weights_only=True)
        torch.save(edit(state), folder / "train_state.pt")

    return damage


def shrink_moments(state: dict) -> dict:
    for moments in state["optimizer"]["state"].values():
        for k, v in moments.items():
            if v.dim():
                moments[k] = v[:1]
    return state


def payload_zip(name: str, marker: Path) -> Callable[[Path], None]:
    return lambda folder: torch.save({"weights": Payload(marker)}, folder / name)


def payload_raw(name: str, marker: Path) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(pickle.dumps(Payload(marker), protocol=2))


def pickle_only_hf(marker: Path) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        torch.save({"transformer.wte.weight": Payload(marker)}, folder / "pytorch_model.bin")

    return damage


def hostile_cases(marker: Path) -> list[tuple[str, str, str, Callable[[Path], None], str]]:
    """(name, base folder: run | hf, command, damage, expected fragment of the error)."""
    nested = b"[" * 100_000 + b"]" * 100_000
    char = {"format": "tinygpt-tokenizer", "version": 1, "kind": "char"}
    return [
        # pickles, named as weights or as training state: never unpickled
        ("pickle as model.safetensors", "run", "sample", payload_raw("model.safetensors", marker), "safetensors"),
        ("torch.save zip as model.safetensors", "run", "sample", payload_zip("model.safetensors", marker),
         "safetensors"),
        ("pickle as train_state.pt (zip)", "run", "resume", payload_zip("train_state.pt", marker),
         "unreadable training state"),
        ("pickle as train_state.pt (raw)", "run", "resume", payload_raw("train_state.pt", marker),
         "unreadable training state"),
        ("HF folder with only pytorch_model.bin", "hf", "sample", pickle_only_hf(marker), "a pickle"),
        ("HF folder with only pytorch_model.bin (import)", "hf", "import", pickle_only_hf(marker), "a pickle"),
        ("pickle as an HF model.safetensors", "hf", "sample", payload_zip("model.safetensors", marker),
         "safetensors"),
        # safetensors framing
        ("header length beyond the file", "run", "sample",
         lambda f: write_st(f / "model.safetensors", b"{}", b"", length=4096), "only 2 follow"),
        ("header over 100 MB", "run", "sample", huge_header, "more than tinygpt reads"),
        ("header not JSON", "run", "sample", raw_header(b"this is not JSON at all"), "not valid JSON"),
        ("header a JSON array", "run", "sample", raw_header(b"[1, 2, 3]"), "not an object"),
        ("header not UTF-8", "run", "sample", raw_header(b'{"\xff\xfe": 1}'), "not valid JSON"),
        ("header nested 100,000 deep", "run", "sample", raw_header(nested), "nested too deeply"),
        ("header packed with 8 MB of tiny entries", "run", "sample", dense_header, "more JSON objects"),
        ("overlapping offsets", "run", "sample", edit_header(overlap), "overlapping"),
        ("gapped offsets", "run", "sample", gap, "gap"),
        ("shape whose product overflows", "run", "sample",
         edit_header(lambda h: h[by_offset(h)[0]].update(shape=[2**40, 2**40, 2**40])), "needs"),
        ("dtype disagreeing with the byte length", "run", "sample",
         edit_header(lambda h: h[by_offset(h)[0]].update(dtype="F16")), "needs"),
        ("duplicate keys", "run", "sample", duplicate_key, "appears twice"),
        ("trailing bytes", "run", "sample", trailing, "trailing bytes"),
        ("truncated data", "run", "sample", truncated, "truncated"),
        ("empty file", "run", "sample", write("model.safetensors", b""), "too short"),
        ("unknown dtype", "run", "sample", edit_header(lambda h: h[by_offset(h)[0]].update(dtype="X9")),
         "unknown dtype"),
        ("negative dimension", "run", "sample", edit_header(lambda h: h[by_offset(h)[0]].update(shape=[-48])),
         "non-negative"),
        ("float in the header", "run", "sample", edit_header(lambda h: h[by_offset(h)[0]].update(shape=[48.0])),
         "not an integer"),
        ("metadata that is not text", "run", "sample", edit_header(lambda h: h.update(__metadata__={"step": 2})),
         "__metadata__"),
        ("a FIFO as model.safetensors", "run", "sample", fifo("model.safetensors"), "not a regular file"),
        ("model.safetensors linked to /dev/zero", "run", "sample", symlink("model.safetensors", "/dev/zero"),
         "not a regular file"),
        ("a folder as model.safetensors", "run", "sample", as_directory, "not a regular file"),
        # values, and weights that disagree with config.json
        ("NaN weights", "run", "sample", set_weight("wte.weight", float("nan")), "NaN or infinite"),
        ("infinite weights", "run", "sample", set_weight("h.0.mlp.c_fc.weight", float("inf")), "NaN or infinite"),
        ("integer weights", "run", "sample", retype_weights, "floating-point"),
        ("an extra tensor", "run", "sample", edit_tensors(lambda t: t.update(extra=torch.zeros(3))), "unexpected"),
        ("a missing tensor", "run", "sample", edit_tensors(lambda t: t.pop("ln_f.bias")), "missing"),
        ("config.json n_embd disagrees", "run", "sample", edit_json("config.json", lambda c: c.update(n_embd=32)),
         "disagrees with the weights"),
        ("config.json claims a million layers", "run", "sample",
         edit_json("config.json", lambda c: c.update(n_layer=10**6)), "n_layer=1000000"),
        ("config.json not JSON", "run", "sample", write("config.json", "{n_layer: 2"), "not valid JSON"),
        ("config.json nested 100,000 deep", "run", "sample", write("config.json", nested), "nested too deeply"),
        ("config.json with an unknown key", "run", "sample", edit_json("config.json", lambda c: c.update(exec=1)),
         "unknown key"),
        ("config.json with a wrong type", "run", "sample", edit_json("config.json", lambda c: c.update(n_head="2")),
         "n_head"),
        ("a FIFO as config.json", "run", "sample", fifo("config.json"), "not a regular file"),
        ("HF config.json claims a million layers", "hf", "sample",
         edit_json("config.json", lambda c: c.update(n_layer=10**6)), "n_layer=1000000"),
        # training state
        ("weights step that is not a number", "run", "resume",
         edit_header(lambda h: h["__metadata__"].update(step="2; rm -rf")), "not a number"),
        ("train_state.pt truncated", "run", "resume",
         lambda f: (f / "train_state.pt").write_bytes((f / "train_state.pt").read_bytes()[:300]),
         "unreadable training state"),
        ("train_state.pt with only a step", "run", "resume", edit_state(lambda s: {"step": s["step"]}),
         "not a training state tinygpt wrote"),
        ("train_state.pt with a bad RNG state", "run", "resume",
         edit_state(lambda s: {**s, "rng": {**s["rng"], "torch": torch.zeros(3)}}), "rng"),
        ("train_state.pt with misshapen optimizer moments", "run", "resume", edit_state(shrink_moments),
         "optimizer"),
        ("train_state.pt a list", "run", "resume", edit_state(lambda s: [s]), "not a training state"),
        ("train_state.pt for another step", "run", "resume", edit_state(lambda s: {**s, "step": 1}),
         "step 1 but the weights for 2"),
        # tokenizers
        ("tokenizer.json not JSON", "run", "sample", write("tokenizer.json", "chars: abc"), "not valid JSON"),
        ("tokenizer.json nested 100,000 deep", "run", "sample", write("tokenizer.json", nested), "nested too deeply"),
        ("tokenizer.json of an unknown kind", "run", "sample",
         edit_json("tokenizer.json", lambda t: t.update(kind="pickle")), "unknown tokenizer kind"),
        ("tokenizer.json with duplicate characters", "run", "sample",
         edit_json("tokenizer.json", lambda t: t.update(chars=t["chars"][:-1] + t["chars"][:1])), "duplicate"),
        ("tokenizer.json larger than the model", "run", "sample",
         write("tokenizer.json", json.dumps({**char, "chars": [chr(0x100 + i) for i in range(500)]})),
         "but the model only"),
        ("tokenizer.json a broken BPE", "run", "sample",
         write("tokenizer.json", json.dumps({**char, "kind": "bpe", "tokenizer": {"model": {"type": "BPE"}}})),
         "does not load"),
        ("tokenizer.json GPT-2 ranks not base64", "run", "sample",
         write("tokenizer.json", json.dumps({**char, "kind": "gpt2", "ranks": ["%%%"]})), "base64"),
        ("a FIFO as tokenizer.json", "run", "sample", fifo("tokenizer.json"), "not a regular file"),
        ("HF tokenizer.json an unsupported model", "hf", "sample",
         edit_json("tokenizer.json", lambda t: t["model"].update(type="Unigram")), "not supported"),
    ]


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(char_data, tmp_path_factory):
    """A trained run (weights, training state, tokenizer) and the same model as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("hostile")
    vocab = tinygpt.load_tokenizer(char_data).vocab_size
    model = GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=16)
    cfg = TrainConfig(batch_size=2, max_iters=2, eval_interval=2, eval_iters=1, device="cpu", dtype="float32")
    train(char_data, root / "run", model, cfg, progress=False)
    from tinygpt.interop.hf_gpt2 import export_hf

    export_hf(*load_run(root / "run", "cpu"), root / "hf")
    return root


def make_cases(bases: Path, root: Path, marker: Path) -> list[Case]:
    cases = []
    for i, (name, base, command, damage, expect) in enumerate(hostile_cases(marker)):
        folder = root / f"{i:02d}"
        shutil.copytree(bases / base, folder)
        damage(folder)
        cases.append(Case(name, folder, command, expect))
    return cases


def argv(case: Case, data: Path) -> list[str]:
    if case.command == "resume":
        return ["train", "--data", str(data), "--out", str(case.folder), "--resume", "--max-iters", "3", "--quiet"]
    if case.command == "import":
        return ["import", str(case.folder), "--out", str(case.folder) + "-imported"]
    extra = {"sample-ok": ["--allow-nonfinite", "--greedy"], "sample-nan": ["--allow-nonfinite"]}.get(case.command, [])
    return ["sample", str(case.folder), "--max-new-tokens", "2", "--device", "cpu", *extra]


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """The folder's regular files' bytes (special files by kind: reading a FIFO would block)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            out[p.name] = "link to " + os.readlink(p)
        elif stat.S_ISREG(mode):
            out[p.name] = p.read_bytes() if p.stat().st_size < 16 * MB else f"{p.stat().st_size} bytes"
        else:
            out[p.name] = stat.filemode(mode)
    return out


def library_call(case: Case, data: Path) -> None:
    if case.command == "resume":
        cfg = TrainConfig(batch_size=2, max_iters=3, eval_interval=2, eval_iters=1, device="cpu", dtype="float32")
        train(data, case.folder, None, cfg, resume=True, progress=False)
    elif case.command == "import":
        from tinygpt.checkpoint import import_hf

        import_hf(case.folder, str(case.folder) + "-imported-lib")
    else:
        load_run(case.folder, "cpu")


# ---- tests ------------------------------------------------------------------------------------


def test_the_payload_runs_code_when_unpickled(tmp_path):
    """The control: these payloads are live, so a missing marker below means nothing unpickled them."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.read_text() == "code ran"


def test_hostile_files_are_refused_by_the_library(bases, char_data, tmp_path):
    marker = tmp_path / "PWNED"
    cases = make_cases(bases, tmp_path / "cases", marker)
    assert len(cases) >= 20
    for case in cases:
        before = snapshot(case.folder)
        with pytest.raises(TinyGPTError) as info:
            library_call(case, char_data)
        message = str(info.value)
        assert "\n" not in message and case.expect in message, (case.name, message)
        assert snapshot(case.folder) == before, case.name
        assert not marker.exists(), case.name


def test_hostile_files_are_refused_by_the_cli_in_bounded_memory(bases, char_data, tmp_path, figure):
    marker = tmp_path / "PWNED"
    cases = make_cases(bases, tmp_path / "cases", marker)
    nan_case = next(c for c in cases if c.name == "NaN weights")
    controls = [Case("the intact run (warm-up and control)", bases / "run", "sample-ok", ""),
                Case("NaN weights with --allow-nonfinite", nan_case.folder, "sample-ok", "")]
    sampled_nan = Case("NaN weights sampled with --allow-nonfinite", nan_case.folder, "sample-nan", "not finite")
    before = {c.name: snapshot(c.folder) for c in cases}
    todo = [{"name": c.name, "argv": argv(c, char_data), "marker": str(marker)}
            for c in [controls[0], *cases, *controls[1:], sampled_nan]]
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    r = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    results = {res["name"]: res for res in json.loads((tmp_path / "out.json").read_text())}
    for control in controls:  # these load: the refusals below are the damage's doing
        res = results[control.name]
        assert res["code"] == 0 and res["stderr"] == "", res
    res = results[sampled_nan.name]  # greedy runs on NaN logits; a random draw cannot, and says so
    assert res["code"] == 2 and res["stderr"].count("\n") == 1 and "not finite" in res["stderr"], res
    worst = 0.0
    for case in cases:
        res = results[case.name]
        lines = res["stderr"].strip().splitlines()
        assert res["code"] == 2, res
        assert len(lines) == 1 and lines[0].startswith("tinygpt: error: ") and case.expect in lines[0], res
        assert not res["marker"], res
        assert snapshot(case.folder) == before[case.name], case.name
        if res["peak_bytes"] is not None:
            size = sum(p.stat().st_size for p in case.folder.rglob("*") if p.is_file() and not p.is_symlink())
            assert res["peak_bytes"] < 2 * size + 100 * MB, res
            worst = max(worst, res["peak_bytes"] / MB)
    huge = results["header over 100 MB"]
    if huge["peak_bytes"] is not None:
        assert huge["peak_bytes"] < 20 * MB  # refused from its length, before the 150 MB were read
    assert not marker.exists()
    slowest = max(results[c.name]["seconds"] for c in cases)
    figure("hostile files refused", f"{len(cases)} of {len(cases)}",
           "library: a TinyGPTError; CLI: one line, exit 2; no code ran, no file changed")
    figure("peak memory while refusing a hostile file", f"{worst:.1f} MB at most",
           f"bound: 2 x the folder's size + 100 MB; slowest refusal {slowest:.2f} s")


def test_a_payload_left_as_a_pending_state_is_discarded_unread(bases, char_data, tmp_path):
    """A train_state.pt.tmp (what a save killed between its two renames leaves) holding a payload is
    not a usable state: the resume drops it, never runs it, and continues from the checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(bases / "run", run)
    marker = tmp_path / "PWNED"
    payload_zip("train_state.pt.tmp", marker)(run)
    cfg = TrainConfig(batch_size=2, max_iters=3, eval_interval=2, eval_iters=1, device="cpu", dtype="float32")
    result = train(char_data, run, None, cfg, resume=True, progress=False)
    assert result.step == 3 and not marker.exists() and not (run / "train_state.pt.tmp").exists()
