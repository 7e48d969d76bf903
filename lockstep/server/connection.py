"""One HTTP connection: uvicorn's h11 protocol with the limits it lacks (``GuardedProtocol``).

- **Who gets a connection** is decided when it is accepted (``ConnectionLedger``): the first ``max_connections``
  are served, and one peer address holds at most ``max_connections_per_client`` of them. uvicorn's own cap
  (``limit_concurrency``) is checked when a request starts, against every connection open by then: a burst of
  1100 connections at a cap of 1024 got 1071 refusals instead of 76, and one client holding the cap left nobody a
  connection, liveness probes included. A connection past either limit is *refused*: its one request gets a JSON
  503 (``too_many_connections``, ``Retry-After: 1``), except ``/health``, which the app answers as usual, so that
  probes survive; then it is closed. At most ``max_refused`` refused connections (64, or an eighth of
  ``max_connections`` if more) are open at once, each for at most ``REFUSED_HEADER_TIMEOUT`` seconds; past that a
  connection is closed unanswered.
- **A deadline for each request's line and headers** (``header_timeout``), counted from the connection's start or
  the request's first byte and never renewed per byte: h11's keep-alive timer runs only between requests, so a
  client could hold a connection with half a header forever.
- **The head's size** (``max_header_bytes``): h11's own limit only sees a head that arrives in pieces (a 100 KB head
  read at once was served) and answers it by closing a connection the client is still writing to, which resets it
  before the client reads anything. Here the buffered head is measured before h11 parses it; past the limit the
  answer is a JSON 431, the connection's write side is shut, and what the client still sends (up to
  ``LINGER_BYTES``, for ``LINGER_SECONDS``) is read and dropped before it is closed, so the 431 arrives.
- **What the client has not read** (``unsent_bytes``): the transport's buffer plus the kernel's send queue (bytes
  not yet acknowledged), which on localhost Linux grows to 4 MB. The ``Gatekeeper`` holds a stream back while more
  than ``UNREAD_BYTES`` of it wait (``until_read``), so a client that stops reading stops its stream's consumer at
  once and ``ServingLimits.unread_timeout`` counts from there, not from when megabytes of kernel buffer are full;
  a stream held back that long has its connection reset.
"""

import asyncio
import fcntl
import json
import logging
import math
import re
import socket
import struct
import termios
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep.server.protocol import error_body

log = logging.getLogger("uvicorn.error")

CONNECTION_KEY = "lockstep.connection"  # where a request's scope holds its ``GuardedProtocol``
HEALTH_PATH = "/health"
REFUSED_HEADER_TIMEOUT = 2.0  # seconds a refused connection has to send its request head
LINGER_SECONDS = 2.0  # after a 431: how long the rest of the client's head is read and dropped
LINGER_BYTES = 1 << 20  # ... and how much of it
UNREAD_BYTES = 256 << 10  # a stream waits while more than this is written but not acknowledged
READ_POLL_SECONDS = 0.05  # how often a waiting stream looks at the send queue (the kernel sends no event)
WARN_EVERY_SECONDS = 10.0  # refusals are logged once, then at most once in this many seconds, with a count
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a request head (it accepts bare \n line ends)

SERVED, REFUSED, DROPPED = "served", "refused", "dropped"


def route_path(path: str, root_path: str) -> str:
    """The path a request names, as FastAPI's ``root_path`` routes it (vLLM's ``--root-path``): under the prefix,
    the rest of it (a proxy that forwards the prefix); any other path as it is (a proxy that strips it)."""
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path) :] or "/"
    return path


