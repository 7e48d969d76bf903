"""The kernels of the sets that do not keep the contract (``layers.kernels``): ``default`` (fast, what
``batch_invariant=False`` runs) and ``torch`` (torch's own ops only, differentiable: the usual trainer). Their
reduction order follows the batch: they are the negative control and the speed baseline; nothing here is part of
the invariance contract. Only the kernel-set registry and the RL trainer import this module.

``torch_paged_attention`` gathers K/V out of the paged cache into dense padded tensors and calls
``F.scaled_dot_product_attention`` once for all the step's decodes and once per group of same-shape chunks.
``fast_paged_attention`` is what a non-deterministic engine runs on CUDA: a paged kernel (lockstep's own, with no
gather) whose KV split size follows the batch's real work in eager decode steps (``split_for_batch``).

Mixture of experts: ``torch_moe_route`` is Hugging Face's routing (``torch.topk``, whose tie order is not
documented); ``torch_moe_experts`` loops over the experts with ``F.linear``; ``fast_moe_experts`` is what a fused-MoE
engine runs on CUDA: lockstep's grouped matmul, with the k outputs of a token added through ``index_add_`` in the
sorted order (atomics on CUDA: the order follows the batch and the run). It needs no host sync, so a decode step
on it can be captured in a CUDA graph.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockstep import ops
from lockstep.layers.batch import HOST_MAX_QUERY_LEN, HOST_SEQ_LENS, AttentionMetadata
from lockstep.ops import fp8, fp8_tree, gated, moe
from lockstep.ops._common import num_sms
from lockstep.ops.attention import fa4
from lockstep.ops.attention.kv_cache import FP8_KV, _bytes, cache_values
from lockstep.ops.attention.launch import _paged_attention_triton
from lockstep.ops.attention.tiling import SPLIT, TILE
from lockstep.ops.moe.grouped_mm import _grouped_mm


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's fused ``F.rms_norm`` with HF's rounding: normalize in fp32, round to the input dtype, then scale.

    With ``residual`` it returns ``(rms_norm(x + residual), x + residual)``, the sum taken in the input dtype.
    """
    if residual is not None:
        x = x + residual
    out = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return out if residual is None else (out, x)


def fast_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``default`` set's RMSNorm: on CUDA one launch with the residual add fused, a program per row (lockstep's
    kernel; vLLM's ``fused_add_rms_norm`` is the same shape of kernel), where ``torch_rms_norm`` takes five; torch's
    on the CPU."""
    if x.is_cuda:
        return ops.rms_norm(x, weight, eps, residual)
    return torch_rms_norm(x, weight, eps, residual)


def fast_rms_norm_qk(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q and k norms for the ``default`` set: one launch for both on CUDA, as ``fast_rms_norm``."""
    if q.is_cuda:
        return ops.rms_norm_qk(q, k, q_weight, k_weight, eps)
    return torch_rms_norm(q, q_weight, eps), torch_rms_norm(k, k_weight, eps)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``: torch's own call on the CPU (batch-dependent there); on CUDA the one-pass kernel with
    torch's bits (``ops.gated``), the fusion the invariant set has too."""
    if gate_up.is_cuda:
        return gated.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``F.log_softmax`` over the last dim, in fp32."""
    return F.log_softmax(x.float(), dim=-1)


def torch_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``k, v: [num_tokens, num_kv_heads, head_dim]`` into the caches at ``slot_mapping``."""
    # k_cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_slots, num_kv_heads, head_dim]
    slots = slot_mapping.long()
    for x, cache in ((k, k_cache), (v, v_cache)):  # an FP8 cache as ops.write_kv stores it (bytes: no e4m3 index ops)
        _bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, _bytes(cache_values(x, cache.dtype)))


# Bytes of dense K + V one SDPA call of the torch path gathers at most (sequences x the longest of their caches
# x kv_heads x head_dim x 2), unless one sequence alone needs more. On CUDA it keeps the copy for a big decode
# batch small next to the cache and the activation reserve (512 MiB: 2^17 positions of 8 KV heads x 128 in bf16).
# On the CPU, where the copy and SDPA are memory-bound, groups that stay near the cache were 2-3x faster than
# one call for 64 decodes of ~300 keys (2 cores; 32 MiB: 4096 positions of 8 x 128 in fp32).
MAX_GATHER_BYTES = {"cpu": 32 << 20, "cuda": 512 << 20}


