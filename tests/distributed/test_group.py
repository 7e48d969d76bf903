"""TPGroup's collectives on real gloo processes, and the chunk tree finished across them."""

import time

import pytest
import torch
import torch.multiprocessing as mp
from tp_spawn import COLLECTIVE_TIMEOUT, run_ranks

from lockstep.distributed import TPGroup
from lockstep.ops.tp_linear import CHUNKS, finish, subtree, tree_linear, tree_reduce


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8 * 24, generator=gen)
    return x, torch.randn(50, 8 * 24, generator=gen), torch.randn(50, generator=gen)


def _collectives(group: TPGroup) -> dict:
    r, n = group.rank, group.size
    gathered = group.all_gather(torch.full((3, 2), float(r)))
    buffer = torch.empty(n, 5, dtype=torch.bfloat16)
    into = group.all_gather(torch.arange(5, dtype=torch.bfloat16) + r, out=buffer)
    # Row i belongs to rank i % n; it holds -0.0 in column 0, which a float sum would turn into +0.0.
    owned = torch.tensor([[-0.0, 1.5 + i, float("nan")] for i in range(2 * n)]).bfloat16().repeat(1, 2)
    mine = torch.tensor([i % n == r for i in range(2 * n)])
    disjoint = group.sum_disjoint(owned.masked_fill(~mine[:, None], 0.0))
    same_buffer = into.data_ptr() == buffer.data_ptr()
    return dict(gathered=gathered, same_buffer=same_buffer, into=into, disjoint=disjoint, tree=_tree(group))


def _tree(group: TPGroup) -> torch.Tensor:
    x, w, b = _inputs()
    k = x.shape[1] // group.size
    own = slice(group.rank * k, (group.rank + 1) * k)
    root = subtree(x[:, own].contiguous(), w[:, own].contiguous(), CHUNKS // group.size)
    return finish(tree_reduce(group.all_gather(root)), b, x.dtype)


def test_single_process_group_needs_no_backend():
    group = TPGroup()
    x = torch.arange(4.0)
    assert torch.equal(group.all_gather(x), x[None])
    assert group.sum_disjoint(x) is x and group.all_reduce(x) is x
    with pytest.raises(ValueError, match="rank"):
        TPGroup(rank=2, size=2)


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_on_gloo(size):
    results = run_ranks(_collectives, size)
    x, w, b = _inputs()
    single = tree_linear(x, w, b)
    owned = torch.tensor([[-0.0, 1.5 + i, float("nan")] for i in range(2 * size)]).bfloat16().repeat(1, 2)
    for res in results:
        assert torch.equal(res["gathered"], torch.arange(size, dtype=torch.float32)[:, None, None].expand(-1, 3, 2))
        assert res["same_buffer"]
        assert torch.equal(res["into"], torch.arange(5, dtype=torch.bfloat16) + torch.arange(size)[:, None])
        assert torch.equal(res["disjoint"].view(torch.int16), owned.view(torch.int16))  # -0.0 and NaN exact
        # The chunk tree finished across processes: the single process's bits on every rank.
        assert torch.equal(res["tree"], single), f"{int((res['tree'] != single).sum())} differ"


def _fail_on_rank_1(group: TPGroup) -> None:
    if group.rank == 1:
        raise RuntimeError("rank 1 fails")
    group.all_gather(torch.zeros(1))  # waits for rank 1, which never comes


def test_a_failing_worker_ends_the_run_without_hanging():
    # torch's process context reports the first worker it sees fail: rank 1's error, or rank 0's broken
    # connection, whichever it checks first.
    start = time.monotonic()
    with pytest.raises((mp.ProcessRaisedException, mp.ProcessExitedException)):
        run_ranks(_fail_on_rank_1, 2)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT.total_seconds()
