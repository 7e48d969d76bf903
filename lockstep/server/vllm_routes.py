"""vLLM's (and SGLang's) routes beside the OpenAI API: ``GET /tokenizer_info`` (with
``--enable-tokenizer-info-endpoint``), ``GET /load`` (with ``--enable-server-load-tracking`` the generation calls in
flight, counted by ``LoadTracked``; else 0, as vLLM answers), ``POST /invocations`` (SageMaker's one route,
dispatched on the body's shape) and SGLang's ``/flush_cache`` (vLLM's ``POST /reset_prefix_cache`` is a development
route, as in vLLM: ``--dev-mode``, ``rl_api``); and the body and reply of vLLM's ``/v1/chat/completions/batch``
(``split_batch``, ``merge_batch``: many conversations in one call, one choice each), which ``openai_api`` serves.

``/flush_cache`` forgets every cached prefix block, on the engine thread between two steps
(``LLMEngine.reset_prefix_cache``). While requests are running their blocks are in use and nothing is reset (as
vLLM and SGLang refuse too): the answer is then a 409 that says so, not a 200 that did nothing. Outputs do not
change either way: a prefix hit gives the bits a fresh prefill gives (docs/design.md).
"""

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lockstep.server.protocol import MAX_N, APIError, error_body
from lockstep.server.state import ServerState

# Tokenizer settings that name files on the server's disk, left out of /tokenizer_info (vLLM drops the same).
_PRIVATE_TOKENIZER_KEYS = ("tokenizer_object", "vocab_file", "merges_file", "tokenizer_file", "name_or_path")


class LoadTracked(Response):
    """A generation call's response that holds its place in ``state.server_load`` until it is written (a stream: to
    its end, or until the client leaves): vLLM's count of the requests using the engine. The count is taken before
    the body is parsed and given back here, whatever happens to the writing."""

    def __init__(self, state: ServerState, inner: Response) -> None:
        self.state, self.inner = state, inner
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, inner.background

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.state.server_load -= 1


async def load_tracked(state: ServerState, answer) -> Response:
    """``await answer()`` counted in ``state.server_load`` while it runs and while its response is written."""
    if not state.enable_server_load_tracking:
        return await answer()
    state.server_load += 1
    try:
        response = await answer()
    except BaseException:
        state.server_load -= 1
        raise
    return LoadTracked(state, response)


def split_batch(body: bytes) -> list[bytes]:
    """vLLM's ``/v1/chat/completions/batch`` body (a chat completion body whose ``messages`` is a list of
    conversations) as one chat completion body per conversation. Refused as vLLM refuses them: streaming, tools and
    beam search; and ``n`` above 1 (vLLM's choices are one per conversation) and more than ``MAX_N`` conversations
    (each one is a request)."""
    try:
        data = json.loads(body)
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    conversations = data.get("messages")
    if not isinstance(conversations, list) or not conversations or not all(isinstance(c, list) for c in conversations):
        raise APIError(400, "messages must be a non-empty list of conversations (lists of messages)", param="messages")
    if len(conversations) > MAX_N:
        raise APIError(400, f"at most {MAX_N} conversations in one batch, got {len(conversations)}", param="messages")
    for key, refused in (
        ("stream", bool(data.get("stream"))),
        ("tools", bool(data.get("tools"))),
        ("tool_choice", data.get("tool_choice") not in (None, "none")),
        ("use_beam_search", bool(data.get("use_beam_search"))),
        ("n", data.get("n", 1) not in (1, None)),
    ):
        if refused:
            raise APIError(400, f"{key} is not supported by /v1/chat/completions/batch", param=key)
    return [json.dumps(data | {"messages": c}).encode() for c in conversations]


def merge_batch(replies: list[dict]) -> dict:
    """The conversations' replies as one chat completion, vLLM's: choice ``i`` is conversation ``i``'s (its bits
    those of the same call alone), the usage summed, the per-call fields (prompt logprobs and ids, metrics) null."""
    first = replies[0]
    usage = {
        key: sum(r["usage"][key] for r in replies) for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    details = first["usage"].get("prompt_tokens_details")
    if details is not None:
        details = {"cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)}
    head = {key: first[key] for key in ("object", "created", "model", "system_fingerprint")}
    return {
        "id": first["id"],
        **head,
        "choices": [r["choices"][0] | {"index": i} for i, r in enumerate(replies)],
        "usage": usage | {"prompt_tokens_details": details},
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "metrics": None,
    }


def tokenizer_info(state: ServerState) -> dict:
    """vLLM's ``TokenizerInfo``: the tokenizer's init settings as JSON, its class and the chat template."""
    tok = state.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer", type="not_found_error")
    config = {k: v for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k not in _PRIVATE_TOKENIZER_KEYS}
    info = json.loads(json.dumps(config, default=str))  # AddedToken and the like as their text
    info["tokenizer_class"] = type(tok).__name__
    if getattr(tok, "chat_template", None):
        info["chat_template"] = tok.chat_template
    return info


def add_vllm_routes(app: FastAPI, state: ServerState, call) -> None:
    """The routes above; ``call(request, chat)`` answers a completion (``chat=False``) or chat completion call."""

    if state.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info_route() -> Response:
            return Response(json.dumps(tokenizer_info(state)), media_type="application/json")

    @app.get("/load")
    async def load() -> Response:
        return Response(json.dumps({"server_load": state.server_load}), media_type="application/json")

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        # SageMaker's single route: a body with messages is a chat completion, one with a prompt a completion.
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None  # the completion route's parser says what is wrong with it
        if isinstance(body, dict) and "messages" in body:
            return await call(request, chat=True)
        if isinstance(body, dict) and "prompt" in body:
            return await call(request, chat=False)
        raise APIError(
            400,
            "cannot find a handler for this request: /invocations takes a chat completion (messages) or a "
            "completion (prompt) body",
        )

    @app.post("/flush_cache")  # POST only (SGLang also takes GET, which any page can send cross-site)
    async def flush_cache() -> Response:
        if not await state.engine.run_on_engine(lambda engine: engine.reset_prefix_cache(), wait_idle=False):
            body = error_body("requests are running: the prefix cache was not reset", "conflict_error")
            return Response(json.dumps(body), status_code=409, media_type="application/json")
        return Response(status_code=200)