@dataclass(frozen=True)
class SdpaGroup:
    """Sequences of one step that the torch path attends in one batched SDPA call.

    Either decodes (one query token each: ``q_len == 1``, ``kv_len`` the longest cache, ``key_mask`` hiding the
    padding of shorter ones) or chunks with the same ``(q_len, kv_len)`` (no padding); consecutive in batch order,
    with at most ``MAX_GATHER_BYTES`` of padded K/V unless one sequence alone has more.

    Attributes:
        rows: the group's query tokens in the flattened batch, sequence-major (a slice when they are contiguous).
        slots: ``[num_seqs * kv_len]`` int64, the cache slot of each key position, sequence-major; past a
            sequence's end it repeats the slot of its last key, which ``key_mask`` hides (so no unwritten slot is
            ever read: 0 * NaN would still poison the output).
        key_mask: ``[num_seqs, 1, 1, kv_len]`` bool, True where a key exists; None when every key does.
    """

    rows: slice | torch.Tensor
    slots: torch.Tensor
    key_mask: torch.Tensor | None
    num_seqs: int
    q_len: int
    kv_len: int


def sdpa_groups(attn: AttentionMetadata, k_cache: torch.Tensor) -> list[SdpaGroup]:
    """The torch path's batching of ``attn`` over caches shaped like ``k_cache``: the decodes, then the chunks
    grouped by shape, both in batch order and split where a group would gather more than ``MAX_GATHER_BYTES``.

    Built once per step (on the first layer's call) and kept in ``attn.scratch``; every layer reuses it.
    """
    key = ("sdpa_groups", tuple(k_cache.shape[1:]), k_cache.dtype, k_cache.device.type)
    if key in attn.scratch:
        return attn.scratch[key]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    cap = MAX_GATHER_BYTES.get(k_cache.device.type, MAX_GATHER_BYTES["cuda"])
    max_keys = cap // (2 * num_kv_heads * head_dim * k_cache.element_size())
    lens, starts = attn.host_lengths()
    decodes: list[int] = []
    chunks: dict[tuple[int, int], list[int]] = {}  # (q_len, kv_len) -> sequences, in batch order
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            chunks.setdefault((q_len, seq_len), []).append(i)
    runs = [(1, run) for run in _split(decodes, lens, max_keys)]
    runs += [(q_len, run) for (q_len, _), seqs in chunks.items() for run in _split(seqs, lens, max_keys)]
    groups = [_group(attn, run, q_len, block_size) for q_len, run in runs]
    attn.scratch[key] = groups
    return groups


def _split(seqs: list[int], lens: list[int], max_keys: int) -> list[list[int]]:
    """``seqs`` cut into consecutive runs of at most ``max_keys`` padded key positions (or one sequence)."""
    runs: list[list[int]] = []
    run: list[int] = []
    longest = 0
    for i in seqs:
        if run and (len(run) + 1) * max(longest, lens[i]) > max_keys:
            runs.append(run)
            run, longest = [], 0
        run.append(i)
        longest = max(longest, lens[i])
    return runs + [run] if run else runs


