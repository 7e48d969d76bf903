"""Trainer-side token logprobs that equal, bit for bit, the ``.token_logprobs`` the engine sampled with.

The engine's logprob of completion token ``i`` is ``ops.log_softmax(lm_head(h))[token]`` where ``h`` is the
final hidden state at position ``len(prompt) + i - 1``: by the engine's contract that hidden state has the same
bits whether the position came in a prefill, a chunk, a decode step or after a prefix hit, and every row op
after it (the head's matmul, log_softmax) is batch-invariant. So the trainer runs the same model code over
each micro-batch as one flattened prefill into a fresh paged KV cache, applies the head to the rows that
predict completion tokens and takes the same log_softmax: the same bits, with autograd, for any micro-batch
size or packing.

A vision-language policy takes image prompts (``lockstep.rl.images``): the micro-batch's images go through the
same vision tower in one call, their features replace the image tokens' embeddings, and the rows take the
prompt's M-RoPE positions, as in the engine.
"""

from collections.abc import Sequence

import torch

from lockstep.engine.multimodal import MultimodalInputs
from lockstep.layers.batch import AttentionMetadata, flatten_batch
from lockstep.models.llama import LlamaForCausalLM
from lockstep.rl.images import Prompt, image_batch, prompt_inputs

__all__ = ["micro_batches", "token_logprobs"]


def micro_batches(
    lengths: Sequence[int], micro_batch_size: int | None = None, max_num_tokens: int | None = None
) -> list[list[int]]:
    """Split sequences (given by their token counts) into micro-batches of indices, in order.

    A micro-batch holds at most ``micro_batch_size`` sequences and at most ``max_num_tokens`` tokens (a longer
    sequence goes alone). Both None: one micro-batch.
    """
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_num_tokens is not None and max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        full = (micro_batch_size is not None and len(current) >= micro_batch_size) or (
            max_num_tokens is not None and current and tokens + n > max_num_tokens
        )
        if full:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        batches.append(current)
    return batches


def _pack(
    model: LlamaForCausalLM, seqs: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One flattened prefill of ``seqs`` over a fresh, zeroed paged cache that holds exactly them, laid out by the
    engine's own ``flatten_batch``."""
    tables: list[range] = []
    next_block = 0
    for tokens in seqs:
        num_blocks = -(-len(tokens) // block_size)
        tables.append(range(next_block, next_block + num_blocks))
        next_block += num_blocks
    flat = flatten_batch(zip(seqs, [0] * len(seqs), tables, strict=True), block_size)
    return flat.to(model.device, model.allocate_kv_cache(next_block, block_size))


def _micro_batch_logprobs(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    completions: list[list[int]],
    inputs: list[MultimodalInputs | None],
    block_size: int,
) -> list[torch.Tensor]:
    # The last completion token is only predicted, never fed: sequence i runs prompt + completion[:-1].
    seqs = [list(p) + list(c[:-1]) for p, c in zip(prompts, completions, strict=True)]
    input_ids, positions, attn = _pack(model, seqs, block_size)
    if any(mm is not None for mm in inputs):
        positions, mm = image_batch(model, seqs, inputs, positions)
        hidden = model.model(input_ids, positions, attn, mm)  # [num_tokens, hidden_size], autograd on
    else:
        hidden = model.model(input_ids, positions, attn)
    rows: list[int] = []
    offset = 0
    for p, s in zip(prompts, seqs, strict=True):
        rows += range(offset + len(p) - 1, offset + len(s))
        offset += len(s)
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.int64, device=model.device)
    logits = model.lm_head(hidden[torch.tensor(rows, device=model.device)])  # [num_completion_tokens, vocab] fp32
    logprobs = model.kernels.log_softmax(logits)  # TRAINABLE's: the engine's with autograd
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    return list(chosen.split([len(c) for c in completions]))


def token_logprobs(
    model: LlamaForCausalLM,
    prompt_token_ids: Sequence[Prompt],
    completion_token_ids: Sequence[Sequence[int]],
    *,
    micro_batch_size: int | None = None,
    max_num_tokens: int | None = None,
    block_size: int = 16,
) -> list[torch.Tensor]:
    """Per-token logprobs of each completion given its prompt, with autograd.

    Returns one fp32 tensor ``[len(completion)]`` per sequence, in input order. On a policy from
    ``load_policy`` (or ``make_trainable``) the values equal bit for bit the ``RequestOutput.token_logprobs`` an
    invariant engine with the same weights, dtype and device returned for those tokens, whatever the micro-batch
    size or packing. The sequences run in micro-batches of at most ``micro_batch_size`` sequences and
    ``max_num_tokens`` tokens (see ``micro_batches``); the graph of every micro-batch is kept until the caller's
    backward, so for gradient accumulation call this once per micro-batch of ``micro_batches``' indices.

    A prompt is a token-id list, or for a vision-language policy an image prompt: ``LLM.generate``'s dict in
    token-id form (``{"prompt_token_ids": ids, "multi_modal_data": {"image": ...}}``; the placeholders one
    ``<|image_pad|>`` per image or already expanded, as ``RequestOutput.prompt_token_ids`` holds them) or
    ``(prompt_token_ids, MultimodalInputs)`` as the engine processed it (``lockstep.rl.images``). Text and image
    prompts may share a micro-batch.
    """
    parsed = [prompt_inputs(model, i, p) for i, p in enumerate(prompt_token_ids)]
    prompts = [ids for ids, _ in parsed]
    inputs = [mm for _, mm in parsed]
    completions = [list(c) for c in completion_token_ids]
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    vocab = model.config.vocab_size
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if not p or not c:
            raise ValueError(f"sequence {i}: the prompt and the completion must each hold at least one token")
        if len(p) + len(c) - 1 > model.max_model_len:
            raise ValueError(f"sequence {i}: {len(p) + len(c) - 1} tokens exceed max_model_len={model.max_model_len}")
        bad = [t for t in p + c if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sequence {i}: {bad[0]!r} is not a token id in [0, {vocab})")
    out: list[torch.Tensor | None] = [None] * len(prompts)
    lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, completions, strict=True)]
    for idx in micro_batches(lengths, micro_batch_size, max_num_tokens):
        lps = _micro_batch_logprobs(
            model, [prompts[i] for i in idx], [completions[i] for i in idx], [inputs[i] for i in idx], block_size
        )
        for i, lp in zip(idx, lps, strict=True):
            out[i] = lp
    return out
