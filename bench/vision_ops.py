"""Correctness, bitwise invariance and speed of the vision towers' ops, against torch's own kernels.

    python bench/vision_ops.py [--device cuda|cpu] [--out DIR] [--quick]

Shapes of Qwen3-VL-8B's vision tower (16 heads x 72, hidden 1152, MLP 4304, 16-pixel patches: a 448 x 448 image
is 784 patches, a 1024 x 1024 one 4096) and Qwen2.5-VL-7B's (16 heads x 80, hidden 1280, windows of 64 patches).
- vision_attention against SDPA run once per image (what transformers' vision towers do) and SDPA over same-size
  images batched into one call (the ``default`` kernel set's); the first image's bits alone vs inside the batch.
- layer_norm against F.layer_norm, gelu (tanh) against F.gelu; row 0's bits at every row count timed.
Times are medians: triton.testing.do_bench on CUDA, wall clock over a few runs on the CPU (``--device cpu`` runs
tiny sizes, a smoke test). Writes vision_ops.json to --out.
"""

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import torch
import torch.nn.functional as F

from lockstep import ops
from lockstep.layers.torch_kernels import fast_vision_attention, torch_vision_attention

# (name, heads, head_dim, segment lengths): batches of images, and Qwen2.5-VL's windows.
ATTENTION_CASES = [
    ("qwen3vl 1 x 448^2", 16, 72, [784]),
    ("qwen3vl 16 x 448^2", 16, 72, [784] * 16),
    ("qwen3vl 64 x 448^2", 16, 72, [784] * 64),
    ("qwen3vl 1 x 1024^2", 16, 72, [4096]),
    ("qwen3vl mixed 8 sizes", 16, 72, [784, 4096, 256, 1764, 64, 3136, 1024, 400]),
    ("qwen2.5vl 16 x 448^2 windows", 16, 80, [64] * 16 * 16),
    ("qwen2.5vl 16 x 448^2 full", 16, 80, [1024] * 16),
]
CPU_ATTENTION_CASES = [("tiny 1 x 64", 2, 72, [64]), ("tiny 4 mixed", 2, 72, [64, 17, 130, 5])]
# (name, rows, D): norms at 1, 16 and 64 images of 784 patches; gelu on the MLP's intermediate.
ROW_CASES = [("ln 1152", [784, 784 * 16, 784 * 64], 1152), ("ln 1280", [1024, 1024 * 16], 1280)]
CPU_ROW_CASES = [("ln 1152", [17, 200], 1152)]
GELU_CASES = [("gelu 4304", [784, 784 * 16], 4304)]
CPU_GELU_CASES = [("gelu 4304", [17, 200], 4304)]


def timer(device: str, reps: int):
    def cuda_time(fn) -> float:
        from triton.testing import do_bench

        return do_bench(fn, rep=100, return_mode="median") * 1e3

    def cpu_time(fn) -> float:
        fn()
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs) * 1e6

    return cuda_time if device == "cuda" else cpu_time


def attention_case(name, heads, head_dim, lens, device, dtype, bench) -> dict:
    gen = torch.Generator().manual_seed(0)
    total = sum(lens)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    out = ops.vision_attention(q, k, v, cu, scale)
    first = slice(0, lens[0])
    alone = ops.vision_attention(q[first], k[first], v[first], cu[:2], scale)
    ref = torch_vision_attention(q[first].float(), k[first].float(), v[first].float(), cu[:2], scale).double()
    rel = ((out[first].double() - ref).norm() / ref.norm()).item()
    sdpa_out = torch_vision_attention(q, k, v, cu, scale)
    sdpa_alone = torch_vision_attention(q[first], k[first], v[first], cu[:2], scale)
    fast_out = fast_vision_attention(q, k, v, cu, scale)
    last = slice(total - lens[-1], total)
    cu_last = torch.tensor([0, lens[-1]], device=device, dtype=torch.int32)
    last_alone = ops.vision_attention(q[last], k[last], v[last], cu_last, scale)
    row = {
        "case": name, "heads": heads, "head_dim": head_dim, "segments": len(lens), "rows": total,
        "rel_err_first": rel,
        "first_bitwise_alone_vs_batch": torch.equal(out[first], alone),
        "last_bitwise_alone_vs_batch": torch.equal(out[last], last_alone),
        "sdpa_first_bitwise_alone_vs_batch": torch.equal(sdpa_out[first], sdpa_alone),
        "batched_sdpa_first_bitwise_vs_alone": torch.equal(fast_out[first], sdpa_alone),
        "ours_us": bench(lambda: ops.vision_attention(q, k, v, cu, scale)),
        "sdpa_per_segment_us": bench(lambda: torch_vision_attention(q, k, v, cu, scale)),
        "sdpa_batched_us": bench(lambda: fast_vision_attention(q, k, v, cu, scale)),
    }  # fmt: skip
    flops = sum(4 * n * n * head_dim * heads for n in lens)
    row["ours_tflops"] = flops / row["ours_us"] / 1e6
    row["ratio_vs_per_segment"] = row["ours_us"] / row["sdpa_per_segment_us"]
    row["ratio_vs_batched"] = row["ours_us"] / row["sdpa_batched_us"]
    invariant = row["first_bitwise_alone_vs_batch"] and row["last_bitwise_alone_vs_batch"]
    print(f"  {name:30s} ours {row['ours_us']:9.1f} us  SDPA/segment {row['sdpa_per_segment_us']:9.1f}  "
          f"SDPA batched {row['sdpa_batched_us']:9.1f}  rel {rel:.1e}  invariant {invariant}")  # fmt: skip
    return row


