"""A generating request's answer: its sequences handed to the scheduler's model thread, and their events,
which come back through an asyncio queue per request, turned into OpenAI's response or its stream of
chunks. Streamed and whole answers are assembled from the same events, so at temperature 0 they carry
the same text; the event loop only moves bytes and never waits on the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..speculative import SpeculationStats
from ..toolcalls import CallFormat, CallStream
from .protocol import APIError, ChatRequest, CompletionRequest
from .refusals import scheduler_errors
from .scheduler import Event, Sequence
from .scoring import TokenInfo
from .state import ServerState

_GONE = object()  # queued when the client disconnects


async def generate(state: ServerState, request: Request, req: CompletionRequest | ChatRequest, prompts: list[list[int]],
                   settings: dict, *, chat: bool, echo: list[str] | None = None,
                   scored: list[list[TokenInfo]] | None = None,
                   calls: tuple[CallFormat, list[str]] | None = None) -> Response:
    """Hand a request's sequences (n choices of each prompt) to the scheduler and answer with their text:
    a stream of server-sent events, or the whole answer once every choice has finished.

    Args:
        state: the server's state (its scheduler, block size).
        request: the HTTP request, watched for the client leaving.
        req: the validated body (n, seed, stream and stream_options are read here).
        prompts: each prompt's token ids; longer than the context, a prompt keeps its last block_size.
        settings: what every sequence shares (ServerState.settings, with stop strings and logprobs).
        chat: answer as /v1/chat/completions does (a message), else as /v1/completions (text).
        echo: with echo, each prompt's text, written before its choices' text.
        scored: with echo and logprobs, each prompt's tokens' logprobs.
        calls: with tools, how the template writes calls and the tools' names: each choice's text is read
            for calls (tinygpt.toolcalls.CallStream), answered as tool_calls.
    """
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
            seqs.append(Sequence(prompt=ids[-state.block_size :], emit=emit, index=index, seed=seed, **settings))
    generating = settings["max_tokens"] > 0
    if not generating:  # nothing to generate (a prompt scored with echo): every choice ends now
        for s in seqs:
            queue.put_nowait(Event(s.index, finish_reason="length"))
    else:
        with scheduler_errors():
            state.scheduler.submit(seqs)
    # the prompt tokens generation did not see; with nothing to generate there are none (a prompt
    # scored with echo and logprobs is read whole)
    dropped = sum(max(0, len(ids) - state.block_size) for ids in prompts) if generating else 0
    reply = Reply(state, req, seqs, chat=chat, prompt_tokens=sum(map(len, prompts)), dropped=dropped,
                  echo=echo, n=n, scored=scored, calls=calls)

    def gone() -> None:
        state.scheduler.cancel(seqs)
        queue.put_nowait(_GONE)

    if req.stream:
        return _EventStream(reply.stream(request, queue, gone), on_close=lambda: state.scheduler.cancel(seqs))
    watcher = asyncio.create_task(_watch_disconnect(request, gone))
    try:
        return await reply.collect(queue)
    finally:
        watcher.cancel()
        state.scheduler.cancel(seqs)


class Reply:
    """Turns a request's events into OpenAI's response or stream of chunks."""

    def __init__(self, server: ServerState, req, seqs: list[Sequence], *, chat: bool, prompt_tokens: int,
                 dropped: int, echo: list[str] | None, n: int, scored: list[list[TokenInfo]] | None = None,
                 calls: tuple[CallFormat, list[str]] | None = None) -> None:
        self.server, self.req, self.seqs, self.chat = server, req, seqs, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.dropped = dropped
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.speculation: SpeculationStats | None = None  # every choice's, added up, where they could speculate
        self.echo = echo
        # each choice's reader of tool calls (the same reader whole and streamed: the same calls either way)
        self.readers = [CallStream(*calls) for _ in seqs] if calls is not None else None
        self.n = n
        self.scored = scored  # per prompt: its tokens' logprobs (echo with logprobs)
        self.logprobs = seqs[0].logprobs is not None

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.dropped:  # prompts longer than the context were cut to their last block_size tokens
            usage["prompt_tokens_truncated"] = self.dropped
        if self.speculation is not None:  # OpenAI's predicted outputs' fields, and tinygpt's figures
            stats = self.speculation
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": stats.accepted,
                                                  "rejected_prediction_tokens": stats.drafted - stats.accepted}
            usage["speculation"] = stats.to_dict()
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
                raise ClientGone()
            if event.error is not None:
                raise APIError(event.status, event.error, type="server_error",
                               code="service_unavailable" if event.status == 503 else None)
            if event.finish_reason is not None:
                remaining -= 1
                self.completion_tokens += event.completion_tokens
                self.cached_tokens += event.cached_tokens
                if event.speculation is not None:
                    self.speculation = self.speculation or SpeculationStats()
                    self.speculation.add(event.speculation)
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
        except ClientGone:
            return JSONResponse({})  # nobody is there to read it
        return await run_in_threadpool(lambda: JSONResponse(self.body(texts, tokens, finish)))

    def body(self, texts: list[str], tokens: list[list[TokenInfo]], finish: list[str | None]) -> dict:
        choices = []
        for i in range(len(self.seqs)):
            logprobs = self.format_logprobs(tokens[i]) if self.logprobs else None
            if self.chat:
                message: dict = {"role": "assistant", "content": texts[i]}
                if self.readers is not None:
                    deltas = self.readers[i].push(texts[i]) + self.readers[i].finish()
                    message, finish[i] = self.message(i, deltas), self.finish_reason(i, finish[i])
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish[i]})
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
                    for chunk in self.event_chunks(e):
                        yield chunk
            except ClientGone:
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

    def event_chunks(self, e: Event) -> list[str]:
        """An event's chunks: its text (or, read for tool calls, the deltas it settles) with its tokens'
        logprobs, then the finish."""
        tokens = self.generated(e.index, e.tokens)
        if self.readers is None:
            out = [self.chunk(e.index, e.text, tokens, None)] if e.text or e.tokens else []
            return out + ([self.chunk(e.index, "", [], e.finish_reason)] if e.finish_reason is not None else [])
        reader = self.readers[e.index]
        deltas = reader.push(e.text) + (reader.finish() if e.finish_reason is not None else [])
        if tokens and not deltas:
            deltas = [{}]  # the logprobs go out with the tokens, whatever their text became
        out = [self.chunk(e.index, "", tokens if k == 0 else [], None, delta=d) for k, d in enumerate(deltas)]
        if e.finish_reason is not None:
            out.append(self.chunk(e.index, "", [], self.finish_reason(e.index, e.finish_reason)))
        return out

    def message(self, index: int, deltas: list[dict]) -> dict:
        """A choice's message from a reader's deltas: content (None when there is only calls) and tool_calls."""
        content = "".join(d.get("content", "") for d in deltas)
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.readers[index].calls]
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """tool_calls where a choice that called a tool ended on its own (not cut at max_tokens)."""
        return "tool_calls" if reason == "stop" and self.readers[index].calls else reason

    def header(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

    def chunk(self, index: int, text: str, tokens: list[TokenInfo], finish: str | None, role: bool = False,
              delta: dict | None = None) -> str:
        logprobs = self.format_logprobs(tokens) if self.logprobs and tokens else None
        if self.chat:
            if delta is None:
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


class ClientGone(Exception):
    """The client went away before its answer was complete: nobody is there to read the rest."""


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


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
