"""The ASGI layer around the FastAPI app: API key, request body size, request counting.

Being outside the app, it refuses a request before any routing or body parsing, and it counts every /v1
response by status code, its own 401s and 413s included.
"""

import hmac
import json

from fastapi import FastAPI

from lockstep.server.protocol import error_body
from lockstep.server.state import ServerState


class _BodyTooLarge(Exception):
    pass


class Gatekeeper:
    """Outermost ASGI layer: 401 for a wrong API key on /v1, 413 for a body over ``state.max_body_bytes``
    (by Content-Length, or counted as it streams in), and the request counter by status code."""

    def __init__(self, app: FastAPI, state: ServerState) -> None:
        self.app, self.state = app, state

    async def _reply(self, send, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        api = scope["path"].startswith("/v1/")
        status = [500]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if api and state.api_key is not None:
                headers = dict(scope["headers"])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                    msg = "Incorrect API key provided." if given else "No API key provided (Authorization: Bearer)."
                    return await self._reply(
                        counting_send, 401, error_body(msg, "invalid_request_error", code="invalid_api_key")
                    )
            limit = state.max_body_bytes
            too_large = error_body(
                f"the request body exceeds {limit} bytes", "invalid_request_error", code="request_too_large"
            )
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                return await self._reply(counting_send, 413, too_large)
            received = [0]

            async def limited_receive():
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:
                        raise _BodyTooLarge
                return message

            started = [False]

            async def tracking_send(message) -> None:
                started[0] = True
                await counting_send(message)

            try:
                await self.app(scope, limited_receive, tracking_send)
            except _BodyTooLarge:
                if not started[0]:
                    await self._reply(counting_send, 413, too_large)
        finally:
            if api:
                state.metrics.count_request(status[0])
