"""The default kernel set's attention on a GPU: FlashAttention-2 (vendored in torch) over the paged cache.

    python bench/default_attention.py      # H200; needs CUDA

Checks ``flash_paged_attention`` against an fp32 reference on a batch mixing decodes, a chunk after cached
tokens and a fresh prefill, at page 256; reports whether FA2 takes a page of 16 too; then times decode (one
query per sequence, 32 q / 8 kv heads, head_dim 128, bf16) for FA2 at page 256 and lockstep's invariant kernel
at pages 16 and 256, in CUDA graphs.
"""

import torch
from triton.testing import do_bench_cudagraph

from lockstep.layers.attention import AttentionMetadata, flash_paged_attention, torch_paged_attention
from lockstep.ops import paged_attention

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5


def metadata(q_lens, kv_lens, page, device, seed=0):
    """Block tables over a shuffled pool of pages; returns (attn, num_blocks)."""
    need = [-(-n // page) for n in kv_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at : at + n])
        at += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device), block_tables=tables.to(device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device), query_start_loc=starts.to(device),
        kv_caches=[],
    )  # fmt: skip
    return attn, sum(need)


def check_values(device):
    q_lens, kv_lens = [1, 1, 300, 1000, 1], [5000, 17, 700, 1000, 33000]
    attn, nblk = metadata(q_lens, kv_lens, 256, device)
    k = torch.randn(nblk, 256, HKV, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), HQ, D, device=device, dtype=torch.bfloat16)
    got = flash_paged_attention(q, k, v, attn, SCALE).float()
    ref = torch_paged_attention(q.float(), k.float(), v.float(), attn, SCALE)
    err = (got - ref).abs().max().item()
    print(f"values: FA2 paged (page 256) vs fp32 reference, mixed batch: max |diff| {err:.2e}", flush=True)
    assert err < 2e-2, err
    attn16, nblk16 = metadata([1], [100], 16, device)
    k16 = torch.randn(nblk16, 16, HKV, D, device=device, dtype=torch.bfloat16)
    try:
        torch.ops.aten._flash_attention_forward(
            q[:1], k16, k16, attn16.query_start_loc, attn16.query_start_loc, 1, 100, 0.0, True, False,
            scale=SCALE, seqused_k=attn16.seq_lens, block_table=attn16.block_tables,
        )  # fmt: skip
        print("page 16: FA2 accepts it")
    except RuntimeError as e:
        print(f"page 16: FA2 refuses it: {str(e).splitlines()[0]}")


def us(fn):
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the default stream
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def bench_decode(device):
    print("\ndecode: us per call (TB/s reading K+V)")
    print(f"  {'B':>3} {'ctx':>6} | {'lockstep p16':>16} {'lockstep p256':>16} {'FA2 p256':>16}")
    for ctx in (4096, 32768):
        for b in (1, 8, 64):
            q = torch.randn(b, HQ, D, device=device, dtype=torch.bfloat16)
            cells = []
            gbytes = 2 * b * ctx * HKV * D * 2 / 1e9
            for page, fn in ((16, "lockstep"), (256, "lockstep"), (256, "fa2")):
                attn, nblk = metadata([1] * b, [ctx] * b, page, device)
                k = torch.randn(nblk, page, HKV, D, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                if fn == "fa2":
                    attn.host_lengths()  # the engine copies lengths to the host once per step, outside the graph
                    t = us(lambda q=q, k=k, v=v, attn=attn: flash_paged_attention(q, k, v, attn, SCALE))
                else:
                    t = us(lambda q=q, k=k, v=v, attn=attn: paged_attention(
                        q, k, v, attn.block_tables, attn.seq_lens, attn.query_start_loc, SCALE))  # fmt: skip
                cells.append(f"{t:8.1f} ({gbytes / t * 1e3:4.2f})")
                del k, v
            print(f"  {b:3d} {ctx:6d} | " + " ".join(f"{c:>16}" for c in cells), flush=True)


def main():
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    check_values(device)
    bench_decode(device)


if __name__ == "__main__":
    main()
