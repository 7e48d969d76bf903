"""The issue-4 audit on a GPU: ``lockstep serve`` on a random-weight Qwen3-8B-shaped checkpoint, audited by
``lockstep audit``'s runner (1000 identical greedy requests per level, concurrency up to 256, filler requests
mixed in), with the batch-invariant kernels and then with torch's defaults (``--no-batch-invariant``).

    python bench/audit_gpu.py                       # H200: 4 of Qwen3-8B's 36 layers, ~3-4 min
    python bench/audit_gpu.py --layers 36           # the full depth (checkpoint build and load take longer)
    python bench/audit_gpu.py --smoke               # tiny shapes on the CPU, to check the script
    python bench/audit_gpu.py --vlm                 # Qwen3-VL-8B shape (36 layers, dummy weights): one 448^2 image
                                                    # + "Describe this image." among image and text fillers

Writes ``$OUT/audit_gpu.json`` (both reports) and ``$OUT/audit-<mode>/{report.json,distinct_prefixes.png}``.
Needs fastapi, uvicorn, pydantic and openai importable (carry them as wheels where they are missing).
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
if "--smoke" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint  # noqa: E402  (bench/engine.py)

from lockstep.audit.report import plot, summary_lines  # noqa: E402
from lockstep.audit.runner import AuditConfig, audit_endpoint  # noqa: E402


def start_server(folder: Path, port: int, invariant: bool, device: str, log: Path, dummy: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lockstep.cli", "serve", str(folder), "--port", str(port), "--device", device,
           "--log-level", "warning", "--served-model-name", MODEL]  # fmt: skip
    if dummy:
        cmd += ["--load-format", "dummy"]
    if device != "cpu":
        cmd += ["--dtype", "bfloat16"]
    if not invariant:
        cmd.append("--no-batch-invariant")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


MODEL = "qwen3-8b-shape"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


async def warm_up(base_url: str, vocab: int, image_size: tuple[int, int] | None) -> None:
    """Compile the kernels for small and large batches before timing-sensitive levels run (bits unaffected). With
    ``image_size``, every other warm-up request is a chat message with an image of that size."""
    from openai import AsyncOpenAI

    from lockstep.audit.runner import filler_image_url

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    rng = random.Random(1)

    def one(i: int):
        text = " ".join(f"<{rng.randrange(vocab)}>" for _ in range(rng.randrange(8, 200)))
        if image_size is None or i % 2 == 0:
            return client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0)
        content = [{"type": "image_url", "image_url": {"url": filler_image_url(10_000 + i, image_size)}},
                   {"type": "text", "text": text[:200]}]  # fmt: skip
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=4, temperature=0)  # fmt: skip

    try:
        for size in (1, 8, 64, 256):
            await asyncio.gather(*(one(i) for i in range(size)))
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few requests")
    ap.add_argument("--vlm", action="store_true", help="Qwen3-VL-8B shape with dummy weights, an image per target")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: 4 of Qwen3-8B's 36; all 36 with --vlm)")
    ap.add_argument("-n", type=int, default=1000, help="requests per concurrency level")
    ap.add_argument("--concurrency", default=None, help="LEVEL or LEVEL:N (N requests there); default "
                    "1:50,8:250,64,256 (--vlm: 1:50,16:250,64,256)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--filler", type=int, default=100, help="other requests mixed into each level")
    ap.add_argument("--modes", default="invariant,default")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = QWEN3_TINY if args.smoke else QWEN3_8B
    args.concurrency = args.concurrency or ("1:50,16:250,64,256" if args.vlm else "1:50,8:250,64,256")
    if args.smoke:
        args.n, args.concurrency, args.filler, args.max_tokens = 16, "1:4,16", 4, 8
    pairs = [(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else None) for x in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lockstep-audit-"))
    t0 = time.perf_counter()
    image, image_size = None, None
    if args.vlm:
        import vlm_engine  # bench/vlm_engine.py

        # The vocabulary is the tokenizer's (104 characters and special tokens) so that every sampled id decodes to
        # text the audit can compare; Qwen3-VL's 151,936 would mostly sample ids the char tokenizer decodes to "".
        layers = 2 if args.smoke else args.layers or 36
        folder = vlm_engine.make_folder(workdir, layers, args.smoke, vlm_engine.VLM_VOCAB)
        image_size = (112, 112) if args.smoke else (448, 448)
        image = workdir / "needle.png"
        vlm_engine.image(image_size[0], 0).save(image)
        prompt = vlm_engine.NEEDLE
        info = {"folder": folder.name, "layers": layers, "load_format": "dummy",
                "vocab_size": vlm_engine.VLM_VOCAB}  # fmt: skip
        vocab = vlm_engine.VLM_VOCAB
    else:
        rng = random.Random(0)
        prompt = " ".join(f"<{rng.randrange(shape['vocab_size'])}>" for _ in range(64))
        folder = workdir / "qwen3-8b-shape"
        info = build_checkpoint(folder, shape, None if args.smoke else args.layers or 4, torch.device(device))
        print(f"built {folder.name}: {info['num_hidden_layers']} layers, {info['params'] / 1e9:.2f}B params, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        vocab = shape["vocab_size"]
    cfg = AuditConfig(prompt=prompt, n=args.n, concurrency=tuple(c for c, _ in pairs), max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=args.seed, filler=args.filler,
                      level_n={c: k for c, k in pairs if k is not None}, image=image and str(image))  # fmt: skip

    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": info,
                     "torch": torch.__version__, "params": cfg.params(), "modes": {}}  # fmt: skip
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        invariant = mode == "invariant"
        url = f"http://127.0.0.1:{args.port}"
        log = out / f"server-{mode}.log"
        t1 = time.perf_counter()
        proc = start_server(folder, args.port, invariant, device, log, dummy=args.vlm)
        try:
            health = wait_healthy(proc, url, log, timeout=900)
            print(f"[{mode}] server up in {time.perf_counter() - t1:.0f} s: {health['system_fingerprint']}", flush=True)
            t2 = time.perf_counter()
            asyncio.run(warm_up(url + "/v1", vocab, image_size))
            t3 = time.perf_counter()
            report = asyncio.run(audit_endpoint(url + "/v1", MODEL, cfg, progress=True))
            t4 = time.perf_counter()
            metrics = httpx.get(url + "/metrics").text
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        report |= {"health": health, "warm_up_s": round(t3 - t2, 1), "audit_s": round(t4 - t3, 1)}
        folder_out = out / f"audit-{mode}"
        folder_out.mkdir(exist_ok=True)
        (folder_out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (folder_out / "metrics.txt").write_text(metrics)
        plot({f"{mode} kernels": report["levels"]}, str(folder_out / "distinct_prefixes.png"))
        results["modes"][mode] = report
        print(f"[{mode}] audit {t4 - t3:.0f} s (warm-up {t3 - t2:.0f} s)")
        for level, rep in report["levels"].items():
            print("\n".join(summary_lines(f"  concurrency {level}", rep)))
        print("\n".join(summary_lines("  overall", report["overall"])), flush=True)
    (out / "audit_gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"total {time.perf_counter() - t0:.0f} s; JSON: {out / 'audit_gpu.json'}")


if __name__ == "__main__":
    main()
