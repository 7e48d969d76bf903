"""Runs the model on one scheduled batch: flattens it, runs one forward over the paged KV cache, samples.

The runner owns the model and the KV caches. ``run(batch)`` turns the batch's entries, in order, into one
flattened batch of tokens with its ``AttentionMetadata``, computes logits only for the last token of each entry
that samples, and returns one token id and ``TokenLogprobs`` per such entry. For requests that asked for prompt
logprobs it also puts the logits of their prompt positions through the same head and log_softmax
(``batch.prompt_logprobs``): the values a decode step would report for those tokens, whatever the chunking.

Under tensor parallelism every rank has a runner over its shard of the model and a KV cache of the same number of
blocks. Rank 0's runner (the engine's) plans each step as a ``ForwardStep`` (the flattened batch, whose KV slots
the driver's block manager chose, and the rows that go through the LM head), sends it to the other ranks on the
``ControlChannel`` and runs it like them; the other ranks' runners ``serve`` those steps. Only rank 0 samples.
"""

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from lockstep.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, resolve_device
from lockstep.distributed import ControlChannel, TPGroup
from lockstep.engine.block_tables import DeviceBlockTables, TableUpdate
from lockstep.engine.cuda_graph import DecodeGraphs, graph_rows
from lockstep.engine.encoder_cache import EncoderCache
from lockstep.engine.scheduler import ScheduledBatch, ScheduledSeq
from lockstep.engine.sequence import Sequence
from lockstep.engine.sleep import SleepState
from lockstep.engine.token_feed import FedRows, TokenFeed
from lockstep.layers.batch import FlatBatch, flatten_batch
from lockstep.layers.sampler import PendingSample, Sampled, Sampler, TokenLogprobs, device_tensor, gather_logprobs
from lockstep.models.loader import load_model
from lockstep.models.quantization import checkpoint_slots, conform, load_full_precision
from lockstep.structured.grammar import token_masks, token_masks_ahead

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without num_kv_blocks, the CPU cache gets this much memory (at least one full-length sequence's worth).
CPU_KV_CACHE_BYTES = 512 << 20
# On CUDA, memory kept back for activations of the largest step besides the weights and the cache.
CUDA_ACTIVATION_RESERVE_BYTES = 2 << 30
# Prompt-logprob rows through the LM head at once: a few [rows, vocab] fp32/int64 temporaries (~80 MB each at
# 128 x 151936). Rows are independent, so how they are grouped does not change their bits.
PROMPT_LOGPROB_ROWS = 128


# What rank 0 asks the other ranks to do: the first element of each control message.
STEP, WEIGHTS, STOP, SLEEP, WAKE, JOIN_WEIGHT_GROUP, GROUP_WEIGHTS = 1, 2, 3, 4, 5, 6, 7
# Block-table widths are multiples of this many columns. Triton compiles a kernel again for an integer argument
# newly equal to 1 or divisible by 16, and a table's row stride is one: with widths following the longest
# sequence, serving met table shapes the start-up warm-up had not (compiles while serving, 2026-12-01). Columns
# past a sequence's length are never read, so the bits do not change.
TABLE_COLUMNS = 16


def rank_device(device: str | None, rank: int, size: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` of ``size``: ``cuda:(i + rank)`` from ``cuda:i`` (or
    ``cuda``), the CPU for every rank of a CPU engine."""
    base = resolve_device(device)
    if base.type != "cuda" or size == 1:
        return base
    return torch.device("cuda", (base.index or 0) + rank)


@dataclass
class ForwardStep:
    """One forward, as every rank runs it: the flattened batch (without block tables), what it does to the block
    tables each rank keeps on its device, the groups of its hidden rows that go through the LM head (one
    ``compute_logits`` call each, in order: the collectives inside must line up on every rank), and whether a
    decode step may replay a CUDA graph. ``fed`` (async scheduling): the input rows that take the previous step's
    sampled tokens, ``(rows, sample indices, number of samples)``; rank 0 broadcasts those samples on the model's
    group right after the message (``ModelRunner.launch``)."""

    flat: FlatBatch
    tables: TableUpdate
    logit_rows: list[list[int]]
    use_graphs: bool
    fed: tuple[list[int], list[int], int] | None = None
    # A vision-language step with image rows: ``(positions [3, num_tokens], MultimodalBatch)`` on the device.
    # Under tensor parallelism the message holds only the number of image rows (``mm_rows``); rank 0, which runs
    # the vision tower, broadcasts the tensors after it (``ModelRunner.launch``, ``_receive_mm``).
    mm: tuple[torch.Tensor, object] | None = None
    mm_rows: int = -1  # image rows of ``mm`` (-1: none), what the message carries

    def encode(self) -> torch.Tensor:
        """The control message: ``[STEP, num_tokens, num_seqs, num_table_entries, use_graphs, num_fed,
        num_samples, mm_rows, num_groups, *group_sizes]``, then the flat batch's lists, the table update's, the
        fed rows' and the groups, concatenated."""
        f, t = self.flat, self.tables
        dst, src, num_samples = self.fed if self.fed is not None else ([], [], 0)
        mm_rows = -1 if self.mm is None else int(self.mm[1].rows.shape[0])
        header = [STEP, f.num_tokens, len(f.seq_lens), len(t.rows), int(self.use_graphs), len(dst), num_samples]
        header += [mm_rows, len(self.logit_rows)] + [len(rows) for rows in self.logit_rows]
        rows = [r for group in self.logit_rows for r in group]
        values = header + f.input_ids + f.positions + f.slot_mapping + f.seq_lens + f.query_start_loc
        values += t.picks + t.rows + t.cols + t.values + dst + src + rows
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def decode(cls, message: torch.Tensor) -> "ForwardStep":
        values = message.tolist()
        op, num_tokens, num_seqs, num_entries, use_graphs, num_fed, num_samples, mm_rows, num_groups = values[:9]
        if op != STEP:
            raise ValueError(f"not a step message (op {op})")
        sizes = values[9 : 9 + num_groups]
        at = 9 + num_groups

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n : at]

        input_ids, positions, slot_mapping = take(num_tokens), take(num_tokens), take(num_tokens)
        seq_lens, query_start_loc = take(num_seqs), take(num_seqs + 1)
        tables = TableUpdate(take(num_seqs), take(num_entries), take(num_entries), take(num_entries))
        fed = (take(num_fed), take(num_fed), num_samples) if num_fed else None
        logit_rows = [take(n) for n in sizes]
        if at != len(values):
            raise ValueError(f"a step message of {len(values)} values holds {at}")
        flat = FlatBatch(input_ids, positions, slot_mapping, [], seq_lens, query_start_loc)
        return cls(flat, tables, logit_rows, bool(use_graphs), fed, mm_rows=mm_rows)


class ModelRunner:
    """The model, its KV cache and the sampler, for one ``EngineConfig``.

    ``config.model`` must be a checkpoint folder. After construction ``self.config`` has ``max_model_len``,
    ``num_kv_blocks`` and ``max_num_batched_tokens`` filled in (from the model, from memory and from the device
    when they were None).

    Under tensor parallelism (``tp`` of ``config.tensor_parallel_size`` ranks, ``channel`` to reach them) every
    rank builds its runner with the same config at the same time: the constructor agrees on the number of KV blocks
    and captures the CUDA graphs collectively. ``device`` is this rank's (default: ``rank_device``).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TPGroup | None = None,
        channel: ControlChannel | None = None,
        device: torch.device | None = None,
    ) -> None:
        if config.model is None:
            raise ValueError("ModelRunner needs config.model, a checkpoint folder")
        self.tp = tp or TPGroup()
        if self.tp.size != config.tensor_parallel_size or (self.tp.size > 1) != (channel is not None):
            raise ValueError(
                f"a runner of tensor_parallel_size={config.tensor_parallel_size} needs a group of that size and, "
                f"past one rank, a control channel (got size {self.tp.size})"
            )
        self.channel = channel
        self.device = device if device is not None else rank_device(config.device, self.tp.rank, self.tp.size)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model = load_model(
            config.model,
            dtype=dtype,
            device=self.device,
            kernels=config.kernels,
            max_model_len=config.max_model_len,
            tp=self.tp,
            tp_invariant=config.tp_invariant,
            load_format=config.load_format,
            quantization=config.quantization,
        )
        self.is_multimodal = bool(getattr(self.model, "is_multimodal", False))
        self.encoder_cache = EncoderCache()  # the scheduler decides what it holds (engine/encoder_cache.py)
        if config.kv_cache_dtype != "auto":  # "fp8": e4m3 caches (ops.attention: written saturated, read exactly)
            self.model.kv_cache_dtype = torch.float8_e4m3fn
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
        if channel is not None:  # ranks may have different free memory: the block ids must mean the same on all
            num_kv_blocks = channel.min(num_kv_blocks)
        self.config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks)
        self.block_size = config.block_size
        self.kv_caches = self.model.allocate_kv_cache(num_kv_blocks, config.block_size)
        self.sampler = Sampler(self.model.kernels.log_softmax, self.model.kernels.log_softmax_at)
        max_blocks = _table_width(-(-self.config.max_model_len // config.block_size))
        # Twice the rows a step can use, so a row is taken back only every max_num_seqs new sequences or so.
        self.block_tables = DeviceBlockTables(2 * config.max_num_seqs, max_blocks, self.device)
        self._keep_aux_hidden()  # before the graphs capture the forward
        self.graphs: DecodeGraphs | None = None
        self._capture_graphs()
        self.use_graphs = self.graphs is not None  # bench/engine.py turns them off to compare
        # Sleep mode (engine/sleep.py) and the trainer's weight-update group (engine/weight_updates.py).
        self.sleep_state = SleepState(self.model, self.kv_caches, self.device) if config.enable_sleep_mode else None
        self.weight_group = None

    def _capture_graphs(self) -> None:
        config = self.config
        if self.device.type == "cuda" and not config.enforce_eager and self.model.kernels.capturable:
            # Under TP every rank captures its own graphs, the model's collectives (NCCL) inside them, in the
            # same bucket order, so the captured collectives pair up when rank 0's step replays a bucket.
            max_blocks = self.block_tables.table.shape[1]
            spec = config.speculative_config
            rows = graph_rows(config.max_num_seqs, spec.num_speculative_tokens if spec else 0,
                              config.max_num_batched_tokens)  # fmt: skip
            self.graphs = DecodeGraphs(self.model, self.kv_caches, rows, max_blocks)
            self.graphs.capture()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _keep_aux_hidden(self) -> None:
        """With an EAGLE-3 drafter, rank 0's model keeps the streams its head reads (``LlamaModel.aux_layers``)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "eagle3" or self.tp.rank != 0:
            return
        if self.is_multimodal:
            raise ValueError("speculative_config: EAGLE-3 drafting for a vision-language target is not supported")
        from lockstep.models.eagle3 import read_eagle3_config
        from lockstep.models.hub import resolve_model

        aux = read_eagle3_config(resolve_model(spec.model), self.model.config).aux_layers
        self.model.language_model.aux_layers = aux

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        """EAGLE-3: the last forward's aux hidden states ``[num_tokens, 3 * hidden]``, in the step's token order
        (valid until the next forward); None when no drafter asked for them."""
        lm = self.model.language_model
        return lm.aux_hidden if lm.aux_layers else None

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
        """Copy checkpoint tensors (Hugging Face names, any dtype/device; a transformers 5 MoE's fused expert
        tensors too) into the model; returns the names loaded (the per-expert names for fused tensors).

        Raises ValueError for an unknown name or a wrong shape before anything is copied. Under tensor parallelism
        the tensors are whole checkpoint tensors: rank 0 broadcasts each one and every rank keeps its slice.
        """
        todo = self._plan_weights(weights.items() if isinstance(weights, Mapping) else weights)
        if self.channel is not None:
            self.channel.send(torch.tensor([WEIGHTS]))
            wire = [(name, list(tensor.shape), str(self._wire_dtype(dest, tensor))) for name, dest, tensor, _ in todo]
            self.channel.send_object(wire)
        for name, dest, tensor, shard in todo:
            self._copy_weight(name, dest, tensor.detach().to(self.device, self._wire_dtype(dest, tensor)), shard)
        return [name for name, _, _, _ in todo]

    def _plan_weights(
        self, items: Iterable[tuple[str, torch.Tensor]], slots: tuple[dict, dict] | None = None
    ) -> list[tuple]:
        """``(name, destination, tensor, shard)`` for each released checkpoint tensor to copy (tied heads and rotary
        buffers dropped), an FP8 layer's scales before its weight (a full-precision weight into a checkpoint's FP8
        layer quantizes with them); ValueError for an unknown name or a wrong shape. Meta tensors check an announced
        update. ``slots``: ``_weight_slots()``, when the caller plans several batches of one update."""
        slots, shards = slots or self._weight_slots()
        fp8 = getattr(self.model, "fp8_scheme", None) is not None
        tied = self.model.config.tie_word_embeddings
        todo = []
        for name, tensor in self.model.released_names(items):
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
                continue
            dest = slots.get(name)
            if dest is None:
                raise ValueError(f"load_weights: unexpected tensor {name!r} for a {self.model.config.architecture}")
            expected = list(dest.shape)
            shard = shards.get(name)
            if shard is not None:
                expected[shard.dim] = shard.full
            tensor = conform(name, tensor) if fp8 else tensor
            if list(tensor.shape) != expected:
                raise ValueError(f"load_weights: {name!r} has shape {list(tensor.shape)}, expected {expected}")
            todo.append((name, dest, tensor, shard))
        todo.sort(key=lambda item: item[0].endswith(".weight"))
        return todo

    def _weight_slots(self) -> tuple[dict, dict]:
        """``load_weights``' destinations and shards: the model's checkpoint views (those taken before sleeping,
        while asleep: engine/sleep.py), with an FP8 checkpoint's scale names and shapes."""
        state = self.sleep_state
        asleep = state is not None and state.slots is not None
        slots = state.slots if asleep else self.model.checkpoint_tensors()
        shards = state.shards if asleep and state.shards is not None else self.model.checkpoint_shards()
        self._raw_slots = (slots, shards)  # an FP8 layer's own weight_scale slots, for _copy_weight
        scheme = getattr(self.model, "fp8_scheme", None)
        if scheme is not None and not scheme.online:
            slots, shards = checkpoint_slots(slots, scheme, set(), shards)
        return slots, shards

    def _wire_dtype(self, dest, tensor: torch.Tensor) -> torch.dtype:
        # A full-precision weight bound for an FP8 layer travels in the model's dtype and is quantized on arrival.
        if dest.dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
            return self.model.dtype
        return dest.dtype

    def _copy_weight(self, name: str, dest, full: torch.Tensor, shard, broadcast: bool = True) -> None:
        if self.tp.size > 1 and broadcast:
            self.tp.broadcast(full.contiguous())
        if self.sleep_state is not None:
            self.sleep_state.materialize(name)  # a weight loaded while asleep gets its memory back first
        if dest.dtype == torch.float8_e4m3fn and full.dtype != torch.float8_e4m3fn:
            # quantization.load_full_precision: this part's row scales are the model's own weight_scale slot
            scale_name = name.removesuffix(".weight") + ".weight_scale"
            raw, raw_shards = self._raw_slots
            scale, scale_shard = raw[scale_name], raw_shards.get(scale_name)
            load_full_precision(dest, full, shard, scale, scale_shard, self.model.fp8_scheme)
            return
        dest.copy_(full if shard is None else full[shard.index()])

    @torch.inference_mode()
    def _receive_weights(self) -> None:
        """Ranks > 0: rank 0's ``load_weights``."""
        slots, shards = self._weight_slots()
        for name, shape, dtype in self.channel.recv_object():
            full = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
            self._copy_weight(name, slots[name], full, shards.get(name))

    # -- weight updates from a trainer's group (engine/weight_updates.py) ------------------------------------------

    def join_weight_group(self, init_info: dict) -> None:
        """Every rank joins the trainer's weight-update group as rank ``rank_offset + tp.rank`` (blocks until the
        trainer and every rank have joined). ValueError for bad ``init_info``, before any rank joins."""
        from lockstep.engine.weight_updates import parse_init_info

        parse_init_info(init_info, self.tp.size)
        if self.channel is not None and self.tp.rank == 0:
            self.channel.send(torch.tensor([JOIN_WEIGHT_GROUP]))
            self.channel.send_object(init_info)
        self._join_weight_group(init_info)

    def _join_weight_group(self, init_info: dict) -> None:
        from lockstep.distributed.weight_group import WeightGroup
        from lockstep.engine.weight_updates import parse_init_info

        info = parse_init_info(init_info, self.tp.size)
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        rank = info.rank_offset + self.tp.rank
        self.weight_group = WeightGroup.join(info.master_address, info.master_port, rank, info.world_size, self.device)

    def update_weights(self, update_info: dict) -> list[str]:
        """Receive one update from the trainer over the weight group (every rank, bucket by bucket) into the model;
        returns the names loaded. ValueError for an unknown name or shape, before any rank receives a byte."""
        from lockstep.engine.weight_updates import parse_update_info

        if self.weight_group is None:
            raise RuntimeError("update_weights: no weight-update group; call init_weight_transfer_engine first")
        specs, _ = parse_update_info(update_info)
        with torch.inference_mode():
            meta = [(s.name, torch.empty(s.shape, dtype=s.dtype, device="meta")) for s in specs]
            names = [name for name, _, _, _ in self._plan_weights(meta)]
        if self.channel is not None:
            self.channel.send(torch.tensor([GROUP_WEIGHTS]))
            self.channel.send_object(update_info)
        self._receive_group_weights(update_info)
        return names

    @torch.inference_mode()
    def _receive_group_weights(self, update_info: dict) -> None:
        from lockstep.distributed.weight_group import buckets, unpack
        from lockstep.engine.weight_updates import parse_update_info

        specs, bucket_bytes = parse_update_info(update_info)
        plan = buckets(specs, bucket_bytes)
        buffer = torch.empty(max((b.nbytes for b in plan), default=0), dtype=torch.uint8, device=self.device)
        slots = self._weight_slots()  # once for the whole update, not per bucket
        for bucket in plan:
            self.weight_group.broadcast(buffer[: bucket.nbytes])
            # An FP8 checkpoint layer's scales come before its weight within a bucket; the trainer keeps a layer's
            # weight and scales in one bucket, or sends the scales first (each bucket is applied as it arrives).
            for name, dest, tensor, shard in self._plan_weights(unpack(bucket, buffer), slots):
                self._copy_weight(name, dest, tensor.to(self._wire_dtype(dest, tensor)), shard, broadcast=False)
        del buffer

    # -- sleep mode (engine/sleep.py) ------------------------------------------------------------------------------

    def _sleeping(self) -> SleepState:
        if self.sleep_state is None:
            raise RuntimeError("sleep mode is off: LLM(enable_sleep_mode=True), lockstep serve --enable-sleep-mode")
        return self.sleep_state

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache and, at level 2, its weights (level 1 offloads them to the host)."""
        state = self._sleeping()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if state.is_sleeping:
            raise RuntimeError(f"the engine is already sleeping (level {state.level})")
        if self.channel is not None and self.tp.rank == 0:
            self.channel.send(torch.tensor([SLEEP]))
            self.channel.send_object(level)
        self.release_graphs()  # they hold the old addresses; captured again at wake-up
        state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Every rank takes back what ``tags`` names (default all); returns whether it is fully awake."""
        state = self._sleeping()
        state.check_wake(tags)  # rank 0 checks for all: the ranks' states are the same
        if self.channel is not None and self.tp.rank == 0:
            self.channel.send(torch.tensor([WAKE]))
            self.channel.send_object(tags)
        awake = state.wake_up(tags)
        if awake and self.use_graphs and self.graphs is None:
            self._capture_graphs()
        return awake

    def run(self, batch: ScheduledBatch) -> Sampled:
        """Run one step: a token and its logprobs for each entry that samples, in batch order (``Sampled.errors``
        names the entries, counted among those that sample, that could not be sampled)."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, feed: TokenFeed | None = None) -> PendingSample:
        """``run`` without waiting for the device: the step's work is enqueued and ``result()`` on the answer reads
        the samples back. ``feed``: the previous step's samples, for the sequences whose newest token is still
        pending (async scheduling). Steps with prompt logprobs wait for the device on the way (so do top-p rows on
        the CPU)."""
        if not batch:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=self.device), None, {})
        entries = batch.entries
        flat = flatten_batch(
            ((e.token_ids, e.start, e.seq.block_table) for e in entries), self.block_size, tables=False
        )
        tables = self.block_tables.plan([e.seq for e in entries])
        mm = self._multimodal_step(batch, flat) if self.is_multimodal else None
        prompt = self._prompt_logprob_rows(batch, flat.query_start_loc)
        groups = [prompt.rows[j : j + PROMPT_LOGPROB_ROWS] for j in range(0, len(prompt.rows), PROMPT_LOGPROB_ROWS)]
        samplers = _sample_rows(batch, flat.query_start_loc)
        fed = feed.plan([e.seq for e in entries], flat.query_start_loc, flat.input_ids) if feed is not None else None
        step = ForwardStep(
            flat,
            tables,
            groups + ([[row for _, row, _ in samplers]] if samplers else []),
            self.use_graphs,
            None if fed is None else (fed.dst, fed.src, len(fed.tokens)),
            mm,
        )
        if self.channel is not None:
            self.channel.send(step.encode())
            if fed is not None:  # the other ranks' fed rows need the samples: on the device, no host sync
                self.tp.broadcast(fed.tokens.contiguous())
            if mm is not None:  # the image rows, as rank 0 computed them (the tower runs here only)
                self._broadcast_mm(mm)
        logits = self.execute(step, fed)
        self._prompt_logprobs(batch, prompt, logits[: len(groups)])
        if not samplers:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=self.device), None, {})
        params = [e.seq.params for e, _, _ in samplers]
        positions = [_sample_position(e, j) for e, _, j in samplers]
        histories = [_history(e, j) for e, _, j in samplers]
        return self.sampler.launch(logits[-1], params, positions, histories, self._masks(samplers))

    def _multimodal_step(self, batch: ScheduledBatch, flat: FlatBatch) -> tuple[torch.Tensor, object] | None:
        """Encode the images the step asks for, put every vision-language row's M-RoPE position into
        ``flat.positions`` (the ``[n]`` form: exact for text rows, whose three components are equal), and, when the
        step holds image tokens, return ``(positions [3, n], MultimodalBatch)``."""
        from lockstep.models.multimodal import MultimodalBatch

        self._encode(batch)
        starts = flat.query_start_loc
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        deepstack: list[torch.Tensor] = []
        spans: list[tuple[int, int, int, object]] = []  # (first row, start, end, inputs) of entries with image rows
        for i, e in enumerate(batch.entries):
            mm = e.seq.mm
            if mm is None:
                continue
            if e.start >= mm.num_prompt_tokens:  # output tokens only (a decode step): index + delta, no tensor
                for row in range(starts[i], starts[i + 1]):
                    flat.positions[row] += mm.delta
                continue
            flat.positions[starts[i] : starts[i + 1]] = mm.text_positions(e.start, e.end)
            images = mm.overlapping(e.start, e.end)
            if not images:
                continue
            spans.append((starts[i], e.start, e.end, mm))
            for k, image in images:
                lo, hi = max(e.start, image.offset), min(e.end, image.end)
                features = self.encoder_cache.get(e.seq.request_id, k)
                first = starts[i] + lo - e.start
                rows.append(torch.arange(first, first + hi - lo, dtype=torch.int64))
                embeds.append(features.embeds[lo - image.offset : hi - image.offset])
                if features.deepstack is not None:
                    deepstack.append(features.deepstack[:, lo - image.offset : hi - image.offset])
        if not rows:
            return None
        positions = torch.tensor(flat.positions, dtype=torch.int64).expand(3, -1).clone()
        for first, start, end, mm in spans:
            positions[:, first : first + end - start] = mm.positions_of(start, end)
        mm_batch = MultimodalBatch(
            rows=torch.cat(rows).to(self.device),
            embeds=torch.cat(embeds),
            deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
        )
        return positions.to(self.device), mm_batch

    def _encode(self, batch: ScheduledBatch) -> None:
        """Run the vision encoder once over every image the step's entries ask for, in batch order, and keep each
        image's features in the encoder cache (an image's bits do not depend on the others in the call)."""
        todo = [(e.seq, k) for e in batch.entries for k in e.encode]
        if not todo:
            return
        images = [seq.mm.images[k] for seq, k in todo]
        pixel_values = torch.cat([im.pixel_values for im in images]).to(self.device)
        grid_thw = torch.tensor([im.grid_thw for im in images], dtype=torch.int64, device=self.device)
        features = self.model.encode_images(pixel_values, grid_thw)
        for (seq, k), f in zip(todo, features, strict=True):
            self.encoder_cache.put(seq.request_id, k, f)

    def _masks(self, samplers: list) -> tuple[list[int], torch.Tensor] | None:
        """The tokens each structured-output row may choose, from its grammar state and its own output tokens (EOS
        only where it could end the request: not under ``ignore_eos``); a verify chunk's row ``j`` from the state
        after its first ``j`` drafts."""
        rows = [k for k, (e, _, _) in enumerate(samplers) if e.seq.grammar is not None]
        if not rows:
            return None
        entries = [samplers[k][0] for k in rows if samplers[k][2] == 0]  # one per entry: its first row
        if not any(e.drafts for e in entries):
            states = [(e.seq.grammar, e.seq.output_token_ids, not e.seq.params.ignore_eos) for e in entries]
            return rows, token_masks(states, self.vocab_size, self.device)
        states = [(e.seq.grammar, e.seq.output_token_ids, e.drafts, not e.seq.params.ignore_eos) for e in entries]
        return rows, token_masks_ahead(states, self.vocab_size, self.device)

    @torch.inference_mode()
    def execute(self, step: ForwardStep, fed: FedRows | None = None) -> list[torch.Tensor]:
        """The forward of ``step`` on this rank: fp32 logits ``[len(rows), vocab_size]`` for each group of rows.
        ``fed``: input rows that take an earlier step's sampled tokens on the device (rank 0, async scheduling)."""
        flat = step.flat
        # Only the columns this step's longest sequence uses (rounded up: _table_width): a graph's wider buffer
        # keeps stale (valid) ids past them, which no row reads.
        tables = self.block_tables.gather(
            self.block_tables.apply(step.tables), _table_width(-(-max(flat.seq_lens) // self.block_size))
        )
        if step.use_graphs and step.mm is None and self.graphs is not None and self.graphs.can_run(flat):
            hidden = self.graphs.run(flat, tables, fed)
        else:
            input_ids, positions, attn = flat.to(self.device, self.kv_caches, tables)
            if fed is not None:
                fed.write(input_ids)
            if step.mm is not None:
                hidden = self.model(input_ids, step.mm[0], attn, step.mm[1])  # positions [3, num_tokens]
            else:
                hidden = self.model(input_ids, positions, attn)  # [num_tokens, hidden_size]
        return [self.model.compute_logits(self._hidden_rows(hidden, rows)) for rows in step.logit_rows]

    def _hidden_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows[-1] == len(rows) - 1:  # rows 0, 1, ..., n - 1 (increasing; a decode step): a view, no copy
            return hidden[: len(rows)]
        return hidden[device_tensor(rows, torch.int64, self.device)]

    def serve(self) -> None:
        """Ranks > 0: run what rank 0 sends (steps, weight updates) until it says stop."""
        while True:
            message = self.channel.recv()
            op = int(message[0])
            if op == STEP:
                step = ForwardStep.decode(message)
                fed = self._receive_fed(step)
                step.mm = self._receive_mm(step)
                self.execute(step, fed)
            elif op == WEIGHTS:
                self._receive_weights()
            elif op == GROUP_WEIGHTS:
                self._receive_group_weights(self.channel.recv_object())
            elif op == JOIN_WEIGHT_GROUP:
                self._join_weight_group(self.channel.recv_object())
            elif op == SLEEP:
                self.release_graphs()
                self._sleeping().sleep(self.channel.recv_object())
            elif op == WAKE:
                if self._sleeping().wake_up(self.channel.recv_object()) and self.use_graphs and self.graphs is None:
                    self._capture_graphs()
            elif op == STOP:
                return  # a CUDA worker exits at once, graphs and all (engine/tp_workers.py); the CPU has none
            else:
                raise RuntimeError(f"unknown control message {op} from rank 0")

    def _receive_fed(self, step: ForwardStep) -> FedRows | None:
        """Ranks > 0: a fed step's rows, with rank 0's samples of the previous step (``launch`` broadcasts them)."""
        if step.fed is None:
            return None
        dst, src, num_samples = step.fed
        tokens = torch.empty(num_samples, dtype=torch.int64, device=self.device)
        return FedRows(dst, src, self.tp.broadcast(tokens))

    def _broadcast_mm(self, mm: tuple[torch.Tensor, object]) -> None:
        """Rank 0: a vision-language step's M-RoPE positions and image rows (features, DeepStack) to every rank.
        The other ranks hold the tower's weights too but never run it: the features are rank 0's bits."""
        positions, batch = mm
        self.tp.broadcast(positions.contiguous())
        self.tp.broadcast(batch.rows.contiguous())
        self.tp.broadcast(batch.embeds.contiguous())
        if batch.deepstack is not None:
            self.tp.broadcast(batch.deepstack.contiguous())

    def _receive_mm(self, step: ForwardStep) -> tuple[torch.Tensor, object] | None:
        """Ranks > 0: what ``_broadcast_mm`` sends, for a step whose message has image rows."""
        if step.mm_rows < 0:
            return None
        from lockstep.models.multimodal import MultimodalBatch

        m, n = step.mm_rows, step.flat.num_tokens
        hidden, dtype, depth = (
            self.model.config.hidden_size,
            self.model.dtype,
            self.model.mm_config.num_deepstack_layers,
        )
        positions = self.tp.broadcast(torch.empty((3, n), dtype=torch.int64, device=self.device))
        rows = self.tp.broadcast(torch.empty(m, dtype=torch.int64, device=self.device))
        embeds = self.tp.broadcast(torch.empty((m, hidden), dtype=dtype, device=self.device))
        deepstack = None
        if depth:
            deepstack = self.tp.broadcast(torch.empty((depth, m, hidden), dtype=dtype, device=self.device))
        return positions, MultimodalBatch(rows=rows, embeds=embeds, deepstack=deepstack)

    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks' ``serve`` to return; this rank runs no more steps either."""
        if self.channel is not None:
            self.channel.send(torch.tensor([STOP]))
        self.release_graphs()

    def release_graphs(self) -> None:
        """Free the CUDA graphs (before the group is left: ``DecodeGraphs.release``); later steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _prompt_logprob_rows(self, batch: ScheduledBatch, query_start_loc: list[int]) -> "_PromptRows":
        """Which rows of the step's hidden states give prompt logprobs: prompt token ``p + 1``'s come from
        position ``p``'s row, for every prompt position this step computes that a request asking for them has not
        had yet."""
        prompt = _PromptRows([], [], [], [])
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
            prompt.rows.extend(range(query_start_loc[i] + first - e.start, query_start_loc[i] + last - e.start))
            prompt.targets.extend(seq.token_ids[first + 1 : last + 1])
            prompt.nums.extend([seq.params.prompt_logprobs] * (last - first))
            prompt.owners.append((seq, last - first))
        return prompt

    def _prompt_logprobs(self, batch: ScheduledBatch, prompt: "_PromptRows", logits: list[torch.Tensor]) -> None:
        """Appends each request's prompt logprobs to ``batch.prompt_logprobs``. The head and log_softmax are the
        sampler's, so a prompt token gets the bits a decode step would give it."""
        results: list[TokenLogprobs] = []
        for j, group_logits in zip(range(0, len(prompt.rows), PROMPT_LOGPROB_ROWS), logits, strict=True):
            logprobs = self.sampler.log_softmax(group_logits)
            targets = prompt.targets[j : j + PROMPT_LOGPROB_ROWS]
            target = device_tensor(targets, torch.int64, self.device)
            results += gather_logprobs(logprobs, target, prompt.nums[j : j + PROMPT_LOGPROB_ROWS])[1]
        k = 0
        for seq, count in prompt.owners:
            batch.prompt_logprobs.append((seq, results[k : k + count]))
            k += count


@dataclass
class _PromptRows:
    rows: list[int]  # rows of the step's hidden states
    targets: list[int]  # the prompt token each row predicts
    nums: list[int]  # how many top logprobs each row's request asked for
    owners: list[tuple[Sequence, int]]  # (sequence, how many of the rows are its), in row order


def _sample_rows(batch: ScheduledBatch, query_start_loc: list[int]) -> list[tuple[ScheduledSeq, int, int]]:
    """``(entry, hidden row, j)`` for every row that samples, in batch order: the last row of a sampling entry
    (``j`` 0), or every row of a verify chunk, its ``j``-th row sampling the token after its ``j``-th draft."""
    rows = []
    for i, e in enumerate(batch.entries):
        if e.sample:
            first = query_start_loc[i + 1] - 1 - len(e.drafts)
            rows.extend((e, first + j, j) for j in range(1 + len(e.drafts)))
    return rows


def _sample_position(e: ScheduledSeq, j: int) -> int:
    """The index in its sequence of the token row ``j`` of ``e`` samples: what its seeded noise is keyed by, the
    position plain decoding samples that token at."""
    return e.start + e.num_fed + j


def _history(e: ScheduledSeq, j: int) -> tuple[list[int], int]:
    """What the sampler's penalties, ``min_tokens`` and bad words read for row ``j`` of ``e``: the tokens before the
    one it samples (for a verify row, the sequence's tokens and the drafts before it: what plain decoding would
    have)."""
    seq = e.seq
    if j == 0:
        return seq.token_ids, seq.num_prompt_tokens
    p = seq.params
    if not (p.penalized or p.min_tokens or p.bad_words_token_ids):  # the sampler reads no history for this row
        return seq.token_ids, seq.num_prompt_tokens
    return seq.token_ids + list(e.drafts[:j]), seq.num_prompt_tokens


def _table_width(blocks: int) -> int:
    """``blocks`` rounded up to a multiple of ``TABLE_COLUMNS`` (at least one multiple)."""
    return max(1, -(-blocks // TABLE_COLUMNS)) * TABLE_COLUMNS
