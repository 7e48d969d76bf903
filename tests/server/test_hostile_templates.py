"""Issue 25's reproducers of items 1, 4 and 9 against a real server (``guarded_server``): client-supplied templates
(refused at once, and a normal chat stays fast while they arrive), what else ``chat_template_kwargs`` takes, stop
strings (bounded, and a stream that nearly matches long ones stays correct and quick), a ``logit_bias`` key that
is a digit to Python but not a token id, ``HEAD /health``, a second ``Authorization`` header, and a call whose
client left before its prompt was ready (nothing reaches the engine)."""

import json
import socket
import statistics
import threading
import time

import httpx

from .conftest import Server
from .test_hostile_http import assert_error, post, raw_connection, request_head

CHAT, TOKENIZE = "/v1/chat/completions", "/tokenize"
# The reproducers: ~250 bytes that loop 10^10 times, and 203 bytes that build a 10^9-character string.
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BILLION = "{% set s = 'xxxxxxxxxx' %}{% set s = s*100 %}{% set s = s*100 %}{% set s = s*100 %}{{ s*1000 }}"


def chat_body(server: Server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


def rss_kb(server: Server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_client_cannot_send_a_template(guarded_server: Server) -> None:
    s = guarded_server
    rss = rss_kb(s)
    for path in (CHAT, TOKENIZE):
        for template in (LOOPS, BILLION):
            body = chat_body(s, chat_template_kwargs={"chat_template": template})
            t = time.perf_counter()
            err = assert_error(post(s, path, json.dumps(body)), 400, "chat template")
            assert err["param"] == "chat_template_kwargs" and time.perf_counter() - t < 5  # main: minutes
        for key in ("documents", "bos_token", "tokenize"):  # refused at the top level, or no template variable
            err = assert_error(post(s, path, json.dumps(chat_body(s, chat_template_kwargs={key: []}))), 400, key)
            assert err["param"] == "chat_template_kwargs"
        body = chat_body(s, chat_template_kwargs={"add_generation_prompt": False})
        assert_error(post(s, path, json.dumps(body)), 400, "add_generation_prompt", "request's own field")
        body = chat_body(s, chat_template_kwargs={"date_string": "x" * 70_000})
        assert_error(post(s, path, json.dumps(body)), 400, "65536")
    # A key a template reads is data: the same prompt as without it (this template ignores it).
    plain = post(s, TOKENIZE, json.dumps(chat_body(s))).json()["tokens"]
    body = chat_body(s, chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    assert post(s, TOKENIZE, json.dumps(body)).json()["tokens"] == plain
    assert post(s, CHAT, json.dumps(body)).status_code == 200
    assert rss_kb(s) - rss < 100_000  # no 10^9-character string was built (it took +950 MB)


def test_a_normal_chat_stays_fast_while_templates_arrive(guarded_server: Server) -> None:
    # Four concurrent looping templates froze every request's parsing for ~30 s (a normal chat 0.46 -> 31.8 s).
    s = guarded_server
    normal = json.dumps(chat_body(s, max_tokens=1, temperature=0))

    def normal_chat() -> float:
        t = time.perf_counter()
        assert post(s, CHAT, normal).status_code == 200
        return time.perf_counter() - t

    alone = statistics.median(normal_chat() for _ in range(5))
    stop, attacks = threading.Event(), []

    def attack(path: str) -> None:
        body = json.dumps(chat_body(s, chat_template_kwargs={"chat_template": LOOPS}))
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.post(s.url + path, content=body, headers={"content-type": "application/json", **s.headers})
                attacks.append((r.status_code, time.perf_counter() - t))

    threads = [threading.Thread(target=attack, args=(p,)) for p in (CHAT, CHAT, TOKENIZE, TOKENIZE)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        during = [normal_chat() for _ in range(5)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert attacks and {status for status, _ in attacks} == {400}
    assert max(seconds for _, seconds in attacks) < 5
    assert statistics.median(during) < max(5 * alone, 1.0), (alone, during)


def test_stop_strings_are_bounded(guarded_server: Server) -> None:
    s = guarded_server
    comp = {"model": s.model, "prompt": "hi", "max_tokens": 2}
    huge = {"stop": ["x" * 1_900_000] * 4}  # the four 1.9 MB stop strings
    for fields, words in (
        (huge, ("1024 characters",)),
        ({"stop": "y" * 1025}, ("1024 characters", "1025")),
        ({"stop": ["a", "b", "c", "d", "e"]}, ("at most 4",)),
        ({"stop_token_ids": list(range(1025))}, ("stop_token_ids",)),
    ):
        t = time.perf_counter()
        assert_error(post(s, "/v1/completions", json.dumps(comp | fields)), 400, *words)
        assert time.perf_counter() - t < 5
    assert post(s, "/v1/completions", json.dumps(comp | {"stop": ["z" * 1024] * 4})).status_code == 200


def test_a_stream_that_nearly_matches_long_stop_strings(guarded_server: Server) -> None:
    # The text is all "a" (a bias forces it); each stop string is 1023 "a"s and one other character, so the whole
    # tail may begin one until the stream ends: it is held back, then sent, and nothing is lost.
    s = guarded_server
    a = post(s, TOKENIZE, json.dumps({"model": s.model, "prompt": "a", "add_special_tokens": False})).json()
    stops = ["a" * 1023 + c for c in "bcde"]
    body = {"model": s.model, "prompt": "go", "max_tokens": 600, "ignore_eos": True, "stream": True, "n": 2}
    body |= {"logit_bias": {str(a["tokens"][0]): 100}, "temperature": 0}
    timings = {}
    for name, fields in (("plain", {}), ("stops", {"stop": stops})):
        texts, t = ["", ""], time.perf_counter()
        headers = {"content-type": "application/json", **s.headers}
        with httpx.stream("POST", s.url + "/v1/completions", json=body | fields, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] += choice["text"]
        timings[name] = time.perf_counter() - t
        assert texts == ["a" * 600] * 2, name
    assert timings["stops"] < 3 * timings["plain"] + 5, timings  # loose: the machine's load moves both


def test_a_logit_bias_key_that_is_no_token_id(guarded_server: Server) -> None:
    s = guarded_server
    comp = {"model": s.model, "prompt": "hi", "max_tokens": 1}
    for key in ("²", "٣", "9" * 5000, "-1", " 1"):
        err = assert_error(post(s, "/v1/completions", json.dumps(comp | {"logit_bias": {key: 1}})), 400, "logit_bias")
        assert repr(key[:50]) in err["message"] and "int()" not in err["message"]
    assert post(s, "/v1/completions", json.dumps(comp | {"logit_bias": {"25": 1}})).status_code == 200


def test_head_health_and_a_second_authorization_header(guarded_server: Server) -> None:
    s = guarded_server
    r = httpx.head(s.url + "/health")
    assert r.status_code == 200 and r.content == b""
    key = s.headers["Authorization"]
    for second in (key, "Bearer wrong"):
        for path in ("/v1/models", "/health"):
            r = httpx.get(s.url + path, headers=[("Authorization", key), ("Authorization", second)])
            assert_error(r, 400, "more than one Authorization")
    assert httpx.get(s.url + "/v1/models", headers=s.headers).status_code == 200


def test_a_departed_clients_call_never_reaches_the_engine(guarded_server: Server) -> None:
    # A prompt that takes about a second to tokenize (truncation lets it past the length check): the client sends
    # it and leaves. The call ends there: its prompt is never submitted, so no token is generated for nobody.
    s = guarded_server
    for path, fields in (
        ("/v1/completions", {"prompt": "xyz " * 100_000}),
        (CHAT, {"messages": [{"role": "user", "content": "xyz " * 100_000}]}),
    ):
        body = json.dumps({"model": s.model, "max_tokens": 3, "truncate_prompt_tokens": 10} | fields).encode()
        before = s.metrics()
        with raw_connection(s) as sock:
            sock.sendall(request_head(s, len(body), path) + body)
            sock.shutdown(socket.SHUT_WR)
        time.sleep(4)  # the server sees the client go while it still tokenizes, and ends the call
        after = s.metrics()
        for name in ("lockstep_prompt_tokens_total", "lockstep_generation_tokens_total"):
            assert after[name] == before[name], (path, name)
        # Negative control: the same call with its client waiting reaches the engine, and the metrics see it.
        assert post(s, path, body).status_code == 200
        assert s.metrics()["lockstep_prompt_tokens_total"] >= before["lockstep_prompt_tokens_total"] + 10
