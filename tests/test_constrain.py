"""Constrained decoding in the library (tinygpt.constrain through generate): JSON Schema, regex and choices
honoured by every sampler on random weights, for char, BPE and Hugging Face tokenizers (a padded head too);
what cannot be compiled or written refused in one line; and the prompt cache (tinygpt.prompt_cache)."""

import json
import re

import jsonschema
import pytest
import torch
from server_util import tiny_model, tiny_tokenizer

import tinygpt
from tinygpt.constrain import Constraint, compile_grammar
from tinygpt.errors import ConfigError, GrammarError
from tinygpt.generate import prefill
from tinygpt.kv_cache import KVCache
from tinygpt.prompt_cache import PromptCache
from tinygpt.tokenizer import BPETokenizer, CharTokenizer

# nested objects, arrays, enums, required and optional fields; every string and array bounded
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
# the most tokens a reply to SCHEMA takes, a character a token: what a bounded schema needs at most
# ("score" is the one unbounded value: its digits are not, but this leaves it 80 of them)
MAX_TOKENS = 400


def skeleton(text: str) -> str:
    """JSON text with every string emptied and every number 0: what lies between the values."""
    return re.sub(r"-?[0-9][0-9.eE+-]*", "0", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def bpe_tokenizer():
    texts = [json.dumps({"name": "Ann", "age": 30, "tags": ["x", "yy"]}), "hello world, a small corpus"] * 30
    return BPETokenizer.train(texts, vocab_size=300)


def samplers():
    return [dict(greedy=True), dict(temperature=1.0), dict(temperature=1.5, top_k=20), dict(temperature=0.8, top_p=0.9),
            dict(temperature=1.0, repetition_penalty=1.3)]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_json_schema_50_of_50_on_random_weights_with_every_sampler(kind):
    tok = tiny_tokenizer() if kind == "char" else bpe_tokenizer()
    model = tiny_model(block_size=512, vocab_size=tok.vocab_size)
    valid = 0
    for i in range(5):  # 5 calls of 10 rows: 50 replies, each sampler twice
        generator = torch.Generator().manual_seed(i)
        prompt = torch.tensor([tok.encode("person:")] * 10)
        out = tinygpt.generate(model, prompt, MAX_TOKENS, tokenizer=tok, json_schema=SCHEMA, generator=generator,
                               **samplers()[i % 5])
        for row in out[:, prompt.shape[1]:].tolist():
            text = tok.decode(row)
            # a row that ended before the others repeats its last token: the reply is its first complete value
            value, end = json.JSONDecoder().raw_decode(text)
            jsonschema.validate(value, SCHEMA)
            # json.dumps' spacing between the values (inside strings, escapes may be written another way): no
            # blanks for a small model to run to the limit on
            assert skeleton(text[:end]) == skeleton(json.dumps(value))
            valid += 1
    assert valid == 50


def test_a_padded_head_never_writes_its_extra_rows_under_a_constraint():
    tok = tiny_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size + 29)  # rows past the tokenizer, as Qwen's 151,936 for 151,669
    with torch.no_grad():  # the extra rows the likeliest by far
        model.lm_head.weight[tok.vocab_size:] = 50 * model.lm_head.weight[:1]
    assert int(tinygpt.generate(model, torch.tensor([[1]]), 1, greedy=True)[0, 1]) >= tok.vocab_size
    out = tinygpt.generate(model, torch.tensor([[1]]), 20, greedy=True, tokenizer=tok, regex="[a-z]{3,5}!")
    assert re.fullmatch("[a-z]{3,5}!", tok.decode(out[0, 1:].tolist()))


def test_hugging_face_tokenizer_with_a_padded_head(tmp_path):
    from hf_family import make_folder

    folder = make_folder(tmp_path / "qwen", "qwen2", "qwen")
    model, tok = tinygpt.load(folder), tinygpt.load_tokenizer(folder)
    assert model.config.vocab_size > tok.vocab_size
    from tinygpt.tokenizer.chat import stop_ids

    stops = sorted(stop_ids(tok))
    for seed in range(5):
        out = tinygpt.generate(model, torch.tensor([tok.encode("Hello")]), 300, tokenizer=tok, json_schema=SCHEMA,
                               stop_tokens=stops, generator=torch.Generator().manual_seed(seed), temperature=1.0)
        ids = out[0, 1:].tolist()
        ids = ids[: ids.index(stops[0])] if stops[0] in ids else ids
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


