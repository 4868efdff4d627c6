"""Run an app under uvicorn; SIGTERM drains (503 for new work, running work finishes) before exit."""

from __future__ import annotations

import signal
import socket
import threading

import uvicorn


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful SIGTERM: stop accepting work, finish it, then exit.

    A second SIGTERM, or SIGINT (Ctrl-C), stops at once: what is still generating gets an error.
    """

    def __init__(self, config: uvicorn.Config, scheduler, drain_timeout: float | None) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self._draining:
            self._draining = True
            self.scheduler.start_draining()
            threading.Thread(target=self._exit_when_idle, name="tinygpt-drain", daemon=True).start()
            return
        # end what is generating (clients get an error) so that open streams close now
        threading.Thread(target=self.scheduler.stop, name="tinygpt-stop", daemon=True).start()
        super().handle_exit(sig, frame)

    def _exit_when_idle(self) -> None:
        self.scheduler.wait_idle(self.drain_timeout)
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port).

    Raises:
        OSError: the address is in use or cannot be bound, with the address in the message.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(app, sock: socket.socket, *, log_level: str = "info", drain_timeout: float | None = None) -> None:
    """Serve `app` (from create_app) on a listening socket until SIGTERM/SIGINT.

    Args:
        app: the FastAPI app; its scheduler drains on SIGTERM.
        sock: from `listen`.
        log_level: uvicorn's log level.
        drain_timeout: seconds to wait for running work after SIGTERM (None: as long as it takes).
    """
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=5)
    server = _DrainingServer(config, app.state.scheduler, drain_timeout)
    server.run(sockets=[sock])
