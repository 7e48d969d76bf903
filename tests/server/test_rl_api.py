"""``lockstep serve --dev-mode``: vLLM's weight-transfer, prefix-cache and sleep endpoints on a real server, and a
stock TRL ``GRPOTrainer`` in server mode (``examples/trl_grpo_server.py``) training against it: TRL's own
sampler-vs-trainer mismatch is exactly 0 at every step, and above 0 against a ``--no-batch-invariant`` server (the
negative control). A weight update over gloo through the server answers exactly as an in-process ``load_weights``."""

import importlib.util
import socket
from pathlib import Path

import httpx
import pytest
from tiny_models import save_tiny_llama

from lockstep import LLM, SamplingParams
from lockstep.models.loader import load_model
from lockstep.rl.weight_sync import WeightClient

from .conftest import start_server, stop_server

EXAMPLE = Path(__file__).parents[2] / "examples" / "trl_grpo_server.py"
PROMPT = [(7 * j) % 95 for j in range(24)]
BODY = {
    "model": "tiny",
    "prompt": PROMPT,
    "max_tokens": 6,
    "temperature": 0.9,
    "seed": 11,
    "logprobs": 0,
    "return_token_ids": True,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rl_model_dir(tmp_path_factory) -> Path:
    folder = save_tiny_llama(tmp_path_factory.mktemp("rl-server") / "tiny")
    return folder


@pytest.fixture(scope="module")
def rl_server(rl_model_dir, tmp_path_factory):
    s = start_server(rl_model_dir, tmp_path_factory.mktemp("logs") / "rl.log", "--dev-mode", "--enable-sleep-mode")
    yield s
    stop_server(s.proc)


def _complete(server) -> tuple[list[int], list[float]]:
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_dev_routes_are_off_without_dev_mode(server):
    assert httpx.post(server.url + "/sleep", json={}, headers=server.headers, timeout=10).status_code == 404
    assert httpx.get(server.url + "/get_world_size", headers=server.headers, timeout=10).status_code == 404


def test_sleep_and_wake_over_http(rl_server):
    url = rl_server.url
    before = _complete(rl_server)
    assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert httpx.post(url + "/sleep?level=1", timeout=60).status_code == 200  # no body, as vLLM's clients send
    assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping", r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # up, just asleep
    assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
    assert _complete(rl_server) == before  # the same bits after waking
    bad = httpx.post(url + "/sleep?level=3", timeout=10)
    assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
    assert httpx.post(url + "/reset_prefix_cache", timeout=10).json() == {"success": True}


def test_weight_update_through_the_server_equals_load_weights(rl_server, rl_model_dir, tmp_path):
    other = save_tiny_llama(tmp_path / "other", seed=1)
    before = _complete(rl_server)  # fills the server's prefix cache with the old weights' K/V
    fingerprint = httpx.get(rl_server.url + "/server_info", timeout=10).json()["system_fingerprint"]
    client = WeightClient(rl_server.url)
    client.connect(free_port(), "cpu", bucket_bytes=8192)
    client.update(load_model(other).checkpoint_tensors().items())
    after = _complete(rl_server)
    reference = LLM(str(rl_model_dir))
    reference.load_weights(load_model(other).checkpoint_tensors())
    [out] = reference.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.9, seed=11), use_tqdm=False)
    assert after == (out.outputs[0].token_ids, out.outputs[0].token_logprobs)
    assert after != before  # negative control: the weights did change the answers
    info = httpx.get(rl_server.url + "/server_info", timeout=10).json()
    assert info["system_fingerprint"] != fingerprint  # the served weights are no longer the checkpoint's
    client.update(load_model(rl_model_dir).checkpoint_tensors().items())  # back, for the other tests
    assert _complete(rl_server) == before
    client.close()


def _grpo(server, model_dir: Path, tmp_path: Path) -> list[dict]:
    spec = importlib.util.spec_from_file_location("trl_grpo_server_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--model", str(model_dir), "--server", server.url, "--steps", "3", "--output-dir", str(tmp_path)]
    return example.main(argv)


def _updates(server) -> int:
    return httpx.get(server.url + "/health", timeout=10).json().get("weight_updates", 0)


def test_trl_server_mode_has_zero_mismatch(rl_server, rl_model_dir, tmp_path):
    updates = _updates(rl_server)
    steps = _grpo(rl_server, rl_model_dir, tmp_path)
    assert len(steps) == 3
    assert _updates(rl_server) == updates + 3  # TRL pushed the weights before each step's generation
    for logs in steps:
        assert logs["sampling/sampling_logp_difference/max"] == 0.0, logs
        assert logs["sampling/importance_sampling_ratio/min"] == logs["sampling/importance_sampling_ratio/max"] == 1.0
    assert all(logs["grad_norm"] > 0 for logs in steps)  # the weights moved, and were pushed after each step


def test_trl_server_mode_negative_control(rl_model_dir, tmp_path):
    s = start_server(rl_model_dir, tmp_path / "default.log", "--dev-mode", "--no-batch-invariant")
    try:
        steps = _grpo(s, rl_model_dir, tmp_path)
    finally:
        stop_server(s.proc)
    assert len(steps) == 3
    assert all(logs["sampling/sampling_logp_difference/max"] > 0 for logs in steps), steps
