"""Chat: templates and special tokens, chat data and its loss mask, SFT in the training loop."""

import json

import pytest
import torch

from tinygpt.config import GPTConfig
from tinygpt.errors import ChatError, TokenizerError
from tinygpt.model import GPT, grow_vocab
from tinygpt.tokenizer import (
    EOT,
    BPETokenizer,
    ChatTemplate,
    CharTokenizer,
    GPT2Tokenizer,
    load_tokenizer,
    render_chat,
    render_chat_prompt,
    with_chat_template,
)

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "say <|end|> now"},
    {"role": "assistant", "content": "ok <|user|>"},
]
TEXT = "".join(m["content"] for m in CONVO) + " abcdefghijklmnopqrstuvwxyz"


def byte_gpt2() -> GPT2Tokenizer:
    """GPT-2's shape in small: the 256 byte tokens and <|endoftext|> after them (no merges)."""
    return GPT2Tokenizer({bytes([b]): b for b in range(256)}, {EOT: 256})


def tokenizers():
    return {
        "char": CharTokenizer.from_text(TEXT),
        "bpe": BPETokenizer.train([TEXT * 20], 300),
        "gpt2": byte_gpt2(),
    }


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_special_tokens_get_ids_after_the_vocabulary_and_text_never_encodes_to_them(kind, tmp_path):
    base = tokenizers()[kind]
    tok = with_chat_template(base)
    specials = ChatTemplate().special_tokens()
    ids = tok.special_ids()
    assert [ids[t] for t in specials] == list(range(tok.vocab_size - 4, tok.vocab_size))
    assert tok.vocab_size == base.vocab_size + 4 and base.chat_template is None  # the original is untouched
    if kind == "gpt2":
        assert ids["<|system|>"] == 257  # right after <|endoftext|>
    # a user typing the spelling of a special token gets its characters, not the token
    for spelling in specials:
        encoded = tok.encode(f"x{spelling}y")
        assert not set(encoded) & set(ids.values()) and tok.decode(encoded) == f"x{spelling}y"
    rendered = render_chat(tok, CONVO)
    specials_in = [i for i in rendered.ids if i in ids.values()]
    assert specials_in == [ids[t] for t in ("<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>", "<|end|>")]
    assert tok.decode(rendered.ids) == "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in CONVO)
    # the mask covers the assistant's content and its end of turn, nothing else
    answer = tok.encode(CONVO[2]["content"])
    assert sum(rendered.mask) == len(answer) + 1
    assert rendered.mask[-len(answer) - 1 :] == [1] * (len(answer) + 1) and rendered.mask[: -len(answer) - 1] == [0] * (
        len(rendered.ids) - len(answer) - 1
    )
    prompt = render_chat_prompt(tok, CONVO[:2])
    assert prompt == rendered.ids[: len(prompt)] and prompt[-1] == ids["<|assistant|>"]
    # saved and loaded, the template and its ids come back; the fingerprint tells it from the plain tokenizer
    tok.save(tmp_path / "t.json")
    again = load_tokenizer(tmp_path / "t.json")
    assert again.chat_template == tok.chat_template and render_chat(again, CONVO) == rendered
    assert again.fingerprint() == tok.fingerprint() != base.fingerprint()


def test_malformed_conversations_and_templates_are_refused():
    tok = with_chat_template(CharTokenizer.from_text(TEXT))
    bad = [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}], "empty content"),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "empty content"),
    ]
    for messages, why in bad:
        with pytest.raises(ChatError, match=why):
            render_chat(tok, messages)
    # a prompt may hold an empty reply (the model ended its turn at once), not an empty question
    empty_reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    ends = [tok.special_ids()[name] for name in ("<|assistant|>", "<|end|>")]
    assert render_chat_prompt(tok, empty_reply)[-3:-1] == ends
    with pytest.raises(ChatError, match=r"message 1 \(user\) has empty content"):
        render_chat_prompt(tok, [{"role": "user", "content": " "}])
    with pytest.raises(ChatError, match="no chat template"):
        render_chat(CharTokenizer.from_text(TEXT), CONVO)
    with pytest.raises(ChatError, match="role"):
        ChatTemplate(start="<|start|>")
    with pytest.raises(TokenizerError):  # content outside a char vocabulary
        render_chat(tok, [{"role": "user", "content": "ZZZ"}, {"role": "assistant", "content": "a"}])
    data = tok.to_dict()
    data["specials"] = data["specials"][:-1]
    data["vocab_size"] -= 1
    with pytest.raises(TokenizerError, match="not special tokens"):
        from tinygpt.tokenizer import tokenizer_from_dict

        tokenizer_from_dict(data)


