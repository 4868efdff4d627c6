"""`tinygpt serve`'s HTTP API against a real uvicorn server: the official openai client, a table of
bad requests, a fuzz run, concurrency, the queue limit, dropped streams, auth, CORS, limits."""

import asyncio
import json
import math
import threading

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import CHARS, NAME, health, running, tiny_model, tiny_tokenizer, wait_for

import tinygpt
from tinygpt.server import create_app

CAP = 64  # the module server's --max-tokens


@pytest.fixture(scope="module")
def url(model, tok):
    with running(create_app(model, tok, model_name=NAME, max_tokens=CAP)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(model, tok, prompt: str, n: int) -> str:
    ids = torch.tensor([tok.encode(prompt)[-model.config.block_size :]])
    return tok.decode(tinygpt.generate(model, ids, n, greedy=True)[0, ids.shape[1] :].tolist())


# -- the official client ----------------------------------------------------------------------


def test_openai_completions_streamed_equals_not_streamed(client, model, tok):
    r = client.completions.create(model=NAME, prompt="hello world", max_tokens=40, temperature=0)
    text = r.choices[0].text
    assert text == reference(model, tok, "hello world", 40)  # 40 > block_size: the window slides
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 40, 51)
    assert "prompt_tokens_truncated" not in r.usage.model_dump()
    chunks = list(client.completions.create(model=NAME, prompt="hello world", max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id for c in chunks)


def test_openai_chat_streamed_equals_not_streamed(client, model, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    prompt = "System: Be brief.\nUser: Hi there\nAssistant:"  # the documented template
    expected = reference(model, tok, prompt, 30)
    for stop in ("\nUser:", "\nSystem:"):
        expected = expected.split(stop)[0]
    assert text == expected
    assert r.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n_seed_stop_and_echo(client, model, tok):
    a = client.completions.create(model=NAME, prompt="abc", max_tokens=20, n=3, seed=7, temperature=1.0)
    b = client.completions.create(model=NAME, prompt="abc", max_tokens=20, n=3, seed=7, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own random stream
    assert a.usage.completion_tokens == 60 and a.usage.prompt_tokens == 3
    greedy = reference(model, tok, "abc", 20)
    stop = greedy[8:10]
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == greedy[: greedy.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    r = client.completions.create(model=NAME, prompt=["abc", "xyz"], max_tokens=5, temperature=0, echo=True)
    assert [c.text for c in r.choices] == ["abc" + greedy[:5], "xyz" + reference(model, tok, "xyz", 5)]


def test_more_than_four_stop_strings(client, model, tok):
    """lm-evaluation-harness sends a task's `until` strings and the tokenizer's EOS, uncapped: five once
    ended its run with a 400 (OpenAI's cap of 4). Up to 64 are taken, and the last one cuts as the first."""
    greedy = reference(model, tok, "abc", 20)
    stop = greedy[8:10]
    unused = [f"zz{i}z" for i in range(63)]
    for stops in ([*unused[:4], stop], [*unused, stop]):
        r = client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, stop=stops)
        assert r.choices[0].text == greedy[: greedy.index(stop)] and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="abc", max_tokens=5, stop=[*unused, stop, "zzzz"])
    assert "at most 64 stop strings, got 65" in str(e.value) and e.value.body["param"] == "stop"


def test_logprobs_end_where_a_stop_string_cuts_the_text(client, model, tok):
    greedy = reference(model, tok, "abc", 20)
    # a character held back (it may begin the first stop), then the next one, a stop of its own: the
    # held character is sent, the stop's token is not reported
    i = next(i for i in range(1, 19) if greedy[i + 1] not in greedy[: i + 1])
    stop, text = [greedy[i] + "\x00", greedy[i + 1]], greedy[: i + 1]
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, stop=stop, logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and lp.tokens == list(text) and lp.text_offset == list(range(len(text)))
    chunks = list(client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, stop=stop,
                                            logprobs=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == list(text)


def test_logprobs_are_the_models_own_distribution(client, model, tok):
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([tok.encode("hello")]))[0, -1], -1)
    top = torch.topk(first, 5)
    assert lp.tokens == list(r.choices[0].text) and lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs[0] == pytest.approx(first.max().item(), abs=1e-5)
    assert list(lp.top_logprobs[0]) == [tok.decode([int(i)]) for i in top.indices]
    assert list(lp.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=1e-5)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    h = health(url)
    assert h["status"] == "ok" and h["model"] == NAME and h["block_size"] == 32
    head = httpx.head(url + "/health", timeout=10)  # as load balancers' health checks ask (once 405)
    assert head.status_code == 200 and head.content == b""


def test_openai_client_sees_errors_as_its_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


# -- bad requests -----------------------------------------------------------------------------

C, M, A = "/v1/completions", "/v1/chat/completions", "/v1/tinygpt/attention"
COMP = {"model": NAME, "prompt": "hi"}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
ATTN = {"model": NAME, "prompt": "hi"}


def comp(**kw):
    return {k: v for k, v in {**COMP, **kw}.items() if v is not ...}


def chat(**kw):
    return {k: v for k, v in {**CHAT, **kw}.items() if v is not ...}


def msg(**kw):
    return chat(messages=[{k: v for k, v in {"role": "user", "content": "hi", **kw}.items() if v is not ...}])


BAD = [
    # (route, body: dict or raw text, status, param)
    (C, "{", 400, None),
    (C, "", 400, None),
    (C, "[1, 2]", 400, None),
    (C, '"text"', 400, None),
    (C, "null", 400, None),
    (C, "[" * 5000, 400, None),
    (C, '{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    (C, '{"model": "tiny", "prompt": "a", "max_tokens": 1e400}', 400, "max_tokens"),
    (C, comp(model=...), 400, "model"),
    (C, comp(model=5), 400, "model"),
    (C, comp(model="nope"), 404, "model"),
    (C, comp(prompt=...), 400, "prompt"),
    (C, comp(prompt=5), 400, "prompt"),
    (C, comp(prompt=[]), 400, "prompt"),
    (C, comp(prompt=[[]]), 400, "prompt"),
    (C, comp(prompt=[1, "a"]), 400, "prompt"),
    (C, comp(prompt=[10**6]), 400, "prompt"),
    (C, comp(prompt=[-1]), 400, "prompt"),
    (C, comp(prompt="h\u00e9llo"), 400, "prompt"),
    (C, comp(temperature=-0.1), 400, "temperature"),
    (C, comp(temperature=2.5), 400, "temperature"),
    (C, comp(temperature="hot"), 400, "temperature"),
    (C, comp(top_p=0), 400, "top_p"),
    (C, comp(top_p=1.5), 400, "top_p"),
    (C, comp(top_k=0), 400, "top_k"),
    (C, comp(top_k=1.5), 400, "top_k"),
    (C, comp(top_k=True), 400, "top_k"),
    (C, comp(n=0), 400, "n"),
    (C, comp(n=17), 400, "n"),
    (C, comp(n=9, prompt=["a", "b"]), 400, "n"),
    (C, comp(max_tokens=-1), 400, "max_tokens"),
    (C, comp(max_tokens=CAP + 1), 400, "max_tokens"),
    (C, comp(max_tokens="10"), 400, "max_tokens"),
    (C, comp(presence_penalty=2.5), 400, "presence_penalty"),
    (C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    (C, comp(repetition_penalty=-1), 400, "repetition_penalty"),
    (C, comp(stop=[f"s{i}" for i in range(65)]), 400, "stop"),
    (C, comp(stop=""), 400, "stop"),
    (C, comp(stop=["ok", ""]), 400, "stop"),
    (C, comp(stop=5), 400, "stop"),
    (C, comp(seed=2**70), 400, "seed"),
    (C, comp(seed="1"), 400, "seed"),
    (C, comp(stream="yes"), 400, "stream"),
    (C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, comp(logprobs=6), 400, "logprobs"),
    (C, comp(logprobs=True), 400, "logprobs"),
    (C, comp(echo=1), 400, "echo"),
    (C, comp(suffix="x"), 400, "suffix"),
    (C, comp(best_of=3), 400, "best_of"),
    (C, comp(logit_bias={"abc": 1}), 400, "logit_bias"),
    (C, comp(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    (C, comp(logit_bias={"1": 200}), 400, "logit_bias.1"),
    (C, comp(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),  # past int()'s 4,300-digit limit
    (C, comp(logit_bias={"0" * 5000 + "1": 1, "1" * 30: 1}), 400, "logit_bias"),
    (C, comp(foo=1), 400, "foo"),
    (M, chat(messages=...), 400, "messages"),
    (M, chat(messages=[]), 400, "messages"),
    (M, chat(messages="hi"), 400, "messages"),
    (M, msg(role="bot"), 400, "messages.0.role"),
    (M, msg(role="tool"), 400, "messages.0.tool_call_id"),  # a tool's result that answers no call
    (M, msg(role="tool", tool_call_id="call_1"), 400, "messages.0.tool_call_id"),
    (M, msg(role=...), 400, "messages.0.role"),
    (M, msg(content=5), 400, "messages.0.content"),
    (M, msg(content=...), 400, "messages.0.content"),
    (M, msg(content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages.0.content"),
    (M, msg(content="\u00e9"), 400, "messages.0.content"),
    (M, chat(top_logprobs=3), 400, "top_logprobs"),
    (M, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (M, chat(max_completion_tokens=CAP + 1), 400, "max_completion_tokens"),
    (M, chat(max_tokens=0), 400, "max_tokens"),
    (M, chat(model="gpt-4o"), 404, "model"),
    (M, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (M, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    (M, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}), 400,
     "response_format.json_schema.schema"),
    (M, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}), 400,
     "response_format.json_schema.schema"),  # a keyword the engine does not implement
    (C, comp(structured_outputs={"regex": "a(b"}), 400, "structured_outputs.regex"),
    (C, comp(guided_choice=["caf\u00e9"]), 400, "guided_choice"),  # the vocabulary has no "é"
    (C, comp(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice"),  # two constraints
    (M, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]), 400,
     "tools.0.function.parameters"),
    (M, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                   "function": {"name": "g"}}), 400,
     "tool_choice"),
    (M, chat(tool_choice="required"), 400, "tool_choice"),
    (A, {**ATTN, "layer": 2}, 400, "layer"),
    (A, {**ATTN, "head": -1}, 400, "head"),
    (A, {**ATTN, "prompt": ""}, 400, "prompt"),
    (A, {**ATTN, "model": "x"}, 404, "model"),
    ("/v1/nothing", COMP, 404, None),
]


def test_the_table_has_at_least_40_bad_requests():
    assert len(BAD) >= 40


def check_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


@pytest.mark.parametrize("route, body, status, param", BAD, ids=[f"{i:02d}" for i in range(len(BAD))])
def test_bad_request(url, route, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + route, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    err = check_error(r, status)
    assert err["param"] == param, err


def test_bodies_over_2_mb_get_413(url):
    big = json.dumps(comp(prompt="a" * (2 * 1024 * 1024)))
    check_error(httpx.post(url + C, content=big, timeout=30), 413)

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(3):
            yield b" " * (1024 * 1024)

    check_error(httpx.post(url + C, content=chunks(), timeout=30), 413)
    # just under the limit is fine (and long prompts are cut to their last block_size tokens)
    ok = httpx.post(url + C, content=json.dumps(comp(prompt="a" * (1024 * 1024), max_tokens=2)), timeout=60)
    usage = ok.json()["usage"]
    assert ok.status_code == 200 and usage["prompt_tokens"] == 1024 * 1024
    assert usage["prompt_tokens_truncated"] == 1024 * 1024 - 32


def test_wrong_method_and_unknown_model_route(url):
    check_error(httpx.get(url + C), 405)
    check_error(httpx.get(url + "/v1/models/nope"), 404)


# -- fuzz -------------------------------------------------------------------------------------

FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "stream", "logprobs", "top_logprobs", "echo", "repetition_penalty", "presence_penalty", "logit_bias",
          "stream_options", "role", "content", "max_completion_tokens", "best_of", "suffix", "user"]
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4),
                      max_leaves=10)
plausible = st.fixed_dictionaries(
    {"model": st.just(NAME) | values},
    optional={f: values | st.integers(-3, 20) | st.floats(-3, 3) for f in FIELDS if f != "model"},
)
bodies = st.one_of(values.map(json.dumps), plausible.map(json.dumps), st.text(max_size=40),
                   st.binary(max_size=40))
# valid requests, then the same with one field replaced by anything
SETTINGS = {"max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
            "top_k": st.integers(1, 50), "n": st.integers(1, 3), "seed": st.integers(0, 2**63),
            "stop": st.text(CHARS, min_size=1, max_size=3) | st.lists(st.text(CHARS, min_size=1, max_size=3),
                                                                        max_size=4),
            "stream": st.booleans(), "repetition_penalty": st.floats(0.1, 3), "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2), "logit_bias": st.dictionaries(
                st.integers(0, len(CHARS) - 1).map(str), st.floats(-100, 100), max_size=3)}
valid_completion = st.fixed_dictionaries(
    {"model": st.just(NAME), "prompt": st.text(CHARS, max_size=40) | st.lists(st.integers(0, len(CHARS) - 1),
                                                                                min_size=1, max_size=40)},
    optional={**SETTINGS, "logprobs": st.integers(0, 5), "echo": st.booleans()})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.text(CHARS, max_size=30)})
