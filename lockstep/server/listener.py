"""How the server listens: the HTTP layer's settings (``HTTPConfig``) and the uvicorn options they become.

uvicorn's h11 protocol has no deadline for a request's line and headers (its keep-alive timer only runs between
requests), so a client could hold a connection with half a header forever; ``HeaderDeadlineProtocol`` closes such
a connection after ``header_timeout`` seconds. Body read deadlines and sizes are the ``Gatekeeper``'s.

The connection cap is the protocol's too: uvicorn's own (``limit_concurrency``) answers a plain-text 503, so the
protocol counts connections and requests in flight the same way and answers with an OpenAI-style JSON body.
"""

import asyncio
import errno
import functools
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep.server.protocol import error_body

API_KEY_ENV = "LOCKSTEP_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class HTTPConfig:
    """What the HTTP layer admits and how long it waits.

    ``api_key``: required (``Authorization: Bearer KEY``) on every path but ``/health``. ``allowed_hosts``: the
    host names a request's ``Host`` header may carry (lower case, no port), or ``None`` for any; bound to a
    loopback address the server accepts only loopback names, which stops DNS rebinding. Timeouts are in seconds:
    ``header_timeout`` for a request's line and headers, ``body_timeout`` for its whole body,
    ``keep_alive_timeout`` for an idle connection between requests. ``access_log``: one info line per request
    (``Gatekeeper``).
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_body_bytes: int = 8 << 20
    max_connections: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: int = 5
    workers: int = 4  # threads that parse, tokenize and render off the event loop
    access_log: bool = True  # a log line per request: method, path, status, time, tokens (never the prompt)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
        for name in ("max_body_bytes", "max_connections", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def host_allowed(self, host_header: bytes | None) -> bool:
        """Whether a request's ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names an allowed host."""
        if self.allowed_hosts is None:
            return True
        if host_header is None:
            return False
        host = host_header.decode("latin-1").strip().lower()
        if host.startswith("["):
            name = host[1 : host.find("]")] if "]" in host else ""
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return name.rstrip(".") in self.allowed_hosts


def allowed_hosts_for(bind_host: str, allowed: str | None = None) -> tuple[str, ...] | None:
    """The ``allowed_hosts`` of a server bound to ``bind_host``: ``allowed`` (a comma list, ``*`` for any) when
    given; else the loopback names when bound to a loopback address, and any host otherwise."""
    if allowed is not None:
        names = tuple(n.strip().lower().strip("[]").rstrip(".") for n in allowed.split(",") if n.strip())
        if not names:
            raise ValueError("--allowed-hosts is empty (use '*' for any host)")
        return None if "*" in names else names
    try:
        loopback = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        loopback = bind_host.lower() == "localhost"
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, bind_host.lower().strip("[]")))) if loopback else None


def read_api_key(key: str | None, key_file: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The API key from ``--api-key``, else ``--api-key-file`` (its first line), else ``$LOCKSTEP_API_KEY``; a
    key on the command line is visible to every user of the machine (``ps``), the other two are not."""
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        with open(key_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"the API key file {key_file} is empty")
    elif key is None:
        key = env.get(API_KEY_ENV) or None
    return key


_OVER_CAPACITY = json.dumps(
    error_body("the server has too many connections open; try again later", "server_error", code="too_many_connections")
).encode()


async def _over_capacity(scope, receive, send) -> None:
    """The ASGI answer to a request past the connection cap: 503 with an OpenAI-style body, connection closed."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_OVER_CAPACITY)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": _OVER_CAPACITY})


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers, counted from the connection's
    start or the request's first byte (a connection that misses it is closed), and a cap of ``max_connections``
    on open connections and requests in flight, past which a request gets a JSON 503."""

    def __init__(self, *args, header_timeout: float, max_connections: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        if max_connections is not None:
            # uvicorn's check, made when the request's task runs (the task itself is counted by then).
            self.limit_concurrency = None
            app = self.app

            async def capped(scope, receive, send) -> None:
                if len(self.connections) >= max_connections or len(self.tasks) > max_connections:
                    logging.getLogger("uvicorn.error").warning("Exceeded the connection limit (%d).", max_connections)
                    return await _over_capacity(scope, receive, send)
                return await app(scope, receive, send)

            self.app = capped

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting = self.conn.their_state is h11.IDLE  # still before the end of a request's headers
        if waiting and self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        elif not waiting:
            self._cancel_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._cancel_header_deadline()  # the keep-alive timer takes over until the next request's first byte
        super().on_response_complete()

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet), for ``serve``: binding it before the model loads
    finds a port in use at once, in one line (ValueError), instead of minutes later, and nothing can take the
    port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP (getaddrinfo's do); without
    # it, Nagle's algorithm and delayed ACKs add ~40 ms to small replies.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use (another server?); pick another with --port"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def listen_with(config: uvicorn.Config, http: HTTPConfig) -> None:
    """Make a ``uvicorn.Config`` (not loaded yet) enforce ``http``: the h11 protocol with a header deadline, the
    connection cap (a JSON 503 past it), the keep-alive timeout and h11's 16 KiB header limit."""
    config.http = functools.partial(
        HeaderDeadlineProtocol, header_timeout=http.header_timeout, max_connections=http.max_connections
    )
    config.timeout_keep_alive = http.keep_alive_timeout
    config.h11_max_incomplete_event_size = 16 * 1024
