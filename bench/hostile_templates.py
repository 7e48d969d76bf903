"""Issue 25's figures for items 1 and 4 on the CPU: a normal chat's latency and /health's while four clients send
looping chat templates ("templates"), a neighbour's stream and /health while a stream checks four long stop
strings ("stops"), and one stream chunk's stop-string holdback check as the text grows ("holdback").

    python bench/hostile_templates.py                      # this checkout's server, the embedded SmolLM2
    python bench/hostile_templates.py --root /work/main    # another checkout's code (before/after)
    python bench/hostile_templates.py --cases holdback     # some of the cases

Prints one JSON object per case and writes them all to ``--out`` (default hostile_templates.json).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def loops(n: int) -> str:
    """A ~100-byte template of n^2 empty loop iterations (the issue's used range(100000): minutes each on main)."""
    return f"{{% for i in range({n}) %}}{{% for j in range({n}) %}}{{% endfor %}}{{% endfor %}}"


class Server:
    def __init__(self, root: Path, model: str | None, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "lockstep.cli", "serve", *([model] if model else []), "--port", port]
        cmd += ["--device", "cpu", "--log-level", "warning", "--served-model-name", "m"]
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=root)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()  # rendering threads of the old code would hold a graceful exit for minutes
        self.proc.wait()


def chat(**fields) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 8,
        "temperature": 0,
    } | fields


class Probe:
    """/health latency every 0.1 s from a thread of its own."""

    def __init__(self, url: str) -> None:
        self.url, self.ms, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.wait(0.1):
                t = time.perf_counter()
                c.get(self.url + "/health")
                self.ms.append(1e3 * (time.perf_counter() - t))

    def __enter__(self) -> "Probe":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def summary(self) -> dict:
        ms = sorted(self.ms)
        p95 = ms[int(0.95 * (len(ms) - 1))] if ms else None
        return {"health_n": len(ms), "health_median_ms": statistics.median(ms) if ms else None, "health_p95_ms": p95,
                "health_max_ms": ms[-1] if ms else None}  # fmt: skip


def timed_chat(url: str) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=600)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def case_templates(server: Server, n: int, rounds: int = 3) -> dict:
    """Four concurrent bodies with an n x n loop template (two chats, two /tokenize), as in the issue; normal chats
    one after another while they are out."""
    alone = [timed_chat(server.url) for _ in range(rounds)]
    answers = []

    def attack(path: str) -> None:
        t = time.perf_counter()
        try:
            r = httpx.post(server.url + path, json=chat(chat_template_kwargs={"chat_template": loops(n)}), timeout=600)
            answers.append((r.status_code, time.perf_counter() - t))
        except httpx.HTTPError as e:
            answers.append((type(e).__name__, time.perf_counter() - t))

    threads = [
        threading.Thread(target=attack, args=(p,), daemon=True) for p in ["/v1/chat/completions", "/tokenize"] * 2
    ]
    with Probe(server.url) as probe:
        for t in threads:
            t.start()
        time.sleep(0.2)
        during = [timed_chat(server.url) for _ in range(rounds)]
        for t in threads:
            t.join()
    return {"case": f"templates_{n}x{n}", "chat_alone_s": statistics.median(alone), "chat_during_s": during,
            "attack_answers": sorted(answers, key=str), **probe.summary()}  # fmt: skip


def stream_seconds(url: str, body: dict) -> tuple[float, int]:
    t, chunks = time.perf_counter(), 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
    return time.perf_counter() - t, chunks


def case_stops(server: Server, stop_chars: int, tokens: int) -> dict:
    base = {"model": "m", "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    alone, _ = stream_seconds(server.url, base)
    stops = [c * stop_chars for c in "abcd"]  # never met: the whole check, at every chunk
    t = time.perf_counter()
    refused = httpx.post(server.url + "/v1/completions", json=base | {"stream": False, "stop": stops}, timeout=600)
    first_answer_s = time.perf_counter() - t
    out = {"case": f"stops_{stop_chars}", "status": refused.status_code, "first_answer_s": first_answer_s}
    if refused.status_code != 200:
        return out
    result = {}
    neighbour = threading.Thread(target=lambda: result.update(n=stream_seconds(server.url, base)[0]))
    with Probe(server.url) as probe:
        neighbour.start()
        stopped_s, chunks = stream_seconds(server.url, base | {"n": 2, "stop": stops})
        neighbour.join()
    return out | {"neighbour_alone_s": alone, "neighbour_beside_s": result["n"], "stop_stream_s": stopped_s,
                  "chunks": chunks, **probe.summary()}  # fmt: skip


def holdback_chunk_ms() -> list[dict]:
    """In this process (run with the checkout's code on PYTHONPATH): one stream chunk's holdback check with four
    stop strings the text never begins (the old check tried every prefix length, each slice O(length)), the text
    grown to 40k and 80k characters."""
    from transformers import AutoTokenizer

    from lockstep.models.embedded import default_model_path
    from lockstep.outputs import CompletionOutput, RequestOutput
    from lockstep.server.responses import _TextStream

    tok = AutoTokenizer.from_pretrained(default_model_path())
    out = []
    for stop_chars in (1024, 1_900_000):
        for n in (40_000, 80_000):
            stream = _TextStream(tok, [c * stop_chars for c in "wxyz"])
            for size in range(n // 200, n + 1, n // 200):
                stream.delta(RequestOutput("r", None, [], [CompletionOutput(0, "a" * size, [1])]))
            t = time.perf_counter()
            stream.delta(RequestOutput("r", None, [], [CompletionOutput(0, "a" * (n + 4), [1])]))
            out.append({"stop_chars": stop_chars, "text_chars": n, "chunk_ms": 1e3 * (time.perf_counter() - t)})
    return out


def case_holdback(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, __file__, "--holdback-here"]
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
    return {"case": "holdback", "chunks": json.loads(result.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--model", default=None)
    ap.add_argument("--loops", type=int, default=20000, help="the attack template's loop bound (n^2 iterations)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens of each stream in the stop-string cases")
    ap.add_argument("--cases", default="templates,stops,holdback")
    ap.add_argument("--out", default="hostile_templates.json")
    ap.add_argument("--holdback-here", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holdback_here:
        print(json.dumps(holdback_chunk_ms()))
        return
    cases = args.cases.split(",")
    results = []
    with_server = []
    if "templates" in cases:
        with_server.append(lambda s: case_templates(s, args.loops))
    if "stops" in cases:
        with_server += [lambda s: case_stops(s, 1024, args.tokens), lambda s: case_stops(s, 1_900_000, args.tokens)]
    for case in with_server:
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(args.root.resolve(), args.model, Path(tmp) / "server.log")
            try:
                results.append(case(server))
            finally:
                server.stop()
        print(json.dumps(results[-1]), flush=True)
    if "holdback" in cases:
        results.append(case_holdback(args.root.resolve()))
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