@pytest.mark.parametrize("sampling", samplers())
def test_regex_and_choices_are_honoured(sampling):
    tok = tiny_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size)
    pattern = r"[A-Z][a-z]{2,6} [0-9]{2}-[0-9]{2}(!|\?)"
    prompt = torch.tensor([tok.encode("date: ")] * 4)
    out = tinygpt.generate(model, prompt, 40, tokenizer=tok, regex=pattern, generator=torch.Generator().manual_seed(0),
                           **sampling)
    for row in out[:, prompt.shape[1]:].tolist():
        text = tok.decode(row)  # a row that ended before the others repeats its last token
        end = re.match(pattern, text).end()
        assert set(text[end:]) <= {text[end - 1]}
    choices = ["red", "green", "blue sky"]
    generator = torch.Generator().manual_seed(1)
    out = tinygpt.generate(model, prompt, 40, tokenizer=tok, choices=choices, generator=generator, **sampling)
    for row in out[:, prompt.shape[1]:].tolist():
        text = tok.decode(row)
        assert any(text == c or (text.startswith(c) and set(text[len(c):]) <= {c[-1]}) for c in choices), text


def test_one_row_ends_where_its_grammar_does():
    tok = tiny_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size)
    out = tinygpt.generate(model, torch.tensor([tok.encode("x")]), 50, tokenizer=tok, choices=["yes", "no"])
    assert tok.decode(out[0, 1:].tolist()) in ("yes", "no")  # the generation stopped at the grammar's end


def test_a_grammar_the_vocabulary_cannot_write_is_refused_naming_the_characters():
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.:\n")  # a corpus without braces or quotes
    model = tiny_model(vocab_size=tok.vocab_size)
    with pytest.raises(GrammarError, match=r"json_schema: this model's vocabulary cannot write it: it needs '\{' at "
                                           "the start"):
        tinygpt.generate(model, torch.tensor([[0]]), 10, tokenizer=tok, json_schema={"type": "object"})
    with pytest.raises(GrammarError, match=r"it needs one of '!', '\?' after 'ok'"):
        compile_grammar(tok, Constraint.regex("ok(!|\\?)"), tok.vocab_size)
    with pytest.raises(GrammarError, match=r"it needs 'é' after 'caf'"):
        compile_grammar(tok, Constraint.choices(["café"]), tok.vocab_size)
    compile_grammar(tok, Constraint.regex("[a-z]+( [a-z]+)*[.]"), tok.vocab_size)  # what it can write is taken


@pytest.mark.parametrize("given, message", [
    (dict(json_schema={"type": "strin"}), "json_schema: Invalid type: strin"),
    (dict(json_schema={"type": "array", "uniqueItems": True}), 'Unimplemented keys: \\["uniqueItems"\\]'),
    (dict(json_schema={"$ref": "#/$defs/none"}), "does not exist"),
    (dict(json_schema=[1, 2]), "a schema is a JSON object"),
    (dict(json_schema="{not json"), "json_schema: not JSON"),
    (dict(regex="a(b"), "regex: .*unclosed group"),
    (dict(choices=[]), "choices: must be a non-empty list"),
    (dict(regex="a", choices=["a"]), "give one constraint, got regex and choices"),
    (dict(regex="x" * 300_000), "more than the 262,144 a grammar may have"),
])
def test_what_does_not_compile_is_refused_naming_the_problem(given, message):
    tok = tiny_tokenizer()
    with pytest.raises(GrammarError, match=message):
        tinygpt.generate(tiny_model(), torch.tensor([[1]]), 5, tokenizer=tok, **given)


def test_a_deeply_nested_schema_is_refused_quickly():
    deep = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(GrammarError, match="recursion limit"):
        compile_grammar(tiny_tokenizer(), Constraint.json_schema(deep), 96)


def test_a_constraint_needs_the_tokenizer():
    with pytest.raises(ConfigError, match="pass tokenizer="):
        tinygpt.generate(tiny_model(), torch.tensor([[1]]), 5, regex="a+")


# -- the prompt cache --------------------------------------------------------------------------


def test_prefill_from_a_position_continues_the_cache_as_one_prefill_would():
    model = tiny_model(block_size=64)
    ids = torch.randint(0, 96, (1, 40))
    whole, parts = KVCache.for_model(model, 1), KVCache.for_model(model, 1)
    with torch.inference_mode():
        expected = prefill(model, ids, whole)
        prefill(model, ids[:, :25], parts)
        got = prefill(model, ids[:, 25:], parts, start=25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.k[:, :, :, :40], whole.k[:, :, :, :40], rtol=1e-5, atol=1e-5)


def test_a_conversation_reuses_its_prefix_and_greedy_replies_are_unchanged():
    tok = tiny_tokenizer()
    model = tiny_model(block_size=256)
    cache = PromptCache(10**8)
    history, reused, lengths = tok.encode("User: hello there\nAssistant:"), [], []
    for turn in ("how are you?", "and then?", "bye"):
        before = cache.reused
        with_cache = tinygpt.generate(model, torch.tensor([history]), 12, greedy=True, prompt_cache=cache)
        without = tinygpt.generate(model, torch.tensor([history]), 12, greedy=True)
        assert torch.equal(with_cache, without)
        reused.append(cache.reused - before)
        lengths.append(len(history))
        history = with_cache[0].tolist() + tok.encode(f"\nUser: {turn}\nAssistant:")
    # each turn after the first reuses what the one before held: its prompt, and its reply but the last token
    assert reused == [0, lengths[0] + 11, lengths[1] + 11]
    assert len(cache) == 1  # each turn's entry extends the one before, which it replaces


