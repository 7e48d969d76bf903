"""FP8 experts under tensor parallelism on one GPU: the chunk tree over FP8 experts (``ops.moe_fp8_tree``) at
Qwen3-30B-A3B-FP8's expert shape, N simulated ranks against one process, on the grouped Triton kernel.

    python bench/fp8_moe_tp_check.py --out DIR          # H200 (about a minute)
    python bench/fp8_moe_tp_check.py --tiny --out DIR   # small shapes; without a GPU the CPU path

Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, expert width I = 768, 128 x 128 block scales, activations per
128-column group. At TP 4 a rank holds 192 columns of I and at TP 8 96, which cut the 128-column blocks: both ranks
that share a block hold its scale, the activations' group maxima are gathered (here: each rank's maxima, then
their max), and the down projection runs in pieces of one block cut at the whole I's block edges. For N in 2, 4,
8 the ranks' subtree roots, finished by the pairwise tree, must give the one-process tree's bits for every token
(a batch of 512 and a token alone); a negative control quantizes shared groups with each rank's own part's
maximum and must differ. Times: the one-process tree against the plain FP8 experts (``ops.moe_fp8``) and a rank's
share at TP 8 (its 14-launch cost is the tree's; the all-gathers are not timed here).

Prints a table and writes fp8_moe_tp_check.json to --out. Exits 1 if a bit check fails.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lockstep.ops import fp8, moe, tp_linear  # noqa: E402
from lockstep.ops.moe_fp8 import experts_fp8  # noqa: E402
from lockstep.ops.moe_fp8_tree import down_roots_fp8, experts_fp8_tree  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def quantized_experts(num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Random experts in the 128 x 128 block layout: ``(w13 [E, 2I, H], s13, w2 [E, H, I], s2)`` with row scales."""
    g = torch.Generator(device=DEV).manual_seed(3)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEV, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEV, generator=g) / inter**0.5

    def q(w, parts):
        w8s, scales = [], []
        for m in w:
            for p in m.split(parts):
                w8, s = fp8.quantize_weight(p, (128, 128))
                w8s.append(w8)
                scales.append(fp8.expand_block_scale(s, p.shape[0], 128))
        n = len(parts)
        return (torch.stack([torch.cat(w8s[i * n : (i + 1) * n]) for i in range(num_experts)]),
                torch.stack([torch.cat(scales[i * n : (i + 1) * n]) for i in range(num_experts)]))  # fmt: skip

    return (*q(w13, [inter, inter]), *q(w2, [hidden]))


def rank_slice(w13, s13, w2, s2, rank: int, size: int):
    """Rank ``rank`` of ``size``: its rows of each gate and up projection, its columns of each down projection, and
    the scales of the K blocks they touch (as ``models.quantization`` loads them)."""
    inter = w2.shape[2]
    a, b = rank * inter // size, (rank + 1) * inter // size
    rows = torch.cat([torch.arange(a, b), inter + torch.arange(a, b)]).to(w13.device)
    g = fp8.GROUP_K
    return w13[:, rows], s13[:, rows], w2[:, :, a:b].contiguous(), s2[:, :, a // g : -(-b // g)].contiguous()


def simulated(x, weights, ids, experts, size: int, gather: bool = True) -> torch.Tensor:
    """The output N ranks compute: pass 1 collects each rank's activation group maxima (the all-gather), pass 2
    runs every rank with their max (or, ``gather=False``, its own) and the roots meet in the pairwise tree."""
    inter = experts[2].shape[2]
    shards = [rank_slice(*experts, r, size) for r in range(size)]
    columns = [(r * inter // size, inter) for r in range(size)]
    maxima = []
    for shard, cols in zip(shards, columns, strict=True):
        down_roots_fp8(x, *shard, ids, 128, 8 // size, lambda m: maxima.append(m) or m, None, cols)
    amax = torch.stack(maxima).amax(0)
    roots = []
    for shard, cols in zip(shards, columns, strict=True):
        fn = (lambda m: amax) if gather else (lambda m: m)
        roots.append(down_roots_fp8(x, *shard, ids, 128, 8 // size, fn, None, cols))
    root = tp_linear.tree_reduce(torch.stack([r for r, _ in roots]))
    return moe.combine(root.to(x.dtype), weights.float(), roots[0][1])


def bench(fn, reps: int = 20) -> float:
    """Mean microseconds of ``fn()`` (CUDA: synchronised, after warm-up)."""
    for _ in range(3):
        fn()
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if CUDA:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="small shapes (the default without a GPU)")
    args = parser.parse_args()
    tiny = args.tiny or not CUDA
    num_experts, top_k, hidden, inter, tokens = (4, 2, 160, 768, 24) if tiny else (128, 8, 2048, 768, 512)
    experts = quantized_experts(num_experts, hidden, inter)
    g = torch.Generator(device=DEV).manual_seed(5)
    dtype = torch.float32 if not CUDA else torch.bfloat16  # the interpreter's dots are fp32
    x = torch.randn(tokens, hidden, device=DEV, generator=g).to(dtype)
    weights, ids = moe.route(torch.randn(tokens, num_experts, device=DEV, generator=g), top_k, True)
    one = experts_fp8_tree(x, *experts, weights, ids, 128)
    alone = experts_fp8_tree(x[3:4], *experts, weights[3:4], ids[3:4], 128)
    failures, rows = [], []
    if not torch.equal(alone, one[3:4]):
        failures.append("a token alone differs from the batch")
    for size in (2, 4, 8):
        same = torch.equal(simulated(x, weights, ids, experts, size), one)
        control = None if size == 2 else not torch.equal(simulated(x, weights, ids, experts, size, False), one)
        if not same:
            failures.append(f"TP {size} differs from one process")
        if control is False:
            failures.append(f"TP {size}: the own-maximum control matched: the check proves nothing")
        rows.append({"tp": size, "bits_equal": same, "own_max_control_differs": control})
        print(f"  TP {size}: bits equal to one process {same}   own-maximum control differs {control}")
    times = {}
    if CUDA:
        times["tree_us"] = bench(lambda: experts_fp8_tree(x, *experts, weights, ids, 128))
        times["plain_us"] = bench(lambda: experts_fp8(x, *experts, weights, ids, 128))
        shard = rank_slice(*experts, 1, 8)
        times["tp8_rank1_roots_us"] = bench(lambda: down_roots_fp8(x, *shard, ids, 128, 1, None, None, (96, inter)))
        print(f"  {tokens} tokens: tree {times['tree_us']:.1f} us, plain FP8 experts {times['plain_us']:.1f} us, "
              f"TP 8 rank 1's roots {times['tp8_rank1_roots_us']:.1f} us")  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "shape": {"experts": num_experts, "top_k": top_k, "hidden": hidden, "inter": inter, "tokens": tokens},
        "token_alone_equal": torch.equal(alone, one[3:4]),
        "tp": rows,
        "times": times,
        "failures": failures,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_moe_tp_check.json").write_text(json.dumps(result, indent=1))
    print(f"{len(failures)} failure(s); wrote {out / 'fp8_moe_tp_check.json'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
