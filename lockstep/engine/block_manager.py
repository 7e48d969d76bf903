"""Paged KV cache bookkeeping: ref-counted fixed-size blocks and prefix caching by block hash.

A block is a run of ``block_size`` KV slots. A sequence's ``block_table`` lists its blocks in position order.
Prefix caching: once every slot of a block holds computed KV, the block is keyed by a hash chaining the previous
block's hash with the block's token ids (and the pixel hashes of the images whose tokens it holds), so another
sequence with the same prefix can reuse it. A freed block keeps its hash, and stays findable, until the free list
hands its id out again.

Determinism: free ids live in a deque (taken from the left, returned on the right), so the same calls on a fresh
manager hand out the same ids. Hashes are blake2b over fixed-width little-endian token bytes: stable across
processes and machines, unlike ``hash()``.
"""

import hashlib
import struct
from collections import deque
from collections.abc import Iterable

from lockstep.engine.sequence import Sequence


def hash_block(prev_hash: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Hash of a full block: its predecessor's hash (``b""`` for the first block) chained with its tokens, and
    ``extra`` (the pixels' hashes of the images whose tokens the block holds: ``MultimodalInputs.block_extra``)."""
    h = hashlib.blake2b(prev_hash, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def hash_seq_block(prev_hash: bytes, seq: Sequence, i: int) -> bytes:
    """``hash_block`` of block ``i`` of ``seq``: its tokens, and for a block that covers image tokens the images'
    pixel hashes (an image placeholder's token ids are the same for every image)."""
    extra = seq.mm.block_extra(i, seq.block_size) if seq.mm is not None else b""
    return hash_block(prev_hash, seq.block_token_ids(i), extra)


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set once all the block's slots hold computed KV (prefix caching on); kept after free until reuse.
        self.hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.hash.hex()[:8] if self.hash is not None else None
        return f"Block({self.block_id}, ref={self.ref_count}, hash={h})"


class BlockManager:
    """Hands out KV blocks to sequences and finds reusable prefixes.

    Lifecycle of a sequence: ``can_allocate`` / ``allocate`` on admission (blocks for the whole current context,
    the leading ones taken from the prefix cache where possible); ``mark_computed`` after each step that computed
    some of its tokens (hashes blocks that became full); ``can_append`` / ``append_slot`` before a decode step
    that needs one more block; ``free`` on finish, abort or preemption.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- admission ---------------------------------------------------------------------------------------------

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold seq's leading full blocks, in order.

        Only the first ``num_tokens - 1`` tokens are eligible: the last token is always recomputed, so the step
        that finishes the prefill has logits to sample from. A request that asks for prompt logprobs reads no
        cached block: it needs every prompt position's logits (its own blocks are still cached for others).
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        prev = b""
        for i in range((seq.num_tokens - 1) // self.block_size):
            prev = hash_seq_block(prev, seq, i)
            block_id = self.hash_to_block_id.get(prev)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        # A hit on a free block takes that block off the free list too.
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(self.free_block_ids) - free_hits >= seq.num_blocks - len(hits)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would find enough free blocks now."""
        return self._fits(seq, self._prefix_hits(seq))

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its current tokens, reusing cached prefix blocks.

        Sets ``seq.num_cached_tokens`` and ``seq.num_computed_tokens`` to the tokens covered by prefix hits
        (full blocks only, never the last token). Raises RuntimeError if the blocks are not there.
        """
        if seq.block_table:
            raise RuntimeError(f"allocate: {seq.request_id!r} already holds blocks {seq.block_table}")
        if seq.block_size != self.block_size:
            raise ValueError(f"allocate: {seq.request_id!r} has block_size {seq.block_size}, not {self.block_size}")
        hits = self._prefix_hits(seq)
        if not self._fits(seq, hits):
            raise RuntimeError(
                f"allocate: {seq.request_id!r} needs {seq.num_blocks} blocks ({len(hits)} cached), "
                f"{len(self.free_block_ids)} free"
            )
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)  # O(num free); hits on free blocks are the uncommon case
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(seq.num_blocks - len(hits))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size

    def _take_free(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash is not None:
            # The id is reused for new KV: its old contents stop being findable.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    # -- decode growth and progress ----------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq's table can cover all its current tokens (a new block is needed at a block boundary)."""
        return len(seq.block_table) >= seq.num_blocks or len(self.free_block_ids) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Grow seq's table to cover all its current tokens (at most one new block per decoded token)."""
        if not seq.block_table:
            raise RuntimeError(f"append_slot: {seq.request_id!r} holds no blocks; allocate it first")
        missing = seq.num_blocks - len(seq.block_table)
        if missing > 1:
            raise RuntimeError(f"append_slot: {seq.request_id!r} is {missing} blocks short; decode adds one token")
        if missing == 1:
            if not self.free_block_ids:
                raise RuntimeError(f"append_slot: no free block for {seq.request_id!r}")
            seq.block_table.append(self._take_free())

    def reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Speculative decoding: grow seq's table with free blocks toward ``num_tokens`` slots (its tokens and the
        drafts after them); returns how many slots it covers now, at most ``num_tokens``. Never preempts."""
        while len(seq.block_table) * self.block_size < num_tokens and self.free_block_ids:
            seq.block_table.append(self._take_free())
        return min(num_tokens, len(seq.block_table) * self.block_size)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those seq's current tokens need (``reserve``'s that rejected drafts left
        unused). They were never full of computed KV, so they hold no hash. The table becomes a new list: the
        device block tables mirror a list by appends alone, and start over for a new one (engine/block_tables.py)."""
        keep = seq.num_blocks
        if len(seq.block_table) <= keep:
            return
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            if block.hash is not None:
                raise RuntimeError(f"trim: {seq.request_id!r} block {block_id} is hashed, so computed")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = seq.block_table[:keep]

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the next ``num_new_tokens`` of seq now have KV in the cache; hash blocks that filled up."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if num_new_tokens < 1 or end > seq.num_tokens or end > len(seq.block_table) * self.block_size:
            raise RuntimeError(
                f"mark_computed: {seq.request_id!r} cannot advance {start} -> {end} "
                f"({seq.num_tokens} tokens, {len(seq.block_table)} blocks)"
            )
        seq.num_computed_tokens = end
        if not self.enable_prefix_caching:
            return
        for i in range(start // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            prev = self.blocks[seq.block_table[i - 1]].hash if i else b""
            assert prev is not None, f"{seq.request_id!r}: block {i - 1} is full but was never hashed"
            block.hash = hash_seq_block(prev, seq, i)
            # If an identical block is already registered (computed by a sequence admitted in the same step),
            # that one stays the cache entry; this one is just an unregistered duplicate.
            self.hash_to_block_id.setdefault(block.hash, block.block_id)

    # -- release -----------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop seq's references and its computed state. Blocks whose count reaches zero join the free list,
        last block first, so a sequence's head blocks (the likeliest prefix hits) are reused last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
                if block.hash is not None:
                    # A duplicate whose registered twin was reused meanwhile becomes the cache entry.
                    self.hash_to_block_id.setdefault(block.hash, block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update the cached KV is stale).

        Only valid while no sequence holds blocks: finish, abort or preempt them first.
        """
        in_use = [b.block_id for b in self.blocks if b.ref_count > 0]
        if in_use:
            raise RuntimeError(f"reset_prefix_cache: {len(in_use)} blocks still in use (first {in_use[:8]})")
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash = None

    # -- invariants --------------------------------------------------------------------------------------------

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError naming the first broken invariant, given every sequence that holds blocks."""

        def fail(msg: str) -> None:
            raise AssertionError(f"BlockManager integrity: {msg}")

        seqs = list(seqs)
        if len(self.blocks) != self.num_blocks:
            fail(f"{len(self.blocks)} Block objects for num_blocks={self.num_blocks}")
        for i, block in enumerate(self.blocks):
            if block.block_id != i:
                fail(f"blocks[{i}] has block_id {block.block_id}")

        holders = [0] * self.num_blocks
        for seq in seqs:
            table = seq.block_table
            for block_id in table:
                if not 0 <= block_id < self.num_blocks:
                    fail(f"{seq.request_id!r} holds out-of-range block id {block_id}")
                holders[block_id] += 1
            if len(set(table)) != len(table):
                fail(f"{seq.request_id!r} holds a block twice: {table}")
            needed = self.blocks_needed(seq.num_computed_tokens)
            if not needed <= len(table) <= seq.num_blocks:
                fail(
                    f"{seq.request_id!r} holds {len(table)} blocks for {seq.num_computed_tokens} computed of "
                    f"{seq.num_tokens} tokens (expected {needed}..{seq.num_blocks})"
                )

        is_free = [False] * self.num_blocks
        for block_id in self.free_block_ids:
            if not 0 <= block_id < self.num_blocks:
                fail(f"free list holds out-of-range block id {block_id}")
            if is_free[block_id]:
                fail(f"block {block_id} is on the free list twice")
            is_free[block_id] = True
        for block in self.blocks:
            if block.ref_count != holders[block.block_id]:
                fail(
                    f"block {block.block_id} has ref_count {block.ref_count} "
                    f"but {holders[block.block_id]} block table(s) hold it"
                )
            if is_free[block.block_id] and block.ref_count != 0:
                fail(f"block {block.block_id} is on the free list with ref_count {block.ref_count}")
            if not is_free[block.block_id] and block.ref_count == 0:
                fail(f"block {block.block_id} has ref_count 0 but is not on the free list (leaked)")

        if not self.enable_prefix_caching:
            if self.hash_to_block_id or any(b.hash is not None for b in self.blocks):
                fail("prefix caching is off but blocks are hashed")
            return
        for h, block_id in self.hash_to_block_id.items():
            if not 0 <= block_id < self.num_blocks:
                fail(f"hash {h.hex()} maps to out-of-range block id {block_id}")
            actual = self.blocks[block_id].hash
            if actual != h:
                fail(f"hash {h.hex()} maps to block {block_id}, whose hash is {actual.hex() if actual else None}")
        # A held block's hash may be missing from the map: a duplicate of a block registered first.
        for seq in seqs:
            prev = b""
            for i, block_id in enumerate(seq.block_table):
                block = self.blocks[block_id]
                if (i + 1) * self.block_size > seq.num_computed_tokens:
                    if block.hash is not None:
                        fail(f"{seq.request_id!r} block {i} (id {block_id}) is hashed before its KV is computed")
                    continue
                prev = hash_seq_block(prev, seq, i)
                if block.hash != prev:
                    fail(f"{seq.request_id!r} block {i} (id {block_id}) has a hash that does not match its tokens")
