"""The playground: the web page at / and tinygpt's own POST /v1/tinygpt/attention, one head's attention
weights over a text, which the page draws."""

from __future__ import annotations

import asyncio
from functools import cache
from importlib import resources
from typing import Annotated

import torch
from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from .protocol import AttentionRequest, invalid_value
from .refusals import scheduler_errors
from .state import ServerState, authorized, body

ATTENTION_MAX_TOKENS = 256  # the attention view shows at most the last 256 tokens
# the page may talk only to this server
PAGE_POLICY = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"})


@cache
def _page() -> str:
    """The page, read from the package once."""
    return resources.files(__package__).joinpath("playground.html").read_text(encoding="utf-8")


@router.post("/v1/tinygpt/attention")
async def attention(req: Annotated[AttentionRequest, Depends(body(AttentionRequest))],
                    state: Annotated[ServerState, Depends(authorized)]) -> JSONResponse:
    cfg = state.model.config
    if req.layer >= cfg.n_layer:
        raise invalid_value("layer", f"the model has layers 0..{cfg.n_layer - 1}")
    if req.head >= cfg.n_head:
        raise invalid_value("head", f"the model has heads 0..{cfg.n_head - 1}")
    if not req.prompt:
        raise invalid_value("prompt", "must not be empty")
    ids = await run_in_threadpool(state.encode, req.prompt, "prompt")
    keep = ids[-min(state.block_size, ATTENTION_MAX_TOKENS) :]
    device = next(state.model.parameters()).device

    def run() -> list[list[float]]:
        _, weights = state.model(torch.tensor([keep], device=device), return_attention=True)
        w = weights[req.layer][0, req.head].float().cpu()  # (T, T), row t attends to 0..t
        return [[round(v, 5) for v in w[t, : t + 1].tolist()] for t in range(len(keep))]

    with scheduler_errors():
        rows = await asyncio.wrap_future(state.scheduler.call(run))
    return JSONResponse({"object": "tinygpt.attention", "model": state.model_name, "layer": req.layer,
                         "head": req.head, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "prompt_tokens": len(ids),
                         "truncated": len(keep) < len(ids), "tokens": [state.token_text(i) for i in keep],
                         "token_ids": keep, "attention": rows})
