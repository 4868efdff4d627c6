"""POST /v1/completions: text completion of one prompt or several, as text or token ids; with echo and
logprobs, the prompt's own tokens scored too (what evaluation harnesses ask for)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..tokenizer.incremental import IncrementalDecoder
from .protocol import COMPLETIONS, CompletionRequest, invalid_value
from .refusals import scheduler_errors
from .reply import ClientGone, generate
from .scoring import TokenInfo, score_windows, scoring_windows
from .state import ServerState, authorized, body
from .structured import compiled, requested

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
SCORE_MAX_TOKENS = 65536  # prompt tokens one request may have scored (echo with logprobs), n copies counted
SCORE_WINDOWS_PER_CALL = 8  # context windows scored per turn of the model thread: decoding goes on between

router = APIRouter()


@router.post(COMPLETIONS)
async def completions(request: Request, req: Annotated[CompletionRequest, Depends(body(CompletionRequest))],
                      state: Annotated[ServerState, Depends(authorized)]) -> Response:
    prompts = _prompts(req.prompt)
    state.check_choices(len(prompts) * (req.n or 1))

    def encode_all() -> list[list[int]]:
        return [state.encode(p, "prompt") if isinstance(p, str) else state.check_ids(p, "prompt") for p in prompts]

    ids = await run_in_threadpool(encode_all)
    echo = None
    if req.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts]
    settings = state.settings(req, req.max_tokens, DEFAULT_COMPLETION_TOKENS)
    constraint = requested(req)
    grammar = await compiled(state, *constraint) if constraint is not None else None
    settings.update(stop=req.stops, logprobs=req.logprobs, grammar=grammar)
    scored = None
    if req.echo and req.logprobs is not None:
        # an empty prompt starts from a token of the server's choosing, which is not in the echoed text
        try:
            scored = await score(state, request, [i if p else [] for p, i in zip(prompts, ids)], req.logprobs,
                                 req.n or 1)
        except ClientGone:
            return JSONResponse({})  # nobody is there to read it
    return await generate(state, request, req, ids, settings, chat=False, echo=echo, scored=scored)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a text or a list of token ids."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def score(state: ServerState, request: Request, prompts: list[list[int]], top: int,
                n: int) -> list[list[TokenInfo]]:
    """Each prompt token's logprob and `top` alternatives, each predicted from as much of the
    prompt before it as the context holds (scoring_windows); the first token has none. The
    request holds its places in the scheduler meanwhile (a full server answers 429), and a client
    that leaves stops the scoring (raises ClientGone).

    Args:
        state: the server's state.
        request: the HTTP request, asked between turns whether its client is still there.
        prompts: each prompt's token ids ([] for an empty prompt: nothing to score).
        top: alternatives per token (the request's logprobs).
        n: choices per prompt, each carrying its prompt's logprobs (counted against SCORE_MAX_TOKENS).
    """
    total = sum(len(ids) for ids in prompts) * n  # every choice carries its prompt's logprobs
    if total > SCORE_MAX_TOKENS:
        raise invalid_value("prompt", f"echo with logprobs scores at most {SCORE_MAX_TOKENS:,} "
                            f"prompt tokens per request (n times the prompts' tokens), got {total:,}")
    out = []
    with scheduler_errors(), state.scheduler.hold(len(prompts) * n):
        for ids in prompts:
            out.append(await _score_one(state, request, ids, top) if ids else [])
    return out


async def _score_one(state: ServerState, request: Request, ids: list[int], top: int) -> list[TokenInfo]:
    offsets = _text_offsets(state.tokenizer, ids)
    infos = [TokenInfo(ids[0], None, None, 0)]
    windows = scoring_windows(len(ids), state.block_size)
    for i in range(0, len(windows), SCORE_WINDOWS_PER_CALL):
        chunk = windows[i : i + SCORE_WINDOWS_PER_CALL]
        if await request.is_disconnected():
            raise ClientGone()

        def run(chunk=chunk) -> list[TokenInfo]:
            return score_windows(state.model, ids, chunk, top, offsets, state.vocab_size)

        infos += await asyncio.wrap_future(state.scheduler.call(run))
    return infos


def _text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text begins in the decoded text of ids (see IncrementalDecoder.push_at)."""
    decoder, offsets, chars = IncrementalDecoder(tokenizer), [], 0
    for token in ids:
        text, lead = decoder.push_at(token)
        offsets.append(chars + lead)
        chars += len(text)
    return offsets
