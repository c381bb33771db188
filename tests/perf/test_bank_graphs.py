"""optim.bank_graphs (track_1_short/perf/bank_graphs.py): each bank's update captured once in a CUDA graph and
replayed, against the same update launched op by op.

A replay runs the captured kernels with the arguments they had at capture, so the claim is bitwise: the same
parameters and optimizer state as the ungraphed update, step after step, with the schedule's values changing
in the banks' device scalars. The CPU tests check the switch, its refusal off CUDA and which calls capture
and which replay (with a stand-in for the graph); the ``gpu`` tests check the bits.
"""

from __future__ import annotations

import pytest
import torch

from tests.optim import fake_model as fm
from tests.optim.test_anvil import SPLIT_AT, assert_tree_equal, run_steps, snapshot
from tests.perf_scripts import load_perf_script
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig
from track_1_short.optim.anvil_bank import bank_update_
from track_1_short.perf import bank_graphs
from track_1_short.perf.bank_graphs import GraphedBankUpdate

gpu = pytest.mark.gpu
STEPS = 7
BANKS = [label for label, (_, _, entry) in fm.SPECS.items() if entry.get("optim") == "anvil"]


def build(bank_graphs: bool, bank_update: str = "eager", device: str = "cpu"):
    named = fm.make_params(device=device)
    cfg = OptimConfig(rail_engage_step=3, bank_update=bank_update, bank_graphs=bank_graphs)
    return named, AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, cfg)


def run(named, opt, steps) -> None:
    """The training loop's calls (the schedule, so the banks' scalars, changes every step), on the
    parameters' device."""
    device = next(p.device for _, p in named)
    run_steps(named, opt, steps, lambda s: {k: g.to(device) for k, g in fm.rank_grads(s).items()})


def bank_updates(steps) -> int:
    """Bank updates the steps make: every bank with a gradient, every step (fm drops vo_bank's at step 2)."""
    return sum(not fm.missing_grad(label, s) for s in steps for label in BANKS)


class StandInGraph:
    """What the CPU tests capture instead of a CUDA graph: a replay calls the update with the captured
    operands, so the results are the eager ones and the calls can be counted."""

    def __init__(self, fn, operands, constants):
        self.fn, self.operands, self.constants = fn, operands, constants

    def replay(self) -> None:
        self.fn(*self.operands, **self.constants)


class StandInGraphs(GraphedBankUpdate):
    def __init__(self, update_fn, device):
        super().__init__(update_fn, device)
        self.captured: list[tuple[int, ...]] = []

    def _capture(self, operands, constants):
        self.update_fn(*operands, **constants)  # the capturing call updates, as the real one does
        self.captured.append(tuple(t.data_ptr() for t in operands))
        return StandInGraph(self.update_fn, operands, constants)


def stand_in_optimizer(monkeypatch):
    monkeypatch.setattr(bank_graphs, "check_device", lambda device: None)
    monkeypatch.setattr(bank_graphs, "GraphedBankUpdate", StandInGraphs)
    return build(True)


def assert_switch_validated_and_refused_off_cuda(switch: str) -> None:
    """``optim.<switch>`` must be a bool, and ``true`` on the CPU is refused by name before the optimizer
    exists, the parameters untouched."""
    with pytest.raises(ValueError, match=rf"optim\.{switch}='yes' must be true or false"):
        OptimConfig(**{switch: "yes"})
    named = fm.make_params()
    before = snapshot(named)
    with pytest.raises(RuntimeError, match=rf"CUDA device.*on cpu\. Set optim\.{switch}=false"):
        AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, OptimConfig(**{switch: True}))
    assert_tree_equal(snapshot(named), before)
    assert all(p.grad is None for _, p in named)


def test_the_switch_is_validated_and_refused_off_cuda_before_the_optimizer_exists():
    assert_switch_validated_and_refused_off_cuda("bank_graphs")


def test_each_bank_is_captured_once_then_only_replayed_and_trains_like_the_plain_update(monkeypatch):
    named, opt = stand_in_optimizer(monkeypatch)
    wrapper = next(iter(opt.banks.values())).update_fn
    assert isinstance(wrapper, StandInGraphs) and wrapper.update_fn is bank_update_
    assert all(bank.update_fn is wrapper for bank in opt.banks.values())  # one stream, one pool
    ref_named, ref = build(False)
    run(named, opt, range(STEPS))
    run(ref_named, ref, range(STEPS))
    # One capture per bank, at its first update; every later update is a replay.
    assert wrapper.captures == len(BANKS) == len(set(wrapper.captured))
    assert wrapper.replays == bank_updates(range(STEPS)) - len(BANKS)
    assert_tree_equal(snapshot(named), snapshot(ref_named))
    assert_tree_equal(opt.state_dict(), ref.state_dict())


