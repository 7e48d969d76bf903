"""How the server listens: the HTTP layer's settings (``HTTPConfig``), the bound socket, and the uvicorn options
they become (``listen_with``). What each connection enforces is ``connection.GuardedProtocol``'s (the connection
caps, the header deadline and size); body deadlines and sizes are the ``Gatekeeper``'s.
"""

import errno
import functools
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import uvicorn

from lockstep.server.connection import ConnectionLedger, GuardedProtocol

API_KEY_ENV = "LOCKSTEP_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class HTTPConfig:
    """What the HTTP layer admits and how long it waits.

    ``api_key``: required (``Authorization: Bearer KEY``) on every path but ``/health``. ``allowed_hosts``: the
    host names a request's ``Host`` header may carry (lower case, no port), or ``None`` for any; bound to a
    loopback address the server accepts only loopback names, which stops DNS rebinding. ``max_connections``
    connections are served at once, at most ``max_connections_per_client`` from one peer address (``None``: half
    of ``max_connections``); others get 503, but ``/health`` (``connection.ConnectionLedger``). A request's line
    and headers may hold ``max_header_bytes`` (431). Timeouts are in seconds: ``header_timeout`` for a request's
    line and headers, ``body_timeout`` for its whole body and ``body_idle_timeout`` between two of its pieces,
    ``keep_alive_timeout`` for an idle connection between requests. ``access_log``: one info line per request
    (``Gatekeeper``). ``root_path`` (vLLM's ``--root-path``, e.g. "/llm"): the server also answers every path under
    that prefix, for a reverse proxy that forwards it (``connection.route_path``).
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 16 << 10
    max_connections: int = 1024
    max_connections_per_client: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    body_idle_timeout: float = 10.0
    keep_alive_timeout: int = 5
    workers: int = 4  # threads that parse, tokenize and render off the event loop
    access_log: bool = True  # a log line per request: method, path, status, time, tokens (never the prompt)
    root_path: str = ""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
        if self.max_connections_per_client is None and isinstance(self.max_connections, int):
            object.__setattr__(self, "max_connections_per_client", max(1, self.max_connections // 2))
        positive = ("max_body_bytes", "max_header_bytes", "max_connections", "max_connections_per_client")
        positive += ("header_timeout", "body_timeout", "body_idle_timeout", "keep_alive_timeout")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        root = self.root_path
        if root and (not root.startswith("/") or root.endswith("/") or not root.isascii() or " " in root):
            raise ValueError(f"root_path must be empty or a path like /llm (no trailing slash), got {root!r}")

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


def listen_with(config: uvicorn.Config, http: HTTPConfig, metrics=None) -> ConnectionLedger:
    """Make a ``uvicorn.Config`` (not loaded yet) enforce ``http``: ``GuardedProtocol`` (the connection caps, the
    header deadline and size) and the keep-alive timeout. Returns the ledger of its connections, which keeps
    ``metrics``' connection figures when given."""
    ledger = ConnectionLedger(http.max_connections, http.max_connections_per_client, metrics)
    config.http = functools.partial(
        GuardedProtocol,
        ledger=ledger,
        header_timeout=http.header_timeout,
        max_header_bytes=http.max_header_bytes,
        root_path=http.root_path,
    )
    config.timeout_keep_alive = http.keep_alive_timeout
    config.h11_max_incomplete_event_size = http.max_header_bytes  # h11's own check, behind the protocol's
    return ledger
