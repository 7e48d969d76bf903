"""``lockstep serve --speculative-config``: completions are the plain server's, bit for bit, and /metrics counts
the drafts and the accepted tokens."""

import json
from pathlib import Path

import httpx
import pytest

from .conftest import start_server, stop_server


@pytest.fixture(scope="module")
def spec_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "spec-server.log"
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    s = start_server(tiny_server_model_dir, log, "--speculative-config", config)
    yield s
    stop_server(s.proc)


def _complete(server, body: dict) -> dict:
    r = httpx.post(server.base_url + "/completions", json=body | {"model": server.model}, headers=server.headers,
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_completions_match_the_plain_server_and_metrics_count(server, spec_server) -> None:
    bodies = [
        {"prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0, "logprobs": 2, "ignore_eos": True},
        {"prompt": "xyxyxyxy", "max_tokens": 24, "temperature": 0.8, "seed": 7, "logprobs": 1, "ignore_eos": True},
    ]
    for body in bodies:
        assert _complete(spec_server, body) == _complete(server, body)
    m = spec_server.metrics()
    drafted = m["lockstep_spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and m["lockstep_spec_decode_num_drafts_total"] > 0
    assert 0 <= m["lockstep_spec_decode_num_accepted_tokens_total"] <= drafted
    chunks = sum(v for k, v in m.items() if k.startswith("lockstep_spec_decode_chunks_by_accepted_total{"))
    assert chunks == m["lockstep_spec_decode_num_drafts_total"]
    assert "lockstep_spec_decode_num_draft_tokens_total" not in server.metrics()


def test_streaming_with_drafts_carries_every_token(server, spec_server) -> None:
    # A step may add several tokens: the stream's chunks hold them all, in order, with their logprobs.
    body = {"prompt": "abcabcabcabc", "max_tokens": 20, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    plain = _complete(server, body)
    with httpx.stream("POST", spec_server.base_url + "/completions", headers=spec_server.headers, timeout=120,
                      json=body | {"model": spec_server.model, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for e in events for c in json.loads(e)["choices"]]
    assert "".join(c["text"] for c in choices) == plain["text"]
    streamed = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed == plain["logprobs"]["token_logprobs"]


def test_async_scheduling_with_drafts_matches_the_plain_server(
    server, tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # ``--async-scheduling --speculative-config``: the same completions (and a stream carrying every token).
    log = tmp_path_factory.mktemp("logs") / "async-spec-server.log"
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    s = start_server(tiny_server_model_dir, log, "--speculative-config", config, "--async-scheduling")
    try:
        bodies = [
            {"prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0, "logprobs": 2, "ignore_eos": True},
            {"prompt": "xyxyxyxy", "max_tokens": 24, "temperature": 0.8, "seed": 7, "logprobs": 1, "stop": ["yx"]},
        ]
        for body in bodies:
            assert _complete(s, body) == _complete(server, body)
        assert s.metrics()["lockstep_spec_decode_num_draft_tokens_total"] > 0
    finally:
        stop_server(s.proc)
