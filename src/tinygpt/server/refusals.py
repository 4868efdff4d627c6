"""The answers of a server that cannot take a request now: 429 while every slot and queue place is
taken, 503 while it drains or after its model thread died, 413 for a body over the limit; and the
scheduler's own refusals turned into those answers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .protocol import MAX_BODY_BYTES, APIError
from .scheduler import Draining, ModelDown, QueueFull


def busy(retry_after: int) -> APIError:
    return APIError(429, "The server is busy: too many requests are waiting; retry shortly",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def unavailable() -> APIError:
    return APIError(503, "The server is shutting down", type="server_error", code="service_unavailable")


def model_down(reason: str) -> APIError:
    return APIError(503, f"The model is not available: {reason}", type="server_error", code="service_unavailable")


def too_large() -> APIError:
    return APIError(413, f"The request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MB",
                    code="request_too_large")


@contextmanager
def scheduler_errors() -> Iterator[None]:
    """The scheduler's refusals as the API's answers: a full queue 429, a dead model or a draining server 503."""
    try:
        yield
    except QueueFull as e:
        raise busy(e.retry_after) from None
    except ModelDown as e:
        raise model_down(str(e)) from None
    except Draining:
        raise unavailable() from None