def _group(attn: AttentionMetadata, seqs: list[int], q_len: int, block_size: int) -> SdpaGroup:
    lens, starts = attn.host_lengths()
    kv_lens = [lens[i] for i in seqs]
    kv_len = max(kv_lens)
    device = attn.seq_lens.device
    if seqs == list(range(seqs[0], seqs[-1] + 1)):
        # Consecutive sequences of equal q_len own consecutive tokens.
        index: slice | torch.Tensor = slice(seqs[0], seqs[-1] + 1)
        rows: slice | torch.Tensor = slice(starts[seqs[0]], starts[seqs[-1]] + q_len)
    else:
        index = torch.tensor(seqs, device=device)
        rows = torch.tensor([t for i in seqs for t in range(starts[i], starts[i] + q_len)], device=device)
    seq_lens = attn.seq_lens[index].long()  # [B]
    tables = attn.block_tables[index].long()  # [B, max_blocks]
    pos = torch.arange(kv_len, device=device)
    last = seq_lens[:, None] - 1
    clamped = torch.minimum(pos[None, :], last)  # [B, kv_len]
    slots = tables.gather(1, clamped // block_size) * block_size + clamped % block_size
    slots = slots.flatten()
    key_mask = None if min(kv_lens) == kv_len else (pos[None, :] <= last)[:, None, None, :]
    return SdpaGroup(rows, slots, key_mask, len(seqs), q_len, kv_len)


def torch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of ``q: [num_tokens, num_q_heads, head_dim]`` over the paged cache with torch's SDPA:
    one call for the decodes, one per group of same-shape chunks, each split only past ``MAX_GATHER_BYTES``
    (``sdpa_groups``). Returns the same shape.

    Each group gathers its K/V out of the cache into a dense ``[B, kv_heads, kv_len, head_dim]`` with one index.
    Decodes fold the query heads of a KV head into that head's query rows, so the call needs no GQA support and
    can take a fused kernel with the key-padding mask (FlashAttention takes no mask, and on CUDA the
    memory-efficient kernel and on the CPU the flash kernel take no GQA). Chunks use a lower-right causal bias:
    a chunk's queries are the last ``q_len`` positions of ``kv_len``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, kv_heads, head_dim]
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    groups = sdpa_groups(attn, k_cache)
    if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(0, num_tokens):
        return _attend(q, k_slots, v_slots, groups[0], scale)  # one group holds every token: no copy
    out = torch.empty_like(q)  # sequences with no new tokens own no rows; every other row is written
    for g in groups:
        out[g.rows] = _attend(q[g.rows], k_slots, v_slots, g, scale)
    return out


def _gather(slots: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The cache rows at ``index``; an FP8 cache's as bytes, then read exactly in q's dtype.
    if slots.dtype == FP8_KV:
        return slots.view(torch.uint8).index_select(0, index).view(FP8_KV).to(dtype)
    return slots.index_select(0, index)


def _attend(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, g: SdpaGroup, scale: float) -> torch.Tensor:
    """One group's SDPA call. ``q: [B * q_len, heads, head_dim]`` (the group's rows); ``k_slots, v_slots:
    [num_slots, kv_heads, head_dim]``, the caches by slot. Returns ``[B * q_len, heads, head_dim]``."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[1]
    # k, v: [B, kv_heads, kv_len, head_dim]
    k = _gather(k_slots, g.slots, q.dtype).view(g.num_seqs, g.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_slots, g.slots, q.dtype).view(g.num_seqs, g.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    if g.q_len == 1:
        # [B, kv_heads, group, head_dim]: q head h reads kv head h // group, as with enable_gqa.
        q = q.reshape(g.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask, scale=scale)
    else:
        # Imported here: torch.nn.attention.bias imports torch._dynamo (about 2 s), which the invariant path and
        # the CLI never need.
        from torch.nn.attention.bias import causal_lower_right

        q = q.reshape(g.num_seqs, g.q_len, num_heads, head_dim).transpose(1, 2)  # [B, heads, q_len, head_dim]
        causal = causal_lower_right(g.q_len, g.kv_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True).transpose(1, 2)
    return out.reshape(-1, num_heads, head_dim)


# The fast mode's decode split (``split_for_batch``): splits of SPLIT (the invariant set's) or of 2x, 4x, 8x that,
# only where every resident program still walks at least FILL_WAVES splits of the step's real work. Decode keeps
# at most 2 programs per SM (registers: launch.py), hence RESIDENT_PER_SM.
RESIDENT_PER_SM = 2
FILL_WAVES = 8
MAX_FAST_SPLIT = 8 * SPLIT
# From this many (row, KV head) programs per SM up, a decode step does not split its rows at all (graphs) or takes
# MAX_FAST_SPLIT (eager; one split variant rather than one per width). On the H200 (bench/attention_check.py --only
# fastmode, session 13) batch 64 x 8 KV heads (3.9 programs per SM) read 3.75-4.37 TB/s with whole rows against
# 3.34-3.79 with splits of SPLIT, at 1k-32k contexts; batch 16 (0.97 per SM) needed the splits.
WHOLE_ROWS_PER_SM = 3


def split_for_batch(seq_lens: list[int] | None, num_kv_heads: int, num_sms: int) -> int:
    """The KV split size of the fast mode's decode step: SPLIT (the invariant set's; on the H200 splits of 256 and
    128 were no faster at batch 1, 4k context and slower everywhere else, 1.05-1.9x at batch 1-64 and 4k-32k,
    docs/perf.md 2026-11-29) times the largest power of two up to ``MAX_FAST_SPLIT // SPLIT`` whose splits still
    give every resident program (``RESIDENT_PER_SM`` per SM) ``FILL_WAVES`` of them:
    ``num_kv_heads * sum(seq_lens) / S >= FILL_WAVES * RESIDENT_PER_SM * num_sms``. Larger splits only cut the
    partials and the merge; they never leave the GPU short of programs, nor one long row's few long splits running
    after the rest (the bound uses the whole batch's positions, not its longest row's).

    ``seq_lens``: the step's context lengths as the host knows them (an eager step), or None (a CUDA graph: captured
    once for every context up to max_model_len, it takes SPLIT). The old rule divided the block table's width into
    ``2 * num_sms / (num_seqs * num_kv_heads)`` splits: a graph's table is max_model_len wide, so batch 16 under
    Qwen3's 40,960 positions took splits of 16,384, one program per (row, KV head) walking all of an 8k row, 128
    programs on 132 SMs (47.1 ms a step against the invariant set's 11.66, issue 27)."""
    if not seq_lens:
        return SPLIT
    work = num_kv_heads * sum(seq_lens)  # positions x KV heads: what the step's programs read between them
    wanted = FILL_WAVES * RESIDENT_PER_SM * num_sms
    split = SPLIT
    while 2 * split <= MAX_FAST_SPLIT and work >= wanted * 2 * split:
        split *= 2
    return split


def fast_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The ``default`` set's attention: on CUDA, steps with a prefill chunk through FlashAttention-4 where it is
    installed (``ops.attention.fa4``: the kernel other engines run; its sm_90 forward has no split-KV, so decode
    steps stay with lockstep's kernel), everything else through lockstep's paged kernel straight over the cache, a
    decode step's split size chosen from the batch (``split_for_batch``; from host-side lengths and shapes only, with
    no host sync, so CUDA graphs can capture it); on the CPU ``torch_paged_attention``."""
    if not q.is_cuda:
        return torch_paged_attention(q, k_cache, v_cache, attn, scale)
    if takes_fa4(q, k_cache, attn):
        return fa4.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                   attn.scratch[HOST_MAX_QUERY_LEN], scale)  # fmt: skip
    return batch_split_attention(q, k_cache, v_cache, attn, scale, num_sms(q.device))


def takes_fa4(q: torch.Tensor, k_cache: torch.Tensor, attn: AttentionMetadata) -> bool:
    """Whether the fast set runs this step's attention through FlashAttention-4: an eager step (its metadata carries
    the host's longest query) with a prefill chunk (a query of more than one token), and FA4 usable here."""
    max_query_len = attn.scratch.get(HOST_MAX_QUERY_LEN)
    return max_query_len is not None and max_query_len > 1 and fa4.usable(q, k_cache)


def batch_split_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, num_sms: int
) -> torch.Tensor:
    # Steps with a prefill keep the kernel's own split, as FlashAttention does not split a prefill's keys: a split
    # that followed their sequence count compiled a kernel variant (its split is a constexpr) for each new count
    # in the middle of serving (5 in a 256 x 1k/1k run on the H200), which the decode graphs' warm-up cannot
    # foresee.
    if q.shape[0] != attn.num_seqs:
        return _paged_attention_triton(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale
        )
    seq_lens = attn.scratch.get(HOST_SEQ_LENS)
    if attn.num_seqs * k_cache.shape[2] >= WHOLE_ROWS_PER_SM * num_sms:
        tiles = -(-attn.block_tables.shape[1] * k_cache.shape[1] // TILE)  # the table's width, in tiles
        split = MAX_FAST_SPLIT if seq_lens else TILE * (1 << (tiles - 1).bit_length())
    else:
        split = split_for_batch(seq_lens, k_cache.shape[2], num_sms)
    return _paged_attention_triton(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale, split=split
    )


def fast_fp8_linear(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_group: int | None = fp8.GROUP_K,
) -> torch.Tensor:
    """An FP8 layer as vLLM runs online FP8 by default: one dynamic activation scale for the whole batch (the max of
    ``|x|`` over every row, per tensor), the per-channel weight scales, and ``torch._scaled_mm`` (cuBLASLt) on CUDA
    (``ops.fp8.scaled_mm``'s CPU path elsewhere). A row's e4m3 values follow its neighbours through the shared
    scale, so its bits follow its batch: the fast set's FP8 negative control. ``act_group`` is not used (the scale
    is the batch's); block-scaled layers take ``ops.fp8.fp8_linear``."""
    if w_scale.shape[1] != 1:
        return fp8.fp8_linear(x, w8, w_scale, bias, act_group)
    x2 = x.reshape(-1, x.shape[-1])
    batch_amax = x2.abs().amax().float().expand(x2.shape[0], 1)  # [M, 1]: the batch's max on every row
    a8, a_scale = fp8_tree.activation_scales(x2, None, batch_amax)  # per-token quantization's formulas
    if x.is_cuda:
        out = torch._scaled_mm(a8, w8.t(), scale_a=a_scale, scale_b=w_scale.float().view(1, -1), out_dtype=x.dtype)
        out = out if bias is None else out + bias
    else:
        out = fp8.scaled_mm(a8, a_scale, w8, w_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], w8.shape[0])


