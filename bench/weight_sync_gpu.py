"""Weight updates over NCCL between two GPUs: a trainer process on cuda:1 broadcasts a Qwen3-8B-shape bf16 model
(16 GB) in buckets to an ``LLM`` on cuda:0 (``WeightSender`` -> ``LLM.update_weights``). Per bucket size: the
update's wall time and GB/s, and whether every weight the sampler holds afterwards is bit for bit the trainer's
(an exact integer checksum of each tensor's bits on both sides), and whether the answers changed with the weights.

    python bench/weight_sync_gpu.py                      # 2 GPUs; Qwen3-8B shape, 36 layers
    python bench/weight_sync_gpu.py --layers 4 --buckets 64,256,1024
    python bench/weight_sync_gpu.py --smoke --device cpu # toy shape over gloo (two CPU processes)
"""

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402


def checksum(t: torch.Tensor) -> int:
    """An exact function of the tensor's bits (and their order)."""
    v = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    return int((v * (torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 1009 + 1)).sum())


def trainer(specs: list, bucket_sizes: list[int], port: int, device: str, results) -> None:
    from lockstep.rl.weight_sync import WeightSender

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(1)
    named = [(n, (torch.randn(shape, generator=gen, device=device) / shape[-1] ** 0.5).to(torch.bfloat16))
             for n, shape in specs]  # fmt: skip
    results.put({n: checksum(t) for n, t in named})
    sender = WeightSender.connect("127.0.0.1", port, 2, device)
    for size in bucket_sizes:
        sender.bucket_bytes = size
        sender.send(named)
    sender.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (sampler cuda:0, trainer cuda:1) or cpu (gloo)")
    ap.add_argument("--buckets", default="64,256,1024", help="bucket sizes in MiB, comma-separated")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sampler_device, trainer_device = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    sizes = [int(x) << 20 for x in args.buckets.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), QWEN3_TINY if args.smoke else QWEN3_8B, args.layers, torch.device("cpu"),
                         weights=False)  # fmt: skip
        llm = LLM(tmp, load_format="dummy", dtype="bfloat16" if cuda else "float32", device=sampler_device,
                  gpu_memory_utilization=0.5, max_num_seqs=8)  # fmt: skip
        slots = llm.engine.runner.model.checkpoint_tensors()
        specs = [(n, list(t.shape)) for n, t in slots.items()]
        total = sum(t.numel() * 2 for t in slots.values())
        prompt = [[(13 * j) % 500 for j in range(64)]]
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True)
        before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=trainer, args=(specs, sizes, port, trainer_device, results), daemon=True)
        proc.start()
        want = results.get(timeout=1800)
        llm.init_weight_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        )
        info = {"names": [n for n, _ in specs], "dtype_names": ["bfloat16"] * len(specs),
                "shapes": [s for _, s in specs]}  # fmt: skip
        print(f"{total / 1e9:.2f} GB of bf16 weights, {len(specs)} tensors, {args.device}")
        print(f"{'bucket MiB':>10} {'seconds':>8} {'GB/s':>7}  weights exact  answers changed")
        ok = True
        for size in sizes:
            start = time.perf_counter()
            llm.update_weights(info | {"bucket_bytes": size})
            if cuda:
                torch.cuda.synchronize(sampler_device)
            seconds = time.perf_counter() - start
            exact = all(checksum(slots[n].to(torch.bfloat16)) == want[n] for n, _ in specs)
            after = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            print(f"{size >> 20:>10} {seconds:>8.3f} {total / seconds / 1e9:>7.1f}  {exact!s:>13}  {after != before}")
            ok &= exact
        proc.join(60)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
