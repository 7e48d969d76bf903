"""The draft-model drafter: a smaller checkpoint with the target's tokenizer proposes its greedy continuation.

The draft runs on lockstep's own machinery: a ``ModelRunner`` of its own (the target's kernel set, dtype and
device; the target's ``max_model_len``), with a KV cache of its own whose blocks this module hands out. For each
sequence it keeps an engine ``Sequence`` whose first ``num_computed_tokens`` tokens have K/V in the draft's cache,
between calls. A ``propose`` call, for each request:

1. rolls the sequence back to the longest common prefix of those tokens and the request's ``token_ids``: drafted
   tokens the target accepted keep their K/V, rejected ones just leave the computed count (their slots are
   written again before anything reads them: attention writes a step's K/V first, then reads);
2. grows its block table to hold K/V for every token it will feed, ``len(token_ids) + k - 1`` (a request whose
   table cannot grow that far drafts as many tokens as fit, possibly none: a full cache never fails a call);
3. prefills the tokens past that prefix (chunked under the step budget, decodes first as the scheduler does),
   then decodes greedily until it has ``k`` tokens, all requests batched in each step.

Each decode step's input is the previous step's sample, fed on the device (``TokenFeed``, as async scheduling
does), so the host schedules step i + 1 while step i runs and reads the tokens back once per call, not once per
step. The feed puts the very token id a host round trip would, so it changes no bit.

The drafter changes only speed, never the target's output (the engine accepts a drafted token only where it
equals what plain decoding samples). Its proposals are nonetheless a pure function of the draft model and the
request's tokens: the kernels are batch- and chunk-invariant, so a proposal is the draft model's greedy
continuation as plain ``LLM.generate`` on the draft checkpoint computes it, bit for bit, whichever sequences
share the step and however much of the history was cached (tests/spec/test_draft_model.py).

Memory: the draft's cache holds as many tokens as the target's (``engine_config.num_kv_blocks`` blocks of the same
size, when the target's config has them resolved), so it does not run out before the target does; on CUDA at most
``DRAFT_FREE_MEMORY_SHARE`` of the memory free when the drafter starts, less its own weights, and on the CPU at
most ``CPU_KV_CACHE_BYTES``; never less than one sequence of ``max_model_len`` (a ValueError when even that does
not fit: lower the target's ``gpu_memory_utilization``). ``num_kv_blocks=`` overrides it.
"""

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from lockstep.config import EngineConfig
from lockstep.engine.model_runner import _DTYPES, CPU_KV_CACHE_BYTES, ModelRunner, resolve_device
from lockstep.engine.scheduler import ScheduledBatch, ScheduledSeq
from lockstep.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from lockstep.engine.token_feed import TokenFeed
from lockstep.layers.sampler import PendingSample
from lockstep.sampling_params import SamplingParams
from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import DraftRequest

# On CUDA the draft's KV cache takes at most this share of the memory free when the drafter starts (after the
# target took its cache), less the draft's weights: the rest stays for the draft's activations and graphs.
DRAFT_FREE_MEMORY_SHARE = 0.5
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


@dataclass
class _Work:
    """One request of a ``propose`` call: its draft sequence, how many tokens it drafts, what it got so far."""

    seq: Sequence
    num_tokens: int
    num_prompt: int  # len(request.token_ids): where the drafted tokens start in seq.token_ids
    launched: int = 0  # tokens whose sampling has been launched
    tokens: list[int] = field(default_factory=list)  # read back at the end of the call


