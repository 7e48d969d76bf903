"""The app behind the ``Gatekeeper``, in process over an engine that fails: a real 500 gets a generic body that
names an error id, and the log has the exception once, under that id; a stream that fails says so in-band the
same way. (Everything else the Gatekeeper does is driven over HTTP in test_hostile_http.py.)"""

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx

from lockstep.server.async_engine import ServingLimits
from lockstep.server.metrics import Metrics
from lockstep.server.middleware import Gatekeeper
from lockstep.server.openai_api import build_app
from lockstep.server.state import ServerState

SECRET = "secret internal detail /srv/weights"


class _FailingGroup:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError(SECRET)

    def abort(self) -> None:
        pass


class _Engine:
    """What the routes use of an ``AsyncEngine``; ``submit`` raises, or returns a group that raises."""

    alive = True
    engine = SimpleNamespace(max_model_len=64, default_sampling={})
    limits = ServingLimits()

    def __init__(self, fail_in_submit: bool) -> None:
        self.metrics, self.fail_in_submit = Metrics(), fail_in_submit

    async def submit(self, requests):
        if self.fail_in_submit:
            raise RuntimeError(SECRET)
        return _FailingGroup()


def call(engine: _Engine, body: dict) -> httpx.Response:
    state = ServerState(engine, None, "m", "m", "fp_x", {"lockstep": "0"})
    transport = httpx.ASGITransport(app=Gatekeeper(build_app(state), state))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.post(
                "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
            )

    return asyncio.run(go())


def logged_errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_500_says_nothing_internal_and_is_logged_once(caplog) -> None:
    r = call(_Engine(fail_in_submit=True), {"model": "m", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert SECRET not in r.text and "RuntimeError" not in r.text
    error_id = err["message"].split("logged as ")[1].rstrip(")")
    [record] = logged_errors(caplog)
    assert error_id in record.getMessage() and SECRET in str(record.exc_info[1])


def test_a_failed_stream_says_so_in_band_without_details(caplog) -> None:
    r = call(_Engine(fail_in_submit=False), {"model": "m", "prompt": [1, 2], "max_tokens": 2, "stream": True})
    assert r.status_code == 200
    [event] = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert event["error"]["type"] == "server_error" and SECRET not in r.text
    [record] = logged_errors(caplog)
    assert event["error"]["message"].split("logged as ")[1].rstrip(")") in record.getMessage()
    assert SECRET in str(record.exc_info[1])
