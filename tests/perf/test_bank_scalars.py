"""track_1_short/perf/bank_scalars.py: every bank's scalars in one upload ("batched") against each bank's own
copy (``AnvilBank.stage``, "per_bank", the reference), on the optimizer tests' fake model
(tests/optim/fake_model.py).

Comparisons are bitwise: both paths write the same fp32 values into the tensors the bank update reads, so
nothing downstream may differ by a single bit."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_ranks
from tests.optim import fake_model as fm
from tests.optim.test_anvil import assert_tree_equal, from_bytes, lr_multiplier, snapshot, to_bytes
from tests.perf.test_replicated_adam import _FakeEvent  # the ring protocol's CPU stand-in
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig
from track_1_short.optim.anvil_bank import AnvilBank, scalar_row, scalars_size
from track_1_short.perf.bank_scalars import BANK_SCALAR_SLOTS, BankScalarStaging

STEPS = 8  # rails engage at 3 (make_cfg), embed splits at 4: both regimes and the untie run in both modes
SPLIT_AT = 4


def stage_per_bank(opt: AnvilAndAdam) -> None:
    """Route ``opt``'s set_schedule through the reference upload: each bank's own AnvilBank.stage."""

    def stage(rows):
        for label, row in rows.items():
            opt.banks[label].stage(*row[:4], list(row[4:]))

    opt._bank_staging.stage = stage


def build(mode: str, device="cpu", named=None):
    named = fm.make_params(device=device) if named is None else named
    cfg = OptimConfig(replicated_impl="reference", rail_engage_step=3)
    opt = AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, cfg)
    if mode == "per_bank":
        stage_per_bank(opt)
        opt.set_schedule(1.0, cfg.anvil_momentum, 0)  # construction staged through the batched row
    return named, opt


def bank_scalars(opt) -> dict[str, torch.Tensor]:
    return {label: bank.scalars.detach().cpu().clone() for label, bank in opt.banks.items()}


def run_both(steps: int, device="cpu", grads_for=fm.rank_grads) -> tuple[list, dict]:
    """Both modes stepped side by side; returns per step (batched, per_bank) bank scalars, and the finals."""
    runs = {mode: build(mode, device) for mode in ("batched", "per_bank")}
    staged = []
    for s in range(steps):
        for _, opt in runs.values():
            if s == SPLIT_AT:
                opt.split_embed()
            opt.set_schedule(lr_multiplier(s), 0.85 + 0.01 * (s % 8), s)
        staged.append(tuple(bank_scalars(opt) for _, opt in runs.values()))
        for named, opt in runs.values():
            fm.accumulate(named, grads_for(s))
            opt.step(do_adam=s % 2 == 1)
    final = {mode: (snapshot(named), opt.state_dict()) for mode, (named, opt) in runs.items()}
    for _, opt in runs.values():
        opt.assert_views_intact()
    return staged, final


def assert_modes_agree(staged, final, where: str) -> None:
    for s, (batched, per_bank) in enumerate(staged):
        assert_tree_equal(batched, per_bank, f"{where}: bank scalars staged for step {s}")
    assert_tree_equal(final["batched"][0], final["per_bank"][0], f"{where}: parameters")
    assert_tree_equal(final["batched"][1], final["per_bank"][1], f"{where}: optimizer state")


def test_batched_and_per_bank_uploads_train_bitwise_the_same_parameters_and_state():
    staged, final = run_both(STEPS)
    assert_modes_agree(staged, final, "world 1")
    # The steps differ from each other (lr multiplier, rail beta, engaged rails), so equal rows are a real
    # check, not the same row read twice.
    assert not torch.equal(staged[0][0]["qk_bank"], staged[5][0]["qk_bank"])


def _two_rank_worker(rank: int, world: int) -> bytes:
    staged, final = run_both(STEPS, grads_for=lambda s: fm.rank_grads(s, rank, world))
    return to_bytes((staged, final))


@pytest.mark.slow
def test_batched_and_per_bank_agree_on_two_ranks_with_padded_banks():
    # At 2 ranks qk_bank's 3 matrices pad to 4: rank 1 owns a pad matrix whose eff_lr is 0 in both modes.
    for rank, data in enumerate(run_ranks(_two_rank_worker, 2)):
        staged, final = from_bytes(data)
        assert_modes_agree(staged, final, f"world 2, rank {rank}")


def test_bank_views_tile_one_buffer_in_bank_order():
    _, opt = build("batched")
    buffer = opt._bank_staging.buffer
    offset = 0
    for label, bank in opt.banks.items():
        assert bank.scalars.data_ptr() == buffer.data_ptr() + 4 * offset, label  # fp32: 4 bytes a value
        assert bank.scalars.numel() == scalars_size(bank.grad.shape[0]), label
        offset += bank.scalars.numel()
    assert offset == buffer.numel()


def test_one_stage_writes_bitwise_what_each_banks_own_copy_writes():
    # Values that round (1/3, 0.1), ties at fp32 precision (1 + 2^-24 rounds to even: 1.0; 1 + 3 * 2^-24 up),
    # a subnormal, -0.0 and a value fp32 can only approximate near its top.
    awkward = [1 / 3, 0.1, 1 + 2**-24, 1 + 3 * 2**-24, 1e-40, -0.0, 3.4e38, -2.5e-8]
    rows = {"a": scalar_row(*awkward[:4], awkward[4:]), "b": scalar_row(0.5, *awkward[5:], [7.0, 1e-45])}
    staging = BankScalarStaging({label: len(row) for label, row in rows.items()}, "cpu")
    staging.stage(rows)
    for label, row in rows.items():
        chunk = len(row) - scalars_size(0)
        bank = AnvilBank(
            label, torch.zeros(chunk, 2, 2, dtype=torch.bfloat16), torch.zeros(chunk, 2, 2), 0.9, 0.98, 1.05
        )
        bank.stage(*row[:4], row[4:])
        assert torch.equal(staging.view(label).view(torch.int32), bank.scalars.view(torch.int32)), label


def test_each_stage_is_one_upload_and_leaves_the_previous_steps_row_untouched():
    log, events = [], []

    def factory():
        events.append(_FakeEvent(log, len(events)))
        return events[-1]

    slots = 3
    staging = BankScalarStaging({"a": 5, "b": 6}, "cpu", slots=slots, event_factory=factory)
    host_rows = staging._ring._slots
    for s in range(2 * slots + 1):
        rows = {"a": [float(s)] * 5, "b": [-float(s)] * 6}
        staging.stage(rows)
        want = torch.tensor(rows["a"] + rows["b"])
        assert torch.equal(staging.buffer, want), s
        # The row of step s - 1 (its copy may still be queued on a GPU) was not written by step s.
        if s > 0:
            assert torch.equal(host_rows[(s - 1) % slots], want - torch.tensor([1.0] * 5 + [-1.0] * 6)), s
    # Per stage: wait on the row's previous upload, then one upload (recorded), the rows taken in turn.
    assert log == [e for s in range(2 * slots + 1) for e in (("wait", s % slots), ("record", s % slots))]


def test_bad_rows_are_refused_before_the_host_row_is_written():
    staging = BankScalarStaging({"a": 5, "b": 6}, "cpu")
    staging.stage({"a": [1.0] * 5, "b": [2.0] * 6})
    with pytest.raises(ValueError, match="'b' has 5 values, its scalars 6"):
        staging.stage({"a": [3.0] * 5, "b": [3.0] * 5})
    with pytest.raises(ValueError, match="rows for \\['a'\\]"):
        staging.stage({"a": [3.0] * 5})
    assert torch.equal(staging.buffer, torch.tensor([1.0] * 5 + [2.0] * 6))
    assert torch.equal(staging._ring._slots[0], staging.buffer)  # the host row kept the last good values


def test_a_bank_refuses_scalars_of_the_wrong_size():
    with pytest.raises(ValueError, match="'qk'.*needs \\(6,\\) float32"):
        AnvilBank(
            "qk",
            torch.zeros(2, 2, 2, dtype=torch.bfloat16),
            torch.zeros(2, 2, 2),
            0.9,
            0.98,
            1.05,
            torch.zeros(5),
        )


@pytest.mark.gpu
def test_on_cuda_rows_are_pinned_and_queued_uploads_read_their_own_steps_values():
    staging = BankScalarStaging({"a": 5, "b": 6}, "cuda")
    ring = staging._ring
    assert len(ring._slots) == BANK_SCALAR_SLOTS and all(row.is_pinned() for row in ring._slots)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every copy below queues behind it
    copies = []
    for s in range(3 * BANK_SCALAR_SLOTS):
        staging.stage({"a": [float(s)] * 5, "b": [-float(s)] * 6})
        copies.append(staging.buffer.clone())  # stream-ordered: what the banks would read at step s
    torch.cuda.synchronize()
    for s, got in enumerate(copies):
        assert torch.equal(got.cpu(), torch.tensor([float(s)] * 5 + [-float(s)] * 6)), s


@pytest.mark.gpu
def test_on_cuda_batched_and_per_bank_uploads_train_bitwise_the_same():
    staged, final = run_both(STEPS, device="cuda")
    assert_modes_agree(staged, final, "cuda")


@pytest.mark.gpu
def test_on_cuda_set_schedule_never_waits_for_the_gpu_and_the_per_bank_reference_does():
    # torch's sync debug mode raises on every host wait it knows of (stream syncs, pageable copies); an event
    # wait is not one, and the ring's never blocks here anyway. This is the whole lever: the reference waits.
    cuda = torch.device("cuda")
    for mode, syncs in (("batched", False), ("per_bank", True)):
        _, opt = build(mode, device=cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if syncs:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    opt.set_schedule(0.5, 0.9, 1)
            else:
                for s in range(2 * BANK_SCALAR_SLOTS):
                    opt.set_schedule(0.5, 0.9, s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
