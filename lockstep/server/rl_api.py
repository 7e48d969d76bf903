"""The RL routes of ``lockstep serve --dev-mode`` (or ``VLLM_SERVER_DEV_MODE=1``): vLLM's development endpoints.

Weight transfer, vLLM's shape (the one TRL's ``VLLMClient`` drives): ``POST /init_weight_transfer_engine``
``{"init_info": {master_address, master_port, rank_offset, world_size}}`` joins the trainer's weight-update group
with every rank of the server; ``POST /update_weights`` ``{"update_info": {names, dtype_names, shapes,
bucket_bytes}}`` receives one bucketed broadcast (``engine.weight_updates``) and clears the prefix cache;
``/start_weight_update`` and ``/finish_weight_update`` are accepted (lockstep copies each bucket in place: nothing to
prepare or finalize). ``GET /get_world_size`` (the server's ranks), ``GET /server_info`` (the config TRL reads).
``POST /reset_prefix_cache`` -> ``{"success": bool}``. Sleep mode (``--enable-sleep-mode``): ``POST /sleep?level=1|2``,
``POST /wake_up`` (``?tags=weights``/``kv_cache``), ``GET /is_sleeping``; a request while asleep gets 503.

Each engine call runs in the engine thread once no request is in flight (``AsyncEngine.run_on_engine``); calls
that arrive meanwhile wait behind it. After a weight update ``system_fingerprint`` counts it (``weight_updates``):
the served weights are no longer the checkpoint's files.
"""

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lockstep.server.protocol import error_body
from lockstep.server.state import ServerState, make_fingerprint


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def _body(request: Request, key: str) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(body, dict) or not isinstance(body.get(key), dict):
        raise ValueError(f'the body must be {{"{key}": {{...}}}}')
    return body[key]


def _weights_changed(state: ServerState) -> None:
    parts = dict(state.fingerprint_parts)
    parts["weight_updates"] = parts.get("weight_updates", 0) + 1
    state.fingerprint_parts, state.fingerprint = parts, make_fingerprint(parts)


def add_rl_routes(app: FastAPI, state: ServerState) -> None:
    """Add the routes above to ``app``."""
    engine = state.engine

    async def run(fn, wait_idle: bool = True) -> Response | object:
        try:
            return await engine.run_on_engine(fn, wait_idle)
        except (ValueError, RuntimeError) as e:
            if type(e).__module__.startswith("lockstep.server"):  # EngineError: the app's handler answers
                raise
            return _json(error_body(str(e), "invalid_request_error"), 400)

    def answer(result, body: dict) -> Response:
        return result if isinstance(result, Response) else _json(body)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        try:
            info = await _body(request, "init_info")
        except ValueError as e:
            return _json(error_body(str(e), "invalid_request_error"), 400)
        return answer(await run(lambda e: e.init_weight_transfer_engine(info)), {})

    @app.post("/start_weight_update")
    async def start_weight_update() -> Response:
        return _json({})

    @app.post("/finish_weight_update")
    async def finish_weight_update() -> Response:
        return _json({})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        try:
            info = await _body(request, "update_info")
        except ValueError as e:
            return _json(error_body(str(e), "invalid_request_error"), 400)
        result = await run(lambda e: e.update_weights(info))
        if isinstance(result, Response):
            return result
        _weights_changed(state)
        return _json({"loaded": len(result)})

    @app.get("/get_world_size")
    async def get_world_size() -> Response:
        return _json({"world_size": engine.engine.config.tensor_parallel_size})

    @app.get("/server_info")
    async def server_info() -> Response:
        config = engine.engine.config
        vllm_config = {
            "model_config": {
                "model": state.model_path,
                "served_model_name": state.model_name,
                "max_model_len": config.max_model_len,
                "dtype": state.fingerprint_parts.get("dtype"),
                # The sampled token's logprob is the raw distribution's (before temperature and penalties); at
                # temperature 1 without penalties that is also the processed one.
                "logprobs_mode": "raw_logprobs",
            },
            "parallel_config": {"tensor_parallel_size": config.tensor_parallel_size},
            "weight_transfer_config": {"backend": "lockstep"},
            "lockstep": {"enable_sleep_mode": config.enable_sleep_mode, "kernels": config.kernels},
        }
        return _json({"vllm_config": vllm_config, "system_fingerprint": state.fingerprint})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        done = await run(lambda e: e.reset_prefix_cache(), wait_idle=False)  # False while requests run, as vLLM's
        return answer(done, {"success": done is True})

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            return _json(error_body("level must be 1 or 2", "invalid_request_error"), 400)
        return answer(await run(lambda e: e.sleep(level)), {})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        return answer(await run(lambda e: e.wake_up(tags)), {})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return _json({"is_sleeping": engine.engine.is_sleeping})
