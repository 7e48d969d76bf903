"""Issue 25 item 2's figure: a server's memory after many distinct large structured-output schemas. ``lockstep
serve`` (the embedded SmolLM2-135M by default) gets ``--schemas`` distinct enum schemas of ``--values`` strings each
(the review's: 60 of 1.4 MB), one request each (max_tokens 1), and reports its RSS before, during and after, the
status of each request and the grammar-cache gauges of /metrics.

    python bench/grammar_memory.py                                  # the review's reproducer, default limits
    python bench/grammar_memory.py -- --max-structured-output-bytes 1500000 --structured-output-cache-bytes 1073741824

Arguments after ``--`` go to ``lockstep serve``. Runs against whatever ``lockstep`` PYTHONPATH finds (so the same
command measures another checkout). Prints one JSON object.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS")


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("lockstep_grammar_cache"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("lockstep_")] = float(value)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded SmolLM2-135M)")
    p.add_argument("--schemas", type=int, default=60)
    p.add_argument("--values", type=int, default=30000, help="enum strings a schema (30000: 1.4 MB of JSON)")
    p.add_argument("serve_args", nargs="*", help="after --: lockstep serve options")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lockstep.cli", "serve", *([args.model] if args.model else []), "--port", str(port)]
    cmd += ["--device", "cpu", "--log-level", "warning", "--served-model-name", "m", *args.serve_args]
    log = open("grammar_memory.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (grammar_memory.log)")
            time.sleep(0.5)
        body = {"model": "m", "prompt": "Pick one:", "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=600)  # warm: the first request's own memory
        start = rss_mb(proc.pid)
        statuses: dict[int, int] = {}
        samples = []
        for i in range(args.schemas):
            enum = [f"value-{i:03d}-{j:07d}-{'x' * 24}" for j in range(args.values)]
            r = httpx.post(url + "/v1/completions", json={**body, "guided_json": {"enum": enum}}, timeout=600)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if (i + 1) % 10 == 0 or i + 1 == args.schemas:
                samples.append({"schemas": i + 1, "rss_mb": rss_mb(proc.pid), **gauges(url)})
        schema_bytes = len(json.dumps({"enum": enum}))
        print(
            json.dumps(
                {
                    "serve_args": args.serve_args,
                    "schema_bytes": schema_bytes,
                    "statuses": statuses,
                    "rss_mb_before": start,
                    "samples": samples,
                    "rss_mb_added": round(samples[-1]["rss_mb"] - start, 1),
                }
            )
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
