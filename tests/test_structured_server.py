"""Structured outputs, tool calls and the prompt cache through `tinygpt serve`'s API, with the official openai
client: parse() with a Pydantic model 50 of 50 on a model trained here and on random weights, JSON Schema
validated with jsonschema, regex and choices, streamed equal to whole, a slow grammar that holds up nobody,
a tool loop end to end, and a conversation's second turn from the prompt cache."""

import json
import re
import threading
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
import torch.nn.functional as F
from server_util import CHARS, NAME, running, tiny_model, tiny_tokenizer

from tinygpt.server import create_app


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Annotated[str, pydantic.Field(max_length=8)]] = pydantic.Field(max_length=3)


def people(n: int, seed: int = 0) -> list[str]:
    """n Person objects as openai's strict schema has the model write them (json.dumps' spacing)."""
    import random

    rng = random.Random(seed)
    names = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farouk", "Gus", "Hana"]
    return [json.dumps({"name": rng.choice(names), "age": rng.randint(1, 99),
                        "role": rng.choice(["admin", "user", "guest"]),
                        "address": {"city": rng.choice(["Paris", "Lima", "Oslo"]),
                                    "zip": f"{rng.randint(0, 99999):05d}"},
                        "tags": rng.sample(["a", "bb", "ccc"], rng.randint(0, 3))})
            for _ in range(n)]


def trained_model() -> torch.nn.Module:
    """The tiny model trained here for a few hundred steps on Person objects after chat prompts."""
    tok = tiny_tokenizer()
    model = tiny_model(block_size=128).train()
    text = "".join(f"User: who?\nAssistant:{p}\n" for p in people(400))
    data = torch.tensor(tok.encode(text))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(250):
        starts = torch.randint(0, len(data) - 65, (16,), generator=generator)
        x = torch.stack([data[s: s + 64] for s in starts])
        y = torch.stack([data[s + 1: s + 65] for s in starts])
        loss = F.cross_entropy(model(x).reshape(-1, len(CHARS)), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1.5  # it learned the objects' shape
    return model.eval()


@pytest.fixture(scope="module")
def servers(tok):
    """(trained, random) servers of the tiny char model, 256 tokens of context."""
    trained, random = trained_model(), tiny_model(block_size=256)
    with running(create_app(trained, tok, model_name=NAME, max_tokens=200)) as a, \
            running(create_app(random, tok, model_name=NAME, max_tokens=200)) as b:
        yield a, b


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_parse_with_a_pydantic_model_gives_a_valid_object_50_of_50(servers, which):
    c = client(servers[which == "random"])
    schema = Person.model_json_schema()
    texts = []
    for seed in range(50):
        r = c.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "who?"}], response_format=Person,
                                     temperature=1.0, seed=seed, max_tokens=200)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        texts.append(r.choices[0].message.content)
    assert len(set(texts)) > 40  # sampled, not one answer over and over
    if which == "trained":  # the trained model writes the names it saw; the random one anything it may
        assert sum(json.loads(t)["name"] in {"Ann", "Bob", "Carla", "Dmitri", "Eve", "Farouk", "Gus", "Hana"}
                   for t in texts) > 25


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "kind": {"enum": ["book", "film", "song"]},
        "credits": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"who": {"type": "string", "maxLength": 8}, "lead": {"type": "boolean"}},
            "required": ["who"], "additionalProperties": False}},
        "meta": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                                  "note": {"type": ["string", "null"], "maxLength": 10}},
                 "required": ["year", "note"], "additionalProperties": False},
    },
    "required": ["id", "kind", "credits", "meta"],
    "additionalProperties": False,
}


def test_json_schema_on_chat_and_completions_validates(servers):
    c = client(servers[1])
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "an item"}], response_format=fmt,
                                  n=8, seed=3, temperature=1.2, max_tokens=200)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    r = c.completions.create(model=NAME, prompt="item:", n=8, seed=4, max_tokens=200,
                             extra_body={"response_format": fmt})
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "json"}], max_tokens=200,
                                  response_format={"type": "json_object"}, seed=1)
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choices_as_vllm_takes_them(servers):
    c = client(servers[1])
    pattern = r"[0-9]{3}-[A-Z]{2}(!|\?)"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = c.completions.create(model=NAME, prompt="code:", max_tokens=20, n=4, seed=1, extra_body=body)
        assert all(re.fullmatch(pattern, x.text) and x.finish_reason == "stop" for x in r.choices)
    for body in ({"structured_outputs": {"choice": ["yes", "no", "maybe not"]}}, {"guided_choice": ["yes", "no"]}):
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "ok?"}], max_tokens=20, n=6,
                                      seed=2, extra_body=body)
        assert {x.message.content for x in r.choices} <= {"yes", "no", "maybe not"}
    grammar = 'root ::= "(" [a-c]+ ")"'  # GBNF, as vLLM and llama.cpp take it
    r = c.completions.create(model=NAME, prompt="g:", max_tokens=20, seed=3,
                             extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\([a-c]+\)", r.choices[0].text) or r.choices[0].finish_reason == "length"


def test_streamed_and_whole_answers_are_the_same_text_for_a_seed(servers):
    c = client(servers[1])
    for seed in range(3):
        kw = dict(model=NAME, messages=[{"role": "user", "content": "an item"}], max_tokens=200, temperature=1.0,
                  seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "i", "schema": SCHEMA}})
        whole = c.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        assert streamed == whole and json.loads(whole)


