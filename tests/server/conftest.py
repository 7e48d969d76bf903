"""Real ``lockstep serve`` subprocesses on free localhost ports, shared by the server tests: a tiny random Llama
(char tokenizer, 1024 positions) with an API key, the same with torch's default kernels, the same with the key
from the environment, the default body limit and short HTTP timeouts (for hostile clients), and the embedded
SmolLM2 for one realistic test. Each is killed in the fixture's finalizer."""

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tiny_models import save_tiny_llama

API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20
GUARDED_TIMEOUTS = {"--header-timeout": 1.0, "--body-timeout": 3.0}  # seconds
GUARDED_MAX_CONNECTIONS = 16
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str
    api_key: str | None
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, log: Path, *args: str, env: dict | None = None, timeout: float = 300, launcher: tuple = ()
) -> Server:
    """``lockstep serve MODEL ARGS`` on a free port (``launcher``: python arguments that run the CLI instead of
    ``-m lockstep.cli``, e.g. ``("-c", script)``)."""
    port = free_port()
    cmd = [sys.executable, *(launcher or ("-m", "lockstep.cli")), "serve", str(model), "--port", str(port)]
    cmd += ["--device", "cpu"]
    cmd += ["--log-level", "warning", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else (env or {}).get("LOCKSTEP_API_KEY")
    name = args[args.index("--served-model-name") + 1] if "--served-model-name" in args else model.name
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Server(url, name, api_key, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tiny_server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("server") / "tiny", max_position_embeddings=1024)


@pytest.fixture(scope="session")
def server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    s = start_server(tiny_server_model_dir, log, "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES))
    yield s
    stop_server(s.proc)


@pytest.fixture(scope="session")
def default_kernels_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server-default.log"
    s = start_server(tiny_server_model_dir, log, "--no-batch-invariant")
    yield s
    stop_server(s.proc)


@pytest.fixture(scope="session")
def guarded_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The key from $LOCKSTEP_API_KEY, the default 8 MiB body limit, short timeouts, few connections, info logs."""
    log = tmp_path_factory.mktemp("logs") / "server-guarded.log"
    args = [x for k, v in GUARDED_TIMEOUTS.items() for x in (k, str(v))]
    args += ["--max-connections", str(GUARDED_MAX_CONNECTIONS), "--log-level", "info"]
    s = start_server(tiny_server_model_dir, log, *args, env={"LOCKSTEP_API_KEY": "env-key"})
    yield s
    stop_server(s.proc)


@pytest.fixture(scope="session")
def embedded_server(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server-embedded.log"
    s = start_server(embedded_model_dir, log, "--served-model-name", "smollm2")
    yield s
    stop_server(s.proc)
