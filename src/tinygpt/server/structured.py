"""What a request says its text must be, and its tools: OpenAI's response_format (json_object, json_schema),
vLLM's structured_outputs (json, regex, choice, grammar) and its older guided_* fields, a chat request's
tools and tool_choice; each turned into one Constraint, compiled for the served model on a thread of its own
within ServerState.compile_seconds (decision 16: a request's grammar is bounded in time and size, and costs
the model thread and the other requests nothing).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..constrain import Constraint, Grammar, compile_grammar
from ..errors import GrammarError
from ..tokenizer.chat_template import JinjaChatTemplate
from ..toolcalls import TEXT_FORMAT, CallFormat, ToolError, call_format, calls_constraint, check_tools
from .protocol import ChatRequest, CompletionRequest, invalid_value
from .state import ServerState

# grammars compile here, two at a time: a burst of slow ones waits its turn rather than taking every CPU
_compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinygpt-grammar")


def requested(req: CompletionRequest | ChatRequest) -> tuple[Constraint, str] | None:
    """The constraint a request's response_format, structured_outputs or guided_* field asks for, with the
    field's name for errors; None for none.

    Raises:
        APIError: two fields given, or one whose value is no constraint (400 naming it).
    """
    given: list[tuple[str, str, object]] = []  # (param, kind, value)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", "json_schema", {"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        given.append(("response_format.json_schema.schema", "json_schema", fmt.json_schema.schema_ or {}))
    outputs = req.structured_outputs
    if outputs is not None:
        for name, kind, value in (("json", "json_schema", outputs.json_), ("regex", "regex", outputs.regex),
                                  ("choice", "choices", outputs.choice), ("grammar", "grammar", outputs.grammar),
                                  ("json_object", "json_schema", {"type": "object"} if outputs.json_object else None)):
            if value is not None:
                given.append((f"structured_outputs.{name}", kind, value))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choices"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, kind, getattr(req, name)))
    if len(given) > 1:
        raise invalid_value(given[1][0], f"one constraint a request: {given[0][0]} is given too")
    if not given:
        return None
    param, kind, value = given[0]
    try:
        return Constraint.given(**{kind: value}), param
    except GrammarError as e:
        raise invalid_value(param, str(e)) from None


async def compiled(state: ServerState, constraint: Constraint, param: str) -> Grammar:
    """The constraint compiled for the served model, off the model thread and the event loop, within
    state.compile_seconds (the thread goes on after a refusal until the engine's fuel ends its work).

    Raises:
        APIError: 400 naming `param`: it does not compile, the vocabulary cannot write it, or it took too long.
    """
    model_vocab = state.model.config.vocab_size
    future = _compiler.submit(compile_grammar, state.tokenizer, constraint, model_vocab, state.stop_tokens)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), state.compile_seconds)
    except TimeoutError:
        raise invalid_value(param, f"took more than {state.compile_seconds:g} s to compile; simplify it") from None
    except GrammarError as e:
        raise invalid_value(param, str(e)) from None


@dataclass
class ToolPlan:
    """A chat request's messages as the template is given them, and how its calls are read.

    messages: OpenAI's messages as transformers passes them to a template (a call's arguments an object).
    tools: the tools as sent (OpenAI's function objects), or None.
    text: whether the tools and calls are written into the messages (TEXT_FORMAT: a template without tools),
        rather than given to a Jinja template.
    fmt, names: how calls are written and the tools' names, where the reply is read for calls.
    constraint: the grammar of the calls when tool_choice requires them.
    """

    messages: list[dict]
    tools: list[dict] | None = None
    text: bool = False
    fmt: CallFormat | None = None
    names: list[str] = field(default_factory=list)
    constraint: Constraint | None = None


def tool_plan(state: ServerState, req: ChatRequest) -> ToolPlan:
    """What a chat request's tools and messages become (runs a template's renderings: a worker thread's job).

    Raises:
        APIError: tools whose schema is malformed, a call whose arguments are not JSON, a template that
            writes no tool calls (400 naming the field).
    """
    tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None
    plan = ToolPlan([_message(m, i) for i, m in enumerate(req.messages)], tools)
    try:
        plan.names = check_tools(tools or [])
    except ToolError as e:
        raise invalid_value(e.param, e.why) from None
    with_tools = tools is not None or any(m.role == "tool" or m.tool_calls for m in req.messages)
    if isinstance(state.template, JinjaChatTemplate):
        if tools is not None:
            ends = state.template.turn_ends(state.tokenizer)
            plan.fmt = call_format(state.template, ends[0] if ends else None)
            if plan.fmt is None:
                raise invalid_value("tools", f"the chat template of '{state.model_name}' writes no tool calls")
    elif with_tools:
        plan.text, plan.fmt = True, TEXT_FORMAT
    mode = req.tool_mode
    if mode == "none" or not plan.names:
        plan.fmt = None
    elif mode in ("required", "named"):
        chosen = [t for t in tools if mode == "required" or t["function"]["name"] == req.tool_choice.function.name]
        plan.constraint = calls_constraint(plan.fmt, chosen, parallel=mode == "required"
                                           and req.parallel_tool_calls is not False)
    return plan


def _message(m, i: int) -> dict:
    """A message as transformers' apply_chat_template takes it: the fields sent, content as text, a call's
    arguments as an object, "developer" as "system"."""
    out = m.model_dump(exclude_unset=True, exclude_none=True)
    out["role"] = "system" if m.role == "developer" else m.role
    if m.content is not None:
        out["content"] = m.text
    for j, call in enumerate(out.get("tool_calls", [])):
        try:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        except ValueError as e:
            raise invalid_value(f"messages.{i}.tool_calls.{j}.function.arguments", f"not JSON ({e})") from None
    return out


def one_constraint(plan: ToolPlan, req: ChatRequest) -> tuple[Constraint, str] | None:
    """The chat request's one constraint: its tool calls' grammar or its response format's.

    Raises:
        APIError: both asked for.
    """
    asked = requested(req)
    if plan.constraint is not None and asked is not None:
        raise invalid_value(asked[1], f"tool_choice {req.tool_mode} constrains the reply to tool calls already")
    return (plan.constraint, "tool_choice") if plan.constraint is not None else asked

