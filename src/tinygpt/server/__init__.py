"""`tinygpt serve`: an OpenAI-compatible HTTP API with continuous batching and a web playground.

Needs the `serve` extra (FastAPI, uvicorn): pip install 'tinygpt[serve]'.

    app = create_app(model, tokenizer, model_name="mine")   # a FastAPI app
    serve(app, listen("127.0.0.1", 8000))                    # uvicorn, SIGTERM drains
"""

from .app import create_app
from .run import listen, serve
from .scheduler import Scheduler

__all__ = ["create_app", "listen", "serve", "Scheduler"]