@pytest.mark.parametrize("tie", [True, False])
def test_grow_vocab_adds_mean_rows_and_keeps_the_old_logits(tie):
    cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=tie)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 20, (2, 8))
    before = model(idx)
    old_wte, old_head = model.wte.weight.clone(), model.lm_head.weight.clone()
    grow_vocab(model, 24)
    assert model.config.vocab_size == 24 and model.wte.weight.shape == (24, 16) == model.lm_head.weight.shape
    assert torch.equal(model.wte.weight[:20], old_wte)
    assert torch.allclose(model.wte.weight[20:], old_wte.mean(0).expand(4, -1))
    assert torch.allclose(model.lm_head.weight[20:], old_head.mean(0).expand(4, -1))
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert torch.allclose(model(idx)[..., :20], before, atol=1e-6)  # old tokens' logits unchanged
    assert {n for n, p in model.named_parameters()} >= {"wte.weight"}  # the optimizer sees the new tensors
    with pytest.raises(ValueError):
        grow_vocab(model, 10)


# --- chat data ------------------------------------------------------------------------------


def qa(i: int) -> dict:
    """A tiny instruction: reverse a word."""
    word = "".join("abcdefgh"[(i * 7 + k * 3) % 8] for k in range(2 + i % 4))
    return {"messages": [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]}


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prepare_chat_writes_tokens_masks_and_counts(tmp_path):
    from tinygpt.data import load_data, prepare_chat

    src = write_jsonl(tmp_path / "c.jsonl", [qa(i) for i in range(40)])
    meta = prepare_chat(src, tmp_path / "d", val_fraction=0.1)
    ds = load_data(tmp_path / "d")
    assert ds.is_chat and meta["conversations"] == 40
    assert (meta["train_conversations"], meta["val_conversations"]) == (36, 4)
    assert meta["train_tokens"] == len(ds.train) and len(ds.masks["train"]) == len(ds.train)
    # the trained tokens are the mask's sum: each answer's characters and its end of turn
    answers = [len(qa(i)["messages"][1]["content"]) + 1 for i in range(40)]
    assert meta["trained_tokens"] == int(ds.masks["train"].sum() + ds.masks["val"].sum()) == sum(answers)
    assert meta["train_trained_tokens"] == sum(answers[:36])
    first = ds.train[: ds.starts["train"][1]].tolist()
    assert first == render_chat(ds.tokenizer, qa(0)["messages"]).ids
    assert ds.tokenizer.chat_template == ChatTemplate() and ds.tokenizer.kind == "char"


def test_prepare_chat_reports_malformed_lines_or_skips_them(tmp_path):
    from tinygpt.data import prepare_chat
    from tinygpt.errors import DataError

    bad = [
        "{not json",
        json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        '{"messages": [], "n": ' + "9" * 5000 + "}",  # past Python's digit limit for int: a ValueError
        "[" * 100_000 + "]" * 100_000,  # past the decoder's recursion limit
    ]
    src = write_jsonl(tmp_path / "c.jsonl", [qa(i) for i in range(6)], bad)
    with open(src, "ab") as f:  # a line that is not UTF-8: once the whole file stopped, skip or not, at a byte offset
        f.write(b'{"messages": [{"role": "user", "content": "\xff"}]}\n')
    with pytest.raises(DataError) as e:
        prepare_chat(src, tmp_path / "d")
    # the first five with why, then the others' numbers: every one fixed in one pass
    assert "c.jsonl: 7 malformed lines: line 7: not JSON" in str(e.value) and "| line 8: " in str(e.value)
    assert "| line 11: not JSON" in str(e.value) and "| and 2 more (lines 12, 13); fix them" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    meta = prepare_chat(src, tmp_path / "d", errors="skip")
    assert meta["skipped"] == 7 and meta["skipped_lines"] == [7, 8, 9, 10, 11, 12, 13] and meta["conversations"] == 6
    assert meta["skipped_why"][0].startswith("line 7: not JSON") and meta["skipped_why"][-1] == "and 2 more (lines 12, 13)"
    lone = write_jsonl(tmp_path / "lone.jsonl", [qa(0)], [])
    lone.write_bytes(lone.read_bytes() + b'{"content": "\xff"}\n')
    with pytest.raises(DataError, match=r"lone.jsonl: 1 malformed line: line 2: not UTF-8 \(invalid start byte at "
                                        r"byte 13 of the line\); fix them"):
        prepare_chat(lone, tmp_path / "d2")


