"""Property-based fuzzing of a real server (``guarded_server``): request bodies built from the request schema with
right and wrong types, extreme numbers, deep nesting, huge and broken strings, invalid JSON and UTF-8. Whatever
comes, the server answers with no 5xx, every 4xx carries an OpenAI error body, and afterwards /health answers fast
and no KV block is held. The number of cases tried is printed (``-s``) and kept in docs/reliability.md."""

import json
import statistics
import time

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lockstep.server.chat_template import TEMPLATE_KWARGS

from .conftest import Server

MAX_EXAMPLES = 2000  # 40-70 s on 2 shared CPU cores
CASES = {"tried": 0, "by_status": {}}
# Issue 13 item 1 is the engine's (branch harden-engine): until the door makes a temperature below a floor greedy
# and bounds the repetition penalty, a temperature in (0, 1e-5) or a penalty outside [1e-6, 1e6] can make the
# sampler emit NaN and an id past the vocabulary, and fail the whole engine step with a 500 (the fuzz finds it
# within ~1000 cases: temperature 5e-324, repetition_penalty 1e-300). Such bodies are skipped until then; set this
# to True once that branch is in, and the fuzz covers them too.
ENGINE_GUARDS_LANDED = True


class Raw(str):
    """A JSON fragment written into the body as it is: what json.dumps cannot write (5000-digit integers, NaN,
    lone surrogates, deep nesting)."""


