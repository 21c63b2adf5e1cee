"""Running the app under uvicorn: in the foreground for `kvtier serve`, or on a thread (tests, benchmark).

Shutdown (SIGTERM or Ctrl-C in the foreground, `stop()` on a thread) is uvicorn's graceful one:
stop accepting connections, give in-flight requests `graceful_s` to finish, cancel the rest (their
streams see a disconnect and abort their sequences), then the app's lifespan end closes the engine
and its flash file.
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

GRACEFUL_S = 30.0


def _config(app: FastAPI, host: str, port: int, graceful_s: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=graceful_s)


def serve_forever(app: FastAPI, host: str, port: int, graceful_s: float = GRACEFUL_S,
                  log_level: str = "info") -> None:
    """Serve until SIGTERM / SIGINT (uvicorn installs the handlers on the main thread)."""
    uvicorn.Server(_config(app, host, port, graceful_s, log_level)).run()


class ServerThread:
    """The app served on a background thread at `url` until `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, graceful_s: float = 5.0,
                 log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        self._server = uvicorn.Server(_config(app, host, port, graceful_s, log_level))
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