def torch_moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's routing: fp32 softmax, ``torch.topk``, optional renormalisation by ``sum``.
    ``logits: [n, E]`` -> ``(weights fp32 [n, k], ids int64 [n, k])``; differentiable in the weights."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def torch_moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts in plain torch (``ops.moe.experts_reference``): differentiable, host-syncing."""
    return moe.experts_reference(x, w13, w2, weights, ids)


def fast_moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The ``default`` set's experts: on CUDA the grouped matmul with the outputs summed by ``index_add_`` in the
    sorted order (float atomics), on the CPU ``torch_moe_experts``."""
    if not x.is_cuda:
        return torch_moe_experts(x, w13, w2, weights, ids)
    return sorted_order_moe_experts(x, w13, w2, weights, ids)


def sorted_order_moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """lockstep's grouped expert matmuls, combined the way fused-MoE kernels do: each sorted row, scaled by its
    weight, added into its token's fp32 sum in sorted order (``index_add_``: atomics on CUDA). A token's k terms
    then arrive in expert order, or in whatever order the GPU runs them: not rank order."""
    num_experts, two_i, hidden = w13.shape
    plan = moe.plan_routing(ids, num_experts)
    num_pairs = plan.order.numel()
    cfg1 = moe.moe_config(num_pairs, num_experts, two_i // 2, hidden, x.dtype)
    cfg2 = moe.moe_config(num_pairs, num_experts, hidden, two_i // 2, x.dtype)
    act = _grouped_mm(x, plan.tokens, w13, plan, cfg1, silu_mul=True)
    y = _grouped_mm(act, None, w2, plan, cfg2, silu_mul=False)  # [P, H], sorted rows
    scaled = y.float() * weights.float().reshape(-1)[plan.order][:, None]
    out = torch.zeros((x.shape[0], hidden), device=x.device, dtype=torch.float32)
    return out.index_add_(0, plan.tokens, scaled).to(x.dtype)


def torch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` over the last dim in ``x``'s dtype, as Hugging Face's ``nn.LayerNorm`` runs it (torch
    accumulates in fp32 inside and rounds once)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def torch_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu``: ``"none"`` the exact erf form, ``"tanh"`` the tanh approximation."""
    return F.gelu(x, approximate=approximate)