def test_the_prompt_cache_keeps_to_its_budget_dropping_the_least_recently_used():
    model = tiny_model(block_size=64)
    row = KVCache.for_model(model, 1)
    per_token = 2 * model.config.n_layer * model.config.kv_heads * model.config.head_dim * 4
    cache = PromptCache(30 * per_token)
    cache.store(list(range(10)), row)
    cache.store(list(range(20, 30)), row)
    assert len(cache) == 2 and cache.bytes == 20 * per_token
    assert cache.load(list(range(10)) + [99], row) == 10  # uses (and refreshes) the first
    cache.store(list(range(40, 52)), row)  # over the budget: the second, least recently used, goes
    assert cache.load(list(range(20, 30)) + [1], row) == 0 and cache.load(list(range(11)), row) == 10
    cache.store(list(range(100, 140)), row)  # larger than the whole budget: not kept
    assert cache.bytes <= 30 * per_token and cache.load(list(range(100, 141)), row) == 0
    assert cache.load([0, 1, 2], row) == 2  # a prompt's last token is always the model's to read


def test_the_prompt_cache_needs_one_eager_row():
    with pytest.raises(ConfigError, match="prompt_cache"):
        tinygpt.generate(tiny_model(), torch.tensor([[1], [2]]), 2, prompt_cache=PromptCache(10**6))


# -- the command line --------------------------------------------------------------------------


def test_cli_sample_writes_what_its_constraint_says(tmp_path, cli):
    from server_util import save_tiny_run

    save_tiny_run(tmp_path / "run", block_size=256)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    r = cli("sample", tmp_path / "run", "--json-schema", tmp_path / "schema.json", "--max-new-tokens", MAX_TOKENS,
            "--seed", 1, "--prompt", "p:")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout.removeprefix("p:")), SCHEMA)
    r = cli("sample", tmp_path / "run", "--regex", "[0-9]{2}:[0-9]{2}", "--max-new-tokens", 20, "--seed", 2)
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}\n", r.stdout)
    r = cli("sample", tmp_path / "run", "--choice", "yes", "--choice", "no", "--max-new-tokens", 20, "--num-samples", 3)
    assert [s.strip() for s in r.stdout.split("-" * 40)] and set(re.findall(r"\w+", r.stdout)) <= {"yes", "no"}
    r = cli("sample", tmp_path / "run", "--choice", "caf\u00e9")
    assert r.returncode == 2 and r.stdout == "" and r.stderr == (
        "tinygpt: error: choices: this model's vocabulary cannot write it: it needs '\u00e9' after 'caf', and no token "
        "of the vocabulary writes it\n")
    r = cli("sample", tmp_path / "run", "--regex", "a+", "--choice", "b")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_cli_chat_shows_a_call_takes_its_result_and_reuses_the_conversation(tmp_path, capsys, monkeypatch):
    """A reply that calls a tool (scripted here: a random model calls nothing) is shown, the typed result goes
    back as the tool's message, and the next reply is written after it; each turn reuses the last one's keys
    and values."""
    import importlib
    import io

    from tinygpt.cli import main
    from tinygpt.prompt_cache import PromptCache
    from tinygpt.tokenizer import with_chat_template

    generation = importlib.import_module("tinygpt.generate")  # the module: tinygpt.generate is the function
    tok = with_chat_template(tiny_tokenizer())
    tinygpt.save(tiny_model(block_size=512, vocab_size=tok.vocab_size), tmp_path / "run", tok)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    end = tok.special_ids()[tok.chat_template.end]
    replies = iter(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."])
    prompts, real = [], generation.generate_stream

    def scripted(model, idx, n, **kwargs):
        prompts.append(tok.decode(idx[0].tolist()))
        list(real(model, idx, 1, **kwargs))  # the prompt goes through the cache as a real reply's does
        for token in tok.encode(next(replies)) + [end]:
            yield torch.tensor([token])

    monkeypatch.setattr(generation, "generate_stream", scripted)
    loads = []
    monkeypatch.setattr(PromptCache, "load", lambda self, tokens, row, real=PromptCache.load: loads.append(
        real(self, tokens, row)) or loads[-1])
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 2 + 3?\n5\n"))
    assert main(["chat", str(tmp_path / "run"), "--tools", str(tmp_path / "tools.json"), "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert '(calls add({"a": 2, "b": 3}); type its result)' in err and "It is 5." in out
    assert '"name": "add"' in prompts[0] and "<tool_response>\n5\n</tool_response>" in prompts[1]
    assert loads[0] == 0 and loads[1] > len(prompts[0]) // 2  # the second turn began from the first's cache
    (tmp_path / "bad.json").write_text(json.dumps([{"type": "function", "function": {"name": "a b"}}]))
    assert main(["chat", str(tmp_path / "run"), "--tools", str(tmp_path / "bad.json"), "--prompt", "hi"]) == 2
    assert "--tools" in capsys.readouterr().err
