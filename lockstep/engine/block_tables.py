"""Block tables kept on the model's device and updated with only what changed since the last step.

A step's attention needs every sequence's block table as a ``[num_seqs, width]`` tensor. Building it from the
Python lists each step costs the host ``num_seqs x blocks`` element conversions (12 ms a step at 256 sequences
of ~1k tokens on the H200's host), though a decode step adds a block to a sequence only once every
``block_size`` tokens. Here each sequence keeps a row of one device table; a step sends the rows it uses and the
table entries that are new since that row was last written, a few dozen integers at decode.

A sequence's table only grows by appends until it is freed, and ``BlockManager.allocate``/``free`` replace the
list object: a row remembers the list it mirrors and how much of it was written, and starts over when the list
object changes. The bits of attention never depend on which row a sequence has.

A row holds its sequence (so that the sequence's id, the row's key, cannot be reused meanwhile). Rows of finished
sequences are given back at the next step that leaves rows unused: kept until the rows ran out, up to
``num_rows`` finished sequences stayed alive, and with them their requests' parameters (a structured output's
schema, megabytes) long after their end.
"""

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from lockstep.engine.sequence import Sequence


class _Row:
    __slots__ = ("seq", "table", "written")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.table: list[int] | None = None  # the block_table list object this row mirrors
        self.written = 0  # leading entries of that list already in the device row


@dataclass
class TableUpdate:
    """What one step does to the device table: the row of each of its sequences (in batch order) and the entries
    ``table[rows[i], cols[i]] = values[i]`` to write first. Plain lists: rank 0 sends them to the other
    tensor-parallel ranks as part of the step."""

    picks: list[int]
    rows: list[int]
    cols: list[int]
    values: list[int]


class DeviceBlockTables:
    """``table: [num_rows, max_blocks]`` int32 on ``device``; ``num_rows`` must cover the largest step.

    ``plan`` (rank 0, which has the sequences) decides the rows and the new entries; ``apply`` (every rank)
    writes them into its own copy of the table."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device) -> None:
        self.table = torch.zeros((num_rows, max_blocks), dtype=torch.int32, device=device)
        self._rows: list[_Row | None] = [None] * num_rows
        self._row_of: dict[int, int] = {}  # id(seq) -> row; the row holds seq, so the id cannot be reused meanwhile
        self._free = list(range(num_rows - 1, -1, -1))

    def plan(self, seqs: Seq[Sequence]) -> TableUpdate:
        """Rows for ``seqs`` and the entries appended to their tables since their rows were last written."""
        if len(seqs) > self.table.shape[0]:
            raise ValueError(f"{len(seqs)} sequences in one step, the block tables hold {self.table.shape[0]}")
        update = TableUpdate([], [], [], [])
        if len(self._row_of) > len(seqs):  # rows held by sequences not in this step: some may have finished
            self._give_back(lambda row: row.seq.is_finished)
        for seq in seqs:
            index = self._row_of.get(id(seq))
            if index is None:
                index = self._take_row(seq, seqs)
            row = self._rows[index]
            table = seq.block_table
            if row.table is not table:
                row.table, row.written = table, 0
            n = len(table)
            if n > row.written:
                if n > self.table.shape[1]:
                    raise ValueError(
                        f"{seq.request_id!r} holds {n} blocks, the block tables hold {self.table.shape[1]}"
                    )
                update.rows += [index] * (n - row.written)
                update.cols += range(row.written, n)
                update.values += table[row.written :]
                row.written = n
            update.picks.append(index)
        return update

    def apply(self, update: TableUpdate) -> torch.Tensor:
        """Write ``update``'s entries; its rows, int64 on the table's device. One host-to-device copy."""
        host = torch.tensor(update.picks + update.rows + update.cols + update.values, dtype=torch.int64)
        device = self.table.device
        if device.type == "cuda":
            host = host.pin_memory()
        data = host.to(device, non_blocking=True)
        p, u = len(update.picks), len(update.rows)
        if u:
            self.table[data[p : p + u], data[p + u : p + 2 * u]] = data[p + 2 * u :].to(torch.int32)
        return data[:p]

    def _give_back(self, done) -> None:
        """Free the rows for which ``done(row)`` holds."""
        for key, index in list(self._row_of.items()):
            if done(self._rows[index]):
                del self._row_of[key]
                self._rows[index] = None
                self._free.append(index)

    def _take_row(self, seq: Sequence, step: Seq[Sequence]) -> int:
        if not self._free:  # give back the rows of every sequence this step does not use
            in_step = {id(s) for s in step}
            self._give_back(lambda row: id(row.seq) not in in_step)
        index = self._free.pop()
        self._rows[index] = _Row(seq)
        self._row_of[id(seq)] = index
        return index

    def gather(self, picks: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(picks), width]``: the first ``width`` entries of each picked row."""
        return self.table[:, :width].index_select(0, picks)