valid_chat = st.fixed_dictionaries(
    {"model": st.just(NAME), "messages": st.lists(message, min_size=1, max_size=3)},
    optional={**SETTINGS, "logprobs": st.booleans()})


def mutated(valid):
    return st.tuples(valid, st.sampled_from(FIELDS), values).map(lambda t: {**t[0], t[1]: t[2]})


requests = st.one_of(
    st.tuples(st.sampled_from([C, M, A]), bodies),
    st.tuples(st.just(C), (valid_completion | mutated(valid_completion)).map(json.dumps)),
    st.tuples(st.just(M), (valid_chat | mutated(valid_chat)).map(json.dumps)),
)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("bodies", [250, pytest.param(2000, marks=[pytest.mark.slow, pytest.mark.reliability])])
def test_fuzzed_bodies_never_get_a_5xx(http, bodies, figure):
    statuses: dict[int, int] = {}

    @settings(max_examples=bodies, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(request=requests)
    def fuzz(request):
        route, body = request
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            check_error(r, r.status_code)

    fuzz()
    sent = sum(statuses.values())
    assert sent >= bodies  # hypothesis ran them all (and replays count on top)
    figure(f"fuzzed request bodies ({bodies})", f"{sent} sent, 0 answered with a 5xx",
           ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items())))