def row_case(name, ms, d, device, dtype, bench, op, torch_op) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for m in ms:
        x = (3 * torch.randn(m, d, generator=gen) + 1).to(device, dtype)
        full, torch_full = op(x), torch_op(x)
        ref = torch_op(x[:64].double()) if name.startswith("ln") else F.gelu(x[:64].double(), approximate="tanh")
        rel = ((full[:64].double() - ref).norm() / ref.norm()).item()
        checked = [1, 2, 3, 17, 64, 127, m // 2, m - 1]
        row = {
            "case": name, "rows": m, "D": d, "rel_err": rel,
            "row_counts_differing": [c for c in checked if not torch.equal(op(x[:c]), full[:c])],
            "torch_row_counts_differing": [c for c in checked if not torch.equal(torch_op(x[:c]), torch_full[:c])],
            "ours_us": bench(lambda: op(x)), "torch_us": bench(lambda: torch_op(x)),
        }  # fmt: skip
        row["ratio"] = row["ours_us"] / row["torch_us"]
        row["ours_gbps"] = 2 * x.numel() * x.element_size() / row["ours_us"] / 1e3
        differing, torch_differing = row["row_counts_differing"], row["torch_row_counts_differing"]
        print(f"  {name:10s} M={m:6d}  ours {row['ours_us']:8.1f} us  torch {row['torch_us']:8.1f}  "
              f"ratio {row['ratio']:4.2f}  differing {differing} (torch {torch_differing})")  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="cuda: bf16, cpu: fp32")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="the first cases only")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))
    bench = timer(args.device, reps=3)
    attention = CPU_ATTENTION_CASES if cpu else ATTENTION_CASES[: 2 if args.quick else None]
    norms = CPU_ROW_CASES if cpu else ROW_CASES[: 1 if args.quick else None]
    gelus = CPU_GELU_CASES if cpu else GELU_CASES
    report = {
        "date": str(date.today()), "device": torch.cuda.get_device_name() if not cpu else platform.processor(),
        "torch": torch.__version__, "dtype": str(dtype), "attention": [], "layer_norm": [], "gelu": [],
    }  # fmt: skip
    print("vision_attention")
    for case in attention:
        report["attention"].append(attention_case(*case, args.device, dtype, bench))
    print("layer_norm")
    for name, ms, d in norms:
        w = torch.randn(d, device=args.device, dtype=dtype)
        b = torch.randn(d, device=args.device, dtype=dtype)
        report["layer_norm"] += row_case(
            name, ms, d, args.device, dtype, bench,
            lambda x, w=w, b=b: ops.layer_norm(x, w.to(x.dtype), b.to(x.dtype), 1e-6),
            lambda x, w=w, b=b: F.layer_norm(x, (x.shape[-1],), w.to(x.dtype), b.to(x.dtype), 1e-6),
        )  # fmt: skip
    print("gelu (tanh)")
    for name, ms, d in gelus:
        report["gelu"] += row_case(
            name, ms, d, args.device, dtype, bench,
            lambda x: ops.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"),
        )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "vision_ops.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
