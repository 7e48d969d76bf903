"""Does attention written in Gluon (Triton's explicit Hopper dialect: warpgroup_mma, shared-memory descriptors) give
the invariant kernel's bits? The first step towards an FA3-style prefill kernel (docs/design.md, "Attention").

    python bench/gluon_probe.py    (a Hopper GPU)

One split (n <= 512 keys), 16 query tokens x the 4 query heads of KV head 0 = 64 rows, head_dim 128, TILE 64: the
same operations as ``kernel._attend_tile`` one for one, with each wgmma issued synchronously or asynchronously and
waited for at once, against ``_paged_attention_triton`` on the same values. Prints how many output values differ.
"""

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from lockstep.ops.attention.launch import _paged_attention_triton


@gluon.jit
def probe_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    n,
    pos0,
    qk_scale,
    ASYNC: gl.constexpr,
    BM: gl.constexpr,
    TILE: gl.constexpr,
    D: gl.constexpr,
    GROUP: gl.constexpr,
):
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    p_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    p_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(q_ptr + rows[:, None] * D + dims[None, :])
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16), q
    )
    k_smem = gl.allocate_shared_memory(
        gl.bfloat16, [TILE, D], gl.NVMMASharedLayout.get_default_for([TILE, D], gl.bfloat16)
    )
    v_smem = gl.allocate_shared_memory(
        gl.bfloat16, [TILE, D], gl.NVMMASharedLayout.get_default_for([TILE, D], gl.bfloat16)
    )
    ones = gl.full([TILE, 16], 1.0, gl.bfloat16, layout=blk)
    ones_smem = gl.allocate_shared_memory(
        gl.bfloat16, [TILE, 16], gl.NVMMASharedLayout.get_default_for([TILE, 16], gl.bfloat16), ones
    )
    rows_s = gl.arange(0, BM, layout=gl.SliceLayout(1, mma_s))
    pos = pos0 + rows_s // GROUP
    m = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
    den = gl.zeros([BM, 16], gl.float32, layout=mma_d)
    acc = gl.zeros([BM, D], gl.float32, layout=mma_o)
    for t in range(0, gl.cdiv(n, TILE)):
        offs = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, blk))
        ok = offs[:, None] < n
        k = gl.load(k_ptr + offs[:, None] * D + dims[None, :], mask=ok, other=0.0)
        v = gl.load(v_ptr + offs[:, None] * D + dims[None, :], mask=ok, other=0.0)
        k_smem.store(k)
        v_smem.store(v)
        fence_async_shared()
        s0 = gl.zeros([BM, TILE], gl.float32, layout=mma_s)
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s0, use_acc=False, is_async=ASYNC)
        if ASYNC:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = s * qk_scale
        offs_s = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, mma_s))
        s = gl.where(offs_s[None, :] <= pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.where(m == m_new, 1.0, gl.exp2(m - base))
        p = gl.exp2(s - base[:, None]).to(gl.bfloat16)
        a_d = gl.convert_layout(alpha, gl.SliceLayout(1, mma_d))
        a_o = gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))
        den = warpgroup_mma(gl.convert_layout(p, p_d), ones_smem, den * a_d[:, None], is_async=ASYNC)
        acc = warpgroup_mma(gl.convert_layout(p, p_o), v_smem, acc * a_o[:, None], is_async=ASYNC)
        if ASYNC:
            den, acc = warpgroup_mma_wait(num_outstanding=0, deps=(den, acc))
        m = m_new
    d1 = gl.convert_layout(gl.max(den, 1), gl.SliceLayout(1, mma_o))
    out = acc / gl.where(d1 == 0.0, 1.0, d1)[:, None]
    out = gl.where(out == 0.0, 0.0, out)
    rows_o = gl.arange(0, BM, layout=gl.SliceLayout(1, mma_o))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(o_ptr + rows_o[:, None] * D + cols_o[None, :], out.to(gl.bfloat16))


def main():
    torch.manual_seed(0)
    hq, hkv, d, page, T = 32, 8, 128, 16, 16
    for n in (64, 200, 500, 512):
        nb = triton.cdiv(n, page)
        k_cache = torch.randn(nb, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        ours = _paged_attention_triton(
            q,
            k_cache,
            v_cache,
            torch.arange(nb, device="cuda", dtype=torch.int32)[None],
            torch.tensor([n], device="cuda", dtype=torch.int32),
            torch.tensor([0, T], device="cuda", dtype=torch.int32),
            d**-0.5,
        )
        want = ours[:, :4].reshape(T * 4, d)
        qg = q[:, :4].contiguous()
        kg = k_cache[:, :, 0].reshape(-1, d)[:n].contiguous()
        vg = v_cache[:, :, 0].reshape(-1, d)[:n].contiguous()
        for asyn in (False, True):
            out = torch.empty(T * 4, d, device="cuda", dtype=torch.bfloat16)
            probe_kernel[(1,)](qg, kg, vg, out, n, n - T, d**-0.5 * math.log2(math.e), asyn, 64, 64, d, 4, num_warps=4)
            diff = (out != want).sum().item()
            worst = (out.float() - want.float()).abs().max().item()
            print(f"n {n} async {asyn}: {diff} of {out.numel()} values differ, max |d| {worst:.3g}", flush=True)


if __name__ == "__main__":
    main()
