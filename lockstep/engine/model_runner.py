"""Runs the model on one scheduled batch: flattens it, runs one forward over the paged KV cache, samples.

The runner owns the model and the KV caches. ``run(batch)`` turns the batch's entries, in order, into one
flattened batch of tokens with its ``AttentionMetadata``, computes logits only for the last token of each entry
that samples, and returns one token id and ``TokenLogprobs`` per such entry. For requests that asked for prompt
logprobs it also puts the logits of their prompt positions through the same head and log_softmax
(``batch.prompt_logprobs``): the values a decode step would report for those tokens, whatever the chunking.
"""

import dataclasses
from collections.abc import Iterable, Mapping

import torch

from lockstep.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from lockstep.engine.cuda_graph import DecodeGraphs
from lockstep.engine.scheduler import ScheduledBatch
from lockstep.engine.sequence import Sequence
from lockstep.layers.attention import flatten_batch
from lockstep.layers.sampler import Sampled, Sampler, TokenLogprobs, gather_logprobs
from lockstep.models.loader import load_model
from lockstep.structured.grammar import token_masks

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without num_kv_blocks, the CPU cache gets this much memory (at least one full-length sequence's worth).
CPU_KV_CACHE_BYTES = 512 << 20
# On CUDA, memory kept back for activations of the largest step besides the weights and the cache.
CUDA_ACTIVATION_RESERVE_BYTES = 2 << 30
# Prompt-logprob rows through the LM head at once: a few [rows, vocab] fp32/int64 temporaries (~80 MB each at
# 128 x 151936). Rows are independent, so how they are grouped does not change their bits.
PROMPT_LOGPROB_ROWS = 128


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    """The model, its KV cache and the sampler, for one ``EngineConfig``.

    ``config.model`` must be a checkpoint folder. After construction ``self.config`` has ``max_model_len``,
    ``num_kv_blocks`` and ``max_num_batched_tokens`` filled in (from the model, from memory and from the device
    when they were None).
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            raise ValueError("ModelRunner needs config.model, a checkpoint folder")
        self.device = resolve_device(config.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model = load_model(
            config.model,
            dtype=dtype,
            device=self.device,
            kernels=config.kernels,
            max_model_len=config.max_model_len,
        )
        limit = self.model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {limit} positions")
        max_model_len = self.model.max_model_len
        if config.max_model_len is None and config.num_kv_blocks is not None:
            # A cache given explicitly caps the context (a sequence's last token needs no KV slot).
            max_model_len = min(max_model_len, config.num_kv_blocks * config.block_size + 1)
        budget = config.max_num_batched_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device.type], config.max_num_seqs)
        config = dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=budget)
        num_kv_blocks = config.num_kv_blocks or self._default_num_kv_blocks(config)
        self.config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks)
        self.block_size = config.block_size
        self.kv_caches = self.model.allocate_kv_cache(num_kv_blocks, config.block_size)
        self.sampler = Sampler(self.model.kernels.log_softmax)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.model.kernels.capturable:
            max_blocks = -(-self.config.max_model_len // config.block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, max_blocks)
            self.graphs.capture()
        self.use_graphs = self.graphs is not None  # bench/engine.py turns them off to compare

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _default_num_kv_blocks(self, config: EngineConfig) -> int:
        per_block = self.model.kv_cache_bytes_per_block(config.block_size)
        one_seq = -(-config.max_model_len // config.block_size)
        # Never more than every sequence slot at full length could use.
        most = one_seq * config.max_num_seqs
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * config.gpu_memory_utilization) - CUDA_ACTIVATION_RESERVE_BYTES
        else:
            budget = CPU_KV_CACHE_BYTES
        return max(one_seq, min(most, budget // per_block))

    @torch.inference_mode()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy checkpoint tensors (Hugging Face names, any dtype/device) into the model; returns the names loaded.

        Raises ValueError for an unknown name or a wrong shape before anything is copied.
        """
        slots = self.model.checkpoint_tensors()
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        tied = self.model.config.tie_word_embeddings
        todo = []
        for name, tensor in items:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
                continue
            dest = slots.get(name)
            if dest is None:
                raise ValueError(f"load_weights: unexpected tensor {name!r} for a {self.model.config.architecture}")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"load_weights: {name!r} has shape {list(tensor.shape)}, expected {list(dest.shape)}")
            todo.append((name, dest, tensor))
        for _, dest, tensor in todo:
            dest.copy_(tensor.detach())
        return [name for name, _, _ in todo]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> Sampled:
        """Run one step: a token and its logprobs for each entry that samples, in batch order (``Sampled.errors``
        names the entries, counted among those that sample, that could not be sampled)."""
        if not batch:
            return Sampled([], [])
        flat = flatten_batch(((e.token_ids, e.start, e.seq.block_table) for e in batch.entries), self.block_size)
        if self.use_graphs and self.graphs.can_run(flat):
            hidden = self.graphs.run(flat)
        else:
            hidden = self.model(*flat.to(self.device, self.kv_caches))  # [num_tokens, hidden_size]
        self._prompt_logprobs(batch, flat.query_start_loc, hidden)
        samplers = [(e, flat.query_start_loc[i + 1] - 1) for i, e in enumerate(batch.entries) if e.sample]
        if not samplers:
            return Sampled([], [])
        rows = torch.tensor([row for _, row in samplers], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        params = [e.seq.params for e, _ in samplers]
        histories = [(e.seq.token_ids, e.seq.num_prompt_tokens) for e, _ in samplers]
        return self.sampler.sample(logits, params, [e.end for e, _ in samplers], histories, self._masks(samplers))

    def _masks(self, samplers: list) -> tuple[list[int], torch.Tensor] | None:
        """The tokens each structured-output row may choose, from its grammar state and its own output tokens (EOS
        only where it could end the request: not under ``ignore_eos``)."""
        rows = [k for k, (e, _) in enumerate(samplers) if e.seq.grammar is not None]
        if not rows:
            return None
        seqs = [samplers[k][0].seq for k in rows]
        states = [(s.grammar, s.output_token_ids, not s.params.ignore_eos) for s in seqs]
        return rows, token_masks(states, self.vocab_size, self.device)

    def _prompt_logprobs(self, batch: ScheduledBatch, query_start_loc: list[int], hidden: torch.Tensor) -> None:
        """Prompt token ``p + 1``'s logprobs from position ``p``'s hidden state, for every prompt position this
        step computed that a request asking for them has not had yet; appended to ``batch.prompt_logprobs``.
        The head and log_softmax are the sampler's, so a prompt token gets the bits a decode step would give it."""
        rows: list[int] = []  # rows of hidden
        targets: list[int] = []
        nums: list[int] = []
        owners: list[tuple[Sequence, int]] = []  # (sequence, how many of the rows are its)
        for i, e in enumerate(batch.entries):
            seq = e.seq
            if seq.params.prompt_logprobs is None:
                continue
            first = max(e.start, len(seq.computed_prompt_logprobs))
            last = min(e.end, seq.num_prompt_tokens - 1)  # the last prompt position predicts an output token
            if first >= last:
                continue
            if e.start > len(seq.computed_prompt_logprobs):
                raise RuntimeError(f"prompt logprobs of {seq.request_id!r}: positions before {e.start} were skipped")
            rows += range(query_start_loc[i] + first - e.start, query_start_loc[i] + last - e.start)
            targets += seq.token_ids[first + 1 : last + 1]
            nums += [seq.params.prompt_logprobs] * (last - first)
            owners.append((seq, last - first))
        if not rows:
            return
        results: list[TokenLogprobs] = []
        for j in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            index = torch.tensor(rows[j : j + PROMPT_LOGPROB_ROWS], device=self.device)
            logprobs = self.sampler.log_softmax(self.model.compute_logits(hidden[index]).float())
            target = torch.tensor(targets[j : j + PROMPT_LOGPROB_ROWS], dtype=torch.int64, device=self.device)
            results += gather_logprobs(logprobs, target, nums[j : j + PROMPT_LOGPROB_ROWS])[1]
        k = 0
        for seq, count in owners:
            batch.prompt_logprobs.append((seq, results[k : k + count]))
            k += count
