"""Running an ASGI app under uvicorn: in the foreground (the CLI) or in a background thread (tests, tools).

What it knows: binding the listening socket itself (port 0 -> a free port chosen by
the OS at run time, so there is no pick-then-bind race), starting uvicorn on it,
waiting until it accepts connections, and stopping it. What it does not know: the
app, the engine or any setting beyond host/port/log level.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvfence.errors import KvfenceError

if TYPE_CHECKING:  # imported where a server starts: a worker checks its ports here without loading uvicorn
    import uvicorn

_GRACEFUL_SHUTDOWN_S = 3


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (port 0 -> any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on accepted sockets of such a listener,
    # and without it every small response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """`bind_socket`, with a port that is taken (or an address that is not this host's) refused as a configuration
    error naming the flag: callers bind first, before loading a model or starting anything."""
    try:
        return bind_socket(host, port)
    except OSError as e:
        raise KvfenceError(
            f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e} (another server on it?); choose "
            f"another with {flag}"
        ) from None


def check_free(host: str, port: int, flag: str) -> None:
    """Refuse (KvfenceError, naming `flag`) a port some process already listens on, before anything is started that
    would need it. Another process may still take it before it is used: callers that can hold it use `listen`."""
    if port:
        listen(host, port, flag).close()


def _server(app: Any, log_level: str) -> uvicorn.Server:
    import uvicorn

    return uvicorn.Server(_config(app, log_level))


def _config(app: Any, log_level: str) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level.lower(),
        lifespan="off",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        access_log=log_level.lower() in ("debug", "info"),
    )


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(
    app: Any,
    host: str,
    port: int,
    log_level: str = "info",
    banner: Callable[[str], str] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve until interrupted (SIGINT/SIGTERM), in this thread, on `sock` (bound by the caller with `listen`
    before it loaded anything) or a socket bound here. Prints to stderr, once the port is bound, the line
    `banner(url)` makes (the process's start-up line), else `kvfence: serving <url>`."""
    sock = sock if sock is not None else listen(host, port)
    url = url_of(host, sock.getsockname()[1])
    print(banner(url) if banner is not None else f"kvfence: serving {url}", file=sys.stderr, flush=True)
    try:
        _server(app, log_level).run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """uvicorn serving `app` from a daemon thread; use as a context manager.

    >>> with ServerThread(app) as server:
    ...     httpx.get(server.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app, self.host, self.log_level = app, host, log_level
        self._sock = bind_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._server = _server(app, log_level)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # surfaced by start()/stop()
            self._error = e

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn failed to start on {self.url}: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start on {self.url} within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise TimeoutError(f"uvicorn on {self.url} did not stop within {timeout} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
