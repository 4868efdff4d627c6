"""POST /v1/chat/completions: the messages written in the run's own chat template, or for any other
model in the plain-text one ("User: ... Assistant:"), and the assistant's turn generated."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..errors import ChatError, TokenizerError
from ..tokenizer.chat import render_chat_prompt
from .protocol import CHAT_COMPLETIONS, CHAT_STOPS, APIError, ChatRequest, Message, chat_prompt, invalid_value
from .reply import generate
from .state import ServerState, authorized, body

router = APIRouter()


@router.post(CHAT_COMPLETIONS)
async def chat_completions(request: Request, req: Annotated[ChatRequest, Depends(body(ChatRequest))],
                           state: Annotated[ServerState, Depends(authorized)]) -> Response:
    state.check_choices(req.n or 1)
    why = state.chat_error(m.role for m in req.messages)
    if why is not None:
        raise APIError(400, why, param="model", code="chat_template_unsupported")
    settings = state.settings(req, req.max_completion_tokens or req.max_tokens, state.max_tokens)
    top = req.top_logprobs or 0
    if state.template is None:
        ids = await run_in_threadpool(_plain_chat_ids, state, req.messages)
        settings.update(stop=CHAT_STOPS + req.stops, logprobs=top if req.logprobs else None)
    else:
        ids = await run_in_threadpool(_render, state, req.messages)
        settings.update(stop=req.stops, logprobs=top if req.logprobs else None)
    return await generate(state, request, req, [ids], settings, chat=True)


def _plain_chat_ids(state: ServerState, messages: list[Message]) -> list[int]:
    """The messages in the plain-text chat template (chat_prompt), encoded."""
    try:
        return state.tokenizer.encode(chat_prompt(messages))
    except TokenizerError as e:
        raise _message_error(state, messages, e) from None


def _render(state: ServerState, messages: list[Message]) -> list[int]:
    """The run's own template over the messages, ending with the assistant's start ("developer" is the system)."""
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
    try:
        return render_chat_prompt(state.tokenizer, plain)
    except TokenizerError as e:
        raise _message_error(state, messages, e) from None
    except ChatError as e:
        raise invalid_value("messages", str(e)) from None


def _message_error(state: ServerState, messages: list[Message], error: TokenizerError) -> APIError:
    """A 400 naming the first message whose content the tokenizer refuses, with positions in that
    content: the template's own text around it is not the client's."""
    for i, m in enumerate(messages):
        try:
            state.tokenizer.encode(m.text)
        except TokenizerError as e:
            return invalid_value(f"messages.{i}.content", str(e))
    return invalid_value("messages", str(error))