def _segment_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[s], cu[s + 1]) for s in range(len(cu) - 1)]


def torch_vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment, one ``F.scaled_dot_product_attention`` call per segment (what
    Hugging Face's vision towers run with SDPA); differentiable. ``q, k, v: [total, heads, head_dim]``,
    ``cu_seqlens: [num_segments + 1]``; returns ``[total, heads, head_dim]``."""
    outs = []
    for start, end in _segment_bounds(cu_seqlens):
        if end > start:
            # [1, heads, L, head_dim]: four dimensions with unit last stride, or CUDA's SDPA takes its math path
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs) if outs else torch.empty_like(q)


def fast_vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The ``default`` set's vision attention: segments of one length (images of one size) batched into one SDPA
    call, so a batch of same-size images is one launch. Same arguments and result as ``torch_vision_attention``."""
    bounds = _segment_bounds(cu_seqlens)
    by_len: dict[int, list[int]] = {}
    for start, end in bounds:
        if end > start:
            by_len.setdefault(end - start, []).append(start)
    if len(by_len) == len([b for b in bounds if b[1] > b[0]]):
        return torch_vision_attention(q, k, v, cu_seqlens, scale)  # every length once: nothing to batch
    out = torch.empty_like(q)
    for length, starts in by_len.items():
        rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        # [B, heads, L, head_dim]
        qs, ks, vs = (t[rows].view(len(starts), length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
        out[rows] = o.reshape(-1, *q.shape[1:])
    return out
