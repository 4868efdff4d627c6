"""SFT is fine-tuning with a mask: `tinygpt finetune FROM` on chat data prepared with FROM's tokenizer
(plus a chat template) grows the vocabulary and gives a run that chats, from a tinygpt run, its
Hugging Face export and a GPT-2-tokenizer folder; chat data of another tokenizer, LoRA and frozen
embeddings that cannot train the new tokens are refused; `eval` on chat data scores the assistant's
tokens only; `sample` on a chat run stops at its end of turn."""

import json

import numpy as np
import pytest
import torch
from conftest import make_text

import tinygpt
from tinygpt import ConfigError, DataError, FinetuneConfig, GPTConfig, TrainConfig, checkpoint
from tinygpt.cli import main
from tinygpt.data import load_data, prepare
from tinygpt.finetune import start_model
from tinygpt.interop.hf_gpt2 import export_hf
from tinygpt.tokenizer import EOT, ChatTemplate, GPT2Tokenizer, load_tokenizer

# a trivially learnable chat task in the base text's characters: a fixed answer for each word
PAIRS = {"cat": "moon", "dog": "river", "king": "stones", "bird": "song"}
SFT = ["--max-iters", "60", "--batch-size", "8", "--lr", "3e-3", "--warmup", "5", "--eval-interval", "60",
       "--eval-iters", "2", "--quiet"]


