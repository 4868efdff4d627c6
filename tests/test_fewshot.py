"""Few-shot prompts and accuracy: task files, prompt building, scoring with scripted fake models."""

import json
import re

import pytest
import torch

from tinygpt import GPT, GPTConfig
from tinygpt.lab import fewshot
from tinygpt.errors import ConfigError
from tinygpt.lab.fewshot import Example
from tinygpt.tokenizer import CharTokenizer


TASK_LINES = [
    {"template": "Q: {input}\nA: {output}", "separator": "\n\n", "prefix": "Answer.\n\n", "name": "capitals"},
    {"input": "France", "output": "Paris"},
    {"input": "Italy", "output": "Rome"},
    {"input": "Spain", "output": "Madrid"},
    {"input": "Japan", "output": "Tokyo"},
]
ANSWERS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo"}


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def task_file(tmp_path):
    return write_lines(tmp_path / "capitals.jsonl", TASK_LINES)


def shots_in(prompt: str) -> int:
    return prompt.count("\nA: ")  # worked examples' answers; the query's "A:" is at the very end


class ScriptedModel:
    """Answers by the book for the inputs it `knows`, once the prompt holds at least `needs` worked
    examples; otherwise says "dunno". Records every prompt it is given."""

    context_length = None

    def __init__(self, knows, needs=1):
        self.knows, self.needs, self.prompts = set(knows), needs, []

    def token_count(self, text):
        return len(text)

    def _answer(self, prompt):
        self.prompts.append(prompt)
        query = re.findall(r"Q: (\w+)\nA:$", prompt)[0]
        if query in self.knows and shots_in(prompt) >= self.needs:
            return ANSWERS[query]
        return "dunno"

    def generate_until(self, prompt, stops, max_new_tokens, lead=""):
        return " " + self._answer(prompt)  # a leading space, as a model continuing "A:" would write

    def loglikelihood(self, context, continuations):
        answer = self._answer(context)
        right = " " + ANSWERS[re.findall(r"Q: (\w+)\nA:$", context)[0]] + "\n\n"
        if answer == "dunno":  # then it likes every wrong candidate better than the right one
            return [-9.0 if c == right else -1.0 for c in continuations]
        return [0.0 if c == right else -5.0 for c in continuations]


def test_read_task_and_prompt(task_file):
    task = fewshot.read_task(task_file)
    assert task.name == "capitals" and task.template == "Q: {input}\nA: {output}" and task.separator == "\n\n"
    assert len(task.examples) == 4 and task.examples[1] == Example("Italy", "Rome")
    prompt = fewshot.build_prompt(task, task.examples[0], task.examples[2:4])
    assert prompt == "Answer.\n\nQ: Spain\nA: Madrid\n\nQ: Japan\nA: Tokyo\n\nQ: France\nA: "
    assert fewshot.build_prompt(task, task.examples[0], []) == "Answer.\n\nQ: France\nA: "
    assert task.answer_end == "\n\n"


@pytest.mark.parametrize("scoring", ["generate", "likelihood"])
def test_known_accuracies_for_a_scripted_model(task_file, scoring):
    task = fewshot.read_task(task_file)
    # knows three of the four, but only with a worked example in front of it
    model = ScriptedModel({"France", "Italy", "Spain"}, needs=1)
    report = fewshot.evaluate(model, task, [0, 1, 2, 3], scoring=scoring)
    assert [r.accuracy for r in report.results] == [0.0, 0.75, 0.75, 0.75]
    assert [(r.correct, r.total) for r in report.results] == [(0, 4), (3, 4), (3, 4), (3, 4)]
    # needs two worked examples: nothing until k = 2
    report = fewshot.evaluate(ScriptedModel(ANSWERS, needs=2), task, [0, 1, 2, 3], scoring=scoring)
    assert [r.accuracy for r in report.results] == [0.0, 0.0, 1.0, 1.0]
    report = fewshot.evaluate(ScriptedModel(ANSWERS, needs=2), task, [3], scoring=scoring, queries=2)
    assert [(r.correct, r.total) for r in report.results] == [(2, 2)]
    assert report.to_dict()["results"][0] == {"shots": 3, "accuracy": 1.0, "correct": 2, "total": 2, "truncated": 0}


def test_prompts_the_evaluator_builds(task_file):
    task = fewshot.read_task(task_file)
    model = ScriptedModel(ANSWERS)
    fewshot.evaluate(model, task, [0, 1, 2, 3], seed=7)
    assert len(model.prompts) == 16
    by_query = {}
    for prompt in model.prompts:
        assert prompt.startswith("Answer.\n\n") and prompt.endswith("A:")  # the trailing space moved to the answer
        query = re.findall(r"Q: (\w+)\nA:$", prompt)[0]
        shown = re.findall(r"Q: (\w+)\nA: (\w+)", prompt)
        assert query not in [q for q, _ in shown]  # never its own worked example
        assert all(ANSWERS[q] == a for q, a in shown)
        by_query.setdefault(query, []).append([q for q, _ in shown])
    for lists in by_query.values():
        assert [len(x) for x in lists] == [0, 1, 2, 3]
        for shorter, longer in zip(lists, lists[1:]):
            assert longer[: len(shorter)] == shorter  # k-shot = (k-1)-shot plus one more
    again = ScriptedModel(ANSWERS)
    fewshot.evaluate(again, task, [0, 1, 2, 3], seed=7)
    assert again.prompts == model.prompts  # seeded


