"""POST /v1/chat/completions: the messages written in the run's own chat template, or for any other
model in the plain-text one ("User: ... Assistant:"), and the assistant's turn generated; with tools, the
template is given them (or, without tools of its own, the messages carry them as text) and the reply's
calls are read back as OpenAI's tool_calls (tinygpt.server.structured)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..errors import ChatError, TokenizerError
from ..tokenizer.chat import render_chat_prompt
from ..toolcalls import text_messages
from .protocol import CHAT_COMPLETIONS, CHAT_STOPS, APIError, ChatRequest, Message, chat_prompt, invalid_value
from .reply import generate
from .state import ServerState, authorized, body
from .structured import ToolPlan, compiled, one_constraint, tool_plan

router = APIRouter()


@router.post(CHAT_COMPLETIONS)
async def chat_completions(request: Request, req: Annotated[ChatRequest, Depends(body(ChatRequest))],
                           state: Annotated[ServerState, Depends(authorized)]) -> Response:
    state.check_choices(req.n or 1)
    plan = await run_in_threadpool(tool_plan, state, req)
    roles = {"user" if m["role"] == "tool" else m["role"] for m in plan.messages}
    why = state.chat_error(sorted(roles))
    if why is not None:
        raise APIError(400, why, param="model", code="chat_template_unsupported")
    settings = state.settings(req, req.max_completion_tokens or req.max_tokens, state.max_tokens)
    top = req.top_logprobs or 0
    constraint = one_constraint(plan, req)
    grammar = await compiled(state, *constraint) if constraint is not None else None
    if state.template is None:
        ids = await run_in_threadpool(_plain_chat_ids, state, plan)
        settings.update(stop=CHAT_STOPS + req.stops)
    else:
        ids = await run_in_threadpool(_render, state, plan)
        settings.update(stop=req.stops)
    settings.update(logprobs=top if req.logprobs else None, grammar=grammar)
    calls = (plan.fmt, plan.names) if plan.fmt is not None else None
    return await generate(state, request, req, [ids], settings, chat=True, calls=calls)


def _plain_chat_ids(state: ServerState, plan: ToolPlan) -> list[int]:
    """The messages in the plain-text chat template (chat_prompt), encoded; tools, calls and results written
    into them as text."""
    written = text_messages(plan.messages, plan.tools) if plan.text else plan.messages
    messages = [Message(role=m["role"], content=m["content"]) for m in written]
    try:
        return state.tokenizer.encode(chat_prompt(messages))
    except TokenizerError as e:
        raise _message_error(state, plan.messages, e) from None


def _render(state: ServerState, plan: ToolPlan) -> list[int]:
    """The run's own template over the messages, ending with the assistant's start (a Jinja template with the
    tools)."""
    try:
        return render_chat_prompt(state.tokenizer, plan.messages, plan.tools)
    except TokenizerError as e:
        raise _message_error(state, plan.messages, e) from None
    except ChatError as e:
        raise invalid_value("messages", str(e)) from None


def _message_error(state: ServerState, messages: list[dict], error: TokenizerError) -> APIError:
    """A 400 naming the first message whose content the tokenizer refuses, with positions in that
    content: the template's own text around it is not the client's."""
    for i, m in enumerate(messages):
        try:
            state.tokenizer.encode(m.get("content") or "")
        except TokenizerError as e:
            return invalid_value(f"messages.{i}.content", str(e))
    return invalid_value("messages", str(error))
