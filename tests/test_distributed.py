import pytest
import torch

from tests.distributed_harness import run_ranks
from track_1_short import distributed


def test_world_of_one_collectives_are_local():
    assert distributed.world_size() == 1 and distributed.rank() == 0
    t = torch.arange(4.0)
    distributed.all_reduce_avg(t, async_op=True).wait()
    assert torch.equal(t, torch.arange(4.0))
    out = torch.empty(4)
    distributed.reduce_scatter_avg(out, t).wait()
    assert torch.equal(out, t)
    gathered = torch.zeros(4)
    distributed.all_gather_into(gathered, t).wait()
    assert torch.equal(gathered, t)


def _collectives_worker(rank, world_size):
    x = torch.full((4,), float(rank + 1))
    distributed.all_reduce_avg(x, async_op=True).wait()
    inp = torch.arange(2.0 * world_size) * (rank + 1)
    shard = torch.empty(2)
    distributed.reduce_scatter_avg(shard, inp, async_op=True).wait()
    full = torch.empty(2 * world_size)
    distributed.all_gather_into(full, shard, async_op=True).wait()
    return x, shard, full


@pytest.mark.slow
def test_two_rank_avg_scatter_gather():
    (x0, s0, f0), (x1, s1, f1) = run_ranks(_collectives_worker, 2)
    assert torch.equal(x0, torch.full((4,), 1.5)) and torch.equal(x1, x0)
    expected = torch.arange(4.0) * 1.5
    assert torch.equal(s0, expected[:2]) and torch.equal(s1, expected[2:])
    assert torch.equal(f0, expected) and torch.equal(f1, expected)
