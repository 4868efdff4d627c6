"""The HTTP app: OpenAI's /v1 routes, tinygpt's attention route, the playground page and /health.

Each generating request becomes one Sequence per choice, handed to the Scheduler's model thread;
the model thread reports text back through an asyncio queue per request, so the event loop only
moves bytes and never waits on the model. Streamed and non-streamed answers are assembled from
the same events, so at temperature 0 they carry the same text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, contextmanager
from functools import lru_cache
from importlib import resources

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SampleConfig
from ..errors import ChatError, ConfigError, TokenizerError
from ..tokenizer import IncrementalDecoder, render_chat_prompt, stop_ids
from .protocol import (
    CHAT_STOPS,
    APIError,
    AttentionRequest,
    ChatRequest,
    CompletionRequest,
    Message,
    ValidationError,
    chat_prompt,
    invalid_value,
    validation_error,
)
from .scheduler import (
    Draining,
    Event,
    ModelDown,
    QueueFull,
    Scheduler,
    Sequence,
    TokenInfo,
    score_windows,
    scoring_windows,
)

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
MAX_BODY_BYTES = 2 * 1024 * 1024  # larger bodies get 413
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
ATTENTION_MAX_TOKENS = 256  # the attention view shows at most the last 256 tokens
SCORE_MAX_TOKENS = 65536  # prompt tokens one request may have scored (echo with logprobs), n copies counted
SCORE_WINDOWS_PER_CALL = 8  # context windows scored per turn of the model thread: decoding goes on between
_GONE = object()  # queued when the client disconnects


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

    Raises:
        ConfigError: a setting out of range, or a KV cache too large for the device (it is
            allocated here, before any request can be answered).
    """
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError("model_name must be a non-empty string")
    if max_concurrency < 1 or max_queue < 0 or max_tokens < 1:
        raise ConfigError("max_concurrency and max_tokens must be >= 1 and max_queue >= 0")
    if api_key is not None and not api_key:
        raise ConfigError("api_key must not be empty")
    scheduler = Scheduler(model, tokenizer, max_concurrency=max_concurrency, max_queue=max_queue)
    scheduler.allocate()
    server = _Server(model, tokenizer, model_name, api_key, max_tokens, scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        yield
        await run_in_threadpool(server.scheduler.stop)

    app = FastAPI(title="tinygpt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = server.scheduler
    app.state.model_name = model_name
    # innermost of the middleware, so that CORS headers (added outside it) reach a browser's 429 too
    app.add_middleware(_Admission, server=server)
    origins = list(cors_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    # outermost: a request for another host, or a cross-site form post, meets nothing else of the app
    app.add_middleware(_Guard, origins=frozenset(origins),
                       hosts=None if trusted_hosts is None else frozenset(_host_name(h) for h in trusted_hosts))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            err = APIError(404, f"Unknown URL: {request.method} {request.url.path}", code="unknown_url")
        elif e.status_code == 405:
            err = APIError(405, f"Method {request.method} is not allowed for {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(e.status_code, str(e.detail))
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        err = APIError(500, "internal server error", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    page = resources.files(__package__).joinpath("playground.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        # the page may talk only to this server
        csp = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"
        return HTMLResponse(page, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache"})

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> JSONResponse:
        failure, draining = server.scheduler.failure, server.scheduler.draining
        cfg = model.config
        chat_error = server.chat_error()
        body = {"status": "error" if failure else "draining" if draining else "ok", "model": model_name,
                "block_size": cfg.block_size, "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer,
                "n_head": cfg.n_head, "max_tokens": max_tokens, "auth": api_key is not None,
                "chat": chat_error is None, "chat_template": server.chat_format()["kind"],
                **server.scheduler.stats()}
        if chat_error:
            body["chat_error"] = chat_error
        if failure:
            body["error"] = failure
        return JSONResponse(body, status_code=503 if failure or draining else 200)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str, request: Request) -> JSONResponse:
        server.authorize(request)
        server.check_model(name)
        return JSONResponse(server.model_card())

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        req = await server.parse(request, CompletionRequest)
        return await server.complete(request, req)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        req = await server.parse(request, ChatRequest)
        return await server.chat(request, req)

    @app.post("/v1/tinygpt/attention")
    async def attention(request: Request) -> JSONResponse:
        req = await server.parse(request, AttentionRequest)
        return JSONResponse(await server.attention(req))

    return app


class _Server:
    """What the routes share: the model, its settings, the scheduler."""

    def __init__(self, model, tokenizer, model_name: str, api_key: str | None, max_tokens: int,
                 scheduler: Scheduler) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._key = api_key.encode("utf-8") if api_key is not None else None
        self.max_tokens = max_tokens
        self.scheduler = scheduler
        self.block_size = model.config.block_size
        # ids the tokenizer can decode (a model's vocabulary may be padded beyond it)
        self.vocab_size = min(model.config.vocab_size, tokenizer.vocab_size)
        # a generation ends at <|endoftext|> and, for a run trained on chat data, at its end of turn (a
        # completion too, as `tinygpt sample` stops there); such a run renders messages with its own
        # template, any other model gets the plain-text "User: ... Assistant:" prompt
        self.stop_tokens = stop_ids(tokenizer)
        self.template = getattr(tokenizer, "chat_template", None)
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.encodable = lru_cache(maxsize=4096)(self._encodable)

    # -- request checks ----------------------------------------------------------------------

    def authorized(self, header: str) -> bool:
        """Whether an Authorization header value carries the API key (always, when there is none)."""
        if self._key is None:
            return True
        scheme, _, token = header.partition(" ")
        # header values arrive decoded as latin-1: encoding back gives the bytes that were sent
        given = token.strip().encode("latin-1", errors="replace")
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._key)

    def authorize(self, request: Request) -> None:
        if not self.authorized(request.headers.get("authorization", "")):
            raise APIError(401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def parse(self, request: Request, kind):
        """Authorize, refuse while draining, read at most MAX_BODY_BYTES, validate the JSON."""
        self.authorize(request)
        if self.scheduler.failure is not None:
            raise _model_down(self.scheduler.failure)
        if self.scheduler.draining:
            raise _unavailable()
        if kind is not AttentionRequest and not self.scheduler.has_room(1):
            raise _busy(1)  # filled up since _Admission let it through: still before reading the body
        length = request.headers.get("content-length")
        if length is not None and _is_uint(length) and _uint_at_most(length, MAX_BODY_BYTES) is None:
            raise _too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise _too_large()
        try:
            req = kind.model_validate_json(bytes(body))
        except ValidationError as e:
            raise validation_error(e) from None
        if hasattr(req, "check"):
            req.check()
        self.check_model(req.model)
        return req

    def encode(self, text: str, param: str) -> list[int]:
        try:
            ids = self.tokenizer.encode(text)
        except TokenizerError as e:
            raise invalid_value(param, str(e)) from None
        return ids or self.start_ids(param)

    def _encodable(self, char: str) -> bool:
        try:
            return bool(self.tokenizer.encode(char))
        except TokenizerError:
            return False

    def chat_error(self, roles: Iterable[str] = ("user",)) -> str | None:
        """Why the chat template cannot be written, for messages of these roles, in this model's
        vocabulary (a character model whose corpus lacks 'U' or ':'), or None when it can."""
        if self.template is not None:  # its special tokens are in the vocabulary by construction
            return None
        template = chat_prompt([Message(role=role, content="") for role in roles])
        missing = [c for c in sorted(set(template)) if not self.encodable(c)]
        if not missing:
            return None
        return (f"The model '{self.model_name}' cannot chat: its vocabulary cannot express the chat template "
                f"{template!r}, which needs the characters {', '.join(repr(c) for c in missing)}; use "
                "/v1/completions with a prompt in the model's own characters")

    def start_ids(self, param: str) -> list[int]:
        """What an empty prompt starts from: <|endoftext|> where the tokenizer has it, else a newline."""
        if self.tokenizer.eot_id is not None:
            return [self.tokenizer.eot_id]
        try:
            return self.tokenizer.encode("\n")
        except TokenizerError:
            raise invalid_value(param, "must not be empty for this model") from None

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise invalid_value(param, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def settings(self, req, max_tokens: int | None, default_max_tokens: int) -> dict:
        """Per-sequence settings shared by every choice of a request."""
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is not None and max_tokens > self.max_tokens:
            raise invalid_value(param, f"at most {self.max_tokens} on this server, got {max_tokens}")
        bias = None
        if req.logit_bias:
            bias = {}
            for key, value in req.logit_bias.items():
                token = _uint_at_most(key, self.vocab_size - 1)
                if token is None:
                    shown = repr(key) if len(key) <= 40 else f"{key[:20]!r}... ({len(key):,} characters)"
                    raise invalid_value("logit_bias", f"{shown} is not a token id in 0..{self.vocab_size - 1}")
                bias[token] = value
        sampling = SampleConfig(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        )
        return dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens, sampling=sampling,
                    stop_tokens=self.stop_tokens, presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0, logit_bias=bias)

    # -- routes ------------------------------------------------------------------------------

    async def complete(self, request: Request, req: CompletionRequest) -> Response:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt[0], str):
            prompts = list(prompt)
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        self.check_choices(len(prompts) * (req.n or 1))

        def encode_all() -> list[list[int]]:
            return [self.encode(p, "prompt") if isinstance(p, str) else self.check_ids(p, "prompt")
                    for p in prompts]

        ids = await run_in_threadpool(encode_all)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        settings = self.settings(req, req.max_tokens, DEFAULT_COMPLETION_TOKENS)
        settings.update(stop=req.stops, logprobs=req.logprobs)
        scored = None
        if req.echo and req.logprobs is not None:
            # an empty prompt starts from a token of the server's choosing, which is not in the echoed text
            try:
                scored = await self.score(request, [i if p else [] for p, i in zip(prompts, ids)], req.logprobs,
                                          req.n or 1)
            except _ClientGone:
                return JSONResponse({})  # nobody is there to read it
        return await self.generate(request, req, ids, settings, chat=False, echo=echo, scored=scored)

    async def chat(self, request: Request, req: ChatRequest) -> Response:
        self.check_choices(req.n or 1)
        why = self.chat_error(m.role for m in req.messages)
        if why is not None:
            raise APIError(400, why, param="model", code="chat_template_unsupported")
        settings = self.settings(req, req.max_completion_tokens or req.max_tokens, self.max_tokens)
        top = req.top_logprobs or 0
        if self.template is None:
            ids = await run_in_threadpool(self.plain_chat_ids, req.messages)
            settings.update(stop=CHAT_STOPS + req.stops, logprobs=top if req.logprobs else None)
        else:
            ids = await run_in_threadpool(self.render, req.messages)
            settings.update(stop=req.stops, logprobs=top if req.logprobs else None)
        return await self.generate(request, req, [ids], settings, chat=True)

    def plain_chat_ids(self, messages: list[Message]) -> list[int]:
        """The messages in the plain-text chat template (chat_prompt), encoded."""
        try:
            return self.tokenizer.encode(chat_prompt(messages))
        except TokenizerError as e:
            raise self.message_error(messages, e) from None

    def render(self, messages: list[Message]) -> list[int]:
        """The run's own template over the messages, ending with the assistant's start ("developer" is the system)."""
        plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
        try:
            return render_chat_prompt(self.tokenizer, plain)
        except TokenizerError as e:
            raise self.message_error(messages, e) from None
        except ChatError as e:
            raise invalid_value("messages", str(e)) from None

    def message_error(self, messages: list[Message], error: TokenizerError) -> APIError:
        """A 400 naming the first message whose content the tokenizer refuses, with positions in that
        content: the template's own text around it is not the client's."""
        for i, m in enumerate(messages):
            try:
                self.tokenizer.encode(m.text)
            except TokenizerError as e:
                return invalid_value(f"messages.{i}.content", str(e))
        return invalid_value("messages", str(error))

    def check_choices(self, count: int) -> None:
        """n times the number of prompts must fit; a full server answers 429 before any work."""
        limit = min(16, self.scheduler.max_concurrency + self.scheduler.max_queue)
        if count > limit:
            raise invalid_value("n", f"n times the number of prompts must be at most {limit}, got {count}")
        if not self.scheduler.has_room(count):
            raise _busy(1)

    async def score(self, request: Request, prompts: list[list[int]], top: int, n: int) -> list[list[TokenInfo]]:
        """Each prompt token's logprob and `top` alternatives, each predicted from as much of the
        prompt before it as the context holds (scoring_windows); the first token has none. The
        request holds its places in the scheduler meanwhile (a full server answers 429), and a client
        that leaves stops the scoring (raises _ClientGone)."""
        total = sum(len(ids) for ids in prompts) * n  # every choice carries its prompt's logprobs
        if total > SCORE_MAX_TOKENS:
            raise invalid_value("prompt", f"echo with logprobs scores at most {SCORE_MAX_TOKENS:,} "
                                f"prompt tokens per request (n times the prompts' tokens), got {total:,}")
        out = []
        with _scheduler_errors(), self.scheduler.hold(len(prompts) * n):
            for ids in prompts:
                out.append(await self._score_one(request, ids, top) if ids else [])
        return out

    async def _score_one(self, request: Request, ids: list[int], top: int) -> list[TokenInfo]:
        offsets = _text_offsets(self.tokenizer, ids)
        infos = [TokenInfo(ids[0], None, None, 0)]
        windows = scoring_windows(len(ids), self.block_size)
        for i in range(0, len(windows), SCORE_WINDOWS_PER_CALL):
            chunk = windows[i : i + SCORE_WINDOWS_PER_CALL]
            if await request.is_disconnected():
                raise _ClientGone()

            def run(chunk=chunk) -> list[TokenInfo]:
                return score_windows(self.model, ids, chunk, top, offsets, self.vocab_size)

            infos += await asyncio.wrap_future(self.scheduler.call(run))
        return infos

    async def generate(self, request: Request, req, prompts: list[list[int]], settings: dict, *, chat: bool,
                       echo: list[str] | None = None, scored: list[list[TokenInfo]] | None = None) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        held: list[Event] = []  # touched by the model thread only

        def put_all(events: list[Event]) -> None:
            for e in events:
                queue.put_nowait(e)

        def emit(event: Event) -> None:
            if req.stream:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            elif event.finish_reason is None and event.error is None:
                held.append(event)  # a whole answer is sent at once: wake the event loop only at the end
            else:
                events = [*held, event]
                held.clear()
                loop.call_soon_threadsafe(put_all, events)

        n = req.n or 1
        seqs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                seed = None if req.seed is None else (req.seed + index) % 2**64  # each choice its own stream
                # prompts longer than the context are cut to their last block_size tokens
                seqs.append(Sequence(prompt=ids[-self.block_size :], emit=emit, index=index, seed=seed, **settings))
        generating = settings["max_tokens"] > 0
        if not generating:  # nothing to generate (a prompt scored with echo): every choice ends now
            for s in seqs:
                queue.put_nowait(Event(s.index, finish_reason="length"))
        else:
            with _scheduler_errors():
                self.scheduler.submit(seqs)
        # the prompt tokens generation did not see; with nothing to generate there are none (a prompt
        # scored with echo and logprobs is read whole)
        dropped = sum(max(0, len(ids) - self.block_size) for ids in prompts) if generating else 0
        reply = _Reply(self, req, seqs, chat=chat, prompt_tokens=sum(map(len, prompts)), dropped=dropped,
                       echo=echo, n=n, scored=scored)

        def gone() -> None:
            self.scheduler.cancel(seqs)
            queue.put_nowait(_GONE)

        if req.stream:
            return _EventStream(reply.stream(request, queue, gone), on_close=lambda: self.scheduler.cancel(seqs))
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:
            return await reply.collect(queue)
        finally:
            watcher.cancel()
            self.scheduler.cancel(seqs)

    async def attention(self, req: AttentionRequest) -> dict:
        cfg = self.model.config
        if req.layer >= cfg.n_layer:
            raise invalid_value("layer", f"the model has layers 0..{cfg.n_layer - 1}")
        if req.head >= cfg.n_head:
            raise invalid_value("head", f"the model has heads 0..{cfg.n_head - 1}")
        if not req.prompt:
            raise invalid_value("prompt", "must not be empty")
        ids = await run_in_threadpool(self.encode, req.prompt, "prompt")
        keep = ids[-min(self.block_size, ATTENTION_MAX_TOKENS) :]
        device = next(self.model.parameters()).device

        def run() -> list[list[float]]:
            _, weights = self.model(torch.tensor([keep], device=device), return_attention=True)
            w = weights[req.layer][0, req.head].float().cpu()  # (T, T), row t attends to 0..t
            return [[round(v, 5) for v in w[t, : t + 1].tolist()] for t in range(len(keep))]

        with _scheduler_errors():
            rows = await asyncio.wrap_future(self.scheduler.call(run))
        return {"object": "tinygpt.attention", "model": self.model_name, "layer": req.layer, "head": req.head,
                "n_layer": cfg.n_layer, "n_head": cfg.n_head, "prompt_tokens": len(ids),
                "truncated": len(keep) < len(ids), "tokens": [self.token_text(i) for i in keep],
                "token_ids": keep, "attention": rows}

    # -- output ------------------------------------------------------------------------------

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tinygpt",
                "context_length": self.block_size, "chat_template": self.chat_format()}

    def chat_format(self) -> dict:
        """How /v1/chat/completions writes messages for this model: the run's template, or plain text."""
        if self.template is None:
            return {"kind": "plain", "prompt": chat_prompt([Message(role="user", content="...")]),
                    "stops": list(CHAT_STOPS)}
        return {"kind": "run", **self.template.to_dict(), "jinja": self.template.jinja()}

    def _token_text(self, token: int) -> str:
        """A token as text; bytes that are not UTF-8 on their own are written as OpenAI does: 'bytes:\\xe2\\x80'."""
        raw = self.tokenizer.decode_bytes([token])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class _Reply:
    """Turns a request's events into OpenAI's response or stream of chunks."""

    def __init__(self, server: _Server, req, seqs: list[Sequence], *, chat: bool, prompt_tokens: int,
                 dropped: int, echo: list[str] | None, n: int, scored: list[list[TokenInfo]] | None = None) -> None:
        self.server, self.req, self.seqs, self.chat = server, req, seqs, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.dropped = dropped
        self.completion_tokens = 0
        self.echo = echo
        self.n = n
        self.scored = scored  # per prompt: its tokens' logprobs (echo with logprobs)
        self.logprobs = seqs[0].logprobs is not None

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.dropped:  # prompts longer than the context were cut to their last block_size tokens
            usage["prompt_tokens_truncated"] = self.dropped
        return usage

    def echoed(self, index: int) -> tuple[str, list[TokenInfo]]:
        """Choice `index`'s echoed prompt text and the prompt tokens' logprobs ("" and [] without echo)."""
        if not self.echo:
            return "", []
        return self.echo[index // self.n], self.scored[index // self.n] if self.scored else []

    def generated(self, index: int, tokens: list[TokenInfo]) -> list[TokenInfo]:
        """Generated tokens with their text offsets moved past the echoed prompt: positions in the text."""
        start = len(self.echoed(index)[0])
        return [dataclasses.replace(t, offset=t.offset + start) for t in tokens] if start else tokens

    async def events(self, queue: asyncio.Queue) -> AsyncIterator[Event]:
        """Events until every choice has finished; raises APIError on a failure."""
        remaining = len(self.seqs)
        while remaining:
            event = await queue.get()
            if event is _GONE:
                raise _ClientGone()
            if event.error is not None:
                raise APIError(event.status, event.error, type="server_error",
                               code="service_unavailable" if event.status == 503 else None)
            if event.finish_reason is not None:
                remaining -= 1
                self.completion_tokens += event.completion_tokens
            yield event

    async def collect(self, queue: asyncio.Queue) -> JSONResponse:
        """The whole answer, once every choice has finished. It is built and rendered on a worker thread:
        with logprobs it can be tens of megabytes (16 choices of 2,048 tokens with 20 alternatives each:
        ~30 MB, seconds of work), and on the event loop that would stall every other request."""
        texts = [self.echoed(i)[0] for i in range(len(self.seqs))]
        tokens: list[list[TokenInfo]] = [list(self.echoed(i)[1]) for i in range(len(self.seqs))]
        finish = [None] * len(self.seqs)
        try:
            async for e in self.events(queue):
                texts[e.index] += e.text
                tokens[e.index] += self.generated(e.index, e.tokens)
                finish[e.index] = e.finish_reason or finish[e.index]
        except _ClientGone:
            return JSONResponse({})  # nobody is there to read it
        return await run_in_threadpool(lambda: JSONResponse(self.body(texts, tokens, finish)))

    def body(self, texts: list[str], tokens: list[list[TokenInfo]], finish: list[str | None]) -> dict:
        choices = []
        for i in range(len(self.seqs)):
            logprobs = self.format_logprobs(tokens[i]) if self.logprobs else None
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": logprobs, "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": finish[i]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices, "usage": self.usage()}

    async def stream(self, request: Request, queue: asyncio.Queue, gone) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:
            for i in range(len(self.seqs)):
                if self.chat:
                    yield self.chunk(i, "", [], None, role=True)
                elif self.echo:
                    yield self.chunk(i, *self.echoed(i), None)
            try:
                async for e in self.events(queue):
                    if e.text or e.tokens:
                        yield self.chunk(e.index, e.text, self.generated(e.index, e.tokens), None)
                    if e.finish_reason is not None:
                        yield self.chunk(e.index, "", [], e.finish_reason)
            except _ClientGone:
                return
            except APIError as e:
                yield _sse(e.body())
                return
            if include_usage:
                yield _sse({**self.header(), "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            self.server.scheduler.cancel(self.seqs)

    def header(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

    def chunk(self, index: int, text: str, tokens: list[TokenInfo], finish: str | None, role: bool = False) -> str:
        logprobs = self.format_logprobs(tokens) if self.logprobs and tokens else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {**self.header(), "choices": [choice]}
        if self.req.stream_options and self.req.stream_options.include_usage:
            body["usage"] = None
        return _sse(body)

    def format_logprobs(self, tokens: list[TokenInfo]) -> dict:
        text_of = self.server.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text = text_of(token)
                return {"token": text, "logprob": logprob, "bytes": list(self.server.tokenizer.decode_bytes([token]))}

            return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                                for t in tokens], "refusal": None}
        top: list[dict[str, float] | None] = []
        for t in tokens:
            if t.top is None:  # a prompt's first token: nothing predicts it
                top.append(None)
                continue
            best: dict[str, float] = {}
            for i, lp in t.top:  # two ids may share a text ('bytes:...'): keep the likelier
                best[text_of(i)] = max(lp, best.get(text_of(i), lp))
            top.append(best)
        # text_offset: where each token's text begins in the choice's text (a token that ends inside a
        # UTF-8 character adds nothing until the character is complete)
        return {"tokens": [text_of(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": top, "text_offset": [t.offset for t in tokens]}


class _Admission:
    """Answers 429 to a generating request while every slot and queue place is taken, before FastAPI
    routes it, reads its body or validates it: under a burst that is most of the requests, and the
    event loop (which also carries every running stream) should spend almost nothing on each.
    Requests that would get 401 or 503 go on to the app, which answers them in full."""

    def __init__(self, app, server: _Server) -> None:
        self.app, self.server = app, server
        err = _busy(1)
        self.body = json.dumps(err.body()).encode()
        self.start = {"type": "http.response.start", "status": err.status,
                      "headers": [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(self.body)).encode()),
                                  *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]}

    async def __call__(self, scope, receive, send) -> None:
        server = self.server
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in (COMPLETIONS, CHAT_COMPLETIONS)
                and not server.scheduler.draining and not server.scheduler.has_room(1)
                and server.authorized(_header(scope, b"authorization"))):
            await send(self.start)
            await send({"type": "http.response.body", "body": self.body})
            return
        await self.app(scope, receive, send)


class _Guard:
    """Refuses, before anything else runs, what a web page could make a browser send to a server on
    this machine: a request whose Host header names another site (DNS rebinding: the page's own name,
    rebound to 127.0.0.1), answered 421; and a POST to /v1 from another origin with a body a browser
    sends without asking first (text/plain, a form: anything but JSON), answered 403. A JSON body
    from another origin needs the browser's preflight, which CORS answers."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str]) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = self.refusal(scope)
            if err is not None:
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": err.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        host = _header(scope, b"host")
        if self.hosts is not None and not _trusted_host(host, self.hosts):
            shown = host if len(host) <= 100 else host[:100] + "..."
            return APIError(421, f"The Host header {shown!r} does not name this server: bound to a loopback address, "
                                 "it answers only 'localhost' and loopback addresses (tinygpt serve --allow-host NAME "
                                 "adds a name)", code="misdirected_request")
        if scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return None
        origin = _header(scope, b"origin")
        if not origin or _is_json(_header(scope, b"content-type")) or "*" in self.origins or origin in self.origins:
            return None
        if origin.partition("://")[2].lower() == host.lower():  # the same origin: the playground's own page
            return None
        return APIError(403, f"Cross-origin request refused: a page from {origin[:100]!r} may not POST a body that is "
                             "not JSON here (send Content-Type: application/json; tinygpt serve --cors-origin "
                             "allows an origin)", code="cross_origin_refused")


def _host_name(host: str) -> str:
    """The name in a Host header (or a --allow-host value), lowercased, without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return (name if sep and port.isdigit() and ":" not in name else host).rstrip(".")


def _trusted_host(host: str, names: frozenset[str]) -> bool:
    """Whether a Host header names a loopback address, localhost, or one of `names`."""
    name = _host_name(host)
    if not name:
        return False
    if name == "localhost" or name in names:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_json(content_type: str) -> bool:
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _header(scope, name: bytes) -> str:
    """A request header's value from an ASGI scope, decoded as latin-1 the way Starlette does ('' if absent)."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name), "")


class _ClientGone(Exception):
    pass


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their sequences however the response ends, even when the
    client left before the first chunk (the body generator then never runs its own cleanup)."""

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _watch_disconnect(request: Request, gone) -> None:
    """Call gone() when the client goes away (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone()
            return


def _is_uint(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit alone accepts '²', which int() refuses


def _uint_at_most(text: str, limit: int) -> int | None:
    """text as an integer in 0..limit, or None. Digits past the limit's own count are refused
    before int() sees them: int() raises past 4,300 digits, and a 5xx is not an answer to bad input."""
    if not _is_uint(text):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(limit)):
        return None
    value = int(digits)
    return value if value <= limit else None


def _text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text begins in the decoded text of ids (see IncrementalDecoder.push_at)."""
    decoder, offsets, chars = IncrementalDecoder(tokenizer), [], 0
    for token in ids:
        text, lead = decoder.push_at(token)
        offsets.append(chars + lead)
        chars += len(text)
    return offsets


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


@contextmanager
def _scheduler_errors():
    """The scheduler's refusals as the API's answers: a full queue 429, a dead model or a draining server 503."""
    try:
        yield
    except QueueFull as e:
        raise _busy(e.retry_after) from None
    except ModelDown as e:
        raise _model_down(str(e)) from None
    except Draining:
        raise _unavailable() from None


def _busy(retry_after: int) -> APIError:
    return APIError(429, "The server is busy: too many requests are waiting; retry shortly",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def _unavailable() -> APIError:
    return APIError(503, "The server is shutting down", type="server_error", code="service_unavailable")


def _model_down(reason: str) -> APIError:
    return APIError(503, f"The model is not available: {reason}", type="server_error", code="service_unavailable")


def _too_large() -> APIError:
    return APIError(413, f"The request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MB",
                    code="request_too_large")