def test_prepare_chat_lists_the_conversations_the_tokenizer_cannot_encode_or_skips_them(tmp_path, capsys):
    """A reused char vocabulary without é or →: strict names the first five lines with their characters
    and counts the rest; skip leaves them out, as if they were never in the file. Once the first such
    line stopped prepare, naming it alone, with --errors skip too."""
    from tinygpt.cli import main
    from tinygpt.data import load_data, prepare_chat
    from tinygpt.errors import DataError

    prepare_chat(write_jsonl(tmp_path / "base.jsonl", [qa(i) for i in range(20)]), tmp_path / "base")
    good = [qa(i) for i in range(30)]
    accent = {"messages": [{"role": "user", "content": "reverse café"}, {"role": "assistant", "content": "éfac"}]}
    arrow = {"messages": [{"role": "user", "content": "reverse ab"}, {"role": "assistant", "content": "a → b"}]}
    records = good[:2] + [accent] + good[2:10] + [arrow] * 6 + good[10:]  # lines 3 and 12 to 17
    src = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError) as e:
        prepare_chat(src, tmp_path / "d", tokenizer=None, tokenizer_file=tmp_path / "base")
    message = str(e.value)
    assert message.startswith(f"{src}: 7 conversations the tokenizer cannot encode: line 3: message 1 (user): "
                              "1 character not in the tokenizer's vocabulary: 'é' (U+00E9) at position 11; "
                              "message 2 (assistant): 1 character not in the tokenizer's vocabulary: 'é' (U+00E9) "
                              "at position 0 | line 12: message 2 (assistant): 1 character not in the tokenizer's "
                              "vocabulary: '→' (U+2192) at position 2 | line 13: ")
    assert "| line 15: " in message and "| and 2 more (lines 16, 17); fix them" in message
    assert "\n" not in message and not (tmp_path / "d").exists()

    meta = prepare_chat(src, tmp_path / "d", tokenizer=None, tokenizer_file=tmp_path / "base", errors="skip")
    assert (meta["conversations"], meta["skipped"], meta["unencodable"]) == (30, 7, 7)
    assert meta["skipped_lines"] == [3, 12, 13, 14, 15, 16, 17] and meta["skipped_why"][-1] == "and 2 more (lines 16, 17)"
    prepare_chat(write_jsonl(tmp_path / "good.jsonl", good), tmp_path / "g", tokenizer=None,
                 tokenizer_file=tmp_path / "base")
    skipped, clean = load_data(tmp_path / "d"), load_data(tmp_path / "g")
    for split in ("train", "val"):  # the split falls on the conversations written
        assert skipped.train.tolist() == clean.train.tolist() and skipped.val.tolist() == clean.val.tolist()
        assert skipped.masks[split].tolist() == clean.masks[split].tolist()
        assert skipped.starts[split].tolist() == clean.starts[split].tolist()
    assert {k: v for k, v in meta.items() if "skipped" not in k and k not in ("sources", "unencodable", "errors")} == {
        k: v for k, v in clean.meta.items() if "skipped" not in k and k not in ("sources", "unencodable", "errors")}

    argv = ["prepare", str(src), "--format", "chat", "--tokenizer-file", str(tmp_path / "base"), "--out",
            str(tmp_path / "cli")]
    assert main(argv) == 2 and "7 conversations the tokenizer cannot encode: line 3:" in capsys.readouterr().err
    assert main(argv + ["--errors", "skip"]) == 0
    out = capsys.readouterr().out
    assert "skipped 7 lines (7 the tokenizer cannot encode):\n    line 3: message 1 (user): 1 character" in out
    assert "\n    and 2 more (lines 16, 17)\n" in out


def test_prepare_chat_streams_the_file_in_memory_that_does_not_grow_with_it(tmp_path, monkeypatch):
    """Python's peak allocation while preparing 0.44 MB and then 1.8 MB of conversations: the same, the
    tokens written as they are rendered (once the whole file's messages, ids and mask were held, 11.8 and
    34.5 MB; benchmarks/prepare_memory.py --format chat measures a 30 MB file's peak RSS)."""
    import tracemalloc

    from tinygpt.data import chat as data

    monkeypatch.setattr(data, "CHAT_BUFFER_TOKENS", 1 << 14, raising=False)  # flat from a small file on

    def conversation(i: int) -> dict:
        text = "".join(chr(97 + (i * 7 + k) % 26) for k in range(400))
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]}

    peaks = []
    for n in (500, 2000):
        src = write_jsonl(tmp_path / f"c{n}.jsonl", [conversation(i) for i in range(n)])
        tracemalloc.start()
        try:
            meta = data.prepare_chat(src, tmp_path / f"d{n}")
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert meta["conversations"] == n and meta["train_tokens"] + meta["val_tokens"] == n * (800 + 4)
    assert peaks[1] - peaks[0] < 1e6, f"peak {peaks[0] / 1e6:.1f} MB, then {peaks[1] / 1e6:.1f} MB"


