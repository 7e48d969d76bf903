"""Gumbel-max over many rows in one pass: the sampler's choice at temperature > 0 on CUDA (and, without the noise,
its greedy choice).

``gumbel_argmax(x, keys)`` returns, for each row of scaled and filtered logits ``x: [rows, V]`` fp32, the token
``argmax_t(x[t] + g[t])`` (ties to the lowest id; NaN counts as -inf; a row with nothing above -inf gives token
0 and score -inf) and the fp64 score that won, where ``g[t] = -log(-log(u[t]))`` and ``u[t]`` is the sampler's
counter-based hash of the row's 64-bit key and ``t`` (``layers/sampler.py``: ``_uniform``, ``_gumbel``). It is
the same arithmetic as the sampler's torch path (integer hashing modulo 2**64, exact conversions, fp64 logs and
one fp64 add a token, then an exact maximum and an integer minimum), with no ``[rows, V]`` temporaries: torch
spends about 25 passes over fp64 and int64 arrays of that size, 4.40 / 1.22 / 0.41 ms at 256 / 64 / 1 rows of
Qwen3's vocabulary on an H200 against this kernel's 0.38 / 0.12 / 0.08 ms, with the same tokens and scores bit for
bit (bench/sampler.py, 2026-12-01).

A row's result depends on that row alone: its programs read only its scores, and the per-block and per-chunk
maxima and minimum ids are combined exactly (a maximum and an integer minimum do not depend on their order). A
block whose tokens are all -inf (most of them after top-k) skips the hash: its scores are -inf, which only an all
-inf row could pick, and that row's answer (token 0) does not need them.
"""

import torch
import triton
import triton.language as tl

BLOCK = 2048
# Tokens per program: a row is cut into chunks of this many, each one program, so one row alone still spreads over
# the GPU (the noise costs two fp64 logs a token: one program per row took 0.46 ms for Qwen3's 151,936 tokens on the
# H200, 19 chunks 0.08 ms). The chunks' best scores and ids are combined exactly, so CHUNK is a speed setting, never
# a numerics one.
CHUNK = 8192
# splitmix64's constants, shared with the sampler's torch path and its scalar reference (layers/sampler.py).
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr, keys_ptr, part_best_ptr, part_id_ptr, vocab, stride, num_chunks, golden, m1, m2,
    NOISE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (row, chunk): the best score of tokens [chunk * CHUNK, (chunk + 1) * CHUNK) and its lowest id (vocab
    # when no token there is above -inf).
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)  # read, and unused, without NOISE
    best = tl.full([], float("-inf"), tl.float64)
    best_id = vocab
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < vocab
        x = tl.load(base + offs, mask=ok, other=float("-inf"))
        x = tl.where(x == x, x, float("-inf"))  # NaN -> -inf
        if tl.max(x, 0) > float("-inf"):
            score = x.to(tl.float64)
            if NOISE:
                # splitmix64's finaliser of (id * golden) ^ key, modulo 2**64 (unsigned: >> is a logical shift)
                h = (offs.to(tl.uint64) * golden) ^ key
                h = (h ^ (h >> 30)) * m1
                h = (h ^ (h >> 27)) * m2
                h = h ^ (h >> 31)
                u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53: u in (0, 1), never 0 or 1
                score = score + -tl.log(-tl.log(u))
            score = tl.where(ok, score, float("-inf"))
            top = tl.max(score, 0)
            top_id = tl.min(tl.where(score == top, offs, vocab), 0)
            better = (top > best) | ((top == best) & (top_id < best_id))
            best = tl.where(better, top, best)
            best_id = tl.where(better, top_id, best_id)
    tl.store(part_best_ptr + row * num_chunks + chunk, best)
    tl.store(part_id_ptr + row * num_chunks + chunk, best_id)


@triton.jit
def _combine_kernel(part_best_ptr, part_id_ptr, token_ptr, best_ptr, vocab, num_chunks, BLOCK_C: tl.constexpr):
    # One row: the largest of its chunks' scores, the lowest id holding it; token 0 when nothing was above -inf.
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    best = tl.load(part_best_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * num_chunks + c, mask=ok, other=vocab)
    top = tl.max(best, 0)
    top_id = tl.min(tl.where(best == top, ids, vocab), 0)
    tl.store(token_ptr + row, tl.where(top_id < vocab, top_id, 0).to(tl.int64))
    tl.store(best_ptr + row, top)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [rows, V]`` fp32, ``keys: [rows]`` int64 (the sampler's signed row keys) -> ``(tokens [rows] int64,
    best [rows] fp64)``, on x's device. ``keys=None``: no noise, the greedy choice (``greedy_argmax``). Triton (the
    CPU runs it through the interpreter)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"gumbel_argmax takes [rows, V] fp32 scores, got {tuple(x.shape)} {x.dtype}")
    noise = keys is not None
    if noise and (keys.shape != x.shape[:1] or keys.dtype != torch.int64):
        raise ValueError(f"gumbel_argmax takes [rows] int64 keys for {x.shape[0]} rows, got {keys.shape} {keys.dtype}")
    rows, vocab = x.shape
    x = x.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=x.device)
    best = torch.empty(rows, dtype=torch.float64, device=x.device)
    if rows:
        chunks = triton.cdiv(vocab, CHUNK)
        part_best = torch.empty((rows, chunks), dtype=torch.float64, device=x.device)
        part_id = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
        keys = keys.contiguous() if noise else tokens  # any [rows] int64 without noise: its values go unused
        _gumbel_argmax_kernel[(rows, chunks)](
            x, keys, part_best, part_id, vocab, x.stride(0), chunks, _GOLDEN, _M1, _M2,
            NOISE=noise, CHUNK=CHUNK, BLOCK=BLOCK,
        )  # fmt: skip
        _combine_kernel[(rows,)](
            part_best, part_id, tokens, best, vocab, chunks, BLOCK_C=triton.next_power_of_2(chunks)
        )
    return tokens, best


def greedy_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest score of each row of ``x: [rows, V]`` fp32 (ties to the lowest id, NaN as -inf, token 0 for a
    row with nothing above -inf) and that score in fp64: ``sampler._argmax_lowest`` in one pass over the row
    (torch's takes four: the NaN guard, the max, the comparison, the minimum id)."""
    return gumbel_argmax(x, None)
