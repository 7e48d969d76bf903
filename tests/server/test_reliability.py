"""Issue 13 against real ``lockstep serve`` processes: the poisoned request, unbounded work, overload (429s, no
request lost or answered twice), a client that stops reading, SIGTERM's drain and a dead engine's exit.
(The same machinery in-process, fault by fault: test_async_engine.py.)"""

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import save_tiny_llama

from .conftest import Server, start_server, stop_server

# Two sequences running, four waiting: a handful of concurrent requests already overloads it.
GUARDED = ("--max-num-seqs", "2", "--max-queued-seqs", "4", "--max-seqs-per-request", "4", "--unread-timeout", "1")
# Streams stall after a few hundred tokens, not thousands (see small_send_buffers.py).
SMALL_SEND_BUFFERS = str(Path(__file__).with_name("small_send_buffers.py"))


@pytest.fixture(scope="module")
def guarded(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "guarded.log"
    s = start_server(tiny_server_model_dir, log, *GUARDED, launcher=(SMALL_SEND_BUFFERS,))
    yield s
    stop_server(s.proc)


def body(server: Server, prompt, **fields) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0} | fields


def wait_idle(server: Server, timeout: float = 60) -> dict:
    """The metrics once nothing runs, waits or holds a KV block (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["lockstep_num_requests_running"] == m["lockstep_num_requests_waiting"] == 0
        if idle and m["lockstep_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_the_poisoned_request_is_refused_and_hurts_nobody(guarded: Server) -> None:
    # Reproducer 1: this body made the sampler pick token id = vocab size inside the shared step, failing every
    # request in it with a 500. Its repetition_penalty is now refused at the door, naming the field; its
    # temperature alone is greedy. The requests beside it answer as they do alone.
    poisoned = body(guarded, "the the the of of and and Hello Hello", max_tokens=4, temperature=1e-300, seed=1)
    url = guarded.base_url + "/completions"

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            calls = [body(guarded, "left", logprobs=1), poisoned | {"repetition_penalty": 1e308}]
            calls += [body(guarded, "right", temperature=0.9, seed=3)]
            return await asyncio.gather(*(c.post(url, json=b) for b in calls))

    left, bad, right = asyncio.run(together())
    assert bad.status_code == 400 and "repetition_penalty" in bad.json()["error"]["message"], bad.text
    for r, b in ((left, body(guarded, "left", logprobs=1)), (right, body(guarded, "right", temperature=0.9, seed=3))):
        alone = httpx.post(url, json=b, timeout=60).json()["choices"][0]
        assert r.status_code == 200 and r.json()["choices"][0] == alone
    tiny = httpx.post(url, json=poisoned, timeout=60).json()["choices"][0]
    greedy = httpx.post(url, json=poisoned | {"temperature": 0}, timeout=60).json()["choices"][0]
    assert tiny == greedy
    wait_idle(guarded)


def test_unbounded_work_per_request_is_refused_at_once(guarded: Server) -> None:
    # Reproducer 2: an 891-byte body became 20,480 sequences and 281 s of engine time.
    start = time.monotonic()
    r = httpx.post(guarded.base_url + "/completions", json=body(guarded, [[1]] * 160, n=128), timeout=60)
    assert r.status_code == 400 and "20480 sequences" in r.json()["error"]["message"], r.text
    assert time.monotonic() - start < 5
    # The count comes before tokenizing: prompts too long for the context (or not tokens of the model at all) are
    # not looked at when there are too many of them.
    for prompts in (["x" * 5000] * 2, [[10**6]] * 2):
        r = httpx.post(guarded.base_url + "/completions", json=body(guarded, prompts, n=3), timeout=60)
        assert r.status_code == 400 and "6 sequences" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "n"
    wait_idle(guarded)


def test_overload_answers_429_and_loses_no_request(guarded: Server) -> None:
    # More concurrent requests than the queue takes: each is answered once, 200 or 429 with Retry-After; retried,
    # every one completes with the text it gets alone, and the server counted exactly what it answered.
    url = guarded.base_url + "/completions"
    prompts = [f"request {i:02d}" for i in range(24)]
    before = guarded.metrics()

    async def overload() -> tuple[dict, int, int]:
        done, rejected, rounds = {}, 0, 0
        async with httpx.AsyncClient(timeout=60) as c:
            while len(done) < len(prompts):
                rounds += 1
                pending = [p for p in prompts if p not in done]
                answers = await asyncio.gather(*(c.post(url, json=body(guarded, p)) for p in pending))
                for p, r in zip(pending, answers, strict=True):
                    if r.status_code == 429:
                        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
                        rejected += 1
                    else:
                        assert r.status_code == 200, r.text
                        done[p] = r.json()
                await asyncio.sleep(0.5)
        return done, rejected, rounds

    done, rejected, rounds = asyncio.run(overload())
    assert rejected > 0 and rounds > 1
    after = wait_idle(guarded)
    for code, n in (("200", len(prompts)), ("429", rejected)):
        key = f'lockstep_requests_total{{code="{code}"}}'
        assert after[key] - before.get(key, 0) == n
    generated = sum(r["usage"]["completion_tokens"] for r in done.values())
    assert after["lockstep_generation_tokens_total"] - before["lockstep_generation_tokens_total"] == generated
    assert len({r["id"] for r in done.values()}) == len(prompts)
    for p in prompts[::5]:
        alone = httpx.post(url, json=body(guarded, p), timeout=60).json()
        assert done[p]["choices"] == alone["choices"], p


def test_a_client_that_stops_reading_loses_its_stream(guarded: Server) -> None:
    # Reproducer 10: a client that stopped reading kept its sequence generating to max_tokens with an output queue
    # that grew without bound. Now, unread for --unread-timeout (1 s), its request is stopped and its blocks freed
    # while the connection is still open; /health answers meanwhile.
    aborted = guarded.metrics()["lockstep_requests_aborted_total"]
    payload = json.dumps(body(guarded, "slow reader", max_tokens=1000, ignore_eos=True, stream=True, logprobs=5))
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n{payload}".encode())
        deadline = time.monotonic() + 60
        while guarded.metrics()["lockstep_requests_aborted_total"] == aborted:
            assert time.monotonic() < deadline, "the unread stream was never stopped"
            time.sleep(0.2)
        start = time.monotonic()
        assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 1
        m = wait_idle(guarded, timeout=10)
        assert m["lockstep_generation_tokens_total"] > 0
    assert m["lockstep_requests_aborted_total"] == aborted + 1


async def _stream(c: httpx.AsyncClient, url: str, payload: dict, started: asyncio.Event) -> list[str]:
    async with c.stream("POST", url, json=payload | {"stream": True}) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                started.set()
        return lines


def test_sigterm_drains_then_ends_what_is_left(tmp_path: Path) -> None:
    # Reproducer 10: SIGTERM cut streams without [DONE] and answered non-streaming calls with a plain-text 500.
    # Now admission stops, calls that finish within --shutdown-timeout finish, and the rest end with an error
    # event and [DONE] (streams) or a JSON 503 (the others). The long calls must outlast the drain on an idle
    # machine too: 6000 tokens on a model with room for them (1000 took under 5 s on an idle CI machine).
    # Issue 25, item 8: during the drain the server still accepts connections, to answer 503 and /health's
    # "shutting down" (it closed its socket at once, so clients saw a refused connection), it exits 0 (143: uvicorn
    # re-raised the signal), and the access line of the stream cut short counts the tokens it sent (it said 0).
    model = save_tiny_llama(tmp_path / "tiny", max_position_embeddings=8192)
    log = tmp_path / "drain.log"
    s = start_server(model, log, "--shutdown-timeout", "5", "--log-level", "info")
    url = s.base_url + "/completions"
    try:

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                events = [asyncio.Event(), asyncio.Event()]
                short = asyncio.ensure_future(_stream(c, url, body(s, "short", max_tokens=60), events[0]))
                long = asyncio.ensure_future(
                    _stream(c, url, body(s, "long", max_tokens=6000, ignore_eos=True, logprobs=0), events[1])
                )
                reply = asyncio.ensure_future(c.post(url, json=body(s, "reply", max_tokens=6000, ignore_eos=True)))
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
                deadline = time.monotonic() + 30
                while s.metrics()["lockstep_num_requests_running"] < 3 - short.done():  # the reply is in too
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                s.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.5)
                async with httpx.AsyncClient(timeout=10) as late:  # new connections, mid-drain
                    health = await late.get(s.url + "/health")
                    refused = await late.post(url, json=body(s, "late"))
                results = await asyncio.gather(short, long, reply)
                return results, time.monotonic() - sent, health, refused

        (short, long, reply), elapsed, health, refused = asyncio.run(main())
        assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
        assert long[-1] == "data: [DONE]" and "shut down" in json.loads(long[-2][6:])["error"]["message"]
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down", reply.text
        assert health.status_code == 503 and health.json()["status"] == "shutting down"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert 4 < elapsed < 15
        assert s.proc.wait(timeout=30) == 0
        text = log.read_text()
        assert "Traceback" not in text
        sent_tokens = sum(len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]) for line in long[:-2])
        counts = [int(x.split("=")[1]) for x in text.split() if x.startswith("completion_tokens=")]
        assert sent_tokens > 50 and sent_tokens in counts, (sent_tokens, counts)
    finally:
        stop_server(s.proc)


BROKEN_ENGINE = """
import sys
from lockstep.cli import main
from lockstep.engine.llm_engine import LLMEngine

def step(self):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

LLMEngine.step = step
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_fails_its_calls_with_503_and_the_server_exits_1(
    tiny_server_model_dir: Path, tmp_path: Path
) -> None:
    # Reproducer 6's class: an engine that cannot continue must not leave a server that hangs or answers 500
    # forever. Two failed steps are answered 500 and served on; the third kills the engine: 503, exit status 1.
    log = tmp_path / "dead.log"
    s = start_server(tiny_server_model_dir, log, launcher=("-c", BROKEN_ENGINE))
    try:
        url = s.base_url + "/completions"
        codes = [httpx.post(url, json=body(s, "x"), timeout=60).status_code for _ in range(3)]
        assert codes == [500, 500, 503]
        assert s.proc.wait(timeout=30) == 1
        assert "the engine cannot continue: 3 steps failed in a row" in log.read_text()
    finally:
        stop_server(s.proc)
