"""FP8 matmul tiles at decode-sized M on the H200: the candidates for ``ops.fp8.fp8_config``'s M <= 64 rows.

    python bench/fp8_decode_tiles.py --out DIR   # H200, Qwen3-8B shapes, M 1 / 16 / 64 (about 1 min)

Per shape (K, N) of a Qwen3-8B layer (fused QKV, o_proj, fused gate-up, down) and M: the activation quantization
alone (per 128 columns and per token), ``torch._scaled_mm`` (cuBLASLt, per-token and per-channel scales), bf16
``F.linear`` (cuBLAS), the table's tile, and each candidate tile, all block-scaled, timed in CUDA graphs over weight
copies that defeat the L2. Every candidate's output is compared with the table tile's bits (the reduction order
must not depend on the tile). Prints a line per (shape, M), then each tile's microseconds ('!' after a tile whose
bits differ), and writes fp8_decode_tiles.json.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_check import L2_BYTES, same, sweep_time, tile_name, weight  # noqa: E402

from lockstep.ops import fp8  # noqa: E402
from lockstep.ops.fp8 import Fp8Config, _fp8_mm_triton, fp8_config  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]  # (K, N)
C = Fp8Config
TILES = [
    C(64, 32, num_stages=4), C(64, 32, num_stages=4, blocks=2), C(64, 32, num_stages=3, blocks=4),
    C(64, 32, num_stages=4, blocks=4), C(64, 16, num_stages=4, blocks=4), C(64, 16, num_stages=6, blocks=2),
    C(64, 64, num_stages=4), C(64, 64, num_stages=4, blocks=2), C(64, 64, num_stages=3, blocks=4),
    C(64, 128, num_stages=4), C(64, 128, num_stages=3, blocks=2), C(64, 32, num_stages=6, blocks=2),
    # swapped: the weights' rows as the MMA's M (BN), the tokens as its N (BM)
    C(16, 64, num_stages=4, swap=True), C(16, 64, num_stages=4, blocks=2, swap=True),
    C(16, 64, num_stages=3, blocks=4, swap=True), C(16, 128, num_stages=4, swap=True),
    C(16, 128, num_stages=3, blocks=2, swap=True), C(64, 64, num_stages=4, swap=True),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_decode_tiles.py times FP8 tensor-core tiles: it needs a CUDA GPU")
    rows = []
    for k, n in SHAPES:
        copies = max(1, min(8, math.ceil(4 * L2_BYTES / (n * k))))
        block = [weight(n, k, "block", seed=i) for i in range(copies)]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, copies // 2))]
        chan = [weight(n, k, "channel", seed=i) for i in range(copies)]
        col_scales = [s.t().contiguous() for _, s in chan]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            a8, a_s = fp8.quantize_rows(x, 128)
            t8, t_s = fp8.quantize_rows(x, None)
            table = fp8_config(m, n, k)
            want = _fp8_mm_triton(a8, a_s, *block[0], None, torch.bfloat16, table)

            def per_copy(fn, weights):
                us = sweep_time(lambda: [fn(w) for w in weights])
                return None if us is None else us / len(weights)

            row = {"K": k, "N": n, "M": m, "table": tile_name(table),
                   "quant_group_us": sweep_time(lambda: fp8.quantize_rows(x, 128)),
                   "quant_token_us": sweep_time(lambda: fp8.quantize_rows(x, None)),
                   "scaled_mm_us": per_copy(lambda wc: torch._scaled_mm(t8, wc[0][0].t(), scale_a=t_s, scale_b=wc[1],
                                                                         out_dtype=torch.bfloat16),
                                            list(zip(chan, col_scales, strict=True))),
                   "bf16_us": per_copy(lambda w: F.linear(x, w), bf16),
                   "table_us": per_copy(lambda ws: _fp8_mm_triton(a8, a_s, *ws, None, torch.bfloat16, table), block),
                   "tiles": {}}  # fmt: skip
            for cfg in TILES:
                try:
                    bits = same(_fp8_mm_triton(a8, a_s, *block[0], None, torch.bfloat16, cfg), want)
                except Exception as e:  # noqa: BLE001  (a tile that does not build: recorded)
                    row["tiles"][tile_name(cfg)] = {"error": str(e)[:100]}
                    continue
                us = per_copy(lambda ws, cfg=cfg: _fp8_mm_triton(a8, a_s, *ws, None, torch.bfloat16, cfg), block)
                row["tiles"][tile_name(cfg)] = {"us": us, "bits_equal": bits}
            timed = [(v["us"], t) for t, v in row["tiles"].items() if v.get("us")]
            bad = [t for t, v in row["tiles"].items() if v.get("bits_equal") is False]
            print(f"K={k} N={n} M={m}: quantize {row['quant_group_us']:.1f} (per 128) / {row['quant_token_us']:.1f} "
                  f"(per token)  scaled_mm {row['scaled_mm_us']:.1f}  bf16 {row['bf16_us']:.1f}  table "
                  f"{row['table_us']:.1f} ({row['table']})  best {min(timed, default=None)}  other bits {bad}",
                  flush=True)  # fmt: skip
            rows.append(row)
    for r in rows:
        cells = [f"{t}={v['us']:.1f}{'' if v['bits_equal'] else '!'}" if v.get("us") else f"{t}=-"
                 for t, v in r["tiles"].items()]  # fmt: skip
        print(f"K={r['K']} N={r['N']} M={r['M']}: " + "  ".join(cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_decode_tiles.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