class DraftModelDrafter:
    """Proposes the draft model's greedy continuation of each request's tokens (``Drafter``).

    ``config.model``: the draft checkpoint (a folder or a Hugging Face model id), whose vocabulary must be the
    target's (same size, and the same token -> id map where both folders have a tokenizer): ValueError naming
    both models otherwise. ``engine_config``: the target engine's ``EngineConfig``. ``num_kv_blocks``: the draft
    cache's size in blocks of ``engine_config.block_size`` (None: see the module docstring).
    """

    def __init__(
        self, config: SpeculativeConfig, engine_config: EngineConfig, num_kv_blocks: int | None = None
    ) -> None:
        from lockstep.models.hub import resolve_model

        self.config = config
        target = _target_path(engine_config)
        draft = resolve_model(config.model)
        check_vocab(target, draft)
        self.runner = ModelRunner(_draft_engine_config(engine_config, target, draft, num_kv_blocks))
        self.config_used = self.runner.config  # the draft's resolved EngineConfig
        self.block_size = self.config_used.block_size
        self.max_model_len = self.config_used.max_model_len
        self._free: list[int] = list(range(self.config_used.num_kv_blocks))  # a stack: lowest ids first
        self._free.reverse()
        self._seqs: dict[int, Sequence] = {}  # seq_id -> its draft state; lookup only, never iterated for order
        if self.runner.device.type == "cuda":
            self.warm_up()

    def warm_up(self) -> None:
        """Compile the draft's prefill shapes now rather than on the first requests (decode shapes compiled with
        its CUDA graphs): one sequence of each of the engine's warm-up lengths that fits, drafted and released.
        The K/V they leave in free blocks is written again before anything reads it."""
        from lockstep.engine.warmup import WARMUP_LENGTHS

        rng = random.Random(0)
        vocab = self.runner.vocab_size
        budget = min(self.config_used.max_num_batched_tokens, self.max_model_len - 2)
        for i, n in enumerate(n for n in WARMUP_LENGTHS if n <= budget):
            seq_id = -1 - i  # ids no engine sequence has
            self.propose([DraftRequest(seq_id, [rng.randrange(vocab) for _ in range(n)], 2)])
            self.release(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_kv_blocks(self) -> int:
        return self.config_used.num_kv_blocks

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` whose K/V the draft's cache holds (0 for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.num_computed_tokens

    # -- the Drafter protocol ----------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """The draft model's greedy continuation of each request's ``token_ids``, at most ``num_tokens`` long
        (shorter where the draft's cache or ``max_model_len`` has no room), in request order."""
        ids = [r.seq_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"propose: a seq_id appears twice among {ids}")
        out: list[list[int]] = [[] for _ in requests]
        work: list[tuple[int, _Work]] = []
        for i, r in enumerate(requests):
            w = self._prepare(r)
            if w is not None:
                work.append((i, w))
        group = self.config_used.max_num_seqs
        try:
            for j in range(0, len(work), group):
                self._run([w for _, w in work[j : j + group]])
        except BaseException:  # a failed forward: the sequences' K/V and pending tokens are unknown, start over
            for r in requests:
                self.release(r.seq_id)
            raise
        for i, w in work:
            out[i] = self._finish(w)
        return out

    def release(self, seq_id: int) -> None:
        """Free ``seq_id``'s blocks and forget it (unknown ids are ignored)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.FINISHED  # its device block-table row is given back

    # -- one call ----------------------------------------------------------------------------------------------

    def _prepare(self, r: DraftRequest) -> _Work | None:
        """Roll ``r``'s sequence back to what its cache still holds, give it the blocks the call needs, and return
        its work (None: it drafts nothing this time)."""
        tokens = list(r.token_ids)
        n = len(tokens)
        if n == 0:
            return None
        k = min(r.num_tokens, self.max_model_len - n)  # no proposal past max_model_len
        seq = self._seqs.get(r.seq_id)
        if seq is not None:
            computed = seq.token_ids[: seq.num_computed_tokens]
            keep = _common_prefix(computed, tokens)
            seq.token_ids = tokens
            seq.num_prompt_tokens = n
            seq.num_computed_tokens = min(keep, n - 1)  # the newest token is fed again: its logits draft
        if k < 1:
            return None
        # K/V for every fed token: the request's n, and the first k - 1 drafted ones.
        have = len(seq.block_table) if seq is not None else 0
        room = (have + len(self._free)) * self.block_size - n + 1
        k = min(k, room)
        if k < 1:
            return None
        if seq is None:
            seq = Sequence(f"draft-{r.seq_id}", tokens, _GREEDY, self.block_size)
            seq.status = SequenceStatus.RUNNING
            self._seqs[r.seq_id] = seq
        needed = -(-(n + k - 1) // self.block_size)
        for _ in range(needed - len(seq.block_table)):
            seq.block_table.append(self._free.pop())  # appended, never replaced: the device row stays valid
        return _Work(seq, k, n)

    def _run(self, work: list[_Work]) -> None:
        """Prefill and decode ``work`` (at most ``max_num_seqs`` sequences) until each has launched its tokens;
        then read them all back."""
        launched: list[tuple[list[_Work], PendingSample]] = []
        feed: TokenFeed | None = None
        while True:
            batch, samplers = self._schedule(work)
            if not batch:
                break
            sample = self.runner.launch(batch, feed)
            for e in batch.entries:
                e.seq.num_computed_tokens += e.num_new_tokens
            rows: dict[Sequence, int] = {}
            for j, w in enumerate(samplers):
                w.launched += 1
                if w.launched < w.num_tokens:  # fed to the next step from the device
                    w.seq.token_ids.append(PENDING_TOKEN)
                    rows[w.seq] = j
            feed = TokenFeed(sample.tokens, rows) if rows else None
            launched.append((samplers, sample))
        for samplers, sample in launched:
            result = sample.result()  # the first waits for the device; the rest are there by then
            for j, w in enumerate(samplers):
                w.tokens.append(result.token_ids[j])

    def _schedule(self, work: list[_Work]) -> tuple[ScheduledBatch, list[_Work]]:
        """One step: every decoding sequence's next token, then prefill chunks under the step's token budget. Also
        returns the work of the entries that sample, in batch order. A call's first step in steady state brings one
        new token a sequence (after a rejection) or two (the last draft and the target's bonus token): short chunks,
        which replay a decode graph like the decode steps after them (``cuda_graph.expand_rows``)."""
        batch = ScheduledBatch()
        samplers: list[_Work] = []
        budget = self.config_used.max_num_batched_tokens
        todo = [w for w in work if w.launched < w.num_tokens]
        decoding = [w for w in todo if w.seq.num_pending_tokens == 1]
        for w in decoding + [w for w in todo if w.seq.num_pending_tokens > 1]:
            pending = w.seq.num_pending_tokens
            n = min(pending, budget)
            if n < 1:
                break
            sample = n == pending
            batch.entries.append(ScheduledSeq(w.seq, n, w.seq.num_computed_tokens, sample))
            if sample:
                samplers.append(w)
            budget -= n
        return batch, samplers

    def _finish(self, w: _Work) -> list[int]:
        """``w``'s proposal, and its sequence's tokens made real: up to the first row that could not be sampled
        (its K/V and everything after it dropped)."""
        tokens = w.tokens
        if -1 in tokens:
            tokens = tokens[: tokens.index(-1)]
        seq = w.seq
        seq.token_ids = seq.token_ids[: w.num_prompt] + tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
        return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: list comparisons (C loops) in a binary search,
    so a 32k-token history costs ~15 slice compares, not 32k Python steps."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _target_path(engine_config: EngineConfig) -> str:
    """The target checkpoint's folder (the embedded model's for None, a Hugging Face id resolved)."""
    if engine_config.model is None:
        from lockstep.models.embedded import default_model_path

        return str(default_model_path())
    from lockstep.models.hub import resolve_model

    return resolve_model(engine_config.model, engine_config.revision)


def check_vocab(target: str, draft: str) -> None:
    """ValueError naming both models unless the draft's vocabulary is the target's: the same size, and where
    both folders have a tokenizer the same token -> id map (special tokens included)."""
    from lockstep.models.loader import load_tokenizer, read_config

    t, d = read_config(target), read_config(draft)
    if d.multimodal is not None:
        raise ValueError(f"speculative_config: the draft model {draft} is a vision-language model; use a text model")
    if t.vocab_size != d.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {draft} has a vocabulary of {d.vocab_size} tokens, the target "
            f"{target} one of {t.vocab_size}: a draft model must share the target's tokenizer"
        )
    try:
        vocabs = [load_tokenizer(target).get_vocab(), load_tokenizer(draft).get_vocab()]
    except FileNotFoundError:
        return  # a folder without a tokenizer (random-weight benches): the sizes are all there is to compare
    if vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()), key=lambda kv: kv[1])
        raise ValueError(
            f"speculative_config: the draft model {draft} and the target {target} have different tokenizers "
            f"({len(differ)} (token, id) pairs differ, e.g. {differ[0]!r}): a draft model must share the target's"
        )


def _draft_engine_config(
    engine_config: EngineConfig, target: str, draft: str, num_kv_blocks: int | None
) -> EngineConfig:
    """The draft runner's config: the target's kernels, dtype, device, block size, sequence and token limits and
    CUDA-graph setting; one process, no prefix caching (a sequence keeps its own blocks across rollbacks)."""
    from lockstep.models.loader import read_config

    target_config, draft_config = read_config(target), read_config(draft)
    dtype = engine_config.dtype
    if dtype == "auto":  # the target's own dtype, whatever the draft checkpoint's
        dtype = {v: k for k, v in _DTYPES.items()}[target_config.dtype]
    max_len = engine_config.max_model_len or target_config.max_position_embeddings
    max_len = min(max_len, draft_config.max_position_embeddings)
    values = dict(
        model=draft,
        revision=None,
        dtype=dtype,
        max_model_len=max_len,
        num_kv_blocks=None,
        enable_prefix_caching=False,
        async_scheduling=False,
        tensor_parallel_size=1,
        tp_invariant=None,
        generation_config="vllm",
        limit_mm_per_prompt=None,
        mm_processor_kwargs=None,
        max_num_encoder_tokens_per_step=None,
    )
    if any(f.name == "speculative_config" for f in dataclasses.fields(EngineConfig)):
        values["speculative_config"] = None  # the draft drafts for nobody
    config = dataclasses.replace(engine_config, **values)
    blocks = num_kv_blocks or _default_num_kv_blocks(config, engine_config.num_kv_blocks)
    return dataclasses.replace(config, num_kv_blocks=blocks)


def _default_num_kv_blocks(config: EngineConfig, target_blocks: int | None) -> int:
    """As many blocks as the target's cache (all a full-length sequence per slot could use, when unknown), capped
    by memory (module docstring); ValueError if one ``max_model_len`` sequence does not fit."""
    from lockstep.models.loader import model_class, read_config

    model_config = read_config(config.model)
    dtype = _DTYPES[config.dtype]
    model = model_class(model_config.architecture)(
        model_config, kernels=config.kernels, dtype=dtype, device="meta", max_model_len=config.max_model_len
    )
    if config.kv_cache_dtype != "auto":
        model.kv_cache_dtype = torch.float8_e4m3fn
    per_block = model.kv_cache_bytes_per_block(config.block_size)
    one_seq = -(-config.max_model_len // config.block_size)
    most = one_seq * config.max_num_seqs if target_blocks is None else max(one_seq, target_blocks)
    device = resolve_device(config.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = int((free - weights) * DRAFT_FREE_MEMORY_SHARE)
    else:
        budget = CPU_KV_CACHE_BYTES
    cap = max(0, budget) // per_block
    if cap < one_seq:
        raise ValueError(
            f"speculative_config: the draft model's KV cache needs {one_seq} blocks ({one_seq * per_block / 2**30:.2f} "
            f"GiB) for one sequence of max_model_len={config.max_model_len}, and {max(0, budget) / 2**30:.2f} GiB "
            f"are available for it; lower gpu_memory_utilization or max_model_len"
        )
    return min(most, cap)