def test_groups_keep_worked_examples_in_their_episode(tmp_path):
    lines = [{"input": f"{g}{i}", "output": f"v{g}", "group": g} for g in "xyz" for i in range(4)]
    task = fewshot.read_task(write_lines(tmp_path / "g.jsonl", lines))
    for i, ex in enumerate(task.examples):
        pool = task.pools()[i]
        assert len(pool) == 3 and all(task.examples[j].group == ex.group for j in pool) and i not in pool
    with pytest.raises(ConfigError, match="4-shot prompts need 4 other examples"):
        fewshot.evaluate(ScriptedModel({}), task, [4])


def test_likelihood_uses_choices_and_the_answer_end(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [{"template": "{input}={output}", "separator": ";"},
                                              {"input": "a", "output": "1", "choices": ["1", "2"]},
                                              {"input": "b", "output": "2", "choices": ["1", "2", "3"]}])
    task = fewshot.read_task(path)
    seen = []

    class Recorder:
        context_length = None

        def token_count(self, text):
            return len(text)

        def loglikelihood(self, context, continuations):
            seen.append((context, list(continuations)))
            return [-float(i) for i in range(len(continuations))]  # always the first candidate

    report = fewshot.evaluate(Recorder(), task, [0, 1], scoring="likelihood")
    assert [r.correct for r in report.results] == [1, 1]  # "1" is right for a, wrong for b
    assert seen[0] == ("a=", ["1;", "2;"])
    assert seen[1] == ("b=2;a=", ["1;", "2;"])
    assert seen[2] == ("b=", ["1;", "2;", "3;"])


def test_truncated_prompts_are_counted(task_file):
    model = ScriptedModel(ANSWERS)
    model.context_length = 40  # characters, for this fake
    report = fewshot.evaluate(model, fewshot.read_task(task_file), [0, 3])
    assert report.results[0].truncated == 0 and report.results[1].truncated == 4


@pytest.mark.parametrize(
    "lines, message",
    [
        (["not json"], "line 1: not valid JSON"),
        ([{"input": "a"}], "'output' must be a string"),
        ([{"input": "a", "output": "b", "label": 1}], "unknown key(s) label"),
        ([{"input": "a", "output": "b"}, {"template": "{input}{output}"}], "settings line must come first"),
        ([{"template": "{output} {input}"}, {"input": "a", "output": "b"}], "template must hold"),
        ([{"colour": "red"}], "unknown setting(s) colour"),
        ([{"template": "{input}: {output}"}], "no examples"),
        ([{"input": "a", "output": "b", "choices": ["c"]}], "not among its choices"),
        ([{"chance": 2}, {"input": "a", "output": "b"}], "'chance' must be a number"),
    ],
)
def test_bad_task_files(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(ConfigError) as e:
        fewshot.read_task(path)
    assert message in str(e.value)


def test_missing_task_file_and_bad_settings(tmp_path, task_file):
    with pytest.raises(ConfigError, match="no such task file"):
        fewshot.load_task(str(tmp_path / "nope.jsonl"))
    task = fewshot.read_task(task_file)
    with pytest.raises(ConfigError, match="scoring"):
        fewshot.evaluate(ScriptedModel({}), task, [0], scoring="vibes")
    with pytest.raises(ConfigError, match="queries"):
        fewshot.evaluate(ScriptedModel({}), task, [0], queries=9)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"input": "caf\xe9", "output": "x"}\n')  # a UnicodeDecodeError before
    with pytest.raises(ConfigError, match="latin1.jsonl: not UTF-8 text"):
        fewshot.read_task(tmp_path / "latin1.jsonl")


def test_parse_shots():
    assert fewshot.parse_shots("0,1,2,3") == [0, 1, 2, 3]
    assert fewshot.parse_shots("3, 0-2") == [0, 1, 2, 3]
    for bad in ("", "a", "-1", "1,,2", "0-99999999999999", "99999999999999999999", "nan"):
        with pytest.raises(ConfigError, match="--shots"):
            fewshot.parse_shots(bad)
    with pytest.raises(ConfigError, match="at most 10,000"):  # was swallowed into "expected numbers like"
        fewshot.parse_shots("0-99999999999999")
    # a range that goes down was "expected numbers >= 0" (and "3-1,4" measured k=4 alone)
    for bad in ("3-1", "3-1,4"):
        with pytest.raises(ConfigError, match="^--shots: the range 3-1 goes down; write it low to high: 1-3$"):
            fewshot.parse_shots(bad)