def chat_records(n: int) -> list[dict]:
    pairs = list(PAIRS.items())
    return [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
            for user, answer in (pairs[i % 4] for i in range(n))]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A char base run (its vocabulary exactly its tokenizer's, so the template's tokens need new rows),
    its Hugging Face export, and the conversations as JSONL."""
    root = tmp_path_factory.mktemp("sft")
    (root / "a.txt").write_text(make_text(1500, seed=0))
    prepare([str(root / "a.txt")], root / "data-a")
    vocab = load_data(root / "data-a").vocab_size
    tinygpt.train(root / "data-a", root / "base", GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=2,
                                                            n_embd=32),
                  TrainConfig(max_iters=100, batch_size=8, eval_interval=100, eval_iters=2, lr=3e-3, warmup=10))
    export_hf(checkpoint.load(root / "base"), checkpoint.folder_tokenizer(root / "base"), root / "hf")
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(60)))
    return root


@pytest.fixture(scope="module")
def tuned(sft):
    """`prepare --format chat --tokenizer-file FROM` and `finetune FROM` for FROM the run and its export."""
    for name in ("base", "hf"):
        assert main(["prepare", str(sft / "c.jsonl"), "--format", "chat", "--tokenizer-file", str(sft / name),
                     "--out", str(sft / f"chat-{name}")]) == 0
        assert main(["finetune", str(sft / name), "--data", str(sft / f"chat-{name}"), "--out", str(sft / f"ft-{name}"),
                     *SFT]) == 0
    return sft


@pytest.mark.parametrize("name", ["base", "hf"])
def test_finetune_on_chat_data_grows_the_vocabulary_and_the_run_chats(tuned, name, capsys):
    base_tok = checkpoint.folder_tokenizer(tuned / name)
    data = load_data(tuned / f"chat-{name}")
    added = data.vocab_size - base_tok.vocab_size
    assert added == len(ChatTemplate().special_tokens())
    # the base's ids kept, the template's tokens after them
    assert data.tokenizer.encode("the cat.") == base_tok.encode("the cat.")
    assert min(data.tokenizer.special_ids()[t] for t in ChatTemplate().special_tokens()) == base_tok.vocab_size
    run = tuned / f"ft-{name}"
    assert checkpoint.load_config(run).vocab_size == data.vocab_size
    run_tok = load_tokenizer(run)
    assert run_tok.chat_template == ChatTemplate() and run_tok.fingerprint() == data.fingerprint
    # the start: the base's rows as they were, each new row their mean
    start, _ = start_model(tuned / name, tuned / f"chat-{name}")
    old = checkpoint.load(tuned / name).wte.weight
    assert torch.equal(start.wte.weight[: old.shape[0]], old)
    assert torch.allclose(start.wte.weight[old.shape[0]:], old.mean(0).expand(added, -1))
    report = json.loads((run / "finetune_report.json").read_text())
    assert report["after"]["data"]["loss"] < report["before"]["data"]["loss"] - 1.0
    capsys.readouterr()
    for user, answer in PAIRS.items():
        assert main(["chat", str(run), "--prompt", user, "--temperature", "0"]) == 0
        assert capsys.readouterr().out == answer + "\n"


def test_finetune_from_a_gpt2_tokenizer_folder_gives_the_template_ids_after_its_vocabulary(tmp_path):
    # GPT-2's shape in small: 256 byte tokens and <|endoftext|> (id 256); the template's tokens come after it,
    # as they come after 50,256 for GPT-2's own
    tok = GPT2Tokenizer({bytes([b]): b for b in range(256)}, {EOT: 256})
    torch.manual_seed(0)
    export_hf(tinygpt.GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32)), tok,
              tmp_path / "hf")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(40)))
    assert main(["prepare", str(tmp_path / "c.jsonl"), "--format", "chat", "--tokenizer-file", str(tmp_path / "hf"),
                 "--out", str(tmp_path / "chat")]) == 0
    data = load_data(tmp_path / "chat")
    assert data.tokenizer.kind == "gpt2"
    assert sorted(data.tokenizer.special_ids().values()) == [256, 257, 258, 259, 260]
    quick = TrainConfig(max_iters=30, batch_size=8, eval_interval=30, eval_iters=2, lr=3e-3, warmup=5)
    result = tinygpt.finetune(tmp_path / "hf", tmp_path / "chat", tmp_path / "ft", FinetuneConfig(), quick)
    assert checkpoint.load_config(tmp_path / "ft").vocab_size == 261
    assert load_tokenizer(tmp_path / "ft").fingerprint() == data.fingerprint
    # the mask-weighted loss (the assistant's tokens) falls below the base's
    assert result.report["after"]["data"]["loss"] < result.report["before"]["data"]["loss"] - 1.0


def test_chat_data_of_another_tokenizer_lora_and_frozen_embeddings_are_refused(tuned, tmp_path, capsys):
    # prepared with its own char vocabulary (the conversations' characters): other ids, refused
    assert main(["prepare", str(tuned / "c.jsonl"), "--format", "chat", "--out", str(tmp_path / "own")]) == 0
    with pytest.raises(DataError, match="another tokenizer") as e:
        tinygpt.finetune(tuned / "base", tmp_path / "own", tmp_path / "ft")
    assert f"--format chat --tokenizer-file {tuned / 'base'}" in str(e.value)
    capsys.readouterr()
    assert main(["finetune", str(tuned / "base"), "--data", str(tmp_path / "own"), "--out", str(tmp_path / "ft"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinygpt: error:") and err.count("\n") == 1 and "--format chat --tokenizer-file" in err
    # the template's tokens need rows that train: LoRA's frozen base and frozen embeddings cannot
    for cfg, why in ((FinetuneConfig(method="lora"), "method lora keeps"),
                     (FinetuneConfig(freeze_embeddings=True), "freeze-embeddings would keep")):
        with pytest.raises(ConfigError, match=why):
            tinygpt.finetune(tuned / "base", tuned / "chat-base", tmp_path / "ft", cfg)
    assert not (tmp_path / "ft").exists()


def test_eval_on_chat_data_is_the_assistant_tokens_loss(tuned, capsys):
    run, data = tuned / "ft-base", tuned / "chat-base"
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(data), "--json"]) == 0
    out = capsys.readouterr().out
    assert "the assistant's tokens only" in out
    got = json.loads(out.splitlines()[-1])
    # by hand: each val conversation alone, the loss of the targets its mask marks
    ds, model = load_data(data), checkpoint.load(run)
    starts = [*ds.starts["val"].tolist(), len(ds.val)]
    losses = []
    with torch.no_grad():
        for a, b in zip(starts, starts[1:]):
            ids = torch.from_numpy(np.asarray(ds.val[a:b], dtype=np.int64))
            ce = torch.nn.functional.cross_entropy(model(ids[None, :-1])[0], ids[1:], reduction="none")
            losses += ce[torch.from_numpy(ds.masks["val"][a + 1 : b].astype(bool))].tolist()
    assert got["masked"] and got["tokens"] == len(losses) == int(ds.masks["val"].sum())
    assert got["loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)


def test_the_reference_loss_of_a_chat_base_is_scored_as_eval_scores_chat_data(tuned, tmp_path, capsys):
    # a chat run fine-tuned further: its own validation data (the reference) was scored as plain text, system,
    # user and template tokens across conversations (6.49 where eval gave 1.17)
    run, data = tuned / "ft-base", tuned / "chat-base"
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0  # its own data, as the report's reference is
    evaluated = json.loads(capsys.readouterr().out.splitlines()[-1])
    quick = TrainConfig(max_iters=1, batch_size=2, eval_interval=1, eval_iters=1)
    report = tinygpt.finetune(run, data, tmp_path / "more", FinetuneConfig(), quick).report
    reference = report["before"]["reference"]
    # the same sum in another batching: equal to float32's rounding (2.6e-6 apart on an AVX2-only Zen 3)
    assert reference["loss"] == pytest.approx(evaluated["loss"], rel=1e-5)
    assert reference["tokens"] == evaluated["tokens"] and "the assistant's tokens" in reference["text"]
    assert reference["loss"] == report["before"]["data"]["loss"]  # the same split, fine-tuned on and referred to


def test_sample_on_a_chat_run_stops_at_its_end_of_turn(tmp_path, capsys):
    from server_util import stopping_model, tiny_tokenizer

    from tinygpt.tokenizer import with_chat_template

    tok = with_chat_template(tiny_tokenizer())
    model, expected = stopping_model(tok, tok.encode("hello there"))
    tinygpt.save(model, tmp_path / "run", tok)
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "hello there", "--greedy", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == "hello there" + expected + "\n"
    assert main(["sample", str(tmp_path / "run"), "--prompt", "hello there", "--greedy", "--max-new-tokens", "20",
                 "--trace"]) == 0
    assert "stopped early: the end-of-turn token was generated" in capsys.readouterr().out


def test_a_padded_vocabulary_keeps_its_size_and_the_new_tokens_rows_start_as_the_mean(sft, tmp_path):
    tok = checkpoint.folder_tokenizer(sft / "base")
    torch.manual_seed(0)
    padded = tinygpt.GPT(GPTConfig(vocab_size=tok.vocab_size + 8, block_size=32, n_layer=1, n_head=2, n_embd=16))
    tinygpt.save(padded, tmp_path / "padded", tok)
    assert main(["prepare", str(sft / "c.jsonl"), "--format", "chat", "--tokenizer-file", str(tmp_path / "padded"),
                 "--out", str(tmp_path / "chat")]) == 0
    start, data_tok = start_model(tmp_path / "padded", tmp_path / "chat")
    new = slice(tok.vocab_size, data_tok.vocab_size)
    assert start.config.vocab_size == tok.vocab_size + 8  # the padding rows hold the new tokens
    old = padded.wte.weight.detach()
    assert torch.equal(start.wte.weight[: tok.vocab_size], old[: tok.vocab_size])
    assert torch.allclose(start.wte.weight[new], old.mean(0).expand(new.stop - new.start, -1))
