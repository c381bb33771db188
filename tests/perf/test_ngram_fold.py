"""perf/kernels/ngram_fold.py: the sorted segment sum of the n-gram row gradients against the reference fold
(an fp32 index_add on the CPU), bit for bit (under the interpreter on the CPU; ``gpu`` on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.perf.compile_sm90 import assert_kernels_compile
from track_1_short.perf.kernels.ngram_fold import fold_rows_


def _case(seed: int, n: int = 300, slots: int = 40, dim: int = 50):
    """Sums with values in them, slots with long runs (a hot row, as the reserved rows are) and rows touched
    once, gradients spanning many magnitudes (so the order of the adds shows in the bits)."""
    g = torch.Generator().manual_seed(seed)
    sums = torch.randn(slots, dim, generator=g) * 10
    ids = torch.randint(0, slots - 5, (n,), generator=g)  # the last five rows untouched
    ids[::3] = 7  # a third of the tokens on one row
    grads = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-20, 8, (n, 1), generator=g).float())
    return sums, ids, grads.bfloat16()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_fold_equals_the_cpu_index_add_bitwise(device):
    sums, ids, grads = _case(3)
    want = sums.clone().index_add_(0, ids, grads.float())  # the CPU adds in token order, left to right
    got = sums.to(device)
    fold_rows_(got, ids.to(device), grads.to(device))
    assert torch.equal(got.cpu(), want)
    untouched = torch.ones(sums.size(0), dtype=torch.bool)
    untouched[ids] = False
    assert untouched.any() and torch.equal(got.cpu()[untouched], sums[untouched])


def test_the_fold_adds_in_token_order():
    # Stated from the definition: 1 + 2^-24 + 2^-24 in fp32 left to right is 1 (each small add rounds away);
    # 2^-24 + 2^-24 first would give 1 + 2^-23. Row 0's tokens follow row 1's: the sort must keep their order.
    # Row 2 holds -0 and gets a -0 gradient: -0 + -0 is -0, and nothing past its run may add a +0.
    sums = torch.zeros(3, 4)
    sums[2] = -0.0
    ids = torch.tensor([1, 0, 0, 0, 2])
    grads = torch.tensor([[5.0] * 4, [1.0] * 4, [2.0**-24] * 4, [2.0**-24] * 4, [-0.0] * 4]).bfloat16()
    fold_rows_(sums, ids, grads)
    assert sums[0].tolist() == [1.0] * 4 and sums[1].tolist() == [5.0] * 4
    assert torch.signbit(sums[2]).all()


def test_the_fold_takes_an_fp32_table_and_refuses_other_dtypes():
    sums, ids, grads = _case(4)
    want = sums.clone().index_add_(0, ids, grads.float())
    fold_rows_(sums, ids, grads.float())
    assert torch.equal(sums, want)
    with pytest.raises(ValueError, match="grads bf16 or fp32"):
        fold_rows_(torch.zeros(2, 4), torch.tensor([0]), torch.zeros(1, 4, dtype=torch.float16))


def test_the_kernel_compiles_for_the_h100_on_this_machine():
    # The interpreter accepts code Triton's compiler refuses (its data-dependent loop, here): compiled with
    # no GPU.
    sig = {"sums_ptr": "*fp32", "grad_ptr": "*bf16", "sorted_ptr": "*i64", "order_ptr": "*i64", "n": "i32"}
    consts = {"D": 768, "BLOCK": 1024, "CHUNK": 8, "AS_BITS": False}
    assert_kernels_compile("track_1_short.perf.kernels.ngram_fold", {"_fold_runs_kernel": sig}, consts)


def test_a_tables_cycle_gradient_is_the_same_with_either_fold():
    from track_1_short.model.config import NgramConfig
    from track_1_short.model.ngram import NgramTable, ngram_embed

    results = []
    for impl in ("reference", "triton"):
        table = NgramTable(NgramConfig(enabled=True, rows=200, dim=24, fold_impl=impl))
        g = torch.Generator().manual_seed(8)
        batches = [torch.randint(0, 200, (64,), generator=g) for _ in range(3)]
        batches[1][:20] = 199  # a hot row, as the reserved rows are
        table.pull(batches)
        pool = torch.where(torch.randn(4, 24, generator=g) >= 0, 1.0, -1.0).bfloat16()
        for ids in batches:  # three micro batches' forwards and backwards, folded after each
            out = ngram_embed(table.lookup(ids), pool, torch.randint(0, 4, ids.shape, generator=g))
            (out.float() * torch.randn(out.shape, generator=g) * 2.0**-10).sum().backward()
            table.fold_sinks()
        results.append(table.row_grads())
    (rows_r, grads_r), (rows_t, grads_t) = results
    assert torch.equal(rows_r, rows_t) and torch.equal(grads_r, grads_t)
    assert grads_r.abs().sum() > 0