def test_new_operands_or_constants_are_captured_anew_and_the_operands_are_kept_alive(monkeypatch):
    monkeypatch.setattr(bank_graphs, "check_device", lambda device: None)
    calls = []
    wrapper = StandInGraphs(lambda *ops, **kw: calls.append(kw), "cpu")
    ops = [torch.zeros(2, 3) for _ in range(6)]
    wrapper(*ops, margin=1.05)
    wrapper(*ops, margin=1.05)
    assert (wrapper.captures, wrapper.replays) == (1, 1)
    wrapper(*ops, margin=1.1)  # another constant: another graph
    moved = [*ops[:2], ops[2].clone(), *ops[3:]]  # velocity at another address
    wrapper(*moved, margin=1.05)
    wrapper(*ops[:5], ops[5].view(3, 2), margin=1.05)  # another shape at the same address
    assert (wrapper.captures, wrapper.replays) == (4, 1)
    assert len(calls) == 5
    held = [operands for _, operands in wrapper._graphs.values()]
    assert any(t is moved[2] for operands in held for t in operands)
    with pytest.raises(TypeError, match="takes the 6 operands grad, weight, velocity"):
        wrapper(*ops[:5], margin=1.05)


@gpu
@pytest.mark.parametrize("bank_update", ["eager", "triton"])
def test_on_cuda_replayed_graphs_train_bitwise_like_the_plain_update_and_resume_from_a_loaded_state(
    bank_update,
):
    graphed_named, graphed = build(True, bank_update, "cuda")
    plain_named, plain = build(False, bank_update, "cuda")
    run(graphed_named, graphed, range(SPLIT_AT - 1))
    run(plain_named, plain, range(SPLIT_AT - 1))
    saved_sd, saved = plain.state_dict(), snapshot(plain_named)
    run(graphed_named, graphed, range(SPLIT_AT - 1, STEPS))
    run(plain_named, plain, range(SPLIT_AT - 1, STEPS))
    wrapper = graphed.banks[BANKS[0]].update_fn
    assert wrapper.captures == len(BANKS) and wrapper.replays == bank_updates(range(STEPS)) - len(BANKS)
    assert_tree_equal(snapshot(graphed_named), snapshot(plain_named))
    assert_tree_equal(graphed.state_dict(), plain.state_dict())
    # State loaded in place mid-run (the graphs keep their addresses): the replays continue on the same bits.
    with torch.no_grad():
        for _, p in graphed_named:
            p.copy_(saved[p.label])
    graphed.load_state_dict(saved_sd)
    run(graphed_named, graphed, range(SPLIT_AT - 1, STEPS))
    assert wrapper.captures == len(BANKS)
    assert_tree_equal(snapshot(graphed_named), snapshot(plain_named))
    graphed.assert_views_intact()


@gpu
def test_on_cuda_a_capture_that_differs_from_the_eager_run_is_refused_and_the_step_kept():
    # An update that reads a host value which changes between calls: the capture records another value than
    # the eager run used, which is what the check exists to catch.
    calls = []

    def host_dependent_update(grad, weight, velocity, lane_energy, mantissa, scalars, **_):
        calls.append(None)
        velocity.add_(float(len(calls)))

    wrapper = GraphedBankUpdate(host_dependent_update, "cuda")
    ops = [torch.zeros(4, 8, 8, device="cuda") for _ in range(6)]
    with pytest.raises(RuntimeError, match=r"other bits than the same update run eagerly, in velocity"):
        wrapper(*ops, margin=1.05)
    assert torch.equal(ops[2], torch.ones_like(ops[2]))  # the eager run's step: + 1, not the capture's + 2
    assert wrapper.captures == 0


def step_side_by_side(runs, steps: int) -> None:
    """``steps`` ANVIL steps of each (named, optimizer, gradients) that bench_optimizer.build returned, every
    step feeding each optimizer the same gradients."""
    for _ in range(steps):
        for named, opt, grads in runs:
            for label, p in named:
                p.grad = grads[label]
            opt.step(do_adam=False)


@gpu
def test_on_cuda_the_track1_banks_replay_bitwise_through_the_benchmarked_optimizer():
    # The bench's optimizer at the record's bank shapes (cuBLAS picks its kernels by shape): graphed and plain
    # steps from the same weights and gradients end on the same bits.
    bench = load_perf_script("bench_optimizer")
    device = torch.device("cuda")
    runs = [bench.build(bench.TRACK1_BANKS, device, "triton", "bmm", graphs) for graphs in (False, True)]
    step_side_by_side(runs, 3)
    (plain_named, plain, _), (graphed_named, graphed, _) = runs
    assert next(iter(graphed.banks.values())).update_fn.replays == 2 * len(graphed.banks)
    assert_tree_equal(snapshot(graphed_named), snapshot(plain_named))
    assert_tree_equal(graphed.state_dict(), plain.state_dict())