def _json_response(status: int, reason: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + payload


_OVER_CAPACITY = json.dumps(
    error_body("the server has too many connections open; try again later", "server_error", code="too_many_connections")
).encode()


async def _over_capacity(scope, receive, send) -> None:
    """The ASGI answer to a request on a refused connection: 503 with an OpenAI-style body, connection closed."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_OVER_CAPACITY)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": _OVER_CAPACITY})


class ConnectionLedger:
    """The server's open connections, counted when each is accepted: served ones in all and by peer address,
    refused ones, and refusals so far (``metrics``, when given, gets ``connections_open`` and
    ``connections_refused``)."""

    def __init__(self, max_connections: int, max_per_client: int, metrics=None, max_refused: int | None = None) -> None:
        self.max_connections, self.max_per_client = max_connections, max_per_client
        # Each lives REFUSED_HEADER_TIMEOUT seconds at most; unbounded, a flood of them would exhaust the process's
        # file descriptors, and then accept() fails for everyone.
        self.max_refused = max(64, max_connections // 8) if max_refused is None else max_refused
        self.served = 0
        self.refused_open = 0
        self.refused_total = 0
        self.by_client: dict[str | None, int] = {}
        self.metrics = metrics
        self._warned_at = -math.inf
        self._unwarned = 0

    def admit(self, client: str | None) -> str:
        """``SERVED``, ``REFUSED`` (one request, answered 503 or by /health, then closed) or ``DROPPED`` (closed
        now) for a connection just accepted from peer address ``client``."""
        held = self.by_client.get(client, 0)
        if self.served < self.max_connections and held < self.max_per_client:
            self.served += 1
            self.by_client[client] = held + 1
            verdict = SERVED
        else:
            self.refused_total += 1
            self._warn(client, held)
            verdict = REFUSED if self.refused_open < self.max_refused else DROPPED
            self.refused_open += verdict is REFUSED
        self._publish()
        return verdict

    def release(self, client: str | None, verdict: str) -> None:
        """A connection ``admit`` gave ``verdict`` has closed."""
        if verdict is SERVED:
            self.served -= 1
            left = self.by_client[client] - 1
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]
        elif verdict is REFUSED:
            self.refused_open -= 1
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.connections_open = self.served
            self.metrics.connections_refused = self.refused_total

    def _warn(self, client: str | None, held: int) -> None:
        self._unwarned += 1
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_SECONDS:
            return
        why = (
            f"{client} holds {held} (at most {self.max_per_client} a client)"
            if held >= self.max_per_client
            else f"{self.served} are open (at most {self.max_connections})"
        )
        log.warning(
            "Refused %d connection(s) in the last %.0f s; the latest: %s.", self._unwarned, WARN_EVERY_SECONDS, why
        )
        self._warned_at, self._unwarned = now, 0


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring. Each request's scope carries the protocol
    under ``CONNECTION_KEY``, for ``until_read``."""

    def __init__(
        self,
        *args,
        ledger: ConnectionLedger,
        header_timeout: float,
        max_header_bytes: int = 16 * 1024,
        root_path: str = "",
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # the ledger's instead
        self.ledger, self.header_timeout, self.max_header_bytes = ledger, header_timeout, max_header_bytes
        self.root_path = root_path  # --root-path: /health under it is /health too
        self.verdict: str | None = None
        self._peer: str | None = None
        self._header_deadline: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._dropped_bytes: int | None = None  # after a 431: what the client sent since; None until then

    # -- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else None
        self.verdict = self.ledger.admit(self._peer)
        if self.verdict is DROPPED:
            transport.close()
            return
        app, refused = self.app, self.verdict is REFUSED

        async def this_connection(scope, receive, send) -> None:
            scope[CONNECTION_KEY] = self
            if not refused:
                return await app(scope, receive, send)
            if route_path(scope["path"], self.root_path) != HEALTH_PATH:
                return await _over_capacity(scope, receive, send)

            async def closing(message) -> None:  # a refused connection serves one request
                if message["type"] == "http.response.start":
                    message = message | {"headers": [*message.get("headers", []), (b"connection", b"close")]}
                await send(message)

            return await app(scope, receive, closing)

        self.app = this_connection
        timeout = min(self.header_timeout, REFUSED_HEADER_TIMEOUT) if refused else self.header_timeout
        self.header_timeout = timeout
        self._header_deadline = self.loop.call_later(timeout, self._headers_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        if self._linger is not None:
            self._linger.cancel()
        if self.verdict is not None:
            self.ledger.release(self._peer, self.verdict)
            self.verdict = None
        super().connection_lost(exc)

    # -- the request head --------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._dropped_bytes is not None:  # a 431 was sent: read and drop the rest
            self._dropped_bytes += len(data)
            if self._dropped_bytes > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if self._dropped_bytes is not None:
            return
        waiting = self.conn.their_state is h11.IDLE  # still before the end of a request's headers
        if waiting and self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        elif not waiting:
            self._cancel_header_deadline()

    def handle_events(self) -> None:
        # Every path to h11's parser comes here: new bytes, and the next pipelined request after a response.
        if self.conn.their_state is h11.IDLE and self._head_too_large():
            self._refuse_head()
            return
        super().handle_events()

    def _head_too_large(self) -> bool:
        buffered = self.conn.trailing_data[0]  # bytes h11 holds and has not parsed: this request's head so far
        limit = self.max_header_bytes
        return len(buffered) > limit and _HEAD_END.search(buffered, 0, limit + 3) is None

    def _refuse_head(self) -> None:
        self._cancel_header_deadline()
        self._unset_keepalive_if_required()
        self._dropped_bytes = 0
        body = error_body(
            f"the request's line and headers exceed {self.max_header_bytes} bytes",
            "invalid_request_error",
            code="request_header_fields_too_large",
        )
        log.info("%s: refused a request head over %d bytes (431)", self._peer or "-", self.max_header_bytes)
        self.transport.write(_json_response(431, "Request Header Fields Too Large", body))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the 431 and then the end, while it may still be sending
        self._linger = self.loop.call_later(LINGER_SECONDS, self.transport.close)

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

    # -- what the client has read ------------------------------------------------------------------------------

    def unsent_bytes(self) -> int:
        """Bytes written to this connection that the client's TCP has not acknowledged: the transport's buffer and
        the kernel's send queue (Linux; elsewhere the transport's buffer only)."""
        pending = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                pending += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            except (OSError, ValueError):
                pass
        return pending

    async def until_read(self, limit: int, timeout: float) -> bool:
        """Wait while more than ``limit`` bytes written are unacknowledged, or the transport has paused writing
        (then uvicorn's send would wait, unwatched). True once neither holds; False if that took over ``timeout``
        seconds (the connection is then reset: by then the engine has stopped the stream for the same reason)
        or the connection is closing. Not "no progress for ``timeout``": a receiver's kernel that the client does
        not read from still takes a few bytes now and then."""
        deadline = self.loop.time() + timeout
        while not self.transport.is_closing():
            if self.unsent_bytes() <= limit and not self.flow.write_paused:
                return True
            if self.loop.time() > deadline:
                log.info("%s: the client read too little for %.0f s; connection reset", self._peer or "-", timeout)
                self._reset()
                return False
            await asyncio.sleep(READ_POLL_SECONDS)
        return False

    def _reset(self) -> None:
        """Close with a reset: a plain close would leave the kernel an orphaned socket probing a client that reads
        nothing, holding its send buffer for minutes."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()
