"""The trainer's paged attention (lockstep.rl.attention): its gradient against float64 finite differences of
causal SDPA, over a paged cache laid out out of batch order."""

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
