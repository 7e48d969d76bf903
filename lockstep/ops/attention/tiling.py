"""The reduction order every attention path follows: KV tiles of ``TILE`` positions, splits of ``SPLIT``."""

# KV positions per reduction tile. 64 is FlashAttention's usual BLOCK_N for head_dim 64-128 on Hopper, and
# on the CPU it keeps the per-step matmuls big enough to amortise the Python loop.
TILE = 64
# KV positions per split. Decode at small batch needs splits for parallelism (batch 1, 4k context, 8 KV heads:
# 64 programs at 512, 8 at 4096); each split costs one merge step, and the split-parallel path stores one fp32
# partial per (token, split, head). 512 keeps both cheap.
SPLIT = 512