def test_healthy_after_fuzzing(url, client):
    assert health(url)["status"] == "ok"
    wait_for(lambda: health(url)["active"] == 0 and health(url)["queued"] == 0)
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=3).usage.completion_tokens == 3


# -- concurrency ------------------------------------------------------------------------------


def test_8_concurrent_clients_succeed_with_their_own_answers(url, model, tok):
    prompts = [f"client {i} says" for i in range(8)]
    expected = [reference(model, tok, p, 40) for p in prompts]
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def one(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        barrier.wait()
        if i % 2:
            r = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=40, temperature=0)
            results[i] = r.choices[0].text
        else:
            stream = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=40, temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].text for ch in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected
    assert health(url)["peak_batch"] > 1


@pytest.fixture(scope="module")
def small_url(model, tok):
    """8 slots and 12 queue places, long generations allowed."""
    with running(create_app(model, tok, model_name=NAME, max_concurrency=8, max_queue=12, max_tokens=100_000)) as b:
        yield b


def test_full_queue_gets_429_and_dropped_streams_free_everything(small_url):
    before = health(small_url)

    async def scenario():
        async with httpx.AsyncClient(base_url=small_url, timeout=30) as http:
            body = {"model": NAME, "prompt": "x", "max_tokens": 100_000, "stream": True}
            streams = [http.stream("POST", C, json=body) for _ in range(20)]
            responses = await asyncio.gather(*(s.__aenter__() for s in streams))
            assert [r.status_code for r in responses] == [200] * 20
            for _ in range(1000):  # every stream holds a slot or a queue place, and tokens are flowing
                h = (await http.get("/health")).json()
                if (h["active"], h["queued"]) == (8, 12) and h["generated_tokens"] > before["generated_tokens"]:
                    break
                await asyncio.sleep(0.01)
            assert (h["active"], h["queued"]) == (8, 12)
            r = await http.post(C, json={"model": NAME, "prompt": "x", "max_tokens": 5})
            err = check_error(r, 429)
            assert err["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
            for s in streams:  # the clients go away mid-stream
                await s.__aexit__(None, None, None)

    asyncio.run(scenario())
    after = wait_for(lambda: (h := health(small_url))["active"] == 0 and h["queued"] == 0 and h, timeout=10)
    assert after["cancelled"] - before["cancelled"] == 20
    assert after["completed"] == before["completed"]
    ok = httpx.post(small_url + C, json={"model": NAME, "prompt": "x", "max_tokens": 5}, timeout=30)
    assert ok.status_code == 200


def test_a_client_leaving_a_non_streamed_request_frees_its_slot(small_url):
    before = health(small_url)["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_url + C, json={"model": NAME, "prompt": "x", "max_tokens": 100_000}, timeout=0.5)
    wait_for(lambda: (h := health(small_url))["cancelled"] == before + 1 and h["active"] == 0)


# -- in-process: the tokenizer's stop token, auth, CORS, the page ----------------------------


def test_eot_stops_and_byte_tokens_are_reported_as_bytes():
    from conftest import make_text

    from tinygpt.tokenizer import BPETokenizer

    bpe = BPETokenizer.train([make_text(200), "caf\u00e9 \u2014 \U0001f600"], vocab_size=300)
    model = tiny_model(vocab_size=bpe.vocab_size)
    byte = next(i for i in range(bpe.vocab_size) if bpe.decode_bytes([i]) == b"\xe2")
    with TestClient(create_app(model, bpe, model_name=NAME)) as http:
        r = http.post(C, json={**COMP, "max_tokens": 20, "logit_bias": {str(bpe.eot_id): 100}})
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("", "stop")
        assert r.json()["usage"]["completion_tokens"] == 1
        r = http.post(C, json={**COMP, "max_tokens": 1, "logprobs": 1, "logit_bias": {str(byte): 100}})
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == ["bytes:\\xe2"] and choice["text"] == "\ufffd"
        # an empty prompt starts from <|endoftext|>
        r = http.post(C, json={**COMP, "prompt": "", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1


def test_api_key_guards_the_api_but_not_the_page(model, tok):
    app = create_app(model, tok, model_name=NAME, api_key="s3cret")
    with TestClient(app) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for method, route in (("POST", C), ("POST", M), ("POST", A), ("GET", "/v1/models")):
                r = http.request(method, route, json=COMP, headers=headers)
                assert check_error(r, 401)["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert http.post(C, json={**COMP, "max_tokens": 2}, headers=ok).status_code == 200
        assert http.get("/v1/models", headers=ok).status_code == 200
        page = http.get("/")
        assert page.status_code == 200 and "tinygpt playground" in page.text
        assert page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert http.get("/health").json()["auth"] is True
    with pytest.raises(tinygpt.ConfigError):
        create_app(model, tok, model_name=NAME, api_key="")


def test_cors_is_off_unless_origins_are_given(model, tok):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(create_app(model, tok, model_name=NAME)) as http:
        r = http.options(C, headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = http.post(C, json={**COMP, "max_tokens": 1}, headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
    with TestClient(create_app(model, tok, model_name=NAME, cors_origins=["https://app.example"])) as http:
        r = http.options(C, headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = http.options(C, headers={**preflight, "Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_full_server_answers_429_before_the_body_but_after_the_key(model, tok):
    """While every place is taken, a generating request gets 429 without its body being read (so a
    body that is not even JSON gets it too), with CORS headers; a request without the key still gets
    401, a draining server 503, and routes that take no place answer as usual."""
    app = create_app(model, tok, model_name=NAME, api_key="k", cors_origins=["https://app.example"])
    ok = {"Authorization": "Bearer k", "Origin": "https://app.example"}
    with TestClient(app) as http:
        scheduler = app.state.scheduler
        scheduler.has_room = lambda count: False
        for route in (C, M):
            r = http.post(route, content=b"{not json", headers=ok)
            assert check_error(r, 429)["code"] == "rate_limit_exceeded"
            assert r.headers["retry-after"] == "1" and r.headers["access-control-allow-origin"] == "https://app.example"
            assert check_error(http.post(route, json=COMP), 401)["code"] == "invalid_api_key"
        assert http.post(A, json=ATTN, headers=ok).status_code == 200
        assert http.get("/v1/models", headers=ok).status_code == 200
        scheduler.draining = True
        assert check_error(http.post(C, json=COMP, headers=ok), 503)["code"] == "service_unavailable"
        scheduler.draining = False


def test_attention_route_returns_the_models_explicit_weights(model, tok):
    with TestClient(create_app(model, tok, model_name=NAME)) as http:
        r = http.post(A, json={**ATTN, "prompt": "hello there", "layer": 1, "head": 1})
        data = r.json()
        assert data["tokens"] == list("hello there") and data["n_layer"] == 2 and not data["truncated"]
        rows = data["attention"]
        assert [len(row) for row in rows] == list(range(1, 12))
        assert all(math.isclose(sum(row), 1.0, abs_tol=1e-3) for row in rows)
        with torch.no_grad():
            _, weights = model(torch.tensor([tok.encode("hello there")]), return_attention=True)
        assert rows[-1] == pytest.approx(weights[1][0, 1, -1].tolist(), abs=1e-4)
        long = http.post(A, json={**ATTN, "prompt": "x" * 100}).json()  # cut to the last block_size tokens
        assert long["truncated"] and len(long["tokens"]) == 32 and long["prompt_tokens"] == 100


# -- one failing sequence, a dead model thread ------------------------------------------------


def stream_lines(url: str, body: dict, lines: list, started: threading.Event | None = None) -> None:
    with httpx.stream("POST", url + C, json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if started is not None:
                    started.set()


def test_a_poisoned_request_fails_alone_beside_a_long_stream(model, tok, monkeypatch):
    """One request whose sampling raises (an injected fault) gets its own 500, streamed or not,
    while a 1,500-token stream beside it runs to the end with the text it would have had alone."""
    from server_util import POISON_TOP_K, poison_sampler

    poison_sampler(monkeypatch.setattr)
    with running(create_app(model, tok, model_name=NAME, max_tokens=2000)) as base:
        lines: list[str] = []
        started = threading.Event()
        long = threading.Thread(target=stream_lines, args=(base, {**COMP, "prompt": "x", "max_tokens": 1500,
                                                                  "temperature": 0, "stream": True}, lines, started))
        long.start()
        assert started.wait(30)
        poisoned = {**COMP, "max_tokens": 50, "top_k": POISON_TOP_K}
        err = check_error(httpx.post(base + C, json=poisoned, timeout=60), 500)
        assert err["type"] == "server_error" and "this choice" in err["message"]
        with httpx.stream("POST", base + C, json={**poisoned, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "error" in events[-1] and events[-1]["error"]["type"] == "server_error"
        long.join(300)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference(model, tok, "x", 1500)
        h = health(base)
        assert h["status"] == "ok" and h["failed"] == 2 and h["completed"] == 1


class Fault(BaseException):
    """Not an Exception: nothing on the model thread catches it, so the thread dies."""


def test_a_dead_model_thread_turns_health_503_and_answers_503_at_once(model, tok):
    app = create_app(model, tok, model_name=NAME, max_concurrency=1, max_tokens=100_000)
    with running(app) as base:
        assert httpx.get(base + "/health").status_code == 200
        lines: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=stream_lines, args=(base, {**COMP, "max_tokens": 100_000, "stream": True},
                                                             lines, started))
        stream.start()
        assert started.wait(30)
        waiting: list = []
        waiter = threading.Thread(target=lambda: waiting.append(httpx.post(base + C, json=COMP, timeout=60)))
        waiter.start()
        wait_for(lambda: health(base)["queued"] == 1)

        def die(admit):
            raise Fault("injected")

        app.state.scheduler._step = die  # the model thread's next step kills it
        waiter.join(30)
        stream.join(30)
        assert not waiter.is_alive() and not stream.is_alive()
        err = check_error(waiting[0], 503)
        assert err["code"] == "service_unavailable" and "model thread stopped" in err["message"]
        assert json.loads(lines[-1][6:])["error"]["code"] == "service_unavailable"
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.json()["status"] == "error" and "Fault" in r.json()["error"]
        for route, body in ((C, COMP), (M, CHAT), (A, ATTN)):
            assert check_error(httpx.post(base + route, json=body, timeout=10), 503)["code"] == "service_unavailable"


# -- text offsets, the chat template, prompt scoring ------------------------------------------


def token_bytes(token: str) -> bytes:
    """A completions token back to its bytes ('bytes:\\xe2\\x80' for bytes that are not whole characters)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[6:].split("\\x")[1:])
    return token.encode("utf-8")


def assert_offsets_are_positions_in_the_text(text: str, logprobs: dict) -> None:
    """Every offset lies in the text, in order; a token of whole characters is found at its offset,
    and a token of bytes starts its character (or continues the one before it)."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(offsets) == len(tokens) and offsets == sorted(offsets)
    assert all(0 <= o <= len(text) for o in offsets)
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token, (i, token, offset)
        elif token_bytes(token)[0] >= 0xC0:  # a lead byte: its character, or U+FFFD, begins there
            assert offset < len(text), (i, token)


@pytest.fixture(scope="module")
def bpe():
    from conftest import make_text

    from tinygpt.tokenizer import BPETokenizer

    return BPETokenizer.train([make_text(200), "caf\u00e9 \u2014 \U0001f600"], vocab_size=300)


def test_text_offsets_are_positions_in_the_text_when_tokens_split_characters(bpe):
    model = tiny_model(vocab_size=bpe.vocab_size)
    # single bytes of characters the training text lacked: the model's choice among them splits characters
    pieces = [next(i for i in range(bpe.vocab_size) if bpe.decode_bytes([i]) == bytes([b])) for b in b"\xc3\xbc\xe2\x98\x83"]
    with TestClient(create_app(model, bpe, model_name=NAME)) as http:
        body = {**COMP, "max_tokens": 24, "temperature": 0, "logprobs": 1,
                "logit_bias": {str(i): 100 for i in pieces}}
        for stream in (False, True):
            r = http.post(C, json={**body, "stream": stream})
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
                logprobs = {k: [v for p in parts for v in p[k]] for k in ("tokens", "text_offset")}
            else:
                text, logprobs = r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]
            assert any(t.startswith("bytes:") for t in logprobs["tokens"])
            assert_offsets_are_positions_in_the_text(text, logprobs)
        # echoed prompt tokens too, then the generated ones after the prompt's text
        prompt = "na\u00efve \u2603 \u00fcber the cat"
        r = http.post(C, json={**COMP, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 6,
                               "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(prompt)
        assert any(t.startswith("bytes:") for t in choice["logprobs"]["tokens"])
        assert_offsets_are_positions_in_the_text(choice["text"], choice["logprobs"])


def test_chat_on_a_model_whose_vocabulary_lacks_the_template_says_so():
    from tinygpt.tokenizer import CharTokenizer

    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n")  # no 'U', 'A', 'S' or ':'
    with TestClient(create_app(tiny_model(vocab_size=chars.vocab_size), chars, model_name=NAME)) as http:
        r = http.post(M, json={**CHAT, "messages": [{"role": "user", "content": "hello there"}]})
        err = check_error(r, 400)
        assert err["code"] == "chat_template_unsupported" and err["param"] == "model"
        assert "cannot express the chat template" in err["message"] and "'U'" in err["message"]
        assert "':'" in err["message"] and "'A'" in err["message"] and "'S'" not in err["message"]
        r = http.post(M, json={**CHAT, "messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]})
        assert "'S'" in check_error(r, 400)["message"]
        h = http.get("/health").json()
        assert h["chat"] is False and "cannot express the chat template" in h["chat_error"]
        assert http.post(C, json={**COMP, "prompt": "hello", "max_tokens": 3}).status_code == 200
    with TestClient(create_app(tiny_model(), tiny_tokenizer(), model_name=NAME)) as http:
        assert http.get("/health").json()["chat"] is True
        r = http.post(M, json={**CHAT, "messages": [{"role": "user", "content": "caf\u00e9"}]})
        err = check_error(r, 400)  # the user's own character, where it is in their message (once: in the template)
        assert err["param"] == "messages.0.content" and "'\u00e9' (U+00E9) at position 3" in err["message"]


@pytest.fixture(scope="module")
def scoring_url(model, tok):
    with running(create_app(model, tok, model_name=NAME, max_tokens=CAP)) as base:
        yield base


def test_echo_logprobs_and_max_tokens_0_score_the_prompt_with_all_the_context_it_has(scoring_url, model, tok):
    """OpenAI's prompt scoring, through the official client: the prompt's tokens with their logprobs
    and alternatives, no new text. Each token is predicted from as much of the prompt before it as the
    context holds: a prompt that fits scores as `tinygpt eval` (train.evaluate) scores it, and past the
    context the window slides. Scored in consecutive windows instead, a token early in a window saw
    almost nothing, and lm-eval's answers moved by nats with its max_length."""
    import numpy as np

    from tinygpt.train import evaluate

    block = model.config.block_size
    client = openai.OpenAI(base_url=scoring_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for text in ("the cat sees the moon.", "a dog follows two stones; " * 5):  # one window, and 130 tokens (block 32)
        r = client.completions.create(model=NAME, prompt=text, echo=True, logprobs=3, max_tokens=0)
        choice = r.choices[0]
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length" and r.usage.completion_tokens == 0
        assert lp.tokens == list(text) and lp.text_offset == list(range(len(text)))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        ids = tok.encode(text)
        # every token was read: none truncated (a 130-token prompt once reported 98 of 130)
        assert "prompt_tokens_truncated" not in r.usage.model_dump()
        if len(ids) <= block + 1:
            assert -sum(lp.token_logprobs[1:]) == pytest.approx(evaluate(model, np.array(ids))["nll"], abs=1e-4)
        with torch.no_grad():  # each token alone, from the min(t, block) tokens before it
            direct = [torch.log_softmax(model(torch.tensor([ids[max(0, t - block) : t]]))[0, -1], -1)
                      for t in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx([d[i].item() for d, i in zip(direct, ids[1:])], abs=1e-5)
        for t in {5, len(ids) - 1}:  # the alternatives inside the first window, and at the end
            top = torch.topk(direct[t - 1], 3)
            assert list(lp.top_logprobs[t]) == [tok.decode([int(i)]) for i in top.indices]
            assert list(lp.top_logprobs[t].values()) == pytest.approx(top.values.tolist(), abs=1e-5)


def test_echo_with_logprobs_and_generated_tokens(scoring_url, model, tok):
    client = openai.OpenAI(base_url=scoring_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    alone = client.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0, logprobs=2)
    both = client.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0, logprobs=2, echo=True)
    lp, gen = both.choices[0].logprobs, alone.choices[0].logprobs
    assert both.choices[0].text == "hello" + alone.choices[0].text
    assert lp.tokens == list("hello") + gen.tokens
    assert lp.text_offset == list(range(5)) + [5 + o for o in gen.text_offset]
    assert lp.token_logprobs[5:] == pytest.approx(gen.token_logprobs, abs=1e-6) and lp.token_logprobs[0] is None
    streamed = list(client.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0, logprobs=2,
                                              echo=True, stream=True))
    assert streamed[0].choices[0].text == "hello" and streamed[0].choices[0].logprobs.tokens == list("hello")
    assert "".join(c.choices[0].text for c in streamed) == both.choices[0].text
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset] == lp.text_offset
    # several prompts and choices, token-id prompts, and a stream with nothing to generate
    r = client.completions.create(model=NAME, prompt=["ab", "xyz"], echo=True, logprobs=0, max_tokens=0, n=2)
    assert [c.text for c in r.choices] == ["ab", "ab", "xyz", "xyz"]
    assert [len(c.logprobs.tokens) for c in r.choices] == [2, 2, 3, 3]
    ids = tok.encode("abc")
    r = client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert r.choices[0].text == "abc" and r.choices[0].logprobs.tokens == ["a", "b", "c"]
    chunks = list(client.completions.create(model=NAME, prompt="abc", echo=True, logprobs=1, max_tokens=0, stream=True))
    assert [c.choices[0].text for c in chunks] == ["abc", ""] and chunks[-1].choices[0].finish_reason == "length"


def test_prompt_scoring_holds_its_place_and_stops_when_its_client_leaves(model, tok, monkeypatch):
    """Scoring a prompt (echo with logprobs) is model work before any sequence exists: it once took no
    place, so a full server still let any number of them in, and it ran on after its client had left."""
    import time

    from tinygpt.server import completions

    calls = []

    def slow(*args, **kwargs):  # a call scores up to 8 windows; this makes the whole prompt take minutes
        calls.append(time.monotonic())
        time.sleep(0.05)
        return real(*args, **kwargs)

    real = completions.score_windows
    monkeypatch.setattr(completions, "score_windows", slow)
    body = {**COMP, "prompt": "ab" * 20_000, "echo": True, "logprobs": 0, "max_tokens": 0}  # 39,968 windows
    with running(create_app(model, tok, model_name=NAME, max_concurrency=1, max_queue=0)) as base:
        def leaving_client():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + C, json=body, timeout=2)

        client = threading.Thread(target=leaving_client)
        client.start()
        wait_for(lambda: calls)
        r = httpx.post(base + C, json={**COMP, "max_tokens": 2}, timeout=30)
        assert check_error(r, 429)["code"] == "rate_limit_exceeded"
        assert health(base)["scoring"] == 1
        client.join()
        wait_for(lambda: health(base)["scoring"] == 0)
        stopped = len(calls)
        assert stopped < 100  # of the 4,996 calls the whole prompt takes
        time.sleep(0.3)
        assert len(calls) == stopped
        assert httpx.post(base + C, json={**COMP, "max_tokens": 2}, timeout=30).status_code == 200


def test_a_whole_answer_is_built_off_the_event_loop(model, tok, monkeypatch):
    """Formatting a large answer's logprobs (16 x 2,048 tokens x 21 entries: seconds) once ran on the
    event loop, and every other request, /health included, waited for it."""
    import time

    from tinygpt.server.reply import Reply

    real, formatting = Reply.format_logprobs, threading.Event()

    def slow(self, tokens):
        formatting.set()
        time.sleep(1.5)
        return real(self, tokens)

    monkeypatch.setattr(Reply, "format_logprobs", slow)
    with running(create_app(model, tok, model_name=NAME)) as base:
        answers = []
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(base + C, json={**COMP, "max_tokens": 2, "logprobs": 1}, timeout=30)))
        client.start()
        assert formatting.wait(10)
        start = time.monotonic()
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 0.75
        client.join()
        assert len(answers[0].json()["choices"][0]["logprobs"]["tokens"]) == 2


def test_max_tokens_0_without_echo_is_an_empty_completion(http):
    r = http.post(C, json={**COMP, "max_tokens": 0})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and (choice["text"], choice["finish_reason"]) == ("", "length")
    assert r.json()["usage"]["completion_tokens"] == 0
    r = http.post(C, json={**COMP, "prompt": "", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == []  # the empty prompt's start token is not its own
    err = check_error(http.post(C, json={**COMP, "prompt": "a" * 70_000, "echo": True, "logprobs": 0,
                                         "max_tokens": 0}), 400)
    assert err["param"] == "prompt" and "65,536" in err["message"]
    # every choice carries its prompt's logprobs: n copies count, as they once did not (a 157 MB answer)
    err = check_error(http.post(C, json={**COMP, "prompt": "a" * 40_000, "echo": True, "logprobs": 0,
                                         "max_tokens": 0, "n": 2}), 400)
    assert err["param"] == "prompt" and "got 80,000" in err["message"]


# -- DNS rebinding and cross-site posts -------------------------------------------------------


def test_a_loopback_server_answers_only_its_own_host_names(model, tok):
    with TestClient(create_app(model, tok, model_name=NAME, trusted_hosts=["tinygpt.lan"])) as http:
        for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "127.0.0.2", "[::1]:8000", "LOCALHOST.",
                     "tinygpt.lan:9000"):
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("attacker.example", "attacker.example:8000", "localhost.attacker.example", "127.0.0.1.nip.io",
                     "10.0.0.1:8000", ""):
            for method, route in (("GET", "/health"), ("GET", "/"), ("POST", C)):
                r = http.request(method, route, json={**COMP, "max_tokens": 1}, headers={"Host": host})
                assert check_error(r, 421)["code"] == "misdirected_request", (host, route)
        ok = http.post(C, json={**COMP, "max_tokens": 1}, headers={"Host": "127.0.0.1:8000"})
        assert ok.status_code == 200
    with TestClient(create_app(model, tok, model_name=NAME)) as http:  # no trusted_hosts: any Host
        assert http.get("/health", headers={"Host": "attacker.example"}).status_code == 200


def test_the_openai_client_works_against_a_host_checked_server(model, tok):
    with running(create_app(model, tok, model_name=NAME, trusted_hosts=())) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        local = base.replace("127.0.0.1", "localhost")
        assert httpx.get(local + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/health", headers={"Host": "attacker.example"}, timeout=10).status_code == 421


def test_cross_origin_posts_a_browser_sends_without_asking_are_refused(model, tok):
    body = json.dumps({**COMP, "max_tokens": 1})
    evil = {"Origin": "https://attacker.example"}
    for cors in ((), ("https://app.example",)):
        with TestClient(create_app(model, tok, model_name=NAME, cors_origins=cors, trusted_hosts=())) as http:
            host = {"Host": "127.0.0.1:8000"}
            for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
                headers = {**host, **evil, **({"Content-Type": kind} if kind else {})}
                for route in (C, M, A):
                    r = http.post(route, content=body, headers=headers)
                    assert check_error(r, 403)["code"] == "cross_origin_refused", (kind, route)
                # without an Origin (curl, scripts) or from the page itself the same body is served
                assert http.post(C, content=body, headers={**host, "Content-Type": kind or ""}).status_code == 200
                same = {**host, "Origin": "http://127.0.0.1:8000", "Content-Type": kind or ""}
                assert http.post(C, content=body, headers=same).status_code == 200
            json_post = http.post(C, content=body, headers={**host, **evil, "Content-Type": "application/json"})
            assert json_post.status_code == 200  # needs a preflight in a browser, which CORS answers
            assert "access-control-allow-origin" not in json_post.headers
            if cors:
                allowed = {**host, "Origin": cors[0], "Content-Type": "text/plain"}
                assert http.post(C, content=body, headers=allowed).status_code == 200
