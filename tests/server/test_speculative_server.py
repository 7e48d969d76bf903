"""``lockstep serve --speculative-config``: completions are the plain server's, bit for bit, and /metrics counts
the drafts and the accepted tokens."""

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
