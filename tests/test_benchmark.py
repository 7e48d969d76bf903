"""``lockstep bench latency`` / ``throughput``: the figures' arithmetic, then both commands end to end on a tiny
random Llama. No timing value is asserted, only counts and the order of percentiles."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from lockstep.benchmark import BenchConfig, Run, percentiles, prompt_token_pool, run_benchmark
from lockstep.cli import main
from lockstep.llm import LLM


def bench(kind: str, model: Path, out: Path, *extra: str) -> dict:
    assert main(["bench", kind, "--model", str(model), "--output-json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def assert_ordered(stats: dict) -> None:
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert stats["mean"] > 0


def test_run_turns_token_times_into_ttft_and_itl() -> None:
    run = Run(seconds=1.0, prompt_tokens=10, token_times=[[0.25, 0.5, 1.0], [0.5, 0.75], [0.125]])
    assert run.output_tokens == 6
    assert run.ttfts == [0.25, 0.5, 0.125]
    assert run.itls == [0.25, 0.5, 0.25]  # per request, consecutive gaps; a one-token request has none


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentiles([float(x) for x in range(1, 102)]) == {"mean": 51.0, "p50": 51.0, "p90": 91.0, "p99": 100.0}
    assert percentiles([2.0, 1.0]) == pytest.approx({"mean": 1.5, "p50": 1.5, "p90": 1.9, "p99": 1.99})
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([]) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="latency", num_requests=0, input_len=8, output_len=4), "num_requests"),
        (dict(kind="latency", num_requests=1, input_len=8, output_len=4, num_iters_warmup=-1), "num_iters_warmup"),
        (dict(kind="throughput", num_requests=1, input_len=8, output_len=4, num_iters=2), "num_iters"),
        (dict(kind="latency", num_requests=1, input_len=8, output_len=4, temperature=-1.0), "temperature"),
        (dict(kind="serving", num_requests=1, input_len=8, output_len=4), "kind"),
    ],
)
def test_bench_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def test_throughput_warmup_is_cut_to_a_few_tokens() -> None:
    cfg = BenchConfig("throughput", num_requests=2, input_len=8, output_len=100, temperature=0.5)
    assert (cfg.params().max_tokens, cfg.params(warmup=True).max_tokens) == (100, 4)
    assert cfg.params().ignore_eos and cfg.params().temperature == 0.5
    latency = BenchConfig("latency", num_requests=2, input_len=8, output_len=100)
    assert latency.params(warmup=True).max_tokens == 100  # latency warms up on the very shape it times


def test_prompt_pool_leaves_out_special_tokens(tiny_model_dir: Path) -> None:
    # The char tokenizer: 95 printable characters, then <unk> (95) and </s> (96, EOS).
    assert prompt_token_pool(LLM(str(tiny_model_dir), device="cpu")) == list(range(95))


def test_latency_counts_every_request_and_token(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    args = ["--input-len", "8", "--output-len", "4", "--batch-size", "3", "--num-iters", "2", "--num-iters-warmup", "1"]
    report = bench("latency", tiny_model_dir, tmp_path / "out" / "latency.json", *args)
    cfg, r = report["config"], report["results"]
    assert (cfg["kind"], cfg["num_requests"], cfg["input_len"], cfg["output_len"]) == ("latency", 3, 8, 4)
    assert (cfg["num_iters"], cfg["num_iters_warmup"], cfg["temperature"], cfg["seed"]) == (2, 1, 0.0, 0)
    assert (r["requests"], r["prompt_tokens"], r["output_tokens"]) == (3 * 2, 3 * 2 * 8, 3 * 2 * 4)
    assert len(r["latencies_s"]) == 2 and all(t > 0 for t in r["latencies_s"])
    for key in ("latency_s", "ttft_s", "itl_s"):
        assert_ordered(r[key])
    assert r["latency_s"]["mean"] == pytest.approx(sum(r["latencies_s"]) / 2)
    # A request's first token comes before its batch ends.
    assert r["ttft_s"]["p99"] <= max(r["latencies_s"])
    env = report["environment"]
    assert (env["kernels"], report["engine"]["batch_invariant"]) == ("invariant", True)
    assert env["lockstep"] and env["torch"] and env["device_name"] and env["dtype"] == "float32"
    assert report["engine"]["model"] == str(tiny_model_dir)
    datetime.fromisoformat(report["date"])
    out = capsys.readouterr().out
    assert "kernels invariant" in out and "latency (s)" in out and "TTFT (ms)" in out and "ITL (ms)" in out


@pytest.mark.parametrize("invariant", [True, False])
def test_throughput_counts_and_rates(tiny_model_dir: Path, tmp_path: Path, capsys, invariant: bool) -> None:
    args = ["--input-len", "8", "--output-len", "4", "--num-prompts", "3", "--quiet"]
    args += [] if invariant else ["--no-batch-invariant"]
    r = (report := bench("throughput", tiny_model_dir, tmp_path / "throughput.json", *args))["results"]
    assert (r["requests"], r["prompt_tokens"], r["output_tokens"], r["total_tokens"]) == (3, 3 * 8, 3 * 4, 36)
    assert r["elapsed_s"] > 0
    assert r["requests_per_s"] * r["elapsed_s"] == pytest.approx(3)
    assert r["total_tok_s"] * r["elapsed_s"] == pytest.approx(36)
    assert r["output_tok_s"] / r["requests_per_s"] == pytest.approx(4)  # every request made exactly output-len
    assert_ordered(r["ttft_s"])
    assert_ordered(r["itl_s"])
    assert r["ttft_s"]["p99"] <= r["elapsed_s"]
    kernels = "invariant" if invariant else "default"
    assert (report["environment"]["kernels"], report["engine"]["batch_invariant"]) == (kernels, invariant)
    out = capsys.readouterr().out
    assert f"kernels {kernels}" in out and "requests/s" in out and "output tok/s" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["latency", "--input-len", "0"], "argument --input-len: must be an integer >= 1, got '0'"),
        (["throughput", "--num-prompts", "x"], "argument --num-prompts: must be an integer >= 1, got 'x'"),
        (["latency", "--num-iters-warmup", "-1"], "argument --num-iters-warmup: must be an integer >= 0"),
        (["latency", "--num-prompts", "3"], "unrecognized arguments: --num-prompts"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["latency", "--input-len", "250", "--output-len", "10"],
            "input_len + output_len = 250 + 10 exceeds the context length (max_model_len) 256",
        ),
        (["latency", "--batch-size", "5", "--max-num-seqs", "4"], "batch size 5 exceeds max_num_seqs 4"),
        (["throughput", "--temperature", "-1"], "temperature must be"),
    ],
)
def test_requests_the_engine_cannot_run_are_errors(tiny_model_dir: Path, args: list[str], message: str, capsys):
    assert main(["bench", *args, "--model", str(tiny_model_dir), "--quiet"]) == 2
    assert f"lockstep: error: {message}" in capsys.readouterr().err


def test_prompts_come_from_the_seed(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu")
    sent: list[list[int]] = []
    add = llm.engine.add_request

    def record(rid, ids, params, **kwargs):
        sent.append(ids)
        return add(rid, ids, params, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", record)

    def prompts(seed: int) -> list[list[int]]:
        sent.clear()
        cfg = BenchConfig("latency", num_requests=3, input_len=5, output_len=1, num_iters=2, seed=seed)
        run_benchmark(llm, cfg, progress=False)
        return list(sent)

    first = prompts(0)
    assert len(first) == 3 * 3 and all(len(p) == 5 and max(p) < 95 for p in first)  # 1 warm-up + 2 runs of 3
    assert len({tuple(p) for p in first}) == 9  # every run gets fresh prompts: no prefix-cache hits
    assert prompts(0) == first
    assert prompts(1) != first


def test_sizes_left_unset_take_the_cpu_defaults(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    # vLLM's throughput default (1000 x 1024/128) took over an hour on 2 cores: a CPU gets 32 x 128/32.
    report = bench("throughput", tiny_model_dir, tmp_path / "t.json", "--num-prompts", "2", "--num-iters-warmup", "0")
    cfg = report["config"]
    assert (cfg["num_requests"], cfg["input_len"], cfg["output_len"], cfg["num_iters_warmup"]) == (2, 128, 32, 0)
    report = bench("latency", tiny_model_dir, tmp_path / "l.json", "--batch-size", "1", "--input-len", "4")
    cfg = report["config"]
    assert (cfg["output_len"], cfg["num_iters"], cfg["num_iters_warmup"]) == (32, 5, 1)
    assert "warm-up 1/1 (untimed: compiles kernels)" in capsys.readouterr().err