# --- training on chat data -------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from tinygpt.data import prepare_chat

    root = tmp_path_factory.mktemp("chat")
    prepare_chat(write_jsonl(root / "c.jsonl", [qa(i) for i in range(200)]), root / "data", val_fraction=0.1)
    return root / "data"


def test_packed_rows_hold_whole_conversations_and_never_learn_across_them(chat_data):
    from tinygpt.data import get_chat_batch, load_data, pack_conversations

    ds = load_data(chat_data)
    starts, n, block = ds.starts["train"], len(ds.train), 40
    rows = pack_conversations(starts, n, block)
    ends = dict(zip(starts.tolist(), [*starts[1:].tolist(), n]))
    spans = [span for row in rows for span in row]
    assert all(ends[a] == b for a, b in spans) and len(spans) == len(starts)  # every conversation whole, once
    assert all(sum(b - a for a, b in row) <= block + 1 for row in rows) and len(rows) < len(starts)  # packed
    x, y, w, docs = get_chat_batch(ds.train, ds.masks["train"], rows, torch.arange(3), block)
    for b in range(3):
        flat = [t for a, e in rows[b] for t in ds.train[a:e].tolist()]
        flat_mask = [t for a, e in rows[b] for t in ds.masks["train"][a:e].tolist()]
        k = len(flat) - 1
        assert x[b, :k].tolist() == flat[:-1] and y[b, :k].tolist() == flat[1:]
        assert w[b, k:].sum() == 0 and docs[b, k + 1 :].eq(-1).all()  # padding counts for nothing
        # the trained targets are the mask's tokens, except none of one conversation predicts the next's start
        assert w[b].sum() == sum(flat_mask[1:])
    # a packed row computes each conversation exactly as alone: attention and positions stay inside
    model = GPT(GPTConfig(vocab_size=ds.vocab_size, block_size=block, n_layer=2, n_head=2, n_embd=16)).eval()
    packed = model(x[:1], documents=docs[:1])
    at = 0
    for a, e in rows[0]:
        alone = model(torch.as_tensor(ds.train[a:e].astype("int64"))[None, :-1])
        assert torch.allclose(packed[0, at : at + e - a - 1], alone[0], atol=1e-5)
        at += e - a
    # a conversation longer than a row is cut into overlapping pieces, each of its tokens a target once
    long_rows = pack_conversations(starts[:1], 30, 8)
    assert long_rows == [[(0, 9)], [(8, 17)], [(16, 25)], [(24, 30)]]


def test_masked_positions_add_nothing_to_the_loss_or_its_gradient(chat_data):
    from tinygpt.data import load_data
    from tinygpt.data.batches import Batches
    from tinygpt.train import batch_loss

    ds = load_data(chat_data)
    batches = Batches.of(ds, "train", 32)
    x, y, w, docs = batches.get(torch.arange(4))
    model = GPT(GPTConfig(vocab_size=ds.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))

    def grads(targets):
        model.zero_grad()
        loss = batch_loss(model, (x, targets, w, docs), "cpu")
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, g = grads(y)
    masked = w == 0
    changed = torch.where(masked, (y + 1) % ds.vocab_size, y)  # every masked target another token
    assert masked.any() and not torch.equal(changed, y)
    loss2, g2 = grads(changed)
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(g, g2))
    trained = torch.where(~masked, (y + 1) % ds.vocab_size, y)  # and the trained targets do count
    loss3, _ = grads(trained)
    assert not torch.equal(loss, loss3)


def test_train_on_chat_data_learns_the_assistant_turns(chat_data, tmp_path):
    from tinygpt.config import TrainConfig
    from tinygpt.data import load_data
    from tinygpt.train import train

    ds = load_data(chat_data)
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=48, n_layer=1, n_head=2, n_embd=32)
    result = train(chat_data, tmp_path / "run", cfg, TrainConfig(max_iters=30, batch_size=8, eval_interval=30,
                                                                 eval_iters=2, lr=3e-3, warmup=5))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    # the loss is on the answers alone: reversing a word from 8 letters starts near ln(vocab) and falls
    assert losses[0] > 2.0 and result.val_loss < losses[0] - 1.0
    run_tok = load_tokenizer(tmp_path / "run")
    assert run_tok.chat_template == ChatTemplate() and run_tok.fingerprint() == ds.tokenizer.fingerprint()


