"""Issue 25's connection reproducers (items 3, 6, 7) against a real server with small numbers: 16 connections,
8 a client, a 2 s idle-body timeout, a 1 s unread timeout. Other clients are other loopback addresses
(127.0.0.2 and up), which Linux routes to the server like 127.0.0.1. (Item 8, the drain: test_reliability.py.)"""

import json
import socket
import time

import pytest
from tiny_models import save_tiny_llama

from .conftest import Server, start_server, stop_server

MAX_CONNECTIONS, PER_CLIENT, IDLE_BODY, UNREAD = 16, 8, 2.0, 1.0
ARGS = ["--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-client", str(PER_CLIENT)]
ARGS += ["--body-idle-timeout", str(IDLE_BODY), "--body-timeout", "8", "--unread-timeout", str(UNREAD)]
ARGS += ["--log-level", "info"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("connections")
    model = save_tiny_llama(folder / "tiny", max_position_embeddings=8192)  # room for a long n=16 stream
    s = start_server(model, folder / "server.log", *ARGS)
    yield s
    stop_server(s.proc)


def connect(server: Server, peer: str = "127.0.0.1", timeout: float = 10) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.bind((peer, 0))
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    return sock


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()


def post_head(length: int, extra: str = "") -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def ask(server: Server, peer: str, request: bytes) -> tuple[int, bytes]:
    with connect(server, peer) as sock:
        sock.sendall(request)
        answer = read_all(sock)
    return status(answer), answer.partition(b"\r\n\r\n")[2]


def wait_served(server: Server, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()["lockstep_http_connections_open"] != count + 1:  # + the metrics call's own
        assert time.monotonic() < deadline, server.metrics()["lockstep_http_connections_open"]
        time.sleep(0.05)


def test_a_burst_past_the_cap_refuses_only_what_is_past_it(server: Server) -> None:
    # Reproducer: 1100 connections at a cap of 1024 got 1071 refusals, the cap being checked when each request
    # started, against every connection accepted by then. Now it is counted when a connection is accepted: of 20
    # (from 4 addresses, 5 each, under the per-client limit) opened before any sends, 16 are served, 4 refused.
    socks = [connect(server, f"127.0.0.{2 + i % 4}") for i in range(MAX_CONNECTIONS + 4)]
    time.sleep(1.0)  # all accepted (which are served is decided then, in the order accepted)
    for sock in socks:
        sock.sendall(get("/v1/models"))
    answers = [read_all(sock) for sock in socks]
    for sock in socks:
        sock.close()
    codes = sorted(status(a) for a in answers)
    assert codes == [200] * MAX_CONNECTIONS + [503] * 4, codes
    refused = [json.loads(a.partition(b"\r\n\r\n")[2]) for a in answers if status(a) == 503]
    assert {r["error"]["code"] for r in refused} == {"too_many_connections"}
    assert b"retry-after: 1" in next(a for a in answers if status(a) == 503).lower()
    wait_served(server, 0)
    assert server.metrics()["lockstep_http_connections_refused_total"] >= 4


def test_one_client_cannot_take_every_connection(server: Server) -> None:
    # Reproducer: ~1023 connections from one client, each holding a 100-byte partial body, sat for the 60 s body
    # timeout while every /health and completion got 503. Now one address holds at most 8 connections (the rest
    # get 503 at once); others are served; /health is answered even past the caps; and a partial body that goes
    # quiet gets 408 after the idle-body timeout (2 s), long before the body timeout (8 s).
    partial = post_head(1000) + b'{"model": "m", "prompt": "' + b"x" * 74
    held = [connect(server, "127.0.0.3") for _ in range(PER_CLIENT + 4)]
    others = [connect(server, "127.0.0.4") for _ in range(MAX_CONNECTIONS - PER_CLIENT)]  # with held[:8]: all 16
    sent = time.monotonic()
    for sock in held:
        sock.sendall(partial)
    try:
        for sock in held[PER_CLIENT:]:
            answer = read_all(sock)
            assert status(answer) == 503 and b"too_many_connections" in answer, answer[:300]
        assert ask(server, "127.0.0.5", get("/v1/models"))[0] == 503  # the server is full
        assert ask(server, "127.0.0.3", get("/v1/models"))[0] == 503  # and .3 is over its own limit
        for peer in ("127.0.0.5", "127.0.0.3"):  # ... but a probe is answered
            code, body = ask(server, peer, get("/health"))
            assert code == 200 and json.loads(body)["status"] == "ok"
        assert time.monotonic() - sent < IDLE_BODY, "too slow to see the server full"
        for sock in others:
            sock.close()
        completion = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 2}).encode()
        code, body = ask(server, "127.0.0.2", post_head(len(completion), "Connection: close\r\n") + completion)
        assert code == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        for sock in held[:PER_CLIENT]:  # the quiet bodies
            answer = read_all(sock)
            assert status(answer) == 408 and b"no body bytes arrived for 2 s" in answer, answer[:300]
        assert time.monotonic() - sent < IDLE_BODY + 3
    finally:
        for sock in held + others:
            sock.close()
    wait_served(server, 0)


def test_a_head_over_16_kib_gets_431(server: Server) -> None:
    # Reproducer: a 100 KB header got 200 (h11 measures only a head that arrives in pieces), and at 250 KB and
    # more the connection was reset before any answer. Now both get a JSON 431, read to the end without a reset.
    for size in (100_000, 300_000):
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            answer = read_all(sock)
        assert status(answer) == 431, (size, answer[:200])
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_header_fields_too_large" and "16384" in error["message"]
    for size in (100, 15_000):  # within the limit
        padded = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Pad: " + b"a" * size
        assert ask(server, "127.0.0.1", padded + b"\r\n\r\n")[0] == 200


def test_a_stream_nobody_reads_stops_at_the_unread_timeout(server: Server) -> None:
    # Reproducer: the unread timeout counted only once socket writes blocked, after the kernel had taken ~4 MB,
    # so a non-reading n=16 stream generated ~130 s instead of ~30. Now a stream waits while more than 256 KiB of
    # it are unacknowledged, the timeout counts from there, and the connection is closed. (At --unread-timeout 1
    # on the CI machine: main generated 17,000 tokens in 18 s and kept the connection; this, ~2,400 in 1.5 s.)
    before = server.metrics()
    payload = json.dumps(
        {"model": server.model, "prompt": "x", "max_tokens": 6000, "n": 16, "ignore_eos": True, "stream": True}
    ).encode()
    with connect(server, "127.0.0.6", timeout=30) as sock:
        sock.sendall(post_head(len(payload)) + payload)
        start = time.monotonic()
        while server.metrics()["lockstep_requests_aborted_total"] < before["lockstep_requests_aborted_total"] + 16:
            assert time.monotonic() - start < 30, "the unread stream was never stopped"
            time.sleep(0.1)
        stopped = time.monotonic() - start
        generated = server.metrics()["lockstep_generation_tokens_total"] - before["lockstep_generation_tokens_total"]
        try:
            read_all(sock)  # the server closed it: EOF after what was buffered (a timeout if it had not)
        except ConnectionResetError:
            pass
    # How soon depends on how fast 256 KiB of chunks are made (1.5 s idle, 9 s on a loaded machine); the tokens
    # do not: main's stall came after ~4 MB, some 16,000 tokens, whatever the speed.
    assert generated < 8000, (generated, stopped)
    print(f"\nunread n=16 stream stopped after {stopped:.1f} s, {generated:.0f} tokens")
