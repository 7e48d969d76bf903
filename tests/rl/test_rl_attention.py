"""The trainer's paged attention (lockstep.rl.attention): its gradient against float64 finite differences of
causal SDPA, over a paged cache laid out out of batch order."""

import pytest
import torch
import torch.nn.functional as F
from gradients import check_directional, randn

from lockstep.layers.batch import AttentionMetadata
from lockstep.layers.torch_kernels import torch_write_kv
from lockstep.rl import attention


def test_paged_attention_grad():
    # Two sequences (70 > one 64-position tile, and 5), GQA 4 q / 2 kv heads, head_dim 8, pages of 4.
    lens, hq, hkv, d, page = [70, 5], 4, 2, 8, 4
    n = sum(lens)
    q, k, v = randn(n, hq, d), randn(n, hkv, d, seed=2), randn(n, hkv, d, seed=3)
    blocks = [-(-s // page) for s in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    tables[0, : blocks[0]] = torch.arange(blocks[0]) + blocks[1]  # not in order of the flattened batch
    tables[1, : blocks[1]] = torch.arange(blocks[1])
    slots = torch.cat([tables[i, torch.arange(s) // page].long() * page + torch.arange(s) % page
                       for i, s in enumerate(lens)])  # fmt: skip
    starts = torch.tensor([0, lens[0], n], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5

    def lockstep_attn(q, k, v):
        caches = [(torch.zeros(sum(blocks), page, hkv, d), torch.zeros(sum(blocks), page, hkv, d))]
        meta = AttentionMetadata(slots, tables, seq_lens, starts, caches)
        torch_write_kv(k, v, *caches[0], slots)
        return attention.paged_attention(q, *caches[0], meta, scale)

    def ref(q, k, v):
        outs = []
        for i in range(len(lens)):
            s = slice(int(starts[i]), int(starts[i + 1]))
            qi, ki, vi = (t[s].transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                       scale=scale, enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
        return torch.cat(outs)

    check_directional(lockstep_attn, ref, [q, k, v])


def _packed_case(lens, hq, hkv, d, page, dtype=torch.float32):
    """q/k/v of packed sequences written through a paged cache whose pages are out of batch order."""
    n = sum(lens)
    q, k, v = (randn(n, h, d, seed=s).to(dtype) for h, s in ((hq, 1), (hkv, 2), (hkv, 3)))
    blocks = [-(-s // page) for s in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for i in reversed(range(len(lens))):  # the last sequence's pages first
        tables[i, : blocks[i]] = torch.arange(blocks[i]) + first
        first += blocks[i]
    slots = torch.cat([tables[i, torch.arange(s) // page].long() * page + torch.arange(s) % page
                       for i, s in enumerate(lens)])  # fmt: skip
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    meta = (slots, tables, torch.tensor(lens, dtype=torch.int32), starts, sum(blocks))
    return q, k, v, meta


def _grads(q, k, v, meta, page, grad, checkpointed: bool = False):
    slots, tables, seq_lens, starts, num_blocks = meta
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    shape = (num_blocks, page, k.shape[1], k.shape[2])

    def attend(q, k, v):
        caches = (k.new_zeros(shape), v.new_zeros(shape))
        torch_write_kv(k, v, *caches, slots)
        meta = AttentionMetadata(slots, tables, seq_lens, starts, [caches])
        return attention.paged_attention(q, *caches, meta, q.shape[-1] ** -0.5)

    if checkpointed:  # saved tensors unpack once there
        out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
    else:
        out = attend(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (8, 2, 80)])  # 80: a head_dim padded to the kernel's 128
def test_triton_backward_matches_the_reference(monkeypatch, hq, hkv, d):
    """BACKWARD = "triton" (ops.attention.backward, through Triton's interpreter here): the same forward bits, the
    reference's gradients to fp32 rounding, the same bits run to run and under gradient checkpointing; it really runs
    (calls counted)."""
    import lockstep.rl.attention as module

    lens, page = [70, 1, 17, 64], 16
    q, k, v, meta = _packed_case(lens, hq, hkv, d, page)
    grad = randn(q.shape[0], hq, d, seed=9)
    ref = _grads(q, k, v, meta, page, grad)
    calls = []
    real = module.causal_attention_backward
    monkeypatch.setattr(module, "causal_attention_backward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(module, "BACKWARD", "triton")
    fused = _grads(q, k, v, meta, page, grad)
    again = _grads(q, k, v, meta, page, grad, checkpointed=True)  # and under gradient checkpointing
    assert len(calls) == 2
    assert torch.equal(fused[0], ref[0])  # the forward is the engine's either way
    for name, a, b, c in zip(("dq", "dk", "dv"), fused[1:], ref[1:], again[1:], strict=True):
        assert torch.equal(a, c), name
        assert b.abs().max() > 0.1, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=name)


def test_triton_backward_bf16_close_to_float64():
    """The kernel in bf16 (the interpreter computes its dots in fp32 after rounding the operands, as the GPU's
    bf16 products are exact in fp32) against float64 autograd: within bf16's rounding of P and dS."""
    from lockstep.ops.attention.backward import causal_attention_backward

    hq, hkv, d = 4, 1, 32
    cu = [0, 33, 35, 85]  # sequences of 33, 2 and 50 tokens
    q, k, v = (randn(85, h, d, seed=s).to(torch.bfloat16) for h, s in ((hq, 4), (hkv, 5), (hkv, 6)))
    grad = randn(85, hq, d, seed=7).to(torch.bfloat16)
    want, outs = [], []
    for a, b in zip(cu, cu[1:], strict=False):
        qi, ki, vi = (t[a:b].double().requires_grad_() for t in (q, k, v))
        o = attention._reference(qi, ki, vi, d**-0.5)
        want.append(torch.autograd.grad(o, (qi, ki, vi), grad[a:b].double()))
        outs.append(o.detach())
    got = causal_attention_backward(q, k, v, torch.cat(outs).to(torch.bfloat16), grad, cu, d**-0.5)
    for i, name in enumerate(("dq", "dk", "dv")):
        ref = torch.cat([w[i] for w in want])
        assert got[i].dtype == torch.bfloat16
        err = float((got[i].double() - ref).abs().max() / ref.abs().max())
        assert err < 1.5e-2, (name, err)  # 6e-3 here; bf16's rounding of the outputs alone is up to 4e-3


def test_backward_choice(monkeypatch):
    """BACKWARD "auto" takes the Triton backward on CUDA only (here, on the CPU, the reference); an unknown name is an
    error that names the setting."""
    q = torch.zeros(3, 2, 16)
    assert not attention._takes_triton(q)  # auto on the CPU
    monkeypatch.setattr(attention, "BACKWARD", "reference")
    assert not attention._takes_triton(q)
    monkeypatch.setattr(attention, "BACKWARD", "flash")
    with pytest.raises(ValueError, match="BACKWARD must be"):
        attention._takes_triton(q)
