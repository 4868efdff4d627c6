"""Tool calls with Hugging Face templates (tinygpt.toolcalls): on Qwen2.5- and Llama-3.2-style folders written
here (random weights, a tokenizer and each model's template with its tools), the prompt the server renders
with tools equals transformers' apply_chat_template(tools=...) id for id, the call format is read from the
template, and calls the server constrains parse; the reader gives the same calls streamed in any pieces."""

import json
import random

import jsonschema
import openai
import pytest
from hf_family import make_folder
from server_util import NAME, running

import tinygpt
from tinygpt.server import create_app
from tinygpt.toolcalls import TEXT_FORMAT, CallFormat, CallStream, call_format, read_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
CONVERSATION = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
                {"role": "user", "content": "And add 2 and 3."}]
STYLES = {"qwen25": ("qwen2", "qwen25-tools", CallFormat("<tool_call>\n", "\n</tool_call>", "\n", "arguments")),
          "llama32": ("llama", "llama32-tools", CallFormat("", "", None, "parameters"))}


@pytest.fixture(scope="module", params=sorted(STYLES))
def folder(request, tmp_path_factory):
    kind, style, _ = STYLES[request.param]
    return request.param, make_folder(tmp_path_factory.mktemp(request.param), kind, style)


def as_transformers_takes_it(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' templates want it: a call's arguments an object, no null fields."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def test_the_call_format_is_read_from_the_template(folder):
    name, path = folder
    tok = tinygpt.load_tokenizer(path)
    ends = tok.chat_template.turn_ends(tok)
    assert call_format(tok.chat_template, ends[0]) == STYLES[name][2]


def test_the_prompt_with_tools_equals_apply_chat_template_and_required_calls_parse(folder, monkeypatch):
    import transformers

    from tinygpt.server import chat

    name, path = folder
    model, tok = tinygpt.load(path), tinygpt.load_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    prompts = []
    real = chat.generate

    async def generate(state, request, req, ids, *args, **kwargs):
        prompts.append(ids[0])
        return await real(state, request, req, ids, *args, **kwargs)

    monkeypatch.setattr(chat, "generate", generate)
    with running(create_app(model, tok, model_name=NAME, max_tokens=100)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        c.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=1)
        expected = hf.apply_chat_template(as_transformers_takes_it(CONVERSATION), tools=TOOLS,
                                          add_generation_prompt=True, return_dict=False)
        assert prompts[-1] == expected
        for seed in range(4):
            r = c.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=100, seed=seed, temperature=1.0)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
            for call in calls:
                schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("fmt", [STYLES["qwen25"][2], STYLES["llama32"][2], TEXT_FORMAT])
def test_calls_read_in_any_pieces_are_the_calls_read_whole(fmt):
    def call(name, args):
        return fmt.prefix + json.dumps({"name": name, fmt.arguments: args}) + fmt.suffix

    tricky = {"a": 1, "b": {"c": "}\\\"x ]"}}  # braces and an escaped quote inside a string
    texts = [call("add", tricky)]
    if fmt.separator is not None:
        texts += ["I will look.\n" + call("add", {"a": 2}) + fmt.separator + call("get_weather", {"city": "Oslo"}),
                  fmt.prefix + '{"name": "nope", "arguments": {}}' + fmt.suffix,  # no such tool: text
                  "plain text, <tool but no call"]
    texts += [call("add", {"a": 1})[:-len(fmt.suffix) - 3] if fmt.suffix else call("add", {"a": 1})[:-3]]  # cut short
    rng = random.Random(0)
    for text in texts:
        whole = read_calls(text, fmt, ["add", "get_weather"])
        for _ in range(30):
            reader, deltas, i = CallStream(fmt, ["add", "get_weather"]), [], 0
            while i < len(text):
                k = rng.randint(1, 5)
                deltas += reader.push(text[i:i + k])
                i += k
            deltas += reader.finish()
            content = "".join(d.get("content", "") for d in deltas) or None
            calls: dict[int, list] = {}
            for d in deltas:
                for c in d.get("tool_calls", []):
                    calls.setdefault(c["index"], [c["function"].get("name"), ""])[1] += c["function"]["arguments"]
            assert content == whole[0]
            assert [tuple(v) for _, v in sorted(calls.items())] == [(c["name"], c["arguments"]) for c in whole[1]]
    content, calls = read_calls(texts[0], fmt, ["add"])
    assert content is None and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("add", tricky)]
