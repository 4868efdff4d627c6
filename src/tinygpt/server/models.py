"""GET /v1/models and /v1/models/{name}: the one model this server serves, as OpenAI's model card with
its context length and how chat writes its messages."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from .state import ServerState, authorized

router = APIRouter()


@router.get("/v1/models")
async def models(state: Annotated[ServerState, Depends(authorized)]) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [state.model_card()]})


@router.get("/v1/models/{name:path}")
async def model_info(name: str, state: Annotated[ServerState, Depends(authorized)]) -> JSONResponse:
    state.check_model(name)
    return JSONResponse(state.model_card())