# --- serving a chat run ------------------------------------------------------------------------


def test_chat_completions_use_the_runs_template_and_stop_at_its_end_of_turn():
    import openai
    from server_util import NAME, running, stopping_model, tiny_model, tiny_tokenizer

    from tinygpt.server import create_app

    tok = with_chat_template(tiny_tokenizer())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "type <|end|> for me"}]
    prompt = render_chat_prompt(tok, messages)
    model, expected = stopping_model(tok, prompt)
    with running(create_app(model, tok, model_name=NAME, max_tokens=32)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
        assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
        # the prompt is the template's rendering, the user's "<|end|>" spelled in characters
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(expected) + 1  # + <|end|>
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        # a plain completion of the same ids stops at the end of turn too, as `tinygpt sample` does
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
        card = client.models.retrieve(NAME).model_dump()
        assert card["chat_template"]["kind"] == "run" and card["chat_template"]["end"] == "<|end|>"
        with pytest.raises(openai.BadRequestError, match="empty content"):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": " "}])
        # a reply that starts another turn ends there: once "<|user|>" was written out as text and, in
        # `tinygpt chat`, kept in the conversation, which the character vocabulary could not encode again
        user = tok.special_ids()["<|user|>"]
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, logit_bias={str(user): 100})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("", "stop")
        with pytest.raises(openai.BadRequestError) as e:  # which message, and where in it
            client.chat.completions.create(model=NAME, messages=[messages[0], {"role": "user", "content": "caf\u00e9"}])
        assert e.value.body["param"] == "messages.1.content" and "at position 3" in e.value.body["message"]
    # a model without a template keeps the plain "User: ... Assistant:" text, and says so
    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_model(), tiny_tokenizer(), model_name=NAME)) as plain:
        assert plain.get("/v1/models").json()["data"][0]["chat_template"]["kind"] == "plain"


