"""Request bodies to JSON objects: what passes (every JSON value a request can hold, at the limits), what is a 400,
and that neither depends on commas, brackets or quotes inside strings."""

import json
import threading
import time

import pytest

from lockstep.server import json_body
from lockstep.server.json_body import MAX_CONTAINERS, MAX_STRINGS, MAX_VALUES, decode_object
from lockstep.server.protocol import APIError


def refused(raw: bytes | str, *words: str) -> None:
    with pytest.raises(APIError) as e:
        decode_object(raw.encode() if isinstance(raw, str) else raw)
    assert e.value.status == 400 and all(w in e.value.message for w in words), e.value.message


def test_what_passes_comes_back_as_json_loads_makes_it() -> None:
    bodies = [
        {"model": "m", "prompt": "plain", "n": 2, "temperature": 0.5, "stop": None, "stream": True},
        {"prompt": [[1, 2], [3]], "logit_bias": {"5": -100}, "x": {"deep": [{"a": [1, [2, [3]]]}]}},
        {"prompt": 'commas, [brackets] {braces} "quotes" \\ backslashes \\" and \u00e9\U0001f600 \ud7ff\ue000'},
        {"prompt": [7] * (MAX_VALUES - 10)},  # at the limits: a 256k-token prompt as ids
        {"prompt": [[1]] * (MAX_CONTAINERS - 10)},
        {"prompt": ["a"] * (MAX_STRINGS - 10)},
        {"prompt": "," * 10 * MAX_VALUES + "[{" * MAX_CONTAINERS},  # in a string, they are not structure
    ]
    for body in bodies:
        for ensure_ascii in (True, False):
            raw = json.dumps(body, ensure_ascii=ensure_ascii).encode()
            assert decode_object(raw) == body


def test_malformed_bodies_are_400s() -> None:
    refused(b"{not json", "not valid JSON")
    refused(b'{"a": 1', "not valid JSON")
    refused(b'{"a": "unterminated', "not valid JSON")
    refused(b'{"a": "bad escape \\x"}', "not valid JSON")
    refused(b'{"a": "control \x01 char"}', "not valid JSON")
    refused(b"[1, 2]", "JSON object")
    refused(b'"a string"', "JSON object")
    refused(b'{"a": 1}\xff', "UTF-8")
    refused(b'\xef\xbb\xbf{"a": 1}', "not valid JSON")  # a BOM
    refused(b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeply")
    refused(b'{"a": ' + b"9" * 5000 + b"}", "4300")
    for s in ("\\ud800", "a\\udfff", "\\ude00\\ud83d", "\\ud83d x"):  # lone or out-of-order surrogates
        refused('{"prompt": "' + s + '"}', "lone surrogate")
    refused('{"\\ud800": 1}', "lone surrogate")  # a key too


def test_too_many_values_are_refused_before_parsing() -> None:
    refused(json.dumps({"prompt": [7] * (MAX_VALUES + 2)}), "too many")
    refused(json.dumps({"prompt": [[7]] * (MAX_CONTAINERS + 1)}), "too many")
    refused(json.dumps({"x": [{}] * (MAX_CONTAINERS + 1)}), "too many")
    refused(json.dumps({"prompt": ["a"] * (MAX_STRINGS + 1)}), "too many")
    refused(b'{"x": ' + b'"' * 8_000_000 + b"}", "too many")


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({"prompt": [7] * 2_800_000}).encode(),
        json.dumps({"prompt": [[7]] * 1_400_000}).encode(),
        json.dumps({"prompt": ["a"] * 1_600_000}).encode(),
        b'{"x": "' + b'\\"' * 4_000_000 + b'"}',
        json.dumps({"prompt": "x" * 8_000_000}).encode(),
    ],
    ids=["ids", "id-lists", "strings", "escaped-quotes", "text"],
)
def test_an_8_mb_body_costs_milliseconds(raw: bytes) -> None:
    # json.loads alone: 0.2-3 s for the first three, holding the GIL throughout.
    start = time.perf_counter()
    try:
        decode_object(raw)
    except APIError:
        pass
    assert time.perf_counter() - start < 1.0


def test_the_event_loop_thread_keeps_running_while_a_body_is_checked() -> None:
    # The structure check runs a C scan per string with Python steps between: other threads get the GIL.
    raw = json.dumps({"prompt": ["a"] * (MAX_STRINGS - 10), "x": "y" * 4_000_000}).encode()
    done, gaps = threading.Event(), []
    worker = threading.Thread(target=lambda: (json_body._check_structure(raw.decode()), done.set()))
    last = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    assert max(gaps) < 0.1
