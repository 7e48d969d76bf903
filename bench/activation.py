"""SiLU-and-mul on a GPU: ``ops.gated.silu_and_mul`` (one Triton pass) against torch's ``F.silu(gate) * up``.

    python bench/activation.py [--out DIR]

Bits: random rows at widths 1..12288 (odd ones included) in bf16, fp16 and fp32, scaled from 1e-3 to 1e3, plus
special values (+-0, +-inf, NaN, subnormals, the largest finite, exp's overflow edge): the count of elements whose
bits differ from torch's. Speed: median microseconds of CUDA-graph replays at M = 1, 16, 256, 8192 (I = 12288,
Qwen3-8B's intermediate size), and GB/s over the bytes read and written. JSON to --out, a table last.
"""

import argparse
import json
import os
from datetime import date

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from lockstep.ops.gated import silu_and_mul


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return int((a.view(ints) != b.view(ints)).sum())


def specials(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    values = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny, -info.tiny, info.tiny / 4, info.max,
              -info.max, 88.7, -88.7, 87.3, -87.3, 103.9, -103.9, 1e-8, -1e-8, 20.0, -20.0]  # fmt: skip
    v = torch.tensor(values, dtype=torch.float32).to(dtype)
    gate = v.repeat_interleave(len(values))  # every (gate, up) pair
    up = v.repeat(len(values))
    return torch.cat([gate, up])[None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    checks = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        diff = total = 0
        for width in (1, 3, 17, 1000, 1023, 1025, 4097, 12288):
            for scale in (1e-3, 1.0, 8.0, 1e3):
                x = (torch.randn(37, 2 * width, device=dev, generator=g) * scale).to(dtype)
                diff += differing(silu_and_mul(x), torch_silu_and_mul(x))
                total += x.numel() // 2
        s = specials(dtype).to(dev)
        special_diff = differing(silu_and_mul(s), torch_silu_and_mul(s))
        checks.append({"dtype": str(dtype), "elements": total, "differing": diff, "special_differing": special_diff})
        print(checks[-1], flush=True)
    timings = []
    width = 12288
    for m in (1, 16, 256, 8192):
        x = torch.randn(m, 2 * width, device=dev, dtype=torch.bfloat16)
        gb = 3 * m * width * 2 / 1e9  # read gate and up, write the product
        ours = do_bench_cudagraph(lambda: silu_and_mul(x), rep=50, return_mode="median") * 1e3
        ref = do_bench_cudagraph(lambda: torch_silu_and_mul(x), rep=50, return_mode="median") * 1e3
        timings.append({"M": m, "fused_us": ours, "torch_us": ref, "fused_GBps": gb / ours * 1e6})
        print(timings[-1], flush=True)
    meta = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(os.path.join(args.out, "activation.json"), "w") as f:
        json.dump({"meta": meta, "checks": checks, "timings": timings}, f, indent=1)
    print(f"\nsilu_and_mul | {meta['gpu']} | torch {meta['torch']}")
    for c in checks:
        print(f"  {c['dtype']:15s} bits differing from torch: {c['differing']} of {c['elements']}, specials "
              f"{c['special_differing']}")  # fmt: skip
    for t in timings:
        fused = f"fused {t['fused_us']:8.1f} us ({t['fused_GBps']:6.0f} GB/s)"
        print(f"  M {t['M']:5d}: {fused}  torch {t['torch_us']:8.1f} us")


if __name__ == "__main__":
    main()
