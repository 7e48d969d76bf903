"""The ASGI layer around the FastAPI app: Host, API key, Content-Type, the request body, errors, counting.

Being outside the app, it refuses a request before any routing or parsing, in this order: a ``Host`` that is not
allowed (400: DNS rebinding), more than one ``Authorization`` header (400: no guessing which counts), a missing
or wrong API key on any path but ``/health`` (401), a POST whose body is
not ``application/json`` (415: a web page cannot send one cross-site without a CORS preflight, and the server
answers no preflight), a body over the size limit, by Content-Length or counted as it arrives, chunked or not
(413), a body not complete within the body timeout, or silent for the body idle timeout (408). Then the app gets
the whole body at once. A response's body waits while more than ``connection.UNREAD_BYTES`` of it are unread by
the client (``GuardedProtocol.until_read``): a stream's consumer then stops where the client stopped, and a stream
held back for the unread timeout has its connection reset. A client that leaves mid-body costs one log
line. An exception out of the app is logged once, with its traceback, under an
id that the client's generic 500 body names. Every /v1 response is counted by status code, and every request gets
an access log line (``HTTPConfig.access_log``, on by default): the client, method, path, status and time, and for
a completion call its id and token counts (``ACCESS_KEY``) — never a prompt or a query string.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI

from lockstep.server.connection import CONNECTION_KEY, UNREAD_BYTES
from lockstep.server.protocol import error_body
from lockstep.server.state import ServerState

log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn's handlers and --log-level

OPEN_PATHS = ("/health",)  # every other path needs the API key, when one is set
# vLLM's development endpoints that clients (TRL's VLLMClient, curl) POST without a body: accepted so under
# --dev-mode (server.rl_api). A cross-site page can send such a POST too: --dev-mode is for a trusted network.
BODILESS_DEV_POSTS = ("/reset_prefix_cache", "/sleep", "/wake_up")
ERROR_ID_KEY = "lockstep.error_id"  # where the app's 500 handler leaves the id it told the client
ACCESS_KEY = "lockstep.access"  # where a completion call leaves what its access log line adds (id, tokens)


class _Refusal(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        self.status, self.body = status, error_body(message, "invalid_request_error", code=code)


class _ClientGone(Exception):
    pass


def new_error_id() -> str:
    return "err_" + uuid.uuid4().hex[:12]


def server_error_body(error_id: str) -> dict:
    """The body of every 500: no exception text, only the id under which the log has the details."""
    return error_body(f"internal server error (logged as {error_id})", "server_error")


def given_key(headers: dict[bytes, bytes]) -> bytes:
    """The API key a request carries (``Authorization: Bearer KEY``), or b""."""
    auth = headers.get(b"authorization", b"")
    return auth[7:] if auth[:7].lower() == b"bearer " else b""


def authorized(state: ServerState, headers: dict[bytes, bytes]) -> bool:
    """Whether the request may pass the API key check: no key is set, or it carries the key."""
    key = state.http.api_key
    return key is None or hmac.compare_digest(given_key(headers), key.encode())


def _access_line(scope, status: int, seconds: float) -> None:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    extra = "".join(f" {k}={v}" for k, v in scope.get(ACCESS_KEY, {}).items())
    log.info("%s %s %s %d %.1f ms%s", who, scope["method"], scope["path"][:200], status, 1e3 * seconds, extra)


class Gatekeeper:
    """Outermost ASGI layer: the checks of the module docstring, then the app with the body read in full."""

    def __init__(self, app: FastAPI, state: ServerState) -> None:
        self.app, self.state = app, state

    async def _reply(self, send, status: int, body: dict, close: bool = False) -> None:
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if close:  # the body was not read to its end: the connection cannot carry another request
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def _check_headers(self, scope, headers: dict[bytes, bytes]) -> None:
        cfg = self.state.http
        if not cfg.host_allowed(headers.get(b"host")):
            raise _Refusal(400, "invalid Host header", "invalid_host")
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:  # which one counts is ambiguous
            raise _Refusal(400, "more than one Authorization header", "duplicate_header")
        if scope["path"] not in OPEN_PATHS and not authorized(self.state, headers):
            given = given_key(headers)
            msg = "Incorrect API key provided." if given else "No API key provided (Authorization: Bearer)."
            raise _Refusal(401, msg, "invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            bodiless = headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers
            dev_exempt = self.state.dev_mode and bodiless and scope["path"] in BODILESS_DEV_POSTS
            if media != b"application/json" and not dev_exempt:
                raise _Refusal(415, "the body must be JSON: Content-Type: application/json", "unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise _Refusal(413, f"the request body exceeds {cfg.max_body_bytes} bytes", "request_too_large")

    async def _read_body(self, receive) -> bytes:
        """The whole request body, within the size limit and the body timeout."""
        cfg = self.state.http
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:  # each piece within the idle timeout, all of them within the body timeout
                message = await asyncio.wait_for(receive(), timeout=max(min(left, cfg.body_idle_timeout), 0))
            except asyncio.TimeoutError:
                if left > cfg.body_idle_timeout:
                    why = f"no body bytes arrived for {cfg.body_idle_timeout:g} s"
                else:
                    why = f"the body took over {cfg.body_timeout:g} s to arrive"
                raise _Refusal(408, why, "request_timeout") from None
            if message["type"] == "http.disconnect":
                raise _ClientGone(size)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise _Refusal(413, f"the request body exceeds {cfg.max_body_bytes} bytes", "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, logged = [500], False
        started = [False]
        connection = scope.get(CONNECTION_KEY)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
            elif message.get("more_body") and connection is not None:  # a stream: wait for its client to read
                if not await connection.until_read(UNREAD_BYTES, self.state.engine.limits.unread_timeout):
                    return  # closed: the app hears the disconnect from receive()
            await send(message)

        try:
            self._check_headers(scope, dict(scope["headers"]))
            body = await self._read_body(receive)
            delivered = [False]

            async def replay() -> dict:
                if delivered[0]:
                    return await receive()  # after the body: the client's disconnect, when it comes
                delivered[0] = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, counting_send)
        except _Refusal as r:
            await self._reply(counting_send, r.status, r.body, close=True)
        except _ClientGone as gone:  # this line is the request's access line too: one line per abandoned body
            status[0], logged = 499, True
            log.info("%s %s: the client left after %d body bytes", scope["method"], scope["path"], gone.args[0])
        except Exception:
            error_id = scope.get(ERROR_ID_KEY) or new_error_id()  # the app's 500 handler may have named it
            log.exception("%s %s failed (%s)", scope["method"], scope["path"], error_id)
            if not started[0]:
                await self._reply(counting_send, 500, server_error_body(error_id))
        finally:
            if scope["path"].startswith("/v1/"):
                self.state.metrics.count_request(status[0])
            if self.state.http.access_log and not logged:
                _access_line(scope, status[0], time.perf_counter() - start)
