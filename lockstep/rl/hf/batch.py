"""A Hugging Face batch (``[batch, seq]`` with ``attention_mask`` / ``position_ids``) laid out as the engine lays
out a step: the real tokens flattened, sequence after sequence, with paged-attention metadata over a fresh cache.

The engine's attention reads the keys of a query at position p as positions 0..p of its own sequence, reduced in
position order in tiles aligned to position 0 (``ops.attention``). So each sequence must start at position 0:

- a padded batch (``attention_mask``, left or right padding) holds one sequence per row, its real tokens numbered
  0, 1, ... whatever the padding (as ``generate`` numbers them; ``position_ids``, if given, must agree);
- a packed batch (``position_ids`` restarting at 0 for each sequence, as TRL's ``padding_free`` and
  ``DataCollatorWithFlattening`` produce) holds a sequence wherever the positions restart.

Padding tokens are dropped before the first layer and their output rows are zeros.
"""

from dataclasses import dataclass

import torch

from lockstep.layers.batch import AttentionMetadata

# Cache page size of the trainer's scratch caches. The attention's bits do not depend on it: the kernel's tiles are
# aligned to positions, not pages.
PAGE = 16


@dataclass
class FlatLayout:
    """Where a ``[batch, seq]`` batch's real tokens sit in the flattened one.

    Attributes:
        shape: ``(batch, seq)`` of the Hugging Face batch.
        rows: ``[num_tokens]`` int64, the index ``b * seq + t`` of each flattened token, or None when every token is
            real and in order (no padding: the flattened batch is the reshaped one).
        positions: ``[num_tokens]`` int64, each token's position in its sequence (0 first).
        attn: the paged-attention metadata of the flattened batch (``kv_caches`` empty: each layer allocates its own
            zeroed cache of ``num_blocks`` pages).
        num_blocks: pages of ``PAGE`` slots the sequences' caches take in all.
    """

    shape: tuple[int, int]
    rows: torch.Tensor | None
    positions: torch.Tensor
    attn: AttentionMetadata
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def _row_sequences(valid: torch.Tensor, pos: torch.Tensor | None, row: int) -> tuple[list[int], list[int]]:
    """Row ``row``'s real token columns and the length of each sequence among them, in order."""
    cols = valid.nonzero()[:, 0].tolist()
    if not cols:
        return [], []
    if pos is None:
        return cols, [len(cols)]
    p = pos[cols].tolist()
    lengths: list[int] = []
    for j, position in enumerate(p):
        if position == 0:
            lengths.append(1)
        elif not lengths or position != p[j - 1] + 1:
            raise ValueError(
                f"row {row}: position_ids must number each sequence's tokens 0, 1, 2, ... (the engine's positions); "
                f"got {p[j - 1] if lengths else None} then {position} at column {cols[j]}. For a padded batch pass "
                "attention_mask alone and the positions are counted from it"
            )
        else:
            lengths[-1] += 1
    return cols, lengths


def flat_layout(
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    device: torch.device,
) -> FlatLayout:
    """Lay out a ``shape = (batch, seq)`` batch (see the module docstring). ``attention_mask: [batch, seq]`` (1 for
    real tokens) or None (all real); ``position_ids: [batch or 1, seq]`` or None (each row one sequence)."""
    batch, seq = shape
    valid = torch.ones(shape, dtype=torch.bool) if attention_mask is None else attention_mask.detach().cpu().bool()
    if tuple(valid.shape) != shape:
        raise ValueError(f"attention_mask has shape {tuple(valid.shape)}, the inputs {shape}")
    pos = None
    if position_ids is not None:
        pos = position_ids.detach().cpu().long()
        if pos.dim() == 1:
            pos = pos[None]
        if pos.shape[-1] != seq or pos.shape[0] not in (1, batch):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, the inputs {shape}")
        pos = pos.expand(batch, seq)
    rows: list[int] = []
    lengths: list[int] = []
    for b in range(batch):
        cols, lens = _row_sequences(valid[b], None if pos is None else pos[b], b)
        rows += [b * seq + c for c in cols]
        lengths += lens
    if not lengths:
        raise ValueError("the batch holds no tokens (attention_mask is all zeros)")
    lens_t = torch.tensor(lengths, dtype=torch.int64)
    pages = (lens_t + PAGE - 1) // PAGE  # [num_seqs]
    first_page = torch.cumsum(pages, 0) - pages
    width = int(pages.max())
    # block_tables: [num_seqs, width], each sequence's pages in order (consecutive), padded with page 0.
    table = first_page[:, None] + torch.arange(width)[None, :]
    table = torch.where(torch.arange(width)[None, :] < pages[:, None], table, 0)
    starts = torch.cumsum(lens_t, 0) - lens_t  # each sequence's first flattened token
    positions = torch.arange(int(lens_t.sum())) - torch.repeat_interleave(starts, lens_t)
    slots = torch.repeat_interleave(first_page * PAGE, lens_t) + positions
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(lens_t, 0)))
    attn = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=table.to(torch.int32).to(device),
        seq_lens=lens_t.to(torch.int32).to(device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        kv_caches=[],
    )
    dense = len(rows) == batch * seq  # every token real: rows are 0..n-1 in order
    rows_t = None if dense else torch.tensor(rows, dtype=torch.int64, device=device)
    return FlatLayout(shape, rows_t, positions.to(device), attn, int(pages.sum()))
