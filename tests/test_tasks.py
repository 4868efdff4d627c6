"""The built-in checkable task: its splits never meet, its checker reads only the answer, its reward is TRL's shape."""

import pytest

from tinygpt.align.tasks import Addition, task
from tinygpt.errors import ConfigError


def test_held_out_prompts_are_never_training_prompts_whatever_the_seed():
    add = Addition(digits=2)
    train = {p for seed in range(5) for p in add.pairs("train", 400, seed)}
    held = {p for seed in range(5) for p in add.pairs("held-out", 100, seed)}
    assert not train & held
    assert 0.07 < len(held) / (len(held) + len(train)) < 0.2  # about a tenth of the pairs seen
    assert add.rows("held-out", 8, seed=3) == add.rows("held-out", 8, seed=3)  # the same set every time
    assert add.rows("held-out", 8, seed=3) != add.rows("held-out", 8, seed=4)
    # spread over the answers: every last digit of a sum is held out and trained on
    for split in (held, train):
        assert {(a + b) % 10 for a, b in split} == set(range(10))


def test_the_checker_reads_the_answer_up_to_the_line_end():
    add = Addition()
    assert add.correct("95\n12+3=15", "95") and add.correct(" 95 ", "95")
    for wrong in ("96", "095", "95a", "", "9 5", "\n95"):
        assert not add.correct(wrong, "95"), wrong
    assert add.reward(["37+58="] * 3, ["95\n", "94", [{"role": "assistant", "content": "95"}]],
                      answer=["95"] * 3, other_column=1) == [1.0, 0.0, 1.0]


def test_the_text_is_worked_training_examples():
    add = Addition(digits=1)
    lines = add.text(50).splitlines()
    assert len(lines) == 50
    for line in lines:
        left, answer = line.split("=")
        a, b = map(int, left.split("+"))
        assert int(answer) == a + b and add.split_of(a, b) == "train"


def test_bad_settings_are_one_line():
    for kwargs, why in (({"digits": 0}, "digits must be 1-4"), ({"held_out_share": 0.7}, "held_out_share")):
        with pytest.raises(ConfigError, match=why):
            Addition(**kwargs)
    with pytest.raises(ConfigError, match="no task 'sorting': the built-in tasks are addition"):
        task("sorting")
    with pytest.raises(ConfigError, match="task addition:"):
        task("addition", base=3)
    with pytest.raises(ConfigError, match="no split"):
        Addition().rows("test", 1)
