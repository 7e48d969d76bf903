"""Issue 25's item 3 at full size, for one checkout: a burst of connections past the cap, and one client holding
connections with partial bodies while another probes /health and asks for a completion.

    python bench/connection_attack.py                            # this checkout, default limits (cap 1024)
    python bench/connection_attack.py --pythonpath /work/main    # another one

- burst: ``--burst`` connections (1100) from 4 peer addresses, all opened before any sends, then each sends
  ``GET /v1/models``: how many get 200 and how many 503 (at a cap of 1024, 76 are past it).
- hold: ``--hold`` connections (1023) from 127.0.0.3, opened one by one, each sending a head and 100 of its 1000
  body bytes; then, from 127.0.0.2, /health and a completion every 0.5 s for ``--seconds``: their statuses and
  latency.

Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reliability  # noqa: E402
from soak import open_from, tiny_model  # noqa: E402

COMPLETION = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()


def ask(port: int, peer: str, request: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        with open_from(peer, port, timeout=30) as sock:
            sock.sendall(request)
            first = sock.recv(64)
        code = int(first.split()[1]) if first.startswith(b"HTTP/1.1 ") else 0
    except OSError:
        code = 0
    return code, time.perf_counter() - start


def burst(port: int, n: int) -> dict:
    socks = [open_from(f"127.0.0.{3 + i % 4}", port) for i in range(n)]
    for sock in socks:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    codes: dict[str, int] = {}
    for sock in socks:
        try:
            first = sock.recv(64)
            key = first.split()[1].decode() if first.startswith(b"HTTP/1.1 ") else "closed"
        except OSError as e:
            key = type(e).__name__
        codes[key] = codes.get(key, 0) + 1
        sock.close()
    return codes


def hold(port: int, n: int, seconds: float) -> dict:
    body = b'{"model": "m", "prompt": "' + b"x" * 74
    socks = []
    for _ in range(n):
        sock = open_from("127.0.0.3", port)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + body
        )
        socks.append(sock)
        time.sleep(0.002)
    time.sleep(1)
    health, completion = [], []
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    post = head + f"Content-Length: {len(COMPLETION)}\r\nConnection: close\r\n\r\n".encode() + COMPLETION
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health.append(ask(port, "127.0.0.2", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"))
        completion.append(ask(port, "127.0.0.2", post))
        time.sleep(0.5)
    held = 0
    for sock in socks:  # still open, nothing received: the server holds it
        sock.setblocking(False)
        try:
            sock.recv(64)
        except BlockingIOError:
            held += 1
        except OSError:
            pass
        sock.close()

    def summary(samples: list) -> dict:
        ms = sorted(1e3 * t for _, t in samples)
        codes: dict[str, int] = {}
        for code, _ in samples:
            codes[str(code)] = codes.get(str(code), 0) + 1
        return {"statuses": codes, "p50_ms": round(statistics.median(ms), 1), "max_ms": round(ms[-1], 1)}

    return {"held_open_at_end": held, "health": summary(health), "completion": summary(completion)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pythonpath", default=str(reliability.ROOT), help="the lockstep checkout the server runs")
    p.add_argument("--server-args", default="", help="more lockstep serve options")
    p.add_argument("--burst", type=int, default=1100)
    p.add_argument("--hold", type=int, default=1023)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--out", default="connection-attack")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(out / "tiny")
    reliability.ROOT = Path(args.pythonpath).resolve()
    os.chdir(reliability.ROOT)  # python -m finds lockstep in the working directory first
    row = {"checkout": str(reliability.ROOT)}
    for case in ("burst", "hold"):
        server = reliability.Server(model, out / f"{case}.log", *args.server_args.split())
        try:
            row[case] = (
                burst(server.port, args.burst) if case == "burst" else hold(server.port, args.hold, args.seconds)
            )
        finally:
            server.stop()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
