"""The ASGI middleware in front of the routes: the guard that refuses what a web page could make a
browser send to a server on this machine, and admission, which answers 429 while the server is full
before a request costs the event loop anything. Both answer from the raw ASGI scope, ahead of FastAPI."""

from __future__ import annotations

import ipaddress
import json

from .protocol import CHAT_COMPLETIONS, COMPLETIONS, APIError
from .refusals import busy
from .state import ServerState


class Admission:
    """Answers 429 to a generating request while every slot and queue place is taken, before FastAPI
    routes it, reads its body or validates it: under a burst that is most of the requests, and the
    event loop (which also carries every running stream) should spend almost nothing on each.
    Requests that would get 401 or 503 go on to the app, which answers them in full."""

    def __init__(self, app, server: ServerState) -> None:
        self.app, self.server = app, server
        err = busy(1)
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


class RequestGuard:
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


def host_name(host: str) -> str:
    """The name in a Host header (or a --allow-host value), lowercased, without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return (name if sep and port.isdigit() and ":" not in name else host).rstrip(".")


def _trusted_host(host: str, names: frozenset[str]) -> bool:
    """Whether a Host header names a loopback address, localhost, or one of `names`."""
    name = host_name(host)
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
