"""Tool calls: how a chat template writes a call, the grammar that makes a reply one (tool_choice "required"
or a named function), and the calls read back out of a reply's text, whole or as it streams.

A Hugging Face model's Jinja template is given the tools as transformers passes them (apply_chat_template's
`tools`), and how it writes a call is read from the template itself, never from a folder's name: a
conversation with one call (and with two) is rendered, and the text around the call's JSON is its format,
as Qwen2.5's and Qwen3's Hermes-style `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` or
Llama 3.x's bare `{"name": ..., "parameters": ...}`. A template that rejects two calls in one turn gets
one. tinygpt's own template, and the plain "User: ... Assistant:" one, have no tools of their own: the tools
and calls are written into the messages as text (TEXT_FORMAT, the Hermes shape), for a run to learn.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .constrain import JSON_LAYOUT, Constraint, schema_error
from .errors import ChatError

PROBE = "tinygpt_probe"  # the function a template is asked to write, to see how it writes calls


@dataclass(frozen=True)
class CallFormat:
    """How a template writes a tool call: `prefix`, then {"name": NAME, ARGUMENTS: {...}} as json.dumps writes
    it, then `suffix`; several calls in one turn joined by `separator` (None: one call a turn).

    Args:
        prefix: the text before a call's JSON ("<tool_call>\\n"; "" for Llama 3's bare JSON).
        suffix: the text after it ("\\n</tool_call>").
        separator: between two calls of one turn, or None where the template takes one call a turn.
        arguments: the key of the arguments ("arguments"; Llama 3's "parameters").
    """

    prefix: str
    suffix: str
    separator: str | None
    arguments: str = "arguments"


TEXT_FORMAT = CallFormat("<tool_call>", "</tool_call>", "\n")


class ToolError(ChatError):
    """A tool that cannot be offered: `param` names it (tools.N...), `why` says what is wrong."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param, self.why = param, why


def check_tools(tools: list[dict]) -> list[str]:
    """The functions' names, once each tool is a function with a name and an object schema for its parameters.

    Raises:
        ToolError: naming the tool (tools.N...) and what is wrong: not a function, no name, a name given twice,
            parameters that are not a JSON Schema the grammar engine reads.
    """
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ToolError(f"tools.{i}", 'a tool is {"type": "function", "function": {...}}')
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools.{i}.function.name", f"1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ToolError(f"tools.{i}.function.name", f"{name!r} is named twice")
        problem = schema_error(parameters(tool))
        if problem is not None:
            raise ToolError(f"tools.{i}.function.parameters", problem)
        names.append(name)
    return names


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (an object with any properties where it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def calls_constraint(fmt: CallFormat, tools: list[dict], parallel: bool = True) -> Constraint:
    """A grammar for a reply that is only tool calls to `tools`, written as `fmt` writes them: one call, or
    (with `parallel` where the format joins calls) one or more.

    Args:
        fmt: the template's call format.
        tools: the tools the reply may call (one, for a named tool_choice).
        parallel: whether several calls may follow one another.
    """
    bodies = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, fmt.arguments: parameters(t)},
               "required": ["name", fmt.arguments], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": JSON_LAYOUT, **({"anyOf": bodies} if len(bodies) > 1 else bodies[0])}
    call = f"{_literal(fmt.prefix)} body {_literal(fmt.suffix)}".strip()
    more = f" ({_literal(fmt.separator)} call)*" if parallel and fmt.separator is not None else ""
    return Constraint.lark(f"start: call{more}\ncall: {call}\nbody: %json {json.dumps(schema)}\n")


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def text_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template without tools of its own: the tools listed in the system message,
    each call written into its assistant message as TEXT_FORMAT writes it, each result a user message
    in <tool_response> tags.

    Args:
        messages: OpenAI-shaped messages (assistant tool_calls with arguments as objects, tool results).
        tools: the tools, or None.
    """
    out = [dict(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        note = ("You may call these tools, one JSON object a call in <tool_call></tool_call> tags:\n"
                f"{listing}")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    written = []
    for m in out:
        if m["role"] == "tool":
            written.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(TEXT_FORMAT, c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            text = TEXT_FORMAT.separator.join(calls)
            written.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m.get("content") else text})
        else:
            written.append({"role": m["role"], "content": m.get("content") or ""})
    return written


def _call_text(fmt: CallFormat, name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, fmt.arguments: arguments}, ensure_ascii=False)
    return fmt.prefix + body + fmt.suffix


def call_format(template, turn_end: str | None) -> CallFormat | None:
    """How a Jinja template writes tool calls, read from its own rendering, or None where it writes none.

    Args:
        template: a JinjaChatTemplate.
        turn_end: the special token it writes after a reply (JinjaChatTemplate.turn_ends), where it has one.
    """
    return _format_of(template.source, tuple(sorted(template.tokens.items())), turn_end)


@functools.lru_cache(maxsize=16)
def _format_of(source: str, tokens: tuple, turn_end: str | None) -> CallFormat | None:
    from .tokenizer.chat_template import JinjaChatTemplate

    template = JinjaChatTemplate(source, dict(tokens))
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": PROBE, "description": "a probe", "parameters": schema}}
    user = {"role": "user", "content": "hi"}

    def reply(*xs: int) -> str | None:
        calls = [{"id": f"call_{x}", "type": "function", "function": {"name": PROBE, "arguments": {"x": x}}}
                 for x in xs]
        try:
            before = template.render([user], add_generation_prompt=True, tools=[tool])[0]
            whole = template.render([user, {"role": "assistant", "content": "", "tool_calls": calls}], tools=[tool])[0]
        except ChatError:
            return None
        return whole[len(before):] if whole.startswith(before) else None

    one = reply(1)
    found = _find_call(one, 0) if one else None
    if found is None:
        return None
    start, end, key = found
    rest = one[end:]
    cut = rest.find(turn_end) if turn_end else -1
    fmt = CallFormat(one[:start], rest[:cut] if cut >= 0 else rest.rstrip(), None, key)
    two = reply(1, 2)
    first = one[:end] + fmt.suffix
    if two and two.startswith(first):
        second = _find_call(two, len(first))
        if second is not None and two[:second[0]].endswith(fmt.prefix):
            fmt = CallFormat(fmt.prefix, fmt.suffix, two[len(first):second[0] - len(fmt.prefix)], key)
    return fmt


def _find_call(text: str, at: int) -> tuple[int, int, str] | None:
    """(start, end, the arguments' key) of the first probe call's JSON in text from `at`, or None."""
    name = text.find(json.dumps(PROBE), at)
    start = text.rfind("{", at, name)
    if name < 0 or start < 0:
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    keys = [k for k, v in obj.items() if k != "name" and isinstance(v, dict)] if isinstance(obj, dict) else []
    return (start, end, keys[0]) if len(keys) == 1 and obj.get("name") == PROBE else None


# the start of a call's JSON: its name, then the arguments' key
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')


class CallStream:
    """A reply's text read as it streams: its content, and the tool calls in it as OpenAI's deltas (the
    first of a call with its id, type and name, then its arguments in pieces). Text that may begin a call is
    held back until it is settled; a call to a tool not given, or text that only looked like a call, stays
    content. Fed a whole reply at once it gives the same calls, so a streamed answer reassembles to the one
    not streamed.

    Args:
        fmt: how the template writes calls.
        names: the tools' names.
    """

    def __init__(self, fmt: CallFormat, names: list[str]) -> None:
        self.fmt, self.names = fmt, names
        self.marker = fmt.prefix.strip()
        self.state = "text"  # text, head (after a marker), arguments, tail (after the arguments)
        self.buffer = ""
        self.plain = False  # bare-JSON calls only: the reply began with text, so it holds no call
        self.calls: list[dict] = []  # {"id", "name", "arguments"}
        self.scan = _JsonEnd()

    def push(self, text: str) -> list[dict]:
        """The deltas `text` settles: {"content": ...} or {"tool_calls": [{index, id?, type?, function}]}."""
        self.buffer += text
        out: list[dict] = []
        while self.buffer:
            step = getattr(self, "_" + self.state)()
            if step is None:
                break
            out += step
        return out

    def finish(self) -> list[dict]:
        """The deltas of what is left at the end of the reply (an unfinished call keeps what it has)."""
        out = self.push("")
        rest, self.buffer = self.buffer, ""
        if self.state == "head":  # a marker, then no call
            rest = self.fmt.prefix.strip() + rest
        keep = rest.strip() if self.calls else rest  # blanks after the last call are no content
        if self.state in ("text", "head") and keep:
            out.append({"content": rest})
        return out

    def _text(self) -> list[dict] | None:
        if not self.marker:  # calls as bare JSON (Llama 3's): a reply that opens with "{" is one
            if not self.plain and not self.calls:
                if not self.buffer.strip():
                    return None
                if self.buffer.lstrip().startswith("{"):
                    self.state, self.buffer = "head", self.buffer.lstrip()
                    return []
                self.plain = True
            return self._content(len(self.buffer))
        at = self.buffer.find(self.marker)
        if at >= 0:  # the text before a call, without the blanks that lead up to it
            before = self._content(len(self.buffer[:at].rstrip()))
            self.buffer, self.state = self.buffer[self.buffer.find(self.marker) + len(self.marker):], "head"
            return before
        hold = next((k for k in range(min(len(self.marker) - 1, len(self.buffer)), 0, -1)
                     if self.buffer.endswith(self.marker[:k])), 0)
        # blanks wait for what follows them: dropped before a call, sent before more text
        ready = len(self.buffer[: len(self.buffer) - hold].rstrip())
        return self._content(ready) if ready else None

    def _content(self, n: int) -> list[dict]:
        text, self.buffer = self.buffer[:n], self.buffer[n:]
        return [{"content": text}] if text else []

    def _head(self) -> list[dict] | None:
        head = _HEAD.match(self.buffer)
        if head is not None and head.end() == len(self.buffer):
            return None  # blanks before the arguments may go on
        if head is None:
            if len(self.buffer) <= max(map(len, self.names), default=0) + 64:
                return None  # it may still become a call
            return self._not_a_call()
        name = json.loads(f'"{head.group(1)}"')
        if name not in self.names or head.group(2) != self.fmt.arguments:
            return self._not_a_call()
        self.buffer, self.state, self.scan = self.buffer[head.end():], "arguments", _JsonEnd()
        self.calls.append({"id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": ""})
        return [{"tool_calls": [{"index": len(self.calls) - 1, "id": self.calls[-1]["id"], "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _not_a_call(self) -> list[dict]:
        self.state, self.plain = "text", True
        text, self.buffer = self.fmt.prefix.strip() + self.buffer, ""
        return [{"content": text}]

    def _arguments(self) -> list[dict]:
        end = self.scan.feed(self.buffer)
        piece = self.buffer if end is None else self.buffer[:end]
        self.buffer = "" if end is None else self.buffer[end:]
        if end is not None:
            self.state = "tail"
        self.calls[-1]["arguments"] += piece
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]}] if piece else []

    def _tail(self) -> list[dict] | None:
        """The call's closing brace and the format's suffix, once they are there."""
        suffix = self.fmt.suffix.strip()
        close = re.match(r"\s*\}\s*", self.buffer)
        if close is None or (close.end() == len(self.buffer) and suffix):
            return None if not self.buffer.strip() or close is not None else self._after(0)
        rest = self.buffer[close.end():]
        if suffix and len(rest) < len(suffix) and suffix.startswith(rest):
            return None
        return self._after(close.end() + (len(suffix) if suffix and rest.startswith(suffix) else 0))

    def _after(self, n: int) -> list[dict]:
        self.buffer, self.state = self.buffer[n:], "text"
        return []


class _JsonEnd:
    """Where a JSON value ends, read a piece at a time: feed(text) gives the index in text just past its
    end, or None while it goes on."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def read_calls(text: str, fmt: CallFormat, names: list[str]) -> tuple[str | None, list[dict]]:
    """A whole reply's content (None when it is only calls) and its calls ({"id", "name", "arguments"}).

    Args:
        text: the reply.
        fmt: how the template writes calls.
        names: the tools' names.
    """
    stream = CallStream(fmt, names)
    content = "".join(d.get("content", "") for d in stream.push(text) + stream.finish())
    return content or None, stream.calls
