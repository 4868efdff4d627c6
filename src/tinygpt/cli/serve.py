"""`tinygpt serve`: a run behind an OpenAI-compatible HTTP API, with the playground."""

from __future__ import annotations

import argparse
import os

from ..config.fields import MAX_THREADS
from ..errors import ConfigError
from .common import (NATURAL, POSITIVE, Number, add_device_flag, add_quantize_flag, add_speculation_flags, load_model,
                     load_speculation)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a run over an OpenAI-compatible HTTP API, with a web playground at /.

    Args (flags):
        RUN: the run folder to serve (or a Hugging Face folder with its tokenizer: GPT-2, Llama, Qwen2, Qwen3).
        --host, --port: where to listen (127.0.0.1:8000; port 0 picks a free one).
        --api-key KEY: require `Authorization: Bearer KEY` on /v1 routes (default: $TINYGPT_API_KEY).
        --max-concurrency N: sequences decoded together in one batched step (8).
        --max-queue N: sequences that may wait for a slot; past that, 429 (32).
        --max-tokens N: the largest max_tokens a request may ask for (2048).
        --cors-origin ORIGIN: let browser pages from ORIGIN call the API (repeatable; "*" for any).
        --allow-host NAME: also answer requests whose Host header is NAME (repeatable). Bound to a
            loopback address, the server answers only Host headers naming localhost or a loopback
            address (421 otherwise), so that no web page can reach it through a rebound DNS name.
        --model-name NAME: the model id clients send (default: the run folder's name).
        --threads N: torch's intra-op threads on CPU (default: torch's choice; 1 often batches
            better on a CPU shared with other work).
        --prompt-cache MB: memory for the keys and values of finished sequences, reused by prompts that
            begin as they do (a conversation's next turn); the least recently used go first (512; 0: off).
        --draft RUN, --prompt-lookup N, --speculate K: speculative decoding for a request that decodes
            alone (the same completions; usage says how many proposed tokens stood).
    Prompts longer than the model's context are cut to their last block_size tokens (the
    response's usage.prompt_tokens_truncated says how many were dropped). SIGTERM stops accepting
    requests (503), finishes those running, then exits. The KV cache for --max-concurrency
    sequences is allocated before the server listens: one it cannot hold is a one-line error.
    """
    from pathlib import Path

    try:
        from ..server import create_app, listen, serve
    except ImportError as e:
        if e.name in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise ConfigError("tinygpt serve needs FastAPI and uvicorn: pip install 'tinygpt[serve]'") from None
        raise
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.max_concurrency < 1 or args.max_queue < 0 or args.max_tokens < 1:
        raise ConfigError("--max-concurrency and --max-tokens must be >= 1, --max-queue >= 0")
    api_key = args.api_key if args.api_key is not None else os.environ.get("TINYGPT_API_KEY") or None
    if args.api_key == "":
        raise ConfigError("--api-key must not be empty")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if any(not name.strip() or "/" in name for name in args.allow_host or ()):
        raise ConfigError("--allow-host takes a host name (or address) such as my.host, without a scheme or path")
    allowed = tuple(args.allow_host or ())
    model, tokenizer = load_model(args.run, args.device, args.quantize)
    speculation = load_speculation(args, model, tokenizer)
    name = args.model_name or Path(args.run).resolve().name
    app = create_app(model, tokenizer, model_name=name, api_key=api_key, max_concurrency=args.max_concurrency,
                     max_queue=args.max_queue, max_tokens=args.max_tokens, cors_origins=tuple(args.cors_origin or ()),
                     trusted_hosts=allowed if allowed or _is_loopback(args.host) else None,
                     prompt_cache_bytes=args.prompt_cache * 2**20, speculation=speculation)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    device = next(model.parameters()).device
    key = " (needs the API key)" if api_key else ""
    print(f"serving {args.run} as model '{name}' on {device}\n  playground  {url}/\n  OpenAI API  {url}/v1{key}",
          flush=True)
    serve(app, sock)
    return 0


def _is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.1, ::1, localhost)."""
    import ipaddress
    import socket

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        return False  # listen() says what is wrong with the address


def add_serve(sub: argparse._SubParsersAction) -> None:
    """`tinygpt serve` and its flags."""
    p = sub.add_parser(
        "serve", help="serve a run over an OpenAI-compatible HTTP API with a playground",
        description=cmd_serve.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prompts longer than the model's context are cut to their last block_size tokens\n"
               "(usage.prompt_tokens_truncated says how many were dropped). SIGTERM drains: new\n"
               "requests get 503, running ones finish, then the server exits.\n\n"
               "examples:\n  tinygpt serve runs/stdlib\n"
               "  tinygpt serve runs/stdlib --host 0.0.0.0 --port 8080 --api-key KEY --cors-origin https://my.app",
    )
    p.add_argument("run", metavar="RUN", help="a run folder (or a Hugging Face folder: GPT-2, Llama, Qwen2, Qwen3)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=Number("int", 0, 65535), default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY", help="require this bearer key on /v1 routes (default $TINYGPT_API_KEY)")
    p.add_argument("--max-concurrency", type=POSITIVE, default=8, metavar="N", help="sequences decoded together (8)")
    p.add_argument("--max-queue", type=NATURAL, default=32, metavar="N", help="sequences waiting for a slot (32)")
    p.add_argument("--max-tokens", type=POSITIVE, default=2048, metavar="N",
                   help="largest max_tokens per request (2048)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN", help="allow browser calls from ORIGIN")
    p.add_argument("--allow-host", action="append", metavar="NAME",
                   help="also answer Host: NAME (repeatable; bound to loopback, only localhost and loopback addresses "
                        "are answered otherwise)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients use (default: RUN's folder name)")
    p.add_argument("--threads", type=Number("int", 1, MAX_THREADS), metavar="N", help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--prompt-cache", type=NATURAL, default=512, metavar="MB",
                   help="memory for reusing earlier prompts' keys and values, least recently used dropped first (512; "
                        "0: off)")
    add_speculation_flags(p)
    add_device_flag(p, help="auto, cpu, cuda, cuda:N, mps")
    add_quantize_flag(p)
    p.set_defaults(func=cmd_serve, hub_args=("run", "draft"))
