"""Running the app under uvicorn: in the foreground for `kvtier serve`, or on a thread (tests, benchmark).

`kvtier serve` binds its socket (`bind`) before it loads the model, so an address in use is a
one-line error at once rather than after seconds of loading, and a port chosen by the system
(port 0) is known for the banner; `serve_forever` then serves on that socket.

Shutdown (SIGTERM or Ctrl-C in the foreground, `stop()` on a thread) is uvicorn's graceful one:
stop accepting connections and give in-flight requests `graceful_s` to finish. Then `grace_over`
(the backend's `fail_unfinished`) fails what is still running, so each of those clients gets an
OpenAI error body (503, or an error event then `[DONE]` in a stream) rather than a cut connection;
uvicorn cancels whatever is left `FAIL_S` later. Last, the app's lifespan end closes the engine
and its flash file.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from kvtier.errors import ConfigError

GRACEFUL_S = 30.0
FAIL_S = 10.0  # after the grace period: time for the failed requests to send their error


class _Server(uvicorn.Server):
    """uvicorn's server, calling `grace_over` when the shutdown's grace period ends."""

    def __init__(self, app: FastAPI, host: str, port: int, graceful_s: float, log_level: str,
                 grace_over: Callable[[], None] | None) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=graceful_s + (FAIL_S if grace_over else 0)))
        self._graceful_s, self._grace_over = graceful_s, grace_over

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self._grace_over is not None:
            timer = asyncio.get_running_loop().call_later(self._graceful_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port, `getsockname()` says which), for `serve_forever`.

    Raises ConfigError, one line, when the host does not resolve or the address cannot be bound (in use, not ours).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own: a restart need not wait TIME_WAIT
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}; stop what serves there or choose "
                          "another port") from None
    return sock


def serve_forever(app: FastAPI, sock: socket.socket, graceful_s: float = GRACEFUL_S, log_level: str = "info",
                  grace_over: Callable[[], None] | None = None) -> None:
    """Serve on `sock` (from `bind`) until SIGTERM / SIGINT (uvicorn installs the handlers on the main thread)."""
    host, port = sock.getsockname()[:2]
    _Server(app, host, port, graceful_s, log_level, grace_over).run(sockets=[sock])


class ServerThread:
    """The app served on a background thread at `url` until `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, graceful_s: float = 5.0,
                 log_level: str = "warning", start_timeout_s: float = 60.0,
                 grace_over: Callable[[], None] | None = None) -> None:
        self._server = _Server(app, host, port, graceful_s, log_level, grace_over)
        self._thread = threading.Thread(target=self._server.run, name="kvtier-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
            time.sleep(0.02)
        bound = self._server.servers[0].sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
