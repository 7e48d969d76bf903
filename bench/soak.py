"""Issue 25's soak: one ``lockstep serve`` under normal traffic with a hostile phase after another, for as long as
asked, sampling what could leak: the server's RSS, open file descriptors, KV blocks in use, connections, grammar
cache bytes (when ``/metrics`` has them) and ``/health`` latency from a client of its own.

    python bench/soak.py --minutes 60                       # the tiny random Llama of the tests, default limits
    python bench/soak.py --minutes 20 --model PATH          # another checkpoint folder (the embedded one: "embedded")
    python bench/soak.py --minutes 2 --phases connections --pythonpath /work/main --server-args=""   # another checkout

Normal traffic is two clients sending completions (streamed and not, one fixed greedy request among them, whose
text must never change) and chat calls, all expected to answer 200. The hostile phases, ``--phase-seconds`` each,
in turn, from other peer addresses (127.0.0.3 and up):

- ``connections``: connections each holding a partial body, more than the server serves, reopened as they close;
- ``slow_heads``: request heads trickled a byte a second;
- ``big_heads``: 100 KB and 300 KB request heads;
- ``non_readers``: streams (n=16) whose client never reads;
- ``disconnects``: streams and calls abandoned part way;
- ``malformed``: invalid JSON, wrong types, 2 MB prompts;
- ``grammars``: distinct JSON schemas (structured outputs), a new one each call.

Writes ``--out``/soak.json (every sample, each phase's /health and traffic figures, the growth over the last half)
and ``--out``/soak.png. The server runs with ``--log-level warning``; its log is ``--out``/server.log.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reliability  # noqa: E402
from reliability import ROOT, Server  # noqa: E402

PHASES = ("connections", "slow_heads", "big_heads", "non_readers", "disconnects", "malformed", "grammars")
NORMAL_PEER, HEALTH_PEER = "127.0.0.1", "127.0.0.2"


def attacker_peer(i: int) -> str:
    return f"127.0.0.{3 + i % 8}"


def tiny_model(folder: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import save_tiny_llama

    if not (folder / "config.json").exists():
        save_tiny_llama(folder, max_position_embeddings=4096)
    return str(folder)


def open_from(peer: str, port: int, timeout: float = 10) -> socket.socket:
    sock = socket.socket()
    sock.bind((peer, 0))
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


class Sampler:
    """Every ``period`` seconds: the server's RSS, open fds, KV blocks, connections and grammar cache bytes."""

    def __init__(self, server: Server, period: float) -> None:
        self.server, self.period, self.rows = server, period, []
        self.phase = "warmup"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def _run(self) -> None:
        pid = self.server.proc.pid
        while not self._stop.wait(self.period):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                m = self.server.metrics()
            except (OSError, httpx.HTTPError, StopIteration):
                continue
            grammar = [v for k, v in m.items() if "grammar" in k and "bytes" in k]
            self.rows.append(
                {
                    "t": round(time.monotonic() - self.start, 1),
                    "phase": self.phase,
                    "rss_mb": round(rss, 1),
                    "fds": fds,
                    "kv_blocks_used": m.get("lockstep_kv_blocks_used"),
                    "connections_open": m.get("lockstep_http_connections_open"),
                    "connections_refused": m.get("lockstep_http_connections_refused_total"),
                    "grammar_cache_bytes": sum(grammar) if grammar else None,
                    "running": m.get("lockstep_num_requests_running"),
                }
            )

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Health:
    """/health every ``period`` seconds on a new connection from ``HEALTH_PEER`` (as a liveness probe does)."""

    def __init__(self, port: int, sampler: Sampler, period: float = 0.5) -> None:
        self.port, self.sampler, self.period, self.samples = port, sampler, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            start = time.perf_counter()
            try:
                with open_from(HEALTH_PEER, self.port, timeout=30) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    first = sock.recv(64)
                code = int(first.split()[1]) if first.startswith(b"HTTP/1.1 ") else 0
            except OSError:
                code = 0
            t = round(time.monotonic() - self.sampler.start, 1)
            self.samples.append((self.sampler.phase, time.perf_counter() - start, code, t))

    def __enter__(self) -> "Health":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def normal_traffic(url: str, stop: threading.Event, sampler: Sampler, seed: int, out: list) -> None:
    """Completions and chat calls one after another; each answer's phase, kind, status and (for the fixed greedy
    request) text."""
    rng = random.Random(seed)
    fixed = {"model": "m", "prompt": "The soak test", "max_tokens": 24, "temperature": 0}
    transport = httpx.HTTPTransport(local_address=NORMAL_PEER)
    with httpx.Client(base_url=url, timeout=120, transport=transport) as c:
        while not stop.is_set():
            kind = rng.choice(["fixed", "completion", "stream", "chat"])
            try:
                if kind == "fixed":
                    r = c.post("/v1/completions", json=fixed)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
                elif kind == "completion":
                    body = {"model": "m", "prompt": f"Request {rng.random()}", "max_tokens": rng.randint(1, 64)}
                    r, text = (
                        c.post("/v1/completions", json=body | {"temperature": 0.8, "seed": rng.randint(0, 99)}),
                        None,
                    )
                elif kind == "stream":
                    body = {"model": "m", "prompt": "Stream", "max_tokens": 48, "stream": True, "n": 2}
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = [line for line in r.iter_lines() if line]
                    text = None if lines and lines[-1] == "data: [DONE]" and "error" not in lines[-2] else "BROKEN"
                else:
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
                    r, text = c.post("/v1/chat/completions", json=body), None
                out.append((sampler.phase, kind, r.status_code, text))
            except httpx.HTTPError as e:
                out.append((sampler.phase, kind, 0, type(e).__name__))


