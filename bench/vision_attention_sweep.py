"""Launch configurations of the vision attention kernel on a GPU: time, and whether each gives the shipped
configuration's bits (the KV tile is part of the numerics, the query block and warps should not be).

    python bench/vision_attention_sweep.py [--out DIR]

For every (BLOCK_M, TILE, num_warps, num_stages): the time on Qwen3-VL-8B's shapes (16 heads x 72; one 448 x 448
image, 16 of them, one 1024 x 1024) and Qwen2.5-VL-7B's windows (16 heads x 80, 64-patch windows), against SDPA
on [1, heads, n, d] (what a per-image transformers tower runs); whether the output equals the shipped config's
bitwise (expected for configs with the same TILE); whether the first image alone equals it inside the batch.
Prints a table, writes vision_attention_sweep.json.
"""

import argparse
import importlib
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

va = importlib.import_module("lockstep.ops.vision_attention")  # lockstep.ops re-exports a function of that name

CASES = [
    ("qwen3vl 1x448", 72, [784]),
    ("qwen3vl 16x448", 72, [784] * 16),
    ("qwen3vl 1x1024", 72, [4096]),
    ("qwen2.5vl 16x448 win", 80, [64] * 256),
]
CONFIGS = [  # (BLOCK_M, TILE, num_warps, num_stages); the first is the shipped one
    (va.BLOCK_M, va.TILE, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 4, 2),
    (64, 64, 8, 2),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 32, 8, 2),
]


def launch(q, k, v, cu, scale, block_m, tile, warps, stages):
    total, heads, d = q.shape
    out = torch.empty_like(q)
    n = cu.shape[0] - 1
    va._vision_attention_kernel[(total // block_m + n, heads)](
        q, k, v, out, cu, n, max(1, n.bit_length()), scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, TILE=tile,
        UPCAST=False, PRECISION="tf32", USE_PDL=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def sdpa_per_image(q, k, v, lens, scale):
    outs, at = [], 0
    for n in lens:
        qs, ks, vs = (t[at : at + n].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, d]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for name, d, lens in CASES:
        gen = torch.Generator().manual_seed(0)
        total = sum(lens)
        q, k, v = (torch.randn(total, 16, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
        scale = d**-0.5
        sdpa_us = do_bench(lambda: sdpa_per_image(q, k, v, lens, scale), return_mode="median") * 1e3
        shipped = launch(q, k, v, cu, scale, *CONFIGS[0])
        for cfg in CONFIGS:
            try:
                out = launch(q, k, v, cu, scale, *cfg)
                first = launch(q[: lens[0]], k[: lens[0]], v[: lens[0]], cu[:2], scale, *cfg)
                us = do_bench(lambda: launch(q, k, v, cu, scale, *cfg), return_mode="median") * 1e3
            except Exception as e:  # out of shared memory or registers: record and go on
                rows.append({"case": name, "config": cfg, "error": str(e)[:200]})
                continue
            rows.append({
                "case": name, "config": cfg, "us": us, "sdpa_per_image_us": sdpa_us, "vs_sdpa": us / sdpa_us,
                "same_bits_as_shipped": torch.equal(out, shipped),
                "first_alone_equal": torch.equal(out[: lens[0]], first),
            })  # fmt: skip
    print(f"{'case':22s} {'BM,TILE,W,S':14s} {'us':>9s} {'SDPA':>9s} {'ratio':>6s} shipped-bits alone==batch")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22s} {str(r['config']):14s} error {r['error'][:60]}")
            continue
        print(f"{r['case']:22s} {','.join(map(str, r['config'])):14s} {r['us']:9.1f} {r['sdpa_per_image_us']:9.1f} "
              f"{r['vs_sdpa']:6.2f} {r['same_bits_as_shipped']} {r['first_alone_equal']}")  # fmt: skip
    Path(args.out, "vision_attention_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