def test_write_task_round_trips(tmp_path, task_file):
    task = fewshot.synthetic_task(groups=3, seed=1)
    fewshot.write_task(task, tmp_path / "t.jsonl")
    back = fewshot.read_task(tmp_path / "t.jsonl")
    assert back.examples == task.examples and back.template == task.template and back.chance == task.chance


def test_synthetic_task_has_a_fresh_mapping_per_episode():
    task = fewshot.synthetic_task(groups=40, lines=6, keys=2, seed=3)
    assert len(task.examples) == 240 and task.chance == 1 / len(fewshot.SYNTHETIC_VALUES)
    episodes = {}
    for ex in task.examples:
        episodes.setdefault(ex.group, {}).setdefault(ex.input, set()).add(ex.output)
    mappings = []
    for mapping in episodes.values():
        assert all(len(v) == 1 for v in mapping.values())  # a mapping holds within its episode
        values = [next(iter(v)) for v in mapping.values()]
        assert len(values) == len(set(values))  # one-to-one
        mappings.append(tuple(sorted((k, next(iter(v))) for k, v in mapping.items())))
    assert len(set(mappings)) > 30  # and differs between episodes
    assert fewshot.synthetic_task(groups=40, seed=3).examples == task.examples
    assert fewshot.synthetic_task(groups=40, seed=4).examples != task.examples
    assert fewshot.load_task("synthetic", seed=3).name == "synthetic"


def test_synthetic_corpus_is_episodes_of_the_task_format():
    text = fewshot.synthetic_corpus(50, seed=0)
    assert text.endswith(fewshot.SYNTHETIC_EPISODE_END)
    episodes = text.split(fewshot.SYNTHETIC_EPISODE_END)[:-1]
    assert len(episodes) == 50
    pattern = re.escape(fewshot.SYNTHETIC_TEMPLATE)
    line = re.compile(pattern.replace(r"\{input\}", "([a-z])").replace(r"\{output\}", r"(\w+)") + "$")
    lengths = set()
    for episode in episodes:
        mapping = {}
        examples = episode.split(fewshot.SYNTHETIC_SEPARATOR)
        lengths.add(len(examples))
        for example in examples:
            m = line.match(example)
            assert m, example
            assert mapping.setdefault(m.group(1), m.group(2)) == m.group(2)  # the mapping holds
            assert m.group(2) in fewshot.SYNTHETIC_VALUES
        assert len(set(mapping.values())) == len(mapping)
    assert len(lengths) > 3 and max(lengths) <= 16


def tiny_model(tokenizer, block_size=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16)).eval()


def test_gpt_loglikelihood_is_the_sum_of_token_log_probs():
    tok = CharTokenizer.from_text("abc =;")
    model = tiny_model(tok)
    lm = fewshot.GPTLanguageModel(model, tok)
    scores = lm.loglikelihood("ab=", ["c;", "a;", "bb;"])
    for cont, score in zip(["c;", "a;", "bb;"], scores):
        ids = torch.tensor([tok.encode("ab=" + cont)])
        logp = torch.log_softmax(model(ids[:, :-1]), -1)[0]
        n = len(cont)
        expected = sum(logp[i, ids[0, i + 1]].item() for i in range(ids.shape[1] - 1 - n, ids.shape[1] - 1))
        assert score == pytest.approx(expected, abs=1e-4)
    # a context longer than the model's window is cut from the left
    long = "ab=c;" * 6
    [score] = lm.loglikelihood(long, ["a;"])
    ids = torch.tensor([tok.encode(long + "a;")[-17:]])
    logp = torch.log_softmax(model(ids[:, :-1]), -1)[0]
    assert score == pytest.approx(logp[-2, ids[0, -2]].item() + logp[-1, ids[0, -1]].item(), abs=1e-4)


def test_gpt_generate_until_cuts_at_the_stop_text():
    tok = CharTokenizer.from_text("abc =;")
    lm = fewshot.GPTLanguageModel(tiny_model(tok), tok)
    free = lm.generate_until("ab=", [], 12)
    assert len(free) == 12
    cut = lm.generate_until("ab=", [free[3]], 12)
    assert cut == free[: free.index(free[3])]
    # the whitespace taken off a prompt's end comes back as the answer's lead: a stop string inside
    # it does not cut the answer to nothing (template "{input}\n{output}" scored 0% before)
    lead = free[0]
    assert lm.generate_until("ab=", [lead], 12) == ""
    assert lm.generate_until("ab=", [lead], 12, lead=lead) == lead + free[1:].split(lead)[0]
    assert lm.generate_until("ab=", [], 12, lead=lead + "zz") == free  # no lead: as without one


def test_gpt_generate_until_never_generates_ids_past_the_tokenizer():
    from test_generate import PaddingLover

    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .")  # 28 characters; the model has 64 ids
    torch.manual_seed(0)
    model = PaddingLover(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    text = fewshot.GPTLanguageModel(model, tok).generate_until("ab c", [], 12)  # padding has the top logits
    assert len(text) == 12 and set(text) <= set(tok.decode(range(tok.vocab_size)))