# -- hostile phases: each runs until ``stop`` and returns what it saw -------------------------------------------


def phase_connections(url: str, port: int, stop: threading.Event, count: int) -> dict:
    """``count`` connections from one attacker address, each sending a head and 100 of its 1000 body bytes, kept
    open; those the server times out (408) are reopened, at most 20 a second; those it refuses (503) are not (a
    client that reopened them at once would churn, and never hold the server's connections)."""
    socks: list[socket.socket] = []
    opened = refused = 0
    body = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()[:100]
    while not stop.is_set():
        alive = []
        for sock in socks:  # closed by the server (408, or refused): count and drop
            sock.setblocking(False)
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                alive.append(sock)
                continue
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 503"):
                refused += 1
                count -= 1
            sock.close()
        socks = alive
        budget = count if opened == 0 else 10
        while len(socks) < count and budget > 0 and not stop.is_set():
            budget -= 1
            try:
                sock = open_from(attacker_peer(0), port)
                sock.sendall(head("/v1/completions", 1000) + body)
                socks.append(sock)
                opened += 1
            except OSError:
                break
        if os.environ.get("SOAK_DEBUG"):
            print("held", len(socks), "opened", opened, "refused", refused, file=sys.stderr, flush=True)
        stop.wait(0.5)
    for sock in socks:
        sock.close()
    return {"connections_opened": opened, "answered_503": refused}


def phase_slow_heads(url: str, port: int, stop: threading.Event, count: int = 32) -> dict:
    socks, cut, sent = [], 0, 0
    text = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    while not stop.is_set():
        while len(socks) < count and not stop.is_set():
            try:
                socks.append([open_from(attacker_peer(len(socks)), port), 0])
            except OSError:
                break
        for entry in list(socks):
            try:
                entry[0].sendall(text[entry[1] : entry[1] + 1])
                entry[1] += 1
                sent += 1
            except OSError:
                cut += 1
                entry[0].close()
                socks.remove(entry)
        stop.wait(1.0)
    for sock, _ in socks:
        sock.close()
    return {"bytes_trickled": sent, "cut_by_server": cut}


def phase_big_heads(url: str, port: int, stop: threading.Event) -> dict:
    codes: dict[str, int] = {}
    i = 0
    while not stop.is_set():
        size = (100_000, 300_000)[i % 2]
        try:
            with open_from(attacker_peer(i), port) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
                answer = sock.recv(64)
            key = answer.split(b"\r\n")[0].decode() or "closed"
        except OSError as e:
            key = type(e).__name__
        codes[key] = codes.get(key, 0) + 1
        i += 1
        stop.wait(0.2)
    return {"answers": codes}


def phase_non_readers(url: str, port: int, stop: threading.Event, count: int = 4) -> dict:
    payload = json.dumps({"model": "m", "prompt": "x", "max_tokens": 2000, "n": 16, "ignore_eos": True, "stream": True})
    socks, opened = [], 0
    while not stop.is_set():
        while len(socks) < count and not stop.is_set():
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it offers
            sock.bind((attacker_peer(opened), 0))
            try:
                sock.connect(("127.0.0.1", port))
                sock.sendall(head("/v1/completions", len(payload)) + payload.encode())
            except OSError:
                sock.close()
                break
            socks.append((sock, time.monotonic()))
            opened += 1
        for sock, since in list(socks):  # after a while, let it go and open another
            if time.monotonic() - since > 20:
                sock.close()
                socks.remove((sock, since))
        stop.wait(1.0)
    for sock, _ in socks:
        sock.close()
    return {"streams_opened": opened}


