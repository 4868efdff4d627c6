"""Preference data in TRL's formats (`prepare --format preference`): the prompt and completions split at
their common token prefix, each completion closed, the implicit prompt extracted as TRL does, the pairs
fitted to a window and batched as TRL's collator lays them out, and bad lines refused in one line with
nothing written. (The split's equality with TRL's own tokenization is in test_align_trl.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tinygpt.data.batches import Pairs
from tinygpt.data.folder import load_data
from tinygpt.data.preference import prepare_preference
from tinygpt.errors import DataError
from tinygpt.tokenizer.bpe import BPETokenizer
from tinygpt.tokenizer.char import CharTokenizer
from tinygpt.tokenizer.chat import render_chat, render_chat_prompt, with_chat_template

TEXT = "the sky is blue and the grass is green, a cat sat on the mat, what colour is the sea? " * 40
STANDARD = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green and red."},
    {"prompt": "A cat sat", "chosen": " on the mat", "rejected": " on"},
    {"prompt": "grass", "chosen": " is green", "rejected": " is blue", "margin": 1.5},
    {"prompt": "the sea is", "chosen": " blue", "rejected": " a cat"},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "what colour is the sky?"}],
     "chosen": [{"role": "assistant", "content": "blue"}], "rejected": [{"role": "assistant", "content": "green"}]},
    {"prompt": [{"role": "system", "content": "be short"}, {"role": "user", "content": "the grass?"}],
     "chosen": [{"role": "assistant", "content": "green"}], "rejected": [{"role": "assistant", "content": "a cat"}]},
]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train([TEXT], 300)


@pytest.fixture(scope="module")
def files(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    tok.save(root / "bpe.json")
    with_chat_template(tok).save(root / "chat.json")
    return root


def test_standard_pairs_split_at_the_prompt_each_completion_closed_by_the_end_of_text(tok, files):
    meta = prepare_preference(write(files / "std.jsonl", STANDARD), files / "std", tokenizer_file=files / "bpe.json",
                              val_fraction=0.25)
    assert (meta["pairs"], meta["train_pairs"], meta["val_pairs"]) == (4, 3, 1)
    assert (meta["pair_format"], meta["closing"], meta["implicit_prompt"], meta["margins"]) == \
        ("standard", "eos", False, True)
    data = load_data(files / "std")
    assert data.is_preference and not data.is_chat
    pairs = Pairs.of(data, "train", 64)
    for i, row in enumerate(STANDARD[:3]):
        prompt, chosen, rejected = (a.tolist() for a in pairs.sides(i))
        assert prompt + chosen == tok.encode(row["prompt"] + row["chosen"]) + [tok.eot_id]
        assert prompt + rejected == tok.encode(row["prompt"] + row["rejected"]) + [tok.eot_id]
        assert prompt == tok.encode(row["prompt"])[: len(prompt)]
    assert Pairs.of(data, "val", 64).sides(0)[0].tolist() == tok.encode("the sea is")
    assert data.margins["train"].tolist() == [0.0, 0.0, 1.5]


def test_a_batch_is_laid_out_as_trl_collates_it_and_a_scored_text_leaves_the_end_of_text_out(files):
    data = load_data(files / "std")
    pairs = Pairs.of(data, "train", 64)
    ids, mask = pairs.get(torch.tensor([0, 2]))
    sides = [pairs.sides(0), pairs.sides(2)]
    rows = [np.concatenate((p, c)) for p, c, _ in sides] + [np.concatenate((p, r)) for p, _, r in sides]
    assert ids.shape == (4, max(map(len, rows)))
    for row, (prompt, *_), ids_row, mask_row in zip(rows, sides * 2, ids, mask):
        assert ids_row[: len(row)].tolist() == row.tolist() and not ids_row[len(row):].any()
        assert mask_row.tolist() == [0] * len(prompt) + [1] * (len(row) - len(prompt)) + [0] * (len(ids_row) - len(row))
    scored, last, margins = pairs.scored(torch.tensor([0, 2]))
    assert last.tolist() == [len(r) - 2 for r in rows]  # the end of text is not scored
    assert all(scored[i, last[i]].item() != data.tokenizer.eot_id for i in range(4))
    assert margins.tolist() == [0.0, 1.5]


def test_conversational_pairs_render_the_prompt_with_the_template_and_end_the_turn(files):
    chat = load_data_tokenizer(files / "chat.json")
    meta = prepare_preference(write(files / "conv.jsonl", CONVERSATIONAL), files / "conv",
                              tokenizer_file=files / "chat.json", val_fraction=0)
    assert (meta["pair_format"], meta["closing"]) == ("conversational", "turn")
    pairs = Pairs.of(load_data(files / "conv"), "train", 64)
    for i, row in enumerate(CONVERSATIONAL):
        prompt, chosen, rejected = (a.tolist() for a in pairs.sides(i))
        assert prompt == render_chat_prompt(chat, row["prompt"])  # with the assistant's start
        assert prompt + chosen == render_chat(chat, row["prompt"] + row["chosen"]).ids
        end = chat.special_ids()[chat.chat_template.end]
        assert chosen[-1] == rejected[-1] == end


def load_data_tokenizer(path):
    from tinygpt.tokenizer.base import load_tokenizer

    return load_tokenizer(path)


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_an_implicit_prompt_is_the_start_both_sides_share(files, kind):
    if kind == "standard":  # TRL's extract_prompt: the shared characters, a space before the split left to them
        implicit = [{"chosen": "The sky is blue.", "rejected": "The sky is green and red."},
                    {"chosen": "grass is green", "rejected": "grass is blue"}]
        rows = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green and red."},
                {"prompt": "grass is", "chosen": " green", "rejected": " blue"}]
    else:  # the shared messages
        rows = CONVERSATIONAL
        implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    tokenizer = files / ("bpe.json" if kind == "standard" else "chat.json")
    explicit = prepare_preference(write(files / "e.jsonl", rows), files / "e", tokenizer_file=tokenizer,
                                  val_fraction=0)
    meta = prepare_preference(write(files / "i.jsonl", implicit), files / "i", tokenizer_file=tokenizer,
                              val_fraction=0)
    assert meta["implicit_prompt"] and not explicit["implicit_prompt"]
    a, b = Pairs.of(load_data(files / "e"), "train", 64), Pairs.of(load_data(files / "i"), "train", 64)
    for i in range(len(rows)):
        assert [x.tolist() for x in b.sides(i)] == [x.tolist() for x in a.sides(i)]


def test_a_long_pair_loses_its_prompt_from_the_start_and_one_that_cannot_fit_is_dropped(files):
    rows = [{"prompt": "the sky is blue and the grass is green, what colour is the sea?", "chosen": " blue",
             "rejected": " a cat sat on the mat"},
            {"prompt": "the sea", "chosen": " is" + " blue and green" * 8, "rejected": " is red"}]
    prepare_preference(write(files / "long.jsonl", rows), files / "long", tokenizer_file=files / "bpe.json",
                       val_fraction=0)
    data = load_data(files / "long")
    whole = Pairs.of(data, "train", 256)
    full_prompt, chosen, rejected = whole.sides(0)
    limit = len(rejected) + 3
    pairs = Pairs.of(data, "train", limit)
    assert len(pairs) == 1 and pairs.dropped == 1
    prompt, _, rejected_cut = pairs.sides(0)
    assert prompt.tolist() == full_prompt[-3:].tolist() and rejected_cut.tolist() == rejected.tolist()
    ids, _ = pairs.get(torch.tensor([0]))
    assert ids.shape[1] == limit


def test_bad_lines_are_listed_first_five_with_numbers_and_nothing_is_written(files, cli):
    rows = [STANDARD[0], {"prompt": "a", "chosen": "x"}, "{not json", {"prompt": "a", "chosen": "x", "rejected": "x"},
            {"prompt": "a", "chosen": 3, "rejected": "b"}, CONVERSATIONAL[0], {"prompt": "", "chosen": "x",
                                                                                "rejected": "y"},
            {"chosen": "same", "rejected": "other"}, STANDARD[1]]
    source = write(files / "bad.jsonl", rows)
    out = files / "bad"
    r = cli("prepare", source, "--format", "preference", "--tokenizer-file", files / "bpe.json", "--out", out)
    assert r.returncode != 0 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    err = r.stderr
    for why in ('line 2: no "rejected" field', "line 3: not JSON", "line 4: chosen and rejected are the same",
                'line 5: "chosen" must be a text', "line 6: a conversational pair, where the file's first (line 1)"):
        assert why in err, why
    assert "and 2 more (lines 7, 8)" in err and "--errors skip" in err
    assert not out.exists()
    r = cli("prepare", source, "--format", "preference", "--tokenizer-file", files / "bpe.json", "--out", out,
            "--errors", "skip", "--val-fraction", "0")
    assert r.returncode == 0 and "skipped 7 lines" in r.stdout
    assert load_data(out).meta["train_pairs"] == 2


def test_a_tokenizer_that_cannot_close_or_render_the_pairs_is_refused_before_anything_is_written(files, cli):
    CharTokenizer(sorted(set(TEXT + "TA.?"))).save(files / "char.json")
    std, conv = write(files / "s.jsonl", STANDARD), write(files / "c.jsonl", CONVERSATIONAL)
    for source, tokenizer, why in ((std, "char.json", "has none"), (conv, "bpe.json", "no chat template")):
        r = cli("prepare", source, "--format", "preference", "--tokenizer-file", files / tokenizer,
                "--out", files / "refused")
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and (why in r.stderr or "none" in r.stderr)
        assert not (files / "refused").exists()
    with pytest.raises(DataError, match="--tokenizer-file FROM"):
        prepare_preference(std, files / "refused", tokenizer="char")


def test_inspect_data_shows_the_pairs_and_the_first_one_decoded(files, cli):
    if not (files / "std").exists():
        prepare_preference(write(files / "std.jsonl", STANDARD), files / "std", tokenizer_file=files / "bpe.json",
                           val_fraction=0.25)
    r = cli("inspect", "data", files / "std")
    assert r.returncode == 0, r.stderr
    assert ": preference, bpe tokenizer" in r.stdout and "pair lengths in tokens: 4 pairs" in r.stdout
    assert 'first pair\'s prompt: "The sky is"' in r.stdout and 'chosen: " blue.<|endoftext|>"' in r.stdout
