"""GET (or HEAD) /health: the model's shape and the server's settings and load; 503 once the model
thread has died or while the server drains, so that a load balancer stops sending it work."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from .state import ServerState, server_state

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
async def health(state: Annotated[ServerState, Depends(server_state)]) -> JSONResponse:
    failure, draining = state.scheduler.failure, state.scheduler.draining
    cfg = state.model.config
    chat_error = state.chat_error()
    body = {"status": "error" if failure else "draining" if draining else "ok", "model": state.model_name,
            "block_size": cfg.block_size, "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "max_tokens": state.max_tokens, "auth": state.auth,
            "chat": chat_error is None, "chat_template": state.chat_format()["kind"],
            **state.scheduler.stats()}
    if chat_error:
        body["chat_error"] = chat_error
    if failure:
        body["error"] = failure
    return JSONResponse(body, status_code=503 if failure or draining else 200)
