"""Speculative decoding's counters: the engine's, ``lockstep bench``'s report and the /metrics text."""

import json
from pathlib import Path

import pytest

from lockstep.cli import build_parser, main
from lockstep.server.metrics import Metrics
from lockstep.spec.stats import SpecDecodeStats


def test_stats_count_chunks_and_requests() -> None:
    s = SpecDecodeStats()
    s.count_chunk(3, 3)
    s.count_chunk(3, 0)
    s.count_chunk(2, 1)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_position == [2, 1, 1] and s.chunks_by_accepted == [1, 1, 0, 1]
    assert s.acceptance_rate == 0.5 and s.mean_accepted_length == 1 + 4 / 3
    s.count_finished(10, 4)
    s.count_finished(6, 6)
    assert s.mean_request_accepted_length == (2.5 + 1.0) / 2


def test_metrics_render_the_counters() -> None:
    m = Metrics()
    assert "spec_decode" not in m.render()
    m.spec_decode = SpecDecodeStats()
    m.spec_decode.count_chunk(4, 2)
    text = m.render()
    assert "lockstep_spec_decode_num_draft_tokens_total 4" in text
    assert "lockstep_spec_decode_num_accepted_tokens_total 2" in text
    assert 'lockstep_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1' in text
    assert 'lockstep_spec_decode_chunks_by_accepted_total{accepted="2"} 1' in text
    assert "lockstep_spec_decode_acceptance_rate 0.5" in text


def test_cli_takes_the_json() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("overlap", [[], ["--async-scheduling"]])
def test_bench_reports_acceptance(tiny_model_dir: Path, tmp_path: Path, overlap: list[str]) -> None:
    out = tmp_path / "bench.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    argv = ["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "3", "--input-len", "8"]
    argv += ["--output-len", "12", "--num-iters-warmup", "0", "--quiet", "--output-json", str(out)]
    assert main([*argv, "--speculative-config", spec, "--device", "cpu", *overlap]) == 0
    report = json.loads(out.read_text())
    assert report["engine"]["speculative_config"]["method"] == "ngram"
    s = report["results"]["speculative"]
    assert s["num_draft_tokens"] > 0 and 0 <= s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert s["mean_request_accepted_length"] >= 1.0
    assert report["results"]["output_tokens"] == 36
