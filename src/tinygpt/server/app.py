"""The HTTP app: OpenAI's /v1 routes, tinygpt's attention route, the playground page and /health,
built the way FastAPI builds an app: a router a family of endpoints (completions, chat, models,
health, the playground), the shared ServerState in `app.state` handed to each route by a dependency
(with the API key checked there), the guard and admission middleware in front, and one error shape.

Each generating request becomes one Sequence per choice, handed to the Scheduler's model thread
(tinygpt.server.reply answers with its events).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError
from ..prompt_cache import PromptCache
from . import chat, completions, health, models, playground
from .guard import Admission, RequestGuard, host_name
from .protocol import APIError
from .scheduler import Scheduler
from .state import ServerState

PROMPT_CACHE_BYTES = 512 * 2**20  # the prompt cache's default budget
ROUTERS = (playground.router, health.router, models.router, completions.router, chat.router)


def create_app(
    model,
    tokenizer,
    *,
    model_name: str,
    api_key: str | None = None,
    max_concurrency: int = 8,
    max_queue: int = 32,
    max_tokens: int = 2048,
    cors_origins: Iterable[str] = (),
    trusted_hosts: Iterable[str] | None = None,
    prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
    speculation: dict | None = None,
) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving one model.

    Args:
        model: a tinygpt GPT (eval mode, on the device it should run on).
        tokenizer: the model's tokenizer (text in and out; its eot_id ends a generation).
        model_name: the name clients pass as `model`; any other name is a 404.
        api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>` (401 otherwise);
            the playground page and /health stay public.
        max_concurrency: sequences decoded together in one batched step.
        max_queue: sequences that may wait for a free slot; past that, 429 with Retry-After.
        max_tokens: the largest max_tokens a request may ask for (and chat's default).
        cors_origins: origins allowed to call the API from a browser ("*" for any); none: CORS off.
            A POST to /v1 whose body is not JSON (a form or text/plain, which a browser sends from
            any page without asking) is refused with 403 when it comes from another origin.
        trusted_hosts: None: any Host header. Otherwise (what `tinygpt serve` passes when bound to a
            loopback address) requests must name a loopback address, `localhost` or one of these
            names in their Host header, or get 421: a web page cannot reach the server through a
            DNS name rebound to 127.0.0.1.
        prompt_cache_bytes: the keys and values of finished sequences kept for prompts that begin as they
            do (a conversation's next turn), at most this many bytes, the least recently used dropped
            first; 0 keeps none.
        speculation: speculative decoding for each sequence that decodes alone: tinygpt.speculative.speculator's
            arguments (draft, speculate, prompt_lookup); each answer's usage then reports what it did
            (completion_tokens_details' accepted and rejected prediction tokens, and `speculation`).

    Raises:
        ConfigError: a setting out of range, speculation that does not fit the model, or a KV cache too
            large for the device (it is allocated here, before any request can be answered).
    """
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError("model_name must be a non-empty string")
    if max_concurrency < 1 or max_queue < 0 or max_tokens < 1:
        raise ConfigError("max_concurrency and max_tokens must be >= 1 and max_queue >= 0")
    if api_key is not None and not api_key:
        raise ConfigError("api_key must not be empty")
    if prompt_cache_bytes < 0:
        raise ConfigError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
    cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None
    scheduler = Scheduler(model, tokenizer, max_concurrency=max_concurrency, max_queue=max_queue,
                          prompt_cache=cache, speculation=speculation)
    scheduler.allocate()
    state = ServerState(model, tokenizer, model_name, api_key, max_tokens, scheduler)
    app = FastAPI(title="tinygpt", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.scheduler = scheduler
    app.state.model_name = model_name
    _add_middleware(app, state, list(cors_origins), trusted_hosts)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The model thread runs while the app does: started before the first request, stopped after the last."""
    app.state.scheduler.start()
    yield
    await run_in_threadpool(app.state.scheduler.stop)


def _add_middleware(app: FastAPI, state: ServerState, origins: list[str], trusted_hosts: Iterable[str] | None) -> None:
    """Admission, CORS where origins are given, and the guard, innermost to outermost (each added wraps the last)."""
    # innermost of the middleware, so that CORS headers (added outside it) reach a browser's 429 too
    app.add_middleware(Admission, server=state)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    # outermost: a request for another host, or a cross-site form post, meets nothing else of the app
    app.add_middleware(RequestGuard, origins=frozenset(origins),
                       hosts=None if trusted_hosts is None else frozenset(host_name(h) for h in trusted_hosts))


# -- every error in OpenAI's shape -------------------------------------------------------------


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if e.status_code == 404:
        err = APIError(404, f"Unknown URL: {request.method} {request.url.path}", code="unknown_url")
    elif e.status_code == 405:
        err = APIError(405, f"Method {request.method} is not allowed for {request.url.path}",
                       code="method_not_allowed")
    else:
        err = APIError(e.status_code, str(e.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(e, "headers", None))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    err = APIError(500, "internal server error", type="server_error")
    return JSONResponse(err.body(), status_code=500)