def test_a_grammar_slow_to_compile_holds_up_no_other_stream(model, tok, monkeypatch):
    """A compile that does not return (here: held until released) keeps its request waiting alone: a stream
    sent meanwhile completes; past the bound, the request is answered 400 naming its field."""
    from tinygpt.server import structured

    entered, release = threading.Event(), threading.Event()
    real = structured.compile_grammar

    def slow(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(structured, "compile_grammar", slow)
    app = create_app(model, tok, model_name=NAME, max_tokens=64)
    with running(app) as url:
        answers = []
        body = {"model": NAME, "prompt": "a", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]+"}}
        pending = threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", json=body,
                                                                            timeout=60)))
        pending.start()
        assert entered.wait(30)
        chunks = list(client(url).completions.create(model=NAME, prompt="hello", max_tokens=20, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length" and not answers  # done while the compile waits
        release.set()
        pending.join(30)
        assert answers[0].status_code == 200 and re.fullmatch("[a-z]+", answers[0].json()["choices"][0]["text"])
        release.clear()
        entered.clear()
        app.state.server.compile_seconds = 0.3
        r = httpx.post(url + "/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]+"}}, timeout=60)
        release.set()
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
        assert "took more than 0.3 s to compile" in r.json()["error"]["message"]


TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two digits.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}},
]


def reassembled(chunks) -> tuple[str | None, list[tuple[str, str]]]:
    """A stream's content and its calls (name, arguments) put back together from the deltas."""
    content, calls = "", {}
    for ch in chunks:
        delta = ch.choices[0].delta if ch.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.function.name is None
            calls[call.index][1] += call.function.arguments or ""
    return content or None, [tuple(v) for _, v in sorted(calls.items())]


def test_a_tool_loop_end_to_end(model, tok, monkeypatch):
    """The call's name and arguments parse; a tool message answers it and the next turn's prompt holds the
    result; the streamed deltas reassemble to the call not streamed; several calls in one turn where allowed."""
    big = tiny_model(block_size=512)
    app = create_app(big, tok, model_name=NAME, max_tokens=120)
    prompts = []
    submit = app.state.scheduler.submit
    monkeypatch.setattr(app.state.scheduler, "submit", lambda seqs: (prompts.append(seqs[0].prompt), submit(seqs)))
    with running(app) as url:
        c = client(url)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        kw = dict(model=NAME, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=5,
                  temperature=1.0)
        r = c.chat.completions.create(messages=messages, **kw)
        message, choice = r.choices[0].message, r.choices[0]
        assert choice.finish_reason == "tool_calls" and message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name in ("add", "weather") and call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(args, next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"][
            "parameters"])
        content, calls = reassembled(c.chat.completions.create(messages=messages, stream=True, **kw))
        assert content is None and calls == [(call.function.name, call.function.arguments)]
        # the tool's answer goes back, and the next turn's prompt carries it
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "RESULT=5"}]
        r = c.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=10, temperature=0)
        assert r.choices[0].message.role == "assistant"
        seen = tok.decode(prompts[-1])
        assert "RESULT=5" in seen and call.function.arguments in seen
        # a named function: that one, and one call
        r = c.chat.completions.create(model=NAME, messages=messages[:1], tools=TOOLS, max_tokens=120, seed=1,
                                      tool_choice={"type": "function", "function": {"name": "weather"}})
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["weather"]
        # required with parallel calls: one or more, each valid, streamed as whole
        many = dict(kw, parallel_tool_calls=True, seed=11)
        r = c.chat.completions.create(messages=messages[:1], **many)
        calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        assert reassembled(c.chat.completions.create(messages=messages[:1], stream=True, **many))[1] == calls


def test_tool_choice_none_never_calls_and_auto_reads_calls_the_model_writes(model, tok):
    """A reply shaped as a call (forced here by a regex): with tool_choice none it is content, with auto a call."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 200,
            "guided_regex": re.escape(call)}
    with running(create_app(tiny_model(block_size=512), tok, model_name=NAME, max_tokens=200)) as url:
        none = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60).json()
        assert none["choices"][0]["message"] == {"role": "assistant", "content": call}
        assert none["choices"][0]["finish_reason"] == "stop"
        auto = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in auto["message"]["tool_calls"]] == [
            ("add", '{"a": 1, "b": 2}')]


def test_a_second_turn_reuses_the_first_from_the_prompt_cache_and_answers_the_same(tok):
    big = tiny_model(block_size=512)
    with running(create_app(big, tok, model_name=NAME, max_tokens=64)) as cached, \
            running(create_app(big, tok, model_name=NAME, max_tokens=64, prompt_cache_bytes=0)) as plain:
        replies = {}
        for url in (cached, plain):
            c = client(url)
            messages = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Tell me a story. " * 8}]
            first = c.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
            second = c.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
            replies[url] = (first.choices[0].message.content, second.choices[0].message.content,
                            second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens)
        assert replies[cached][:2] == replies[plain][:2]
        # the first turn's prompt and its reply (but the last token) came from the cache
        first_prompt = "System: Be brief.\nUser: " + "Tell me a story. " * 8
        assert replies[plain][2] == 0 and replies[cached][2] >= len(first_prompt)
        assert replies[cached][2] < replies[cached][3]
        stats = httpx.get(cached + "/health").json()["prompt_cache"]
        assert stats["hits"] >= 1 and 0 < stats["bytes"] <= stats["max_bytes"]
