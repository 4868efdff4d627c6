"""What the routes share: the model, its tokenizer, the server's settings and the scheduler, in one
ServerState that create_app keeps in `app.state.server`; the checks every request goes through; and
the FastAPI dependencies that hand the state to a route once the request has passed them."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from functools import lru_cache
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from ..config.sampling import SampleConfig
from ..errors import TokenizerError
from ..tokenizer.chat import stop_ids
from .protocol import (
    CHAT_STOPS,
    MAX_BODY_BYTES,
    APIError,
    AttentionRequest,
    Message,
    ValidationError,
    chat_prompt,
    invalid_value,
    validation_error,
)
from .refusals import busy, model_down, too_large, unavailable
from .scheduler import Scheduler

Body = TypeVar("Body")


class ServerState:
    """The model, its settings and the scheduler, with the checks and answers that need them."""

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
        # a request's grammar that takes longer to compile is refused (tinygpt.server.structured)
        self.compile_seconds = 10.0
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.encodable = lru_cache(maxsize=4096)(self._encodable)

    # -- request checks ----------------------------------------------------------------------

    @property
    def auth(self) -> bool:
        """Whether the /v1 routes need an API key."""
        return self._key is not None

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

    async def read(self, request: Request, kind: type[Body]) -> Body:
        """An authorized request's body: refused while draining or full, read up to MAX_BODY_BYTES, validated."""
        if self.scheduler.failure is not None:
            raise model_down(self.scheduler.failure)
        if self.scheduler.draining:
            raise unavailable()
        if kind is not AttentionRequest and not self.scheduler.has_room(1):
            raise busy(1)  # filled up since Admission let it through: still before reading the body
        length = request.headers.get("content-length")
        if length is not None and _is_uint(length) and _uint_at_most(length, MAX_BODY_BYTES) is None:
            raise too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large()
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

    def check_choices(self, count: int) -> None:
        """n times the number of prompts must fit; a full server answers 429 before any work."""
        limit = min(16, self.scheduler.max_concurrency + self.scheduler.max_queue)
        if count > limit:
            raise invalid_value("n", f"n times the number of prompts must be at most {limit}, got {count}")
        if not self.scheduler.has_room(count):
            raise busy(1)

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


# -- dependencies: how a route asks for the state ----------------------------------------------
# async, so that FastAPI runs them on the event loop rather than handing each to a worker thread


async def server_state(request: Request) -> ServerState:
    """The app's ServerState, for a route that answers without a key (the playground page, /health)."""
    return request.app.state.server


async def authorized(request: Request, state: Annotated[ServerState, Depends(server_state)]) -> ServerState:
    """The state, once the request carries the API key (401 otherwise)."""
    state.authorize(request)
    return state


def body(kind: type[Body]):
    """A dependency giving an authorized request's body, read and checked as `kind` (ServerState.read)."""

    async def read(request: Request, state: Annotated[ServerState, Depends(authorized)]) -> Body:
        return await state.read(request, kind)

    return read


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
