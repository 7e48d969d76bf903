"""Issue 25's structured-output reproducers against a real server: compiled grammars held memory without bound
(item 2), and constraints a client got wrong came back as 500s, one of them stalling its batch (item 5). The
server here runs with a 64 KiB constraint limit and a 32 MiB grammar cache, so that a few dozen schemas fill it."""

import json
import time
from pathlib import Path

import httpx
import pytest

from lockstep.structured.limits import charge

from .conftest import Server, start_server, stop_server

MAX_BYTES = 64 << 10
CACHE_BYTES = 32 << 20


@pytest.fixture(scope="module")
def grammar_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server-grammar.log"
    args = ["--max-structured-output-bytes", str(MAX_BYTES), "--structured-output-cache-bytes", str(CACHE_BYTES)]
    s = start_server(tiny_server_model_dir, log, *args, "--max-structured-output-choices", "4000")
    yield s
    stop_server(s.proc)


def complete(server: Server, timeout: float = 120, **body) -> httpx.Response:
    body = {"model": server.model, "prompt": "x", "max_tokens": 1, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=timeout)


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def rss_mb(server: Server) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def wide_schema(i: int) -> dict:
    """An object of 450 optional integer properties (14.6 kB of text, 2.0 MB of heap compiled, charged 2.46 MB),
    distinct for each ``i``. (Past ~500 optional properties llguidance's parser row overflows at the ``{``.)"""
    return {"type": "object", "properties": {f"p{i:04d}_{j:04d}": {"type": "integer"} for j in range(450)}}


def test_distinct_schemas_hold_at_most_the_cache_budget(grammar_server: Server) -> None:
    s = grammar_server
    from lockstep.structured.params import StructuredOutputsParams

    each = charge(StructuredOutputsParams(json=wide_schema(0)).size)
    fits = CACHE_BYTES // each
    start = rss_mb(s)
    for i in range(fits):
        assert complete(s, structured_outputs={"json": wide_schema(i)}).status_code == 200
    m = s.metrics()
    assert m["lockstep_grammar_cache_entries"] == fits and m["lockstep_grammar_cache_bytes"] == fits * each
    filled = rss_mb(s)
    # The harness sees what the cache holds (~2 MB a schema) ...
    assert filled - start > 2 * fits / 2, (start, filled)
    for i in range(fits, fits + 60):
        assert complete(s, structured_outputs={"json": wide_schema(i)}).status_code == 200
    m = s.metrics()
    after = rss_mb(s)
    # ... and 60 more schemas, 120 MB in a cache of entries (or in the states of finished requests, which kept
    # their grammars alive), add a fraction of that (allocator arenas, the server's own growth): the oldest went.
    assert m["lockstep_grammar_cache_entries"] == fits and m["lockstep_grammar_cache_bytes"] <= CACHE_BYTES
    assert after - filled < 50, (start, filled, after)
    print(f"\nRSS {start:.0f} MB, {filled:.0f} MB with the cache full ({fits} schemas), {after:.0f} MB 60 later")


def test_the_issue_reproducers_schema_too_large_is_400(grammar_server: Server) -> None:
    # The review's 1.4 MB enum schema (each compiled to ~26 MB): refused by size, as a dict and as JSON text
    # (that one before it is parsed).
    enum = {"enum": [f"value-{j:07d}-{'x' * 30}" for j in range(30000)]}
    assert len(json.dumps(enum)) > 1_300_000
    before = grammar_server.metrics()
    r = complete(grammar_server, response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": enum}})
    assert_400(r, "response_format", f"at most {MAX_BYTES}", "--max-structured-output-bytes")
    assert_400(complete(grammar_server, guided_json=json.dumps(enum)), "guided_json", "--max-structured-output-bytes")
    assert_400(complete(grammar_server, guided_regex="a" * (MAX_BYTES + 1)), "guided_regex", f"at most {MAX_BYTES}")
    s_metrics = grammar_server.metrics()
    assert s_metrics["lockstep_generation_tokens_total"] == before["lockstep_generation_tokens_total"]


def deep_schema(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_deep_schema_with_closed_objects_is_400_and_logs_no_traceback(grammar_server: Server) -> None:
    s = grammar_server
    log_before = s.log.stat().st_size
    for closed in (True, False):
        so = {"json": deep_schema(300), "disable_additional_properties": closed}
        assert_400(complete(s, structured_outputs=so), "structured_outputs", "nested deeper than 100")
    for _ in range(20):  # the review's 60 such requests wrote 11.7 MB of tracebacks
        so = {"json": deep_schema(300), "disable_additional_properties": True}
        assert complete(s, structured_outputs=so).status_code == 400
    assert_400(complete(s, guided_json="[" * 30_000 + "]" * 30_000), "guided_json", "nested too deeply")
    log = s.log.read_text(errors="replace")[log_before:]
    assert "Traceback" not in log and "RecursionError" not in log and s.log.stat().st_size - log_before < 10_000


def test_constraints_failing_at_their_first_step_are_400_before_any_engine_work(grammar_server: Server) -> None:
    s = grammar_server
    before = s.metrics()
    # A Lark rule without a base case; a rule of 3000 alternatives (llguidance's parser takes 2000 a row).
    assert_400(complete(s, guided_grammar='start: x\nx: "a" x'), "guided_grammar", "first step")
    rule = "start: " + " | ".join(f'"option {i}"' for i in range(3000))
    assert_400(complete(s, guided_grammar=rule), "guided_grammar", "first step", "items")
    # The 30 000-way choice sharing a long prefix, n=128: past the choice limit, refused at once.
    choice = ["x" * 200 + str(i) for i in range(30000)]
    t = time.perf_counter()
    assert_400(complete(s, guided_choice=choice, n=128, timeout=60), "guided_choice", "at most 4000")
    assert time.perf_counter() - t < 10
    after = s.metrics()
    assert after["lockstep_generation_tokens_total"] == before["lockstep_generation_tokens_total"]
    assert not any(k.startswith('lockstep_requests_total{code="5') for k in after)


def test_many_choices_are_followed_not_failed(grammar_server: Server) -> None:
    # 3000 choices used to fail llguidance's 2000-item parser row at the first token; as one terminal they work,
    # n=64 of them in one step.
    choice = [f"option {i}" for i in range(3000)]
    t = time.perf_counter()
    r = complete(grammar_server, guided_choice=choice, n=64, max_tokens=20, temperature=1.0, seed=1)
    seconds = time.perf_counter() - t
    assert r.status_code == 200, r.text[:500]
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 64 and all(t in choice for t in texts if t), texts[:5]
    assert sum(t in choice for t in texts) >= 32  # most end within 20 tokens (the others are cut by max_tokens)
    print(f"\n3000 choices, n=64, 20 tokens: {seconds:.1f} s")


def test_deep_tool_parameters_are_400(grammar_server: Server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(300)}}
    body = {
        "model": grammar_server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 1,
    }
    r = httpx.post(grammar_server.url + "/v1/chat/completions", json=body, headers=grammar_server.headers, timeout=60)
    assert_400(r, "tools", "nested deeper than 100")
