"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncEngine``.

``POST /v1/completions`` and ``/v1/chat/completions`` (SSE streaming or not), vLLM's ``/v1/chat/completions/batch``,
``GET /v1/models``, ``/health``, ``/metrics``, vLLM's ``POST /tokenize`` and ``/detokenize`` (``tokenize``),
``GET /version``, and the rest of vLLM's routes (``vllm_routes``: ``/tokenizer_info``, ``/load``, ``/invocations``,
``/flush_cache``). Every completion carries
``system_fingerprint``: a hash of the weights, lockstep's version, the device, the dtype and the kernel set, the key
under which a request's output is reproducible. Errors are OpenAI-style JSON bodies; nothing a client sends can
take the server down.

A call goes ``middleware`` (Host, API key, Content-Type, the body) -> a route here -> ``requests`` (body to
``ChoiceSpec``s, in a worker thread) -> ``responses`` (engine outputs to a JSON reply or an SSE stream); ``state``
holds the engine and the fingerprint, ``listener`` the HTTP settings. The API key, when set, guards every path
but ``/health``, which then says only whether the server is up.
"""

import asyncio
import gc
import json
import math
import socket
import threading

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.server.async_engine import EngineError
from lockstep.server.beam import beam_reply
from lockstep.server.listener import bind_socket, listen_with
from lockstep.server.middleware import ERROR_ID_KEY, Gatekeeper, authorized, new_error_id, server_error_body
from lockstep.server.protocol import APIError, error_body
from lockstep.server.requests import parse_call
from lockstep.server.responses import DISCONNECT_POLL_SECONDS, respond
from lockstep.server.state import ServerState
from lockstep.server.tokenize import detokenize, tokenize
from lockstep.server.vllm_routes import add_vllm_routes, load_tracked, merge_batch, split_batch


def json_response(body: dict, status: int = 200) -> Response:
    """A JSON response whose body is ASCII: no client string can make it fail to encode."""
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def build_app(state: ServerState) -> FastAPI:
    """The routes and OpenAI-style error handlers over ``state``; ``serve`` wraps it in the ``Gatekeeper``."""
    app = FastAPI(title="lockstep", version=state.fingerprint_parts["lockstep"], docs_url=None, redoc_url=None)
    app.state.lockstep = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return json_response(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return json_response(error_body(str(e.detail), kind), e.status_code)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> Response:
        # Overload (429), shutdown and a dead engine (503), time limits: the engine's own answers.
        response = json_response(error_body(str(e), e.type, code=e.code), e.status)
        if e.retry_after is not None:
            response.headers["Retry-After"] = str(math.ceil(e.retry_after))
        return response

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> Response:
        # The Gatekeeper logs the exception, once, under this id.
        request.scope[ERROR_ID_KEY] = error_id = new_error_id()
        return json_response(server_error_body(error_id), 500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the same status, no body (load balancers probe so)
    async def health(request: Request) -> Response:
        status = state.engine.status  # "ok", "shutting down", or why the engine cannot serve
        body = {"status": status}
        if authorized(state, dict(request.scope["headers"])):  # the weights' identity is for key holders only
            body |= {"model": state.model_name, "system_fingerprint": state.fingerprint, **state.fingerprint_parts}
        return json_response(body, 200 if status == "ok" else 503)

    @app.get("/version")
    async def version() -> dict:  # vLLM's route: the server's version (lockstep's)
        import lockstep

        return {"version": lockstep.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "lockstep",
            "root": state.model_path,  # vLLM's card: where the weights came from, no parent, one permission
            "parent": None,
            "max_model_len": state.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{state.fingerprint}",
                    "object": "model_permission",
                    "created": 0,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
            "system_fingerprint": state.fingerprint,
        }
        return {"object": "list", "data": [card]}

    async def while_connected(request: Request, handler, *args, body: bytes | None = None):
        """``handler(state, body, *args, cancelled)`` in a worker (``body``: the request's, unless given); None if
        the client leaves first (the handler is told, through ``cancelled``, to stop rendering its chat template)."""
        body = await request.body() if body is None else body
        cancelled = threading.Event()
        job = asyncio.get_running_loop().run_in_executor(state.workers, handler, state, body, *args, cancelled)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned job's error is not news
        while True:
            done, _ = await asyncio.wait({job}, timeout=DISCONNECT_POLL_SECONDS)
            gone = await request.is_disconnected()
            if gone:
                cancelled.set()
                return None
            if done:
                return job.result()

    async def call(request: Request, chat: bool) -> Response:
        return await load_tracked(state, lambda: answer(request, chat))

    async def answer(request: Request, chat: bool) -> Response:
        parsed = await while_connected(request, parse_call, chat)
        if parsed is None:  # nothing was submitted: a departed client's call costs the engine nothing
            return Response(status_code=499)
        req, specs = parsed
        if req.use_beam_search:
            return await beam_reply(state, request, req, specs, chat=chat)
        return await respond(state, request, req, specs, chat=chat)

    async def in_worker(request: Request, handler) -> Response:
        answer = await while_connected(request, handler)
        return Response(status_code=499) if answer is None else json_response(answer)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await in_worker(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await in_worker(request, detokenize)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await call(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await call(request, chat=True)

    async def answer_batch(request: Request) -> Response:
        # Each conversation is answered as its own chat call would be, all at once; the first failure fails the
        # batch (vLLM's rule) and stops the others' requests.
        async def one(body: bytes) -> Response:
            parsed = await while_connected(request, parse_call, True, body=body)
            if parsed is None:
                return Response(status_code=499)
            req, specs = parsed
            return await respond(state, request, req, specs, chat=True)

        tasks = [asyncio.ensure_future(one(body)) for body in split_batch(await request.body())]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        failed = next((a for a in answers if a.status_code != 200), None)
        if failed is not None:
            return failed
        return json_response(merge_batch([json.loads(a.body) for a in answers]))

    @app.post("/v1/chat/completions/batch")
    async def chat_completions_batch(request: Request) -> Response:
        return await load_tracked(state, lambda: answer_batch(request))

    add_vllm_routes(app, state, call)
    if state.dev_mode:
        from lockstep.server.rl_api import add_rl_routes

        add_rl_routes(app, state)
    return app


def serve(
    state: ServerState,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout: float = 30.0,
    sock: socket.socket | None = None,
) -> int:
    """Run the server with uvicorn until it is stopped, then stop the engine thread; returns the exit status.

    SIGTERM (or Ctrl-C) starts a drain: admission stops (new calls get 503, ``/health`` says "shutting down"),
    while the server still accepts connections to say so, and the calls in flight have ``shutdown_timeout``
    seconds to finish; the rest then fail with 503 (a JSON body, or an error event and ``[DONE]`` on a stream).
    Once no call is left the server closes and exits with 0; a second signal ends the drain at once. If the engine
    dies, the calls in flight get 503 and the server exits with 1, for an orchestrator to restart it. ``sock``: a
    socket already bound to ``host:port`` (``listener.bind_socket``)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Not uvicorn's: it stops listening at once (new clients are refused by TCP, not told "shutting
            # down") and re-raises the signal once it is done, so a clean drain exited 143 instead of 0.
            if state.engine.draining:
                self.force_exit = self.should_exit  # a third signal: not even the connections' grace period
                self.should_exit = True
            state.engine.drain(shutdown_timeout)

        async def on_tick(self, counter: int) -> bool:
            if state.engine.draining and state.engine.idle:
                self.should_exit = True  # every call has its answer, or is writing it
            return await super().on_tick(counter)

    app = Gatekeeper(build_app(state), state)
    # uvicorn's own grace period starts after the drain: the answers still being written, the idle connections.
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5
    )  # --root-path is the Gatekeeper's (HTTPConfig.root_path), not uvicorn's: that one breaks prefixed paths
    listen_with(config, state.http, state.metrics)
    # The model, torch and transformers are ~200k objects that live as long as the server: out of the garbage
    # collector's sight, a full collection (a request's many small lists can set one off) holds the GIL for
    # milliseconds instead of ~120 ms.
    gc.freeze()
    server = Server(config)

    def fatal() -> None:
        server.should_exit = True  # uvicorn polls it; the calls in flight already have their 503

    state.engine.on_fatal = fatal
    try:
        server.run(sockets=[sock if sock is not None else bind_socket(host, port)])
    finally:
        dead = not state.engine.alive
        state.engine.stop()
    return 1 if dead else 0
