"""``route``: the router's softmax and top k, ties broken by the lowest expert id, made explicit."""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS
from lockstep.ops.softmax import softmax


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [num_tokens, num_experts], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, num_experts={logits.shape[1]}], got {top_k}")
    if logits.dtype not in FLOATS:
        raise TypeError(f"router logits must be float32/bfloat16/float16, got {logits.dtype}")


def top_k_lowest_id(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest of each row of ``probs: [n, E]`` (fp32, non-negative), in descending order, equal
    values in ascending expert id. Returns ``(values fp32 [n, k], ids int64 [n, k])``.

    A non-negative fp32 orders like its bit pattern read as an integer, so ``bits << 32 | (E - 1 - id)`` is an
    int64 key with the same order whose ties are broken by the lowest id; keys are unique, so any top-k finds the
    same ones in the same order.
    """
    num_experts = probs.shape[1]
    ids = torch.arange(num_experts, device=probs.device, dtype=torch.int64)
    key = (probs.contiguous().view(torch.int32).to(torch.int64) << 32) | (num_experts - 1 - ids)
    top = torch.topk(key, top_k, dim=1).values  # [n, k], descending
    values = (top >> 32).to(torch.int32).view(torch.float32)
    return values, num_experts - 1 - (top & 0xFFFFFFFF)


def renormalize_in_order(weights: torch.Tensor) -> torch.Tensor:
    """``weights / weights.sum(-1)`` for ``weights: [n, k]`` fp32, the sum taken left to right."""
    total = weights[:, 0]
    for j in range(1, weights.shape[1]):
        total = total + weights[:, j]
    return weights / total[:, None]


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    # One token: softmax over its E logits in fp32, k rounds of "largest, lowest id among equals", the weights
    # summed left to right in rank order.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # -1: never chosen
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # The lowest id among the maxima (clamped so that NaN logits still give an id in range).
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), 0), E - 1)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        total += best
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / total
    mask = slots < TOP_K
    tl.store(w_ptr + t * TOP_K + slots, weights, mask=mask)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=mask)


def _route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((num_tokens, top_k), device=logits.device, dtype=torch.int64)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
        )  # fmt: skip
    return weights, ids


def _route_cpu(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = softmax(logits.float(), -1)  # [n, E] fp32
    weights, ids = top_k_lowest_id(probs, top_k)
    return (renormalize_in_order(weights) if renormalize else weights), ids


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits: [num_tokens, num_experts]`` -> ``(weights fp32 [n, k], ids int64 [n, k])``.

    Softmax in fp32, the top k by probability (ties to the lowest expert id), optionally renormalised to sum to
    one (left to right in rank order). Row by row: a token's routing never depends on the batch. CUDA runs one
    Triton program per token (one launch); the CPU ``ops.softmax`` and ``top_k_lowest_id``.
    """
    _check_logits(logits, top_k)
    if logits.is_cuda:
        return _route_triton(logits, top_k, renormalize)
    return _route_cpu(logits, top_k, renormalize)
