"""Issue 13's HTTP-layer reproducers against a real server (``guarded_server``: the key from the environment, the
default 8 MiB body limit, 1 s header and 3 s body timeouts, 16 connections): huge prompts do not stall the event
loop (3), slow and abandoned clients (5), 4xx where a 500 used to be (7), strict types (8), what the key guards,
Content-Type, Host and CORS (9)."""

import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from .conftest import GUARDED_MAX_CONNECTIONS, GUARDED_TIMEOUTS, Server

EIGHT_MB = 8 << 20


def post(server: Server, path: str, content: bytes | str, headers: dict | None = None, **kw) -> httpx.Response:
    h = {"content-type": "application/json", **server.headers, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=kw.pop("timeout", 60), **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err
    return err


def attack_bodies(model: str) -> dict[str, tuple[str, bytes]]:
    """Bodies just under 8 MiB, each costing seconds of parsing, validating, templating or tokenizing done naively,
    and the path each goes to."""
    n = EIGHT_MB - 100
    comp, chat = "/v1/completions", "/v1/chat/completions"
    message = {"model": model, "messages": [{"role": "user", "content": "y" * n}]}
    return {
        "text prompt": (comp, json.dumps({"model": model, "prompt": "x" * n}).encode()),
        "chat message": (chat, json.dumps(message).encode()),
        "escaped text": (comp, json.dumps({"model": model, "prompt": "\u00e9" * (n // 6)}).encode()),
        "ids": (comp, json.dumps({"model": model, "prompt": [7] * (n // 3)}).encode()),
        "id lists": (comp, json.dumps({"model": model, "prompt": [[7]] * (n // 5)}).encode()),
        "empty objects": (comp, json.dumps({"model": model, "prompt": "a", "x": [{}] * (n // 4)}).encode()),
        "deep nesting": (comp, b'{"x": ' + b"[" * (n // 2) + b"]" * (n // 2) + b"}"),
    }


def test_huge_prompts_leave_health_and_streams_responsive(guarded_server: Server) -> None:
    s = guarded_server
    bodies = attack_bodies(s.model)
    stop = threading.Event()
    health_ms: list[float] = []
    health_codes: list[int] = []
    stream_gaps_ms: list[float] = []
    stream_lines: list[str] = []
    answers: list[tuple[str, int, float]] = []

    def poll_health() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                health_codes.append(c.get(s.url + "/health").status_code)  # (an assert here would not fail the test)
                health_ms.append(1e3 * (time.perf_counter() - t))
                time.sleep(0.02)

    def stream() -> None:
        body = {"model": s.model, "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}
        headers = {"content-type": "application/json", **s.headers}
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", s.url + "/v1/completions", json=body, headers=headers) as r,
        ):
            last = None
            for line in r.iter_lines():
                now = time.perf_counter()
                stream_lines.append(line)
                if line.startswith("data: {") and last is not None:
                    stream_gaps_ms.append(1e3 * (now - last))
                last = now
                if stop.is_set():
                    break

    def attack() -> None:
        with httpx.Client(timeout=60) as c:
            for _ in range(2):
                for name, (path, body) in bodies.items():
                    headers = {"content-type": "application/json", **s.headers}
                    t = time.perf_counter()
                    r = c.post(s.url + path, content=body, headers=headers)
                    answers.append((name, r.status_code, time.perf_counter() - t))

    watchers = [threading.Thread(target=poll_health), threading.Thread(target=stream)]
    attackers = [threading.Thread(target=attack) for _ in range(2)]
    for t in watchers:
        t.start()
    time.sleep(0.5)  # the stream is running
    start = time.perf_counter()
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    attack_seconds = time.perf_counter() - start
    stop.set()
    for t in watchers:
        t.join()

    assert {code for _, code, _ in answers} == {400}, answers
    assert len(answers) == 2 * 2 * len(bodies)
    p95 = statistics.quantiles(health_ms, n=20)[-1]
    print(
        f"\n{len(answers)} attack bodies of 8 MiB in {attack_seconds:.1f} s (slowest answer "
        f"{max(t for *_, t in answers):.2f} s); /health x{len(health_ms)}: median "
        f"{statistics.median(health_ms):.1f} ms, p95 {p95:.1f} ms, max {max(health_ms):.1f} ms; stream gaps "
        f"x{len(stream_gaps_ms)}: median {statistics.median(stream_gaps_ms):.1f} ms, max {max(stream_gaps_ms):.1f} ms"
    )
    # What cannot flake: /health kept answering while the attack ran, and the stream kept streaming, chunk after
    # chunk, without an error. The timings (printed above; on 2 idle cores p95 < 100 ms where main stalled for
    # seconds) depend on the machine's load, so they are measured (bench/reliability.py), not asserted.
    assert len(health_ms) > 20 and set(health_codes) == {200}
    chunks = [json.loads(line[6:]) for line in stream_lines if line.startswith("data: {")]
    assert len(chunks) > 20 and all("error" not in ch for ch in chunks)
    assert [ch["choices"][0]["index"] for ch in chunks] == [0] * len(chunks)
    assert all(ch["id"] == chunks[0]["id"] for ch in chunks)


def raw_connection(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, out = time.perf_counter(), b""
    while chunk := sock.recv(65536):
        out += chunk
    return out, time.perf_counter() - start


def request_head(server: Server, length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_slow_and_silent_clients_are_cut_off(guarded_server: Server) -> None:
    s = guarded_server
    header_timeout, body_timeout = GUARDED_TIMEOUTS["--header-timeout"], GUARDED_TIMEOUTS["--body-timeout"]
    with raw_connection(s) as sock:  # says nothing
        out, waited = read_until_closed(sock)
    assert out == b"" and header_timeout * 0.9 < waited < header_timeout + 2
    with raw_connection(s) as sock:  # half a request head
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        out, waited = read_until_closed(sock)
    assert out == b"" and waited < header_timeout + 2
    with raw_connection(s) as sock:  # a head trickled a byte at a time: the deadline is not renewed per byte
        start = time.perf_counter()
        with pytest.raises(OSError):
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        assert time.perf_counter() - start < header_timeout + 2
    body = json.dumps({"model": s.model, "prompt": "hi", "max_tokens": 1}).encode()
    with raw_connection(s) as sock:  # a body that stops half way
        sock.sendall(request_head(s, len(body)) + body[:10])
        out, waited = read_until_closed(sock)
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "request_timeout" and waited < body_timeout + 2
    assert httpx.get(s.url + "/health").status_code == 200


def test_abandoned_bodies_cost_one_log_line_each(guarded_server: Server) -> None:
    s = guarded_server
    body = json.dumps({"model": s.model, "prompt": "hi"}).encode()
    before = s.log.read_text()
    for _ in range(3):
        with raw_connection(s) as sock:
            sock.sendall(request_head(s, 1000) + body[:10])
            time.sleep(0.1)
    time.sleep(0.5)
    new = s.log.read_text()[len(before) :]
    assert new.count("the client left after 10 body bytes") == 3, new
    # An earlier test's late /health poll may land its access line in this window: it is not about these bodies.
    lines = [line for line in new.splitlines() if " GET /health " not in line]
    assert len(lines) == 3 and "Traceback" not in new, new


def test_connections_past_the_cap_get_503_and_the_server_recovers(guarded_server: Server) -> None:
    s = guarded_server
    socks = [raw_connection(s) for _ in range(GUARDED_MAX_CONNECTIONS)]
    try:
        # Within the 1 s header deadline of the idle ones. (test_connections.py: the caps in detail.)
        r = httpx.get(s.url + "/v1/models", headers=s.headers, timeout=5)
        err = assert_error(r, 503)  # an OpenAI-style body, not uvicorn's plain text
        assert err["code"] == "too_many_connections" and r.headers["retry-after"] == "1"
        r = httpx.get(s.url + "/health", timeout=5)  # a liveness probe is answered past the cap
        assert r.status_code == 200 and r.headers["connection"] == "close"
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(s.url + "/health").status_code == 200


def test_4xx_where_a_500_used_to_be(guarded_server: Server) -> None:
    s = guarded_server
    comp = "/v1/completions"
    ok = {"model": s.model, "prompt": "hi", "max_tokens": 2}

    def chunks():  # no Content-Length: only counting the body as it arrives can see it is too large
        for _ in range(EIGHT_MB // 65536 + 2):
            yield b" " * 65536

    assert_error(post(s, comp, chunks()), 413)
    assert_error(post(s, comp, b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400, "JSON")
    assert_error(post(s, comp, b'{"model": "x", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"), 400, "deeply")
    assert_error(post(s, comp, json.dumps(ok)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}"), 400, "digits")
    assert_error(post(s, comp, json.dumps(ok)[:-1].encode() + b', "seed": ' + b"9" * 4000 + b"}"), 400, "seed")
    for field in ("prompt", "model", "stop", "user"):
        body = json.dumps(ok | {field: "ab\ud800"}).encode()  # json.dumps writes the lone surrogate as \ud800
        assert_error(post(s, comp, body), 400, "lone surrogate")
    assert_error(post(s, comp, json.dumps(ok).encode() + b"\xff"), 400, "UTF-8")
    for literal in (b"NaN", b"Infinity", b"1e999"):
        assert_error(post(s, comp, json.dumps(ok)[:-1].encode() + b', "temperature": ' + literal + b"}"), 400)
    assert_error(post(s, comp, json.dumps(ok | {"prompt": [[7]] * 20_000}).encode()), 400, "too many")
    assert post(s, comp, json.dumps(ok | {"prompt": "emoji \U0001f600"})).status_code == 200  # a surrogate pair
    assert post(s, comp, json.dumps(ok | {"prompt": [7] * 1000, "max_tokens": 1})).status_code == 200


def test_types_are_strict(guarded_server: Server) -> None:
    s = guarded_server
    ok = {"model": s.model, "prompt": "hi", "max_tokens": 2}
    for field, value in [
        ("max_tokens", "4"),
        ("max_tokens", True),
        ("max_tokens", 4.0),
        ("n", "2"),
        ("stream", "yes"),
        ("stream", 1),
        ("prompt", [True]),
        ("prompt", [[1, "2"]]),
        ("temperature", "0.5"),
        ("seed", "7"),
        ("logprobs", False),
        ("stream_options", {"include_usage": "yes"}),
        ("stop", 5),
    ]:
        err = assert_error(post(s, "/v1/completions", json.dumps(ok | {field: value})), 400)
        assert err["param"] == field, (field, value, err)
    chat = {"model": s.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for bad in ({"logprobs": 1}, {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": 1}]}):
        assert_error(post(s, "/v1/chat/completions", json.dumps(chat | bad)), 400)
    # What clients send today still passes: an int where a float goes, nulls for defaults, extra fields.
    fine = {"temperature": 1, "top_p": 1, "logit_bias": {"25": 100}, "stop": None, "seed": 2**64 - 1, "x": [1]}
    r = post(s, "/v1/completions", json.dumps(ok | fine | {"stream_options": None}))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "pp"


def test_what_the_key_guards(guarded_server: Server) -> None:
    s = guarded_server  # its key came from $LOCKSTEP_API_KEY
    for path in ("/metrics", "/openapi.json", "/v1/models", "/docs", "/nothing"):
        assert_error(httpx.get(s.url + path), 401)
        assert httpx.get(s.url + path, headers=s.headers).status_code in (200, 404)
    assert httpx.get(s.url + "/metrics", headers=s.headers).status_code == 200
    assert httpx.get(s.url + "/openapi.json", headers=s.headers).status_code == 200
    assert httpx.get(s.url + "/health").json() == {"status": "ok"}  # no weights hash, no fingerprint
    full = httpx.get(s.url + "/health", headers=s.headers).json()
    assert full["status"] == "ok" and len(full["weights_blake2b"]) == 32 and full["system_fingerprint"]


def test_content_type_host_and_cors(guarded_server: Server) -> None:
    s = guarded_server
    body = json.dumps({"model": s.model, "prompt": "hi", "max_tokens": 1})
    # What a web page can send cross-site without a preflight: text/plain, a form, no type at all.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = httpx.post(s.url + "/v1/completions", content=body, headers={"content-type": ctype, **s.headers})
        assert_error(r, 415, "application/json")
    assert post(s, "/v1/completions", body, {"content-type": "Application/JSON; charset=utf-8"}).status_code == 200
    # DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1.
    port = s.url.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        assert_error(httpx.get(s.url + "/health", headers={"host": host}), 400, "Host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(s.url + "/health", headers={"host": host}).status_code == 200
    # No CORS: a preflight is not granted, and no response allows another origin to read it.
    pre = httpx.options(
        s.url + "/v1/completions",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST", **s.headers},
    )
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    r = post(s, "/v1/completions", body, {"origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