def phase_disconnects(url: str, port: int, stop: threading.Event) -> dict:
    left = 0

    async def leave(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": "m", "prompt": f"leave {i}", "max_tokens": 500, "ignore_eos": True}
        if i % 2:
            async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                async for _ in r.aiter_lines():
                    break
        else:
            try:
                await asyncio.wait_for(c.post("/v1/completions", json=body), 0.3)
            except asyncio.TimeoutError:
                pass

    async def run() -> None:
        nonlocal left
        i = 0
        while not stop.is_set():
            transport = httpx.AsyncHTTPTransport(local_address=attacker_peer(i))
            async with httpx.AsyncClient(base_url=url, timeout=30, transport=transport) as c:
                await asyncio.gather(*(leave(c, i + k) for k in range(8)), return_exceptions=True)
            i, left = i + 8, left + 8
            await asyncio.sleep(0.2)

    asyncio.run(run())
    return {"calls_abandoned": left}


def phase_malformed(url: str, port: int, stop: threading.Event) -> dict:
    bodies = [
        b"{",
        b'{"model": "m", "prompt": "x", "max_tokens": "4"}',
        b'{"model": "m", "prompt": [true]}',
        json.dumps({"model": "m", "prompt": "x" * (2 << 20)}).encode(),
        b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b"\xff\xfe",
    ]
    codes: dict[int, int] = {}
    transport = httpx.HTTPTransport(local_address=attacker_peer(0))
    with httpx.Client(base_url=url, timeout=60, transport=transport) as c:
        i = 0
        while not stop.is_set():
            r = c.post("/v1/completions", content=bodies[i % len(bodies)], headers={"content-type": "application/json"})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            i += 1
    return {"statuses": codes}


def phase_grammars(url: str, port: int, stop: threading.Event) -> dict:
    codes: dict[int, int] = {}
    transport = httpx.HTTPTransport(local_address=attacker_peer(1))
    with httpx.Client(base_url=url, timeout=120, transport=transport) as c:
        i = 0
        while not stop.is_set():
            schema = {
                "type": "object",
                "properties": {f"k{i}_{j}": {"enum": [f"v{i}_{j}_{v}" for v in range(50)]} for j in range(20)},
                "required": [f"k{i}_0"],
            }
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            body = {"model": "m", "prompt": "{", "max_tokens": 8, "response_format": fmt}
            r = c.post("/v1/completions", json=body)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            i += 1
    return {"statuses": codes, "schemas": i}


def summarize_health(samples: list) -> dict:
    ms = sorted(1e3 * s[1] for s in samples)
    if not ms:
        return {}
    return {
        "samples": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
        "max_ms": round(ms[-1], 1),
        "not_200": sum(1 for s in samples if s[2] != 200),
    }


def growth(rows: list[dict], key: str) -> dict:
    """The last half's least-squares slope (per hour) and its last minus its first value."""
    half = [(r["t"], r[key]) for r in rows[len(rows) // 2 :] if r.get(key) is not None]
    if len(half) < 2:
        return {}
    ts, vs = zip(*half, strict=True)
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts) or 1.0
    slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den
    return {"per_hour": round(3600 * slope, 2), "last_minus_first": round(vs[-1] - vs[0], 2), "max": max(vs)}


def plot(rows: list[dict], health: list, phases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("rss_mb", "RSS (MB)"), ("fds", "open fds"), ("kv_blocks_used", "KV blocks used")]
    keys += [("connections_open", "connections served"), ("grammar_cache_bytes", "grammar cache bytes")]
    keys = [(k, label) for k, label in keys if any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(len(keys) + 1, 1, figsize=(11, 2.1 * (len(keys) + 1)), sharex=True)
    t = [r["t"] / 60 for r in rows]
    for ax, (k, label) in zip(axes, keys, strict=False):
        ax.plot(t, [r.get(k) for r in rows], lw=1)
        ax.set_ylabel(label, fontsize=8)
    ax = axes[-1]
    ht = [s[3] / 60 for s in health]  # (phase, seconds, status, t)
    ax.scatter(ht, [1e3 * s[1] for s in health], s=2, c=["C0" if s[2] == 200 else "C3" for s in health])
    ax.set_yscale("log")
    ax.set_ylabel("/health ms (red: not 200)", fontsize=8)
    ax.set_xlabel("minutes")
    for i, p in enumerate(phases):
        for a in axes:
            a.axvspan(p["start"] / 60, p["end"] / 60, color="0.92" if i % 2 else "0.84", lw=0, zorder=0)
        top = axes[0].get_ylim()[1]
        axes[0].text((p["start"] + p["end"]) / 120, top, p["phase"], fontsize=6, ha="center", va="top", rotation=90)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--phase-seconds", type=float, default=60, help="each hostile phase's length")
    p.add_argument("--quiet-seconds", type=float, default=20, help="normal traffic alone between phases")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--model", default=None, help="checkpoint folder, or 'embedded' (default: a tiny random Llama)")
    p.add_argument("--connections", type=int, default=300, help="connections the 'connections' phase holds")
    p.add_argument("--server-args", default="--max-connections 256", help="more lockstep serve options")
    p.add_argument("--pythonpath", default=str(ROOT), help="the lockstep checkout the server runs")
    p.add_argument("--sample-seconds", type=float, default=5)
    p.add_argument("--out", default="soak")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = None if args.model == "embedded" else args.model or tiny_model(out / "tiny")
    reliability.ROOT = Path(args.pythonpath).resolve()  # what Server puts on the server's PYTHONPATH
    os.chdir(reliability.ROOT)  # and python -m finds lockstep in the working directory first
    server = Server(model, out / "server.log", *args.server_args.split(), launcher=("-m", "lockstep.cli"))
    phases = [name for name in args.phases.split(",") if name]
    hostile = {name: globals()[f"phase_{name}"] for name in PHASES}
    results, traffic = [], []
    deadline = time.monotonic() + 60 * args.minutes
    try:
        with Sampler(server, args.sample_seconds) as sampler, Health(server.port, sampler) as health:
            stop_normal = threading.Event()
            normal = [
                threading.Thread(target=normal_traffic, args=(server.url, stop_normal, sampler, i, traffic))
                for i in range(2)
            ]
            for t in normal:
                t.start()
            i = 0
            while time.monotonic() < deadline:
                sampler.phase = "quiet"
                time.sleep(min(args.quiet_seconds, max(deadline - time.monotonic(), 0)))
                if time.monotonic() >= deadline:
                    break
                name = phases[i % len(phases)]
                i += 1
                sampler.phase = name
                stop = threading.Event()
                start = time.monotonic() - sampler.start
                extra = (args.connections,) if name == "connections" else ()
                box: dict = {}
                worker = threading.Thread(
                    target=lambda n=name, s=stop, e=extra: box.update(hostile[n](server.url, server.port, s, *e))
                )
                worker.start()
                worker.join(timeout=min(args.phase_seconds, max(deadline - time.monotonic(), 1)))
                stop.set()
                worker.join()
                row = {"phase": name, "start": round(start, 1), "end": round(time.monotonic() - sampler.start, 1)}
                row |= box
                samples = [s for s in health.samples if s[0] == name][-int(args.phase_seconds / health.period) :]
                row["health"] = summarize_health(samples)
                print(json.dumps(row), flush=True)
                results.append(row)
            sampler.phase = "end"
            stop_normal.set()
            for t in normal:
                t.join()
        blocks_idle = server.idle_blocks()
    finally:
        server.stop()
    fixed_texts = {text for _, kind, code, text in traffic if kind == "fixed" and code == 200}
    by_phase: dict[str, dict] = {}
    for phase, _, code, _ in traffic:
        by_phase.setdefault(phase, {}).setdefault(str(code), 0)
        by_phase[phase][str(code)] += 1
    broken = sum(1 for _, kind, _, text in traffic if kind == "stream" and text == "BROKEN")
    report = {
        "minutes": round(sampler.rows[-1]["t"] / 60, 1) if sampler.rows else 0,
        "command": " ".join(sys.argv),
        "phases": results,
        "health_by_phase": {
            ph: summarize_health([s for s in health.samples if s[0] == ph]) for ph in {"quiet", *phases}
        },
        "normal_traffic_by_phase": by_phase,
        "normal_streams_broken": broken,
        "fixed_request_distinct_texts": len(fixed_texts),
        "kv_blocks_used_when_idle": blocks_idle,
        "growth_last_half": {
            k: growth(sampler.rows, k) for k in ("rss_mb", "fds", "kv_blocks_used", "grammar_cache_bytes")
        },
        "first_sample": sampler.rows[0] if sampler.rows else None,
        "last_sample": sampler.rows[-1] if sampler.rows else None,
        "samples": sampler.rows,
        "health_samples": [[ph, round(t, 4), code, at] for ph, t, code, at in health.samples],
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(sampler.rows, health.samples, results, out / "soak.png")
    summary = {k: v for k, v in report.items() if k not in ("samples", "health_samples")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
