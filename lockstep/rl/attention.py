"""Paged attention a trainer can differentiate: the forward is ``ops.paged_attention`` (the engine's bits), the
backward a Triton kernel on CUDA, or each sequence's attention recomputed in fp32 with plain torch ops.

Gradients reach the new keys and values through the cache itself: ``layers.attention.torch_write_kv`` copies
``k, v`` into the cache with an in-place ``index_copy_`` (exact, and recorded by autograd), the attention
Function takes the caches as inputs and returns their gradient, and autograd routes the written slots' gradient
back to ``k`` and ``v``.
The trainer gives every micro-batch a fresh zeroed cache, so the caches are ordinary tensors in its graph.

On CUDA, bf16/fp16 batches of whole sequences (the trainer's: each sequence's queries are its own keys from
position 0) take ``ops.attention.backward`` (FlashAttention-2's backward without atomics, bf16 products and fp32
sums); anything else, and the CPU, takes the reference below. ``BACKWARD`` chooses: ``"auto"`` (that rule),
``"reference"`` or ``"triton"`` (also through Triton's interpreter, for the tests). On the H200 (docs/perf.md,
session 15) the Triton backward gives a 16k-token trainer step (Qwen3-8B shape, 4 layers) 1.02x transformers' time
against 1.39x with the reference, the same bits on a second run, and gradients as close to an fp32 backward's
(3.8e-3, 5.1e-3, 5.5e-3 of the largest dq, dk, dv) as the reference's.

The reference backward is deterministic run to run: per sequence, dense matmuls and a softmax over a fixed shape,
and the gradient of each cache slot is added in sequence order (gather, add, scatter), never with atomics. On CUDA the
recomputation's fp32 matmuls run on TF32 tensor cores (``BACKWARD_MATMUL_PRECISION``, torch's
``float32_matmul_precision``, process-wide for the duration of the backward): full-precision fp32 matmuls run on
the CUDA cores, about 7x below TF32's rate on an H100/H200; at the Qwen3-8B shape with 1k-token sequences the
recomputation is ~0.8 TFLOP a layer, and session 11's profile put this backward at 134 of 363 ms of GPU time in a
4-layer, 16k-token step (``bench/hf_trainer.py --components`` times it with and without TF32). TF32 keeps a
10-bit mantissa in the products (FlashAttention's bf16 backward keeps 7) with fp32 sums; cuBLAS's TF32 GEMMs are
as deterministic as its fp32 ones; the forward, and so the logprobs, are untouched.
"""

from contextlib import contextmanager

import torch

from lockstep import ops
from lockstep.layers.batch import AttentionMetadata
from lockstep.ops._common import interpreting
from lockstep.ops.attention.backward import causal_attention_backward

# torch's float32_matmul_precision inside the backward's recomputation on CUDA ("high": TF32; "highest": fp32).
BACKWARD_MATMUL_PRECISION = "high"
# "auto" (ops.attention.backward on CUDA, the reference elsewhere), "reference" (per sequence, recomputed in fp32
# with torch ops) or "triton" (ops.attention.backward wherever Triton runs, the interpreter included); see above.
BACKWARD = "auto"


@contextmanager
def _matmul_precision(device: torch.device):
    if device.type != "cuda":  # the CPU's matmuls stay fp32
        yield
        return
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(BACKWARD_MATMUL_PRECISION)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [q_len, Hq, D], k/v: [seq_len, Hkv, D] -> [q_len, Hq, D]; q token j sits at position seq_len - q_len + j.
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, seq_len, D]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale  # [Hq, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(p, vh).transpose(0, 1)


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float):
        out = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        ctx.fused = _takes_triton(q)
        extra = (out,) if ctx.fused else ()  # the fused backward's delta = rowsum(dO * O) reads the output
        ctx.save_for_backward(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *extra)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # once: a checkpointed layer's saved tensors unpack once
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = saved[:6]
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        if ctx.fused and all(b - a == n for a, b, n in zip(starts, starts[1:], lens, strict=False)):  # whole seqs
            return _fused_backward(saved, ctx.scale, grad_out, lens)
        page = k_cache.shape[1]
        k_flat = k_cache.reshape(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
        v_flat = v_cache.reshape(-1, *v_cache.shape[2:])
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        grad_k = torch.zeros_like(k_flat, dtype=torch.float32)
        grad_v = torch.zeros_like(v_flat, dtype=torch.float32)
        with _matmul_precision(q.device):
            for i, seq_len in enumerate(lens):
                q0, q1 = starts[i], starts[i + 1]
                if q1 == q0:
                    continue
                pos = torch.arange(seq_len, device=q.device)
                slots = block_tables[i].long()[pos // page] * page + pos % page  # [seq_len]
                with torch.enable_grad():
                    qi = q[q0:q1].float().requires_grad_()
                    ki = k_flat[slots].float().requires_grad_()
                    vi = v_flat[slots].float().requires_grad_()
                    out = _reference(qi, ki, vi, ctx.scale)
                    dq, dk, dv = torch.autograd.grad(out, (qi, ki, vi), grad_out[q0:q1].float())
                grad_q[q0:q1] = dq
                grad_k[slots] = grad_k[slots] + dk
                grad_v[slots] = grad_v[slots] + dv
        grad_k = grad_k.view(k_cache.shape).to(k_cache.dtype)
        grad_v = grad_v.view(v_cache.shape).to(v_cache.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


def _takes_triton(q: torch.Tensor) -> bool:
    if BACKWARD not in ("auto", "reference", "triton"):
        raise ValueError(f'rl.attention.BACKWARD must be "auto", "reference" or "triton", got {BACKWARD!r}')
    gpu = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if BACKWARD == "auto":
        return gpu
    return BACKWARD == "triton" and (gpu or interpreting())


def _fused_backward(saved: tuple, scale: float, grad_out: torch.Tensor, lens: list[int]):
    """``ops.attention.backward`` on the whole sequences' K and V gathered from the cache; the caches' gradients
    are those rows scattered back to their slots (each slot holds one token)."""
    q, k_cache, v_cache, block_tables, _, query_start_loc, out = saved
    page = k_cache.shape[1]
    lens_t = torch.tensor(lens, device=q.device)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens_t)  # [total]
    pos = torch.arange(q.shape[0], device=q.device) - query_start_loc[:-1].long()[seq]
    slots = block_tables[seq, pos // page].long() * page + pos % page  # [total]
    k_flat = k_cache.reshape(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
    v_flat = v_cache.reshape(-1, *v_cache.shape[2:])
    dq, dk, dv = causal_attention_backward(
        q.contiguous(), k_flat[slots], v_flat[slots], out, grad_out.contiguous(), query_start_loc.tolist(), scale
    )
    grad_k = torch.zeros_like(k_flat).index_copy_(0, slots, dk).view(k_cache.shape)
    grad_v = torch.zeros_like(v_flat).index_copy_(0, slots, dv).view(v_cache.shape)
    return dq, grad_k, grad_v, None, None, None, None


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``ops.paged_attention`` with autograd into ``q`` and the caches (the ``Kernels.attention`` signature)."""
    return _PagedAttention.apply(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale)