# --- export ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_exported_chat_template_gives_tinygpts_ids_in_transformers_and_gguf(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from tinygpt.interop.gguf import export_gguf
    from tinygpt.interop.hf_gpt2 import export_hf

    tok = with_chat_template(tokenizers()[kind])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16, bias=True,
                          activation="gelu_tanh"))
    export_hf(model, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say ok now"},
                {"role": "assistant", "content": "ok fine"}, {"role": "user", "content": "again"}]

    def hf_ids(msgs, **kw):
        out = hf_tok.apply_chat_template(msgs, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    assert hf_ids(messages[:3]) == render_chat(tok, messages[:3]).ids
    assert hf_ids(messages, add_generation_prompt=True) == render_chat_prompt(tok, messages)
    assert hf_tok.eos_token == "<|end|>"
    # and back: `tinygpt import` of the folder gives the same tokenizer, template included
    from tinygpt.interop.hf_tokenizer import load_hf_tokenizer

    back = load_hf_tokenizer(tmp_path / "hf")
    assert back.chat_template == tok.chat_template and back.fingerprint() == tok.fingerprint()
    path = export_gguf(model, tok, tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert fields["tokenizer.chat_template"] == tok.chat_template.jinja()
    assert fields["tokenizer.ggml.eot_token_id"] == tok.special_ids()["<|end|>"]


# --- the command line ------------------------------------------------------------------------


def test_cli_prepare_chat_train_and_chat_prompt_equals_the_server(tmp_path, capsys):
    from fastapi.testclient import TestClient
    from server_util import NAME, stopping_model, tiny_tokenizer

    import tinygpt
    from tinygpt.cli import main
    from tinygpt.server import create_app

    src = write_jsonl(tmp_path / "c.jsonl", [qa(i) for i in range(30)], ["{broken"])
    assert main(["prepare", str(src), "--format", "chat", "--out", str(tmp_path / "d")]) == 2
    assert "c.jsonl: 1 malformed line: line 31: not JSON" in capsys.readouterr().err
    assert main(["prepare", str(src), "--format", "chat", "--out", str(tmp_path / "d"), "--errors", "skip"]) == 0
    out = capsys.readouterr().out
    assert "30 conversations" in out and "skipped 1 line (1 malformed):\n    line 31: not JSON" in out
    assert main(["train", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "run"), "--max-iters", "2", "--n-layer", "1",
                 "--n-embd", "16", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
                 "--eval-iters", "1"]) == 0
    capsys.readouterr()
    # --prompt answers one message exactly as the server does at temperature 0, up to the end of turn
    tok = with_chat_template(tiny_tokenizer())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    model, expected = stopping_model(tok, render_chat_prompt(tok, messages))
    tinygpt.save(model, tmp_path / "chat-run", tok)
    with TestClient(create_app(model, tok, model_name=NAME)) as http:
        served = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "temperature": 0,
                                                         "max_tokens": 20}).json()
    assert served["choices"][0]["message"]["content"] == expected
    assert main(["chat", str(tmp_path / "chat-run"), "--system", "Be brief.", "--prompt", "hello there",
                 "--temperature", "0", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["chat", str(tmp_path / "chat-run"), "--prompt", "caf\u00e9", "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinygpt: error:") and "vocabulary" in err and err.count("\n") == 1


def test_cli_chat_interactive_resets_sets_the_system_and_trims_history(tmp_path, capsys, monkeypatch):
    import io

    from server_util import tiny_model, tiny_tokenizer

    import tinygpt
    from tinygpt.cli import main

    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(tiny_model(block_size=48, vocab_size=tok.vocab_size), tmp_path / "run", tok)
    lines = ["hello", "/system Be kind.", "a second, longer message to fill the context", "/reset", "/nope", "bye"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("bot> ") == 3
    assert "(system message set)" in captured.err and "(conversation reset)" in captured.err
    assert ("(dropped the 1 oldest exchange (2 messages; a message goes with its reply) to stay within the model's "
            "context of 48 tokens)") in captured.err
    assert "unknown command /nope" in captured.err
    # an empty reply (here: no room for any) is a turn like another: the next message still goes
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", str(tmp_path / "run"), "--max-new-tokens", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("bot> ") == 2 and "cannot send" not in captured.err
    # a message longer than the context: the reply cannot see the system message, and a note says so
    # (once nothing did)
    monkeypatch.setattr("sys.stdin", io.StringIO("a message much too long for a 48-token context, " * 3 + "\n"))
    assert main(["chat", str(tmp_path / "run"), "--max-new-tokens", "8", "--system", "Be kind."]) == 0
    err = capsys.readouterr().err
    assert ("(the prompt is 157 tokens, more than the model's context of 48: the reply cannot see its first 109, "
            "the system message first, and sees less as it grows)") in err
    # a run without a template cannot chat: one line says what to do
    tinygpt.save(tiny_model(), tmp_path / "plain", tiny_tokenizer())
    assert main(["chat", str(tmp_path / "plain"), "--prompt", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err
    # bytes that are not UTF-8 (`--prompt $'\xff'`) are named by their flag, not the tokenizer's words
    for flag in ("--prompt", "--system"):
        assert main(["chat", str(tmp_path / "run"), flag, "hi \udcff"]) == 2
        assert capsys.readouterr().err == f"tinygpt: error: {flag}: not valid UTF-8 text (byte 0xff at character 4)\n"


# Llama 2's template in short: the system message folds into the first user turn, and the roles must alternate
ALTERNATING = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + ('<<SYS>>' + system + '<</SYS>>' if loop.first "
    "and system else '') + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def alternating_tokenizer():
    """A Hugging Face model's tokenizer (byte-level BPE, <s> and </s>) with ALTERNATING as its template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from tinygpt.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    return HFTokenizer(json.loads(tok.to_str()), {"bos_token": "<s>", "eos_token": "</s>"}, ALTERNATING)


def test_trimming_drops_whole_exchanges_so_a_template_that_wants_alternating_roles_still_renders():
    # once one message at a time: the kept history began with a reply and the template raised
    from tinygpt.tokenizer import fit_chat_prompt

    tok = alternating_tokenizer()
    turns = [{"role": role, "content": f"{role} message number {i}, in a few words"}
             for i in range(3) for role in ("user", "assistant")]
    messages = [{"role": "system", "content": "Be brief."}, *turns, {"role": "user", "content": "and now?"}]
    whole = len(render_chat_prompt(tok, messages))
    last_two = len(render_chat_prompt(tok, [messages[0], *messages[5:]]))
    for budget, dropped in ((whole, 0), (whole - 1, 2), (last_two, 4), (last_two - 1, 6), (5, 6)):
        kept, ids, n = fit_chat_prompt(tok, messages, budget)
        assert n == dropped and kept == [messages[0], *messages[1 + dropped:]] and kept[1]["role"] == "user"
        assert ids == render_chat_prompt(tok, kept) and (len(ids) <= budget or len(kept) == 2)
    with pytest.raises(ChatError, match="roles must alternate"):  # what dropping one message would have left
        render_chat_prompt(tok, [messages[0], *messages[2:]])


def test_cli_chat_goes_on_past_the_context_under_a_template_that_wants_alternating_roles(tmp_path, capsys,
                                                                                        monkeypatch):
    # once every message after the first trim was refused ("roles must alternate") until /reset
    import io

    import tinygpt
    from tinygpt.cli import main

    tok = alternating_tokenizer()
    tinygpt.save(GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)),
                 tmp_path / "run", tok)
    lines = ["say now", "the quick brown fox", "jumps over the lazy dog", "be brief", "abc"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", str(tmp_path / "run"), "--system", "Be brief.", "--max-new-tokens", "8", "--seed", "0"]) == 0
    captured = capsys.readouterr()
    assert "cannot send" not in captured.err and captured.out.count("bot> ") == len(lines)
    assert ("(dropped the 1 oldest exchange (2 messages; a message goes with its reply) to stay within the model's "
            "context of 64 tokens)") in captured.err


def test_cli_chat_note_on_a_long_prompt_says_what_the_reply_sees(tmp_path, capsys):
    # a 35-token prompt fits a 64-token context but not beside a 256-token reply (once the note said
    # the reply saw the prompt's last tokens only, not the system message: it sees all of it at first)
    import tinygpt
    from tinygpt.cli import main
    from tinygpt.generate import generate_stream

    tok = with_chat_template(CharTokenizer.from_text(TEXT))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16))
    tinygpt.save(model, tmp_path / "run", tok)
    for system, message in ((None, "abcdefgh" * 4), ("Be brief.", "abcdefghijklmnopqrstu")):
        flags = ["--system", system] if system else []
        assert main(["chat", str(tmp_path / "run"), "--prompt", message, "--seed", "1", *flags]) == 0
        err = capsys.readouterr().err
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        prompt = render_chat_prompt(tok, messages)
        assert len(prompt) == 35 and "sees its last tokens only" not in err
        assert err == ("(the prompt is 35 tokens of the model's context of 64: the reply's first 30 tokens see all of "
                       f"it, later ones lose sight of its start{', the system message first' if system else ''})\n")
    # which is what generation does: the 30th token is chosen from the whole prompt, the 31st without its start
    seen = []
    steps = generate_stream(model, torch.tensor([prompt]), 31, observer=lambda t: seen.append(t.context[0].tolist()))
    list(steps)
    assert seen[29][:35] == prompt and seen[30][:34] == prompt[1:]


def test_cli_chat_refuses_a_system_message_the_vocabulary_cannot_write(tmp_path, capsys, monkeypatch):
    # once accepted, after which every message failed, pointing at positions in the system text
    import io

    from server_util import tiny_model, tiny_tokenizer

    import tinygpt
    from tinygpt.cli import main

    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(tiny_model(block_size=48, vocab_size=tok.vocab_size), tmp_path / "run", tok)
    run = ["chat", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "4"]
    assert main([*run, "--system", "T\u00e9st", "--prompt", "hello"]) == 2
    assert capsys.readouterr().err == ("tinygpt: error: --system: 1 character not in the tokenizer's vocabulary: "
                                       "'\u00e9' (U+00E9) at position 1\n")
    assert main([*run, "--system", "Be kind.", "--prompt", "hello"]) == 0
    expected = capsys.readouterr().out
    assert main([*run, "--prompt", "hello"]) == 0
    assert capsys.readouterr().out != expected  # the system message shows in the reply
    # in the session, /system with such text is refused in a line and the old system message stays
    monkeypatch.setattr("sys.stdin", io.StringIO("/system T\u00e9st\nhello\n"))
    assert main([*run, "--system", "Be kind."]) == 0
    captured = capsys.readouterr()
    assert ("(/system: 1 character not in the tokenizer's vocabulary: '\u00e9' (U+00E9) at position 1; the system "
            "message stays as it was)") in captured.err
    assert "cannot send" not in captured.err and "(system message set)" not in captured.err
    assert captured.out.endswith("bot> " + expected + "you> ")


def test_cli_chat_prints_its_notes_before_the_reply_not_inside_it(tmp_path, capsys, monkeypatch):
    # once "bot> " came first and the note about dropped messages landed between it and the reply
    import io

    from server_util import tiny_model, tiny_tokenizer

    import tinygpt
    from tinygpt.cli import main

    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(tiny_model(block_size=48, vocab_size=tok.vocab_size), tmp_path / "run", tok)
    lines = ["hello", "a second, longer message to fill the context", "caf\u00e9"]
    terminal = io.StringIO()  # stdout and stderr as a terminal shows them, one stream
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["chat", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "8"]) == 0
    shown = terminal.getvalue()
    assert ("you> (dropped the 1 oldest exchange (2 messages; a message goes with its reply) to stay within the "
            "model's context of 48 tokens)\n(the prompt is ") in shown
    assert "bot> (" not in shown and shown.count("bot> ") == 2
    assert "you> (cannot send that: 1 character not in the tokenizer's vocabulary" in shown  # no "bot> " before it


def test_cli_chat_shows_control_characters_of_a_reply_as_escapes(tmp_path, capsys, monkeypatch):
    # once written raw: a reply could clear the screen, move the cursor or retitle the terminal
    import importlib
    import io

    import tinygpt
    from tinygpt.cli import main

    reply = "\x1b[2J\x1b]0;owned\x07\rok\tfine\nbye\x9b\x7f"
    tok = with_chat_template(CharTokenizer.from_text(TEXT + reply))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16))
    tinygpt.save(model, tmp_path / "run", tok)
    prompts = []

    def replies(model, idx, *args, **kwargs):  # the model "writes" `reply`, then ends its turn
        prompts.append(idx[0].tolist())
        for i in [*tok.encode(reply), tok.special_ids()["<|end|>"]]:
            yield torch.tensor([i])

    monkeypatch.setattr(importlib.import_module("tinygpt.generate"), "generate_stream", replies)
    shown = "\\x1b[2J\\x1b]0;owned\\x07\\x0dok\tfine\nbye\\x9b\\x7f\n"
    assert main(["chat", str(tmp_path / "run"), "--prompt", "hi"]) == 0
    assert capsys.readouterr().out == shown
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nagain\n"))
    assert main(["chat", str(tmp_path / "run"), "--max-new-tokens", "8"]) == 0  # room for both turns
    assert capsys.readouterr().out == f"you> bot> {shown}you> bot> {shown}you> "
    # the conversation keeps what the model wrote: the next prompt holds the reply's own tokens
    assert tok.encode(reply) == prompts[-1][5 : 5 + len(reply)]  # after <|user|>hi<|end|><|assistant|>


def test_cli_chat_sends_a_message_that_starts_with_a_slash_typed_with_two(tmp_path, capsys, monkeypatch):
    # once every line starting with "/" was a command: "/etc/hosts?" could not be asked
    import io

    from server_util import tiny_model, tiny_tokenizer

    import tinygpt
    from tinygpt.cli import main

    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(tiny_model(block_size=48, vocab_size=tok.vocab_size), tmp_path / "run", tok)
    run = ["chat", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "8"]
    assert main([*run, "--prompt", "/etc/hosts?"]) == 0
    expected = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("//etc/hosts?\n/help\n"))
    assert main(run) == 0
    captured = capsys.readouterr()
    assert captured.out == f"you> bot> {expected}you> you> " and "unknown command" not in captured.err
    assert "//TEXT sends /TEXT as a message" in captured.err


def test_fact_task_and_exact_match():
    from server_util import stopping_model, tiny_tokenizer

    from tinygpt.lab.chat_task import exact_match, fact_conversations, fact_text

    convs = fact_conversations(5, seed=3)
    for c in convs:
        system, user, assistant = c["messages"]
        table = dict(pair.split("=") for pair in system["content"].split())
        assert len(table) == 3 and table[user["content"].rstrip("?")] == assistant["content"]
    assert fact_text(convs).splitlines()[0] == " ".join(m["content"] for m in convs[0]["messages"])
    assert fact_conversations(5, seed=3) == convs
    others = fact_conversations(200, seed=4, exclude=convs)
    assert not {c["messages"][0]["content"] for c in convs} & {c["messages"][0]["content"] for c in others}
    tok = with_chat_template(tiny_tokenizer())
    model, reply = stopping_model(tok, render_chat_prompt(tok, convs[0]["messages"][:2]))
    right = {"messages": convs[0]["messages"][:2] + [{"role": "assistant", "content": reply}]}
    result = exact_match(model, tok, [right, convs[0]])
    assert (result.correct, result.total) == (1, 2) and result.examples[0] == (convs[0]["messages"][1]["content"],
                                                                            reply, reply)