def to_json(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
)
wrong = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=8), scalars, max_size=3))
extreme_ints = st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30])
extreme_floats = st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-8, 2.0000001, 1e308, -1e308, 1.7976931348623157e308]
)
raw_numbers = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 4000, "9" * 5000, "1e-400"])
extreme = st.one_of(extreme_ints, extreme_floats, raw_numbers.map(Raw))
huge_text = st.tuples(st.sampled_from(["x", "é", "\U0001f600", " ", ",[{", "\\"]), st.integers(1, 2_000_000)).map(
    lambda t: t[0] * (t[1] // len(t[0].encode()))
)
broken_text = st.sampled_from(['"\\ud800"', '"a\\udfff b"', '"\\ude00\\ud83d"', '"\\x"', '"\\u12"', '"\t"']).map(Raw)
deep = st.tuples(st.integers(1, 200_000), st.sampled_from(["[]", "{}"])).map(
    lambda t: Raw(t[1][0] * t[0] + t[1][1] * t[0]) if t[1] == "[]" else Raw('{"a": ' * t[0] + "1" + "}" * t[0])
)
hostile = st.one_of(wrong, extreme, huge_text, broken_text, deep)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: valid most of the time, else anything hostile."""
    return st.one_of(valid, valid, hostile)


def small_floats(lo: float, hi: float) -> st.SearchStrategy:
    """Floats in [lo, hi], the extremes that fall in it included."""
    edges = [x for x in (0.0, 5e-324, 1e-300, 1e-40, 1e-8, 1e8, 1e300, 1.7976931348623157e308) if lo <= x <= hi]
    return st.one_of(st.floats(lo, hi, allow_nan=False), st.sampled_from(edges or [lo]))


token_ids = st.lists(st.integers(0, 96), min_size=1, max_size=8)
SAMPLING = {
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 8),  # always sent: null or none at all runs to the end of the context
    "temperature": st.one_of(st.none(), small_floats(0, 2)),
    "top_p": small_floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": small_floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)
    ),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": small_floats(-2, 2),
    "frequency_penalty": small_floats(-2, 2),
    "repetition_penalty": small_floats(1e-300, 1.7976931348623157e308),
    "logit_bias": st.dictionaries(st.integers(0, 96).map(str), small_floats(-100, 100), max_size=3),
    "user": st.text(max_size=10),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 8),
    "stop_token_ids": st.lists(st.integers(0, 200), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "use_beam_search": st.booleans(),
}
COMPLETION = {
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), min_size=1, max_size=3), token_ids),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "echo": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}
)
CHAT = {
    "messages": st.lists(message, min_size=1, max_size=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": st.integers(1, 8),
}


# -- Issue 25, items 1 and 4 (branch h25-templates): chat_template_kwargs and stop strings --------------------------
# Keys a template reads, keys refused (a template, documents, the request's own fields, anything else) and values
# from plain data to the issue's hostile templates; stop strings up to the 1024-character bound and past it (the issue's
# 1.9 MB ones are in test_hostile_templates.py), in the tiny model's alphabet so that its text nearly matches them.
TEMPLATES = st.sampled_from(
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set s = 'xxxxxxxxxx' %}{% set s = s*100 %}{% set s = s*100 %}{% set s = s*100 %}{{ s*1000 }}",
        "{{ messages }}",
        "{{ raise_exception('no') }}",
        "",
    ]
)
TEMPLATE_KEYS = st.one_of(
    st.sampled_from(sorted(TEMPLATE_KWARGS)),
    st.sampled_from(["chat_template", "documents", "add_generation_prompt", "tools", "messages", "bos_token"]),
    st.text(max_size=8),
)
template_values = st.one_of(
    scalars,
    TEMPLATES,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=5), scalars, max_size=3),
    huge_text,
)
template_kwargs = st.dictionaries(TEMPLATE_KEYS, template_values, max_size=3)
stop_text = st.text(alphabet="ab ", min_size=1, max_size=1100)
long_stop = st.tuples(st.sampled_from("ab"), st.integers(1000, 200_000)).map(lambda t: t[0] * t[1])
stops = st.one_of(stop_text, st.lists(st.one_of(stop_text, long_stop), min_size=1, max_size=5))
SAMPLING["stop"] = st.one_of(SAMPLING["stop"], stops)
CHAT["chat_template_kwargs"] = st.one_of(st.none(), template_kwargs)
TOKENIZE = {
    "messages": CHAT["messages"],
    "chat_template_kwargs": CHAT["chat_template_kwargs"],
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
}


@st.composite
def tokenize_requests(draw) -> bytes:
    """A /tokenize body with chat messages, its template options drawn (hostile now and then)."""
    names = ["messages", *(n for n in TOKENIZE if n != "messages" and draw(st.integers(0, 1)))]
    hostile_names = draw(st.sampled_from([[], [draw(st.sampled_from(names))]]))
    body = {n: draw(field(TOKENIZE[n]) if n in hostile_names else TOKENIZE[n]) for n in names}
    return to_json({"model": "tiny", **body}).encode("utf-8", "surrogatepass")


# -- end of issue 25's block -------------------------------------------------------------------------------------


def poisons_the_sampler(body: dict) -> bool:
    def number(name: str) -> float | None:
        v = body.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, (bool, Raw)) else None

    temperature, penalty = number("temperature"), number("repetition_penalty")
    return (temperature is not None and 0 < temperature < 1e-5) or (
        penalty is not None and penalty > 0 and not 1e-6 <= penalty <= 1e6
    )


@st.composite
def requests(draw) -> tuple[str, bytes, dict]:
    """(path, body, headers): a body from the schema, every field hostile now and then, and sometimes broken as a
    whole (cut short, invalid UTF-8, not an object)."""
    chat = draw(st.booleans())
    fields = {"model": st.just("tiny"), **SAMPLING, **(CHAT if chat else COMPLETION)}
    required = ("model", "max_tokens", "messages" if chat else "prompt")
    names = [n for n in fields if n in required or draw(st.integers(0, 3)) == 0]
    # Half the bodies are valid (they reach the engine, extreme values included); the others have one hostile
    # field, or several.
    hostile_names = draw(st.sampled_from([[], [], [draw(st.sampled_from(names))], names]))
    body = {n: draw(field(fields[n]) if n in hostile_names else fields[n]) for n in names}
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(max_size=10))] = draw(hostile)
    assume(ENGINE_GUARDS_LANDED or not poisons_the_sampler(body))
    text = to_json(body)
    mangle = draw(st.sampled_from(["none"] * 15 + ["cut", "utf8", "array", "empty", "garbage"]))
    raw = text.encode("utf-8", "surrogatepass")
    if mangle == "cut":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mangle == "utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[at:]
    elif mangle == "array":
        raw = b"[" + raw + b"]"
    elif mangle == "empty":
        raw = b""
    elif mangle == "garbage":
        raw = draw(st.binary(max_size=64))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, raw, {"content-type": "application/json"}


def check_reply(r: httpx.Response, stream_lines: list[str] | None) -> None:
    assert r.status_code < 500, r.text[:1000] if stream_lines is None else stream_lines[-3:]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        return
    assert r.status_code == 200
    if stream_lines is None:
        assert r.json()["choices"]
        return
    events = [line[6:] for line in stream_lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", stream_lines[-3:]
    assert all("error" not in json.loads(e) for e in events[:-1]), events


def send(client: httpx.Client, server: Server, path: str, raw: bytes, headers: dict) -> None:
    with client.stream("POST", server.url + path, content=raw, headers={**server.headers, **headers}) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            lines = list(r.iter_lines())
            check_reply(r, lines)
        else:
            r.read()
            check_reply(r, None)
    CASES["by_status"][r.status_code] = CASES["by_status"].get(r.status_code, 0) + 1


def test_fuzzed_requests_never_get_a_5xx(guarded_server: Server) -> None:
    s = guarded_server
    client = httpx.Client(timeout=120)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )
    @given(requests())
    def one(case: tuple[str, bytes, dict]) -> None:
        CASES["tried"] += 1
        send(client, s, *case)

    start = time.perf_counter()
    try:
        one()
    finally:
        client.close()
    seconds = time.perf_counter() - start

    # Afterwards: /health fast, nothing running, no KV block held.
    health_ms = []
    with httpx.Client() as c:
        for _ in range(10):
            t = time.perf_counter()
            assert c.get(s.url + "/health").status_code == 200
            health_ms.append(1e3 * (time.perf_counter() - t))
    deadline = time.monotonic() + 30
    while True:
        m = s.metrics()
        if m["lockstep_kv_blocks_used"] == 0 and m["lockstep_num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    server_5xx = sum(v for k, v in m.items() if k.startswith('lockstep_requests_total{code="5'))
    print(
        f"\nfuzz: {CASES['tried']} cases in {seconds:.0f} s, statuses {dict(sorted(CASES['by_status'].items()))}, "
        f"server-counted 5xx {server_5xx:g}, /health median {statistics.median(health_ms):.1f} ms "
        f"max {max(health_ms):.1f} ms, KV blocks used {m['lockstep_kv_blocks_used']:g}"
    )
    assert CASES["tried"] >= MAX_EXAMPLES // 2
    assert server_5xx == 0
    assert statistics.median(health_ms) < 100
    assert m["lockstep_kv_blocks_used"] == 0 and m["lockstep_num_requests_running"] == 0


# -- Issue 25, items 2 and 5 (branch h25-grammar): structured-output constraints, deep, wide and unbounded ---------
# Schemas nested past any limit (closed objects or not), wide ones (enums, optional and required properties,
# alternatives, choices) around llguidance's 2000-item parser rows and the server's size and count limits, Lark
# grammars without a base case or with huge rows, regexes with big repetitions, schemas as broken JSON text; each
# in one of the parameters that carry a constraint. Whatever comes: no 5xx, and the grammar cache within its bytes.
CONSTRAINT_EXAMPLES = 200  # 20-30 s on 2 shared CPU cores (600: 65 s, 0 x 5xx)


def nested_schema(levels: int, shape: str) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        if shape == "object":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif shape == "array":
            schema = {"type": "array", "items": schema, "minItems": 1}
        else:
            schema = {"anyOf": [schema, {"type": "string"}]}
    return schema


def wide_schema(n: int, shape: str, width: int) -> dict:
    names = [f"k{i:05d}" + "x" * width for i in range(n)]
    if shape == "enum":
        return {"enum": names}
    if shape == "optional":
        return {"type": "object", "properties": {k: {"type": "integer"} for k in names}}
    if shape == "required":
        return {"type": "object", "properties": {k: {"type": "integer"} for k in names}, "required": names}
    return {"anyOf": [{"const": k} for k in names]}


deep_schemas = st.builds(nested_schema, st.integers(1, 400), st.sampled_from(["object", "array", "anyOf"]))
wide_sizes = st.one_of(st.integers(1, 50), st.integers(400, 600), st.integers(1900, 2100), st.integers(3000, 9000))
wide_schemas = st.builds(
    wide_schema, wide_sizes, st.sampled_from(["enum", "optional", "required", "anyOf"]), st.integers(0, 40)
)
schemas = st.one_of(deep_schemas, wide_schemas, st.just({"type": "object"}), st.just({"type": "frob"}))
choice_lists = st.builds(
    lambda n, prefix: [prefix + str(i) for i in range(n)],
    st.one_of(st.integers(1, 10), st.integers(1990, 2010), st.integers(3000, 5000), st.integers(20_000, 30_000)),
    st.sampled_from(["", "a", "option ", "x" * 200]),
)
lark_grammars = st.one_of(
    st.sampled_from(
        [
            'start: x\nx: "a" x',  # no base case
            'start: x\nx: x "a"',  # left recursive, no base case
            'start: x\nx: "a" x | "b"',
            'start: x\nx: x "a" | "b"',
            'start: "a"{1000,2000}',
            'start: x{300}\nx: y{300}\ny: "a" | "b"',
            "start: /(a|b)*a(a|b){20}/",
            "start: nowhere",
            'root ::= "x" root',  # GBNF, no base case
        ]
    ),
    st.builds(lambda n: "start: " + " | ".join(f'"opt {i}"' for i in range(n)), st.integers(1, 4000)),
)
regexes = st.one_of(
    st.sampled_from(["a{1000,100000}", "((a|b){1,100}){1,100}", "(a|b)*a(a|b){25}", "[0-9", "[^\\x00-\\U0010FFFF]"]),
    st.builds(lambda n: "(" + "|".join(f"w{i}" for i in range(n)) + ")", st.integers(1, 30_000)),
)
schema_texts = st.one_of(
    schemas.map(json.dumps),
    st.tuples(st.integers(1, 200_000)).map(lambda t: "[" * t[0] + "]" * t[0]),
    st.sampled_from(['{"type": "object"', "[]", '"x"', "1e999"]),
)


@st.composite
def constraint_requests(draw) -> tuple[str, bytes, dict]:
    """A completion or chat body whose output is constrained by a drawn constraint, in a drawn parameter."""
    where = draw(st.sampled_from(["structured_outputs", "guided", "response_format", "tools"]))
    kind = draw(st.sampled_from(["json", "json_text", "choice", "grammar", "regex"]))
    value = draw({"json": schemas, "json_text": schema_texts, "choice": choice_lists, "grammar": lark_grammars,
                  "regex": regexes}[kind])  # fmt: skip
    chat = where == "tools" or draw(st.booleans())
    body: dict = {"model": "tiny", "max_tokens": draw(st.integers(1, 12)), "n": draw(st.sampled_from([1, 2, 16]))}
    body |= {"temperature": draw(st.sampled_from([0.0, 1.0])), "seed": 1, "stream": draw(st.booleans())}
    if where == "structured_outputs":
        key = "json" if kind == "json_text" else kind
        body["structured_outputs"] = {key: value, "disable_additional_properties": draw(st.booleans())}
    elif where == "guided":
        body[f"guided_{'json' if kind == 'json_text' else kind}"] = value
    elif where == "response_format" or kind not in ("json", "json_text"):
        schema = value if kind == "json" else {"type": "object"}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    if where == "tools":
        parameters = value if kind == "json" else {"type": "object"}
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        body["tool_choice"] = draw(st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]))
        body.pop("response_format", None)
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "x"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json.dumps(body).encode(), {"content-type": "application/json"}


def test_fuzzed_constraints_never_get_a_5xx(guarded_server: Server) -> None:
    s = guarded_server
    client = httpx.Client(timeout=120)
    tried = {"n": 0}
    statuses_before = dict(CASES["by_status"])

    @settings(
        max_examples=CONSTRAINT_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(constraint_requests())
    def one(case: tuple[str, bytes, dict]) -> None:
        tried["n"] += 1
        send(client, s, *case)

    start = time.perf_counter()
    try:
        one()
    finally:
        client.close()
    seconds = time.perf_counter() - start
    health = []
    with httpx.Client() as c:
        for _ in range(10):
            t = time.perf_counter()
            assert c.get(s.url + "/health", timeout=10).status_code == 200
            health.append(1e3 * (time.perf_counter() - t))
    health_ms = statistics.median(health)
    deadline = time.monotonic() + 30
    while True:
        m = s.metrics()
        if m["lockstep_kv_blocks_used"] == 0 and m["lockstep_num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    server_5xx = sum(v for k, v in m.items() if k.startswith('lockstep_requests_total{code="5'))
    statuses = {k: v - statuses_before.get(k, 0) for k, v in sorted(CASES["by_status"].items())}
    statuses = {k: v for k, v in statuses.items() if v}
    cache_mib, entries = m["lockstep_grammar_cache_bytes"] / 2**20, m["lockstep_grammar_cache_entries"]
    print(
        f"\nconstraint fuzz: {tried['n']} cases in {seconds:.0f} s, statuses {statuses}, server-counted 5xx "
        f"{server_5xx:g}, /health median {health_ms:.1f} ms, grammar cache {cache_mib:.1f} MiB in {entries:g} entries"
    )
    assert tried["n"] >= CONSTRAINT_EXAMPLES // 2
    assert server_5xx == 0 and health_ms < 100
    assert m["lockstep_grammar_cache_bytes"] <= 256 << 20  # serve's default --structured-output-cache-bytes
    assert m["lockstep_kv_blocks_used"] == 0 and m["lockstep_num_requests_running"] == 0


# -- end of issue 25's structured-output block ----------------------------------------------------------------------


def test_negative_control_the_checks_see_a_5xx_and_a_bare_4xx() -> None:
    request = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    for bad in (
        httpx.Response(500, json={"error": {"message": "x", "type": "server_error", "param": None, "code": None}}),
        httpx.Response(503, text="Service Unavailable"),
        httpx.Response(400, json={"detail": "plain FastAPI"}),
        httpx.Response(422, json={"error": {"message": "missing the other keys"}}),
    ):
        bad.request = request
        with pytest.raises((AssertionError, KeyError)):
            check_reply(bad, None)
    with pytest.raises(AssertionError):
        check_reply(httpx.Response(200, request=request), ['data: {"error": {}}', "data: [DONE]"])
    check_reply(httpx.Response(200, request=request), ['data: {"choices": []}', "data: [DONE]"])


def test_fuzzed_tokenize_template_options_never_get_a_5xx(guarded_server: Server) -> None:
    # Issue 25's block: /tokenize renders the chat template without generating, so its options are fuzzed alone.
    s, seen = guarded_server, {}
    client = httpx.Client(timeout=60)

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(tokenize_requests())
    def one(raw: bytes) -> None:
        r = client.post(s.url + "/tokenize", content=raw, headers={**s.headers, "content-type": "application/json"})
        check_reply_tokenize(r)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1

    try:
        one()
    finally:
        client.close()
    print(f"\ntokenize fuzz: statuses {dict(sorted(seen.items()))}")
    assert set(seen) <= {200, 400, 413} and seen.get(200, 0) > 10 and seen.get(400, 0) > 10
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200


def check_reply_tokenize(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:1000]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    else:
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0
