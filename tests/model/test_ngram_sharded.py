"""The sharded n-gram table on 2 and 3 gloo ranks against one process holding it whole: the pull, the forward,
the gradient's return to the owners and the update; which bytes go on the wire; micro batches.

Every rank's batches are also run, in rank order, as micro batches of one process (world size 1). The
upstream gradients are small integers, so every row's gradient sum is exact in fp32 whatever order it is
summed in: equality with world size 1 is then bitwise and isolates the routing (a row served from the wrong
owner, a gradient sent to the wrong one or dropped or counted twice all change bits).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_ranks
from track_1_short import distributed
from track_1_short.model.config import NgramConfig
from track_1_short.model.ngram import NgramTable, ngram_embed
from track_1_short.optim.anvil import OptimConfig
from track_1_short.optim.ngram_adam import NgramAdam

ROWS, DIM, POOL = 998, 8, 16  # 998 rows on 3 ranks: 333 a rank, one padding row on the last
CYCLES, MICRO, TOKENS = 3, 2, 40
# rows every rank reads often: each shard's first and last rows at 2 and 3 ranks, the channels' reserved rows
HOT = torch.tensor([0, 150, 332, 333, 498, 499, 665, 666, 997])


def _cfg() -> NgramConfig:
    return NgramConfig(enabled=True, rows=ROWS, dim=DIM, sign_pool_rows=POOL)


def _table0() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7)).bfloat16()


def _pool() -> torch.Tensor:
    return torch.where(torch.randn(POOL, DIM, generator=torch.Generator().manual_seed(8)) >= 0, 1.0, -1.0)


def _batches(data_ranks: int, local_rows: bool = False) -> list[list[list[tuple]]]:
    """[cycle][data rank][micro batch] -> (row ids [2T], sign rows [2T], integer weights [T, DIM]). Rows
    cluster on the HOT ones (read by every rank) plus uniform ones; ``local_rows``: each data rank reads
    only rows its own shard holds (at world size = data_ranks)."""
    g = torch.Generator().manual_seed(data_ranks)
    per = -(-ROWS // data_ranks)
    out = []
    for _ in range(CYCLES):
        cycle = []
        for r in range(data_ranks):
            micro = []
            for _ in range(MICRO):
                if local_rows:
                    ids = torch.randint(r * per, min((r + 1) * per, ROWS), (2 * TOKENS,), generator=g)
                else:
                    hot = HOT[torch.randint(0, len(HOT), (2 * TOKENS,), generator=g)]
                    ids = torch.where(torch.rand(2 * TOKENS, generator=g) < 0.4, hot,
                                      torch.randint(0, ROWS, (2 * TOKENS,), generator=g))  # fmt: skip
                signs = torch.randint(0, POOL, (2 * TOKENS,), generator=g)
                weights = torch.randint(-3, 4, (TOKENS, DIM), generator=g).float()
                micro.append((ids, signs, weights))
            cycle.append(micro)
        out.append(cycle)
    return out


def _train(
    rank: int,
    world: int,
    data_ranks: int,
    merge_micro: bool = False,
    local_rows: bool = False,
    device: str = "cpu",
):
    """Run every cycle; this process takes the data ranks it stands for (all of them at world size 1)."""
    cfg, pool = _cfg(), _pool()
    table = NgramTable(cfg, rank=rank, world=world, device=device)
    pool = pool.to(device)
    real = min(table.per_rank, ROWS - table.first_row)
    table.shard[:real] = _table0()[table.first_row : table.first_row + real]
    opt = NgramAdam(table, cfg, OptimConfig())
    mine = range(data_ranks) if world == 1 else [rank]
    outputs, wire = [], []
    for c, cycle in enumerate(_batches(data_ranks, local_rows)):
        micro = [m for r in mine for m in cycle[r]]
        if merge_micro:  # one micro batch holding them all: the embedding is per position, so the same sums
            micro = [(torch.cat([m[0][:TOKENS] for m in micro] + [m[0][TOKENS:] for m in micro]),
                      torch.cat([m[1][:TOKENS] for m in micro] + [m[1][TOKENS:] for m in micro]),
                      torch.cat([m[2] for m in micro]))]  # fmt: skip
        before = distributed.wire_bytes_sent
        table.pull([m[0] for m in micro])
        pulled = distributed.wire_bytes_sent - before
        for ids, signs, weights in micro:
            ids, signs, weights = ids.to(device), signs.to(device), weights.to(device)
            out = ngram_embed(table.lookup(ids), pool, signs)
            outputs.append(out.detach().cpu())
            (out.float() * weights).sum().backward()
        before = distributed.wire_bytes_sent
        rows, grads = table.row_grads()
        opt.update(rows, grads, lr=0.01 * (1 + c), beta2=0.95, wd_mul=5.0, grad_mul=1.0 / data_ranks)
        wire.append((pulled, distributed.wire_bytes_sent - before))
    opt.bring_current()
    real = min(table.per_rank, ROWS - table.first_row)
    return dict(
        shard=table.shard[:real].cpu(),
        v=opt.exp_avg_sq[:real].cpu(),
        padding=table.shard[real:].cpu(),
        outputs=outputs,
        wire=wire,
    )


def _expected_wire(rank: int, world: int, local_rows: bool) -> list[tuple[int, int]]:
    """Bytes rank ``rank`` must send per cycle, from the data alone: its remote row ids (int64) and, for each
    row a peer reads from its shard, the bf16 row; then the fp32 gradient of each remote row."""
    per = -(-ROWS // world)
    out = []
    for cycle in _batches(world, local_rows):
        wants = [torch.unique(torch.cat([m[0] for m in cycle[r]])) for r in range(world)]
        remote = int(((wants[rank] // per) != rank).sum())
        served = sum(int(((wants[r] // per) == rank).sum()) for r in range(world) if r != rank)
        out.append((8 * remote + 2 * DIM * served, 4 * DIM * remote))
    return out


def _worker(rank: int, world: int):
    return dict(
        spread=_train(rank, world, world),
        merged=_train(rank, world, world, merge_micro=True),
        local=_train(rank, world, world, local_rows=True),
        expected=_expected_wire(rank, world, False),
    )


def _whole(results: list[dict], key: str) -> torch.Tensor:
    return torch.cat([r[key] for r in results])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_table_equals_world_size_one(world):
    results = run_ranks(_worker, world)
    ref = _train(0, 1, world)
    ref_merged = _train(0, 1, world, merge_micro=True)
    spread = [r["spread"] for r in results]
    assert torch.equal(_whole(spread, "shard"), ref["shard"])
    assert torch.equal(_whole(spread, "v"), ref["v"])
    assert not torch.equal(ref["shard"], _table0())  # the updates moved rows
    assert all(r["padding"].eq(0).all() for r in spread)  # padding rows are never read or moved
    # the forward read the same rows: world size 1 runs rank r's micro batches r-th in each cycle
    per_cycle = [r["outputs"] for r in spread]
    for c in range(CYCLES):
        for r in range(world):
            for m in range(MICRO):
                got = per_cycle[r][c * MICRO + m]
                assert torch.equal(got, ref["outputs"][c * world * MICRO + r * MICRO + m])
    # one micro batch a rank, against several: the same table
    merged = [r["merged"] for r in results]
    assert torch.equal(_whole(merged, "shard"), ref["shard"])
    assert torch.equal(ref_merged["shard"], ref["shard"])
    # bytes on the wire: exactly the remote rows' ids, the served rows and the remote rows' gradients
    for rank, r in enumerate(results):
        assert r["spread"]["wire"] == r["expected"], rank
        assert r["local"]["wire"] == [(0, 0)] * CYCLES  # every row local: nothing on the wire
    assert all(r["spread"]["wire"][0][0] > 0 for r in results)


def test_world_size_one_sends_nothing():
    result = _train(0, 1, 2)
    assert result["wire"] == [(0, 0)] * CYCLES


def _cuda_worker(rank: int, world: int):
    return _train(rank, world, world, device="cuda")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible"
)
def test_sharded_table_on_two_nccl_ranks_equals_world_size_one():
    """The same exchange through NCCL (counts on the device); the reference on one CPU process."""
    results = run_ranks(_cuda_worker, 2, device="cuda")
    ref = _train(0, 1, 2)
    assert torch.equal(_whole(results, "shard"), ref["shard"])
    assert torch.equal(_whole(results, "v"), ref["v"])
