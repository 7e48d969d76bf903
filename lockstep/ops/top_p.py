"""Top-p (nucleus) cuts for many rows at once, each row's cut a function of that row alone.

``top_p_mask(x, top_ps)`` sets to -inf the tokens of each row of scaled logits ``x: [rows, V]`` outside the
smallest head of its sorted distribution whose mass reaches ``top_p`` (a token is kept when the mass strictly
before it is below top_p; at least one token; ties at the cut kept). It is the sampler's top-p on CUDA, where one
row at a time meant a sort, a cumsum and a host sync per row: hundreds a step under a chat model's default
``top_p``.

Why a row's cut does not depend on the other rows: the softmax is ``ops.softmax`` (row-invariant); sorting is
exact (a permutation of the row's values); the scan over the sorted row is one Triton program per row, whose
additions follow a fixed procedure (blocks of ``BLOCK`` in order; within a block Triton's cumsum and sum, whose
order the compiled kernel fixes), so the grid's size cannot reach them; the kept count is an integer sum, and the
cut is the kept head's last value. torch's own cumsum is not used: its algorithm may change with the number of
rows (a single row can take a device-wide scan).
"""

import torch
import triton
import triton.language as tl

from lockstep.ops.softmax import softmax

BLOCK = 1024


@triton.jit
def _top_p_cut_kernel(sorted_ptr, top_p_ptr, cut_ptr, vocab, stride, BLOCK: tl.constexpr):
    # One row: count the tokens whose preceding mass is below top_p, then read the last kept value.
    row = tl.program_id(0)
    base = sorted_ptr + row.to(tl.int64) * stride
    limit = tl.load(top_p_ptr + row)
    running = tl.zeros([], tl.float32)
    kept = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < vocab
        p = tl.load(base + offs, mask=ok, other=0.0)
        before = running + (tl.cumsum(p, 0) - p)
        kept += tl.sum((ok & (before < limit)).to(tl.int32), 0)
        running += tl.sum(p, 0)
    kept = tl.maximum(kept, 1)
    tl.store(cut_ptr + row, tl.load(base + kept - 1))


def top_p_cuts(sorted_probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Each row's cut: ``sorted_probs: [rows, V]`` fp32, descending; ``top_ps: [rows]`` fp32 (above 1: keep all)
    -> ``[rows]`` fp32, the smallest probability kept. Triton (the CPU runs it through the interpreter)."""
    rows, vocab = sorted_probs.shape
    sorted_probs = sorted_probs.contiguous()
    cuts = torch.empty(rows, dtype=torch.float32, device=sorted_probs.device)
    if rows:
        _top_p_cut_kernel[(rows,)](sorted_probs, top_ps.contiguous(), cuts, vocab, sorted_probs.stride(0), BLOCK=BLOCK)
    return cuts


def top_p_mask(x: torch.Tensor, top_ps: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
    """``x: [rows, V]`` fp32 scaled logits, ``top_ps: [rows]`` fp32 (a row at 1 or above is left as it is) -> ``x``
    with each row's tokens outside its top-p head set to -inf. ``head: [rows, k]`` int64: each row's k largest
    tokens of ``x`` (what top-k found), every token above -inf among them but ties at the cut; then only their k
    probabilities need sorting (the values a vocab-wide ``topk(probs, k)`` gives, found without one). The others'
    probabilities are 0, or equal to the k-th, and cannot move a cut."""
    probs = softmax(x)
    if head is not None:
        sorted_probs = probs.gather(1, head).sort(dim=-1, descending=True).values
    else:
        sorted_probs = probs.sort(dim=-1, descending=True, stable=True).values
    limits = torch.where(top_ps < 1.0, top_ps, torch.full_like(top_ps, float("inf")))
    return x.masked_fill(probs < top_p_cuts(sorted_probs, limits)[:, None], float("-inf"))
