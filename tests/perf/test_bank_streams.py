"""optim.bank_streams (track_1_short/perf/bank_streams.py): each bank's update on a CUDA stream of its own.

The claim is bitwise (the same kernels on the same operands as the serial order) and an ordering: every bank
launched before any is waited for, each bank's all-gather after the wait. The CPU tests check the switch, its
refusal off CUDA and the ordering (with a stand-in that records the calls and runs each update at once); the
``gpu`` tests check the bits against the serial order.
"""

from __future__ import annotations

import pytest
import torch

from tests.optim import fake_model as fm
from tests.optim.test_anvil import assert_tree_equal, run_steps, snapshot
from tests.perf.test_bank_graphs import (
    StandInGraphs,
    assert_switch_validated_and_refused_off_cuda,
    step_side_by_side,
)
from tests.perf_scripts import load_perf_script
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig
from track_1_short.perf import bank_graphs, bank_streams
from track_1_short.perf.bank_streams import BankStreams

gpu = pytest.mark.gpu
STEPS = 7
BANKS = [label for label, (_, _, entry) in fm.SPECS.items() if entry.get("optim") == "anvil"]


def build(bank_streams: bool, device: str = "cpu", **cfg):
    named = fm.make_params(device=device)
    config = OptimConfig(rail_engage_step=3, bank_streams=bank_streams, **cfg)
    return named, AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, config)


def run(named, opt, steps) -> None:
    device = next(p.device for _, p in named)
    run_steps(named, opt, steps, lambda s: {k: g.to(device) for k, g in fm.rank_grads(s).items()})


class RecordingStreams(BankStreams):
    """What the CPU tests use instead of CUDA streams: a launch runs the update at once and is logged, as is
    each join; ``log`` is shared with the gathers the test wraps."""

    log: list[tuple[str, str]] = []

    def __init__(self, labels, device):
        self.streams = dict.fromkeys(labels)
        self._launched = []

    def launch(self, label, update):
        self.log.append(("launch", label))
        update()
        self._launched.append(label)

    def join(self):
        launched, self._launched = self._launched, []
        self.log.extend(("join", label) for label in launched)
        return launched


def recording_optimizer(monkeypatch, **cfg):
    monkeypatch.setattr(bank_streams, "check_device", lambda device: None)
    monkeypatch.setattr(bank_streams, "BankStreams", RecordingStreams)
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(RecordingStreams, "log", log)
    named, opt = build(True, **cfg)
    for label, shards in opt.shards.items():
        real = shards.gather

        def gather(full, label=label, real=real):
            log.append(("gather", label))
            return real(full)

        shards.gather = gather
    return named, opt, log


def test_the_switch_is_validated_and_refused_off_cuda_before_the_optimizer_exists():
    assert_switch_validated_and_refused_off_cuda("bank_streams")


def test_every_bank_is_launched_before_any_is_waited_for_and_gathered_after_the_wait(monkeypatch):
    named, opt, log = recording_optimizer(monkeypatch)
    ref_named, ref = build(False)
    run(named, opt, [0])
    log.clear()
    run(named, opt, [1])  # an Adam step: the tables are updated and gathered too
    run(ref_named, ref, [0, 1])
    kinds = [kind for kind, _ in log]
    # The banks in work order: launched, then all joined, then gathered, each list in work order.
    banks_in_order = [label for label in fm.WORK_ORDER if label in BANKS]
    assert [label for kind, label in log if kind == "launch"] == banks_in_order
    assert [label for kind, label in log if kind == "join"] == banks_in_order
    last_launch = max(i for i, k in enumerate(kinds) if k == "launch")
    first_join = kinds.index("join")
    assert last_launch < first_join  # a join inside the loop would serialise the banks again
    bank_gathers = [i for i, (kind, label) in enumerate(log) if kind == "gather" and label in BANKS]
    assert len(bank_gathers) == len(BANKS) and min(bank_gathers) > max(
        i for i, k in enumerate(kinds) if k == "join"
    )
    # The other sharded labels are updated and gathered between the launches, as in the serial order.
    other = [i for i, (kind, label) in enumerate(log) if kind == "gather" and label not in BANKS]
    assert other and all(i < first_join for i in other)
    # The stand-in runs each update at once, so the results are the serial order's, bit for bit.
    run(named, opt, range(2, STEPS))
    run(ref_named, ref, range(2, STEPS))
    assert_tree_equal(snapshot(named), snapshot(ref_named))
    assert_tree_equal(opt.state_dict(), ref.state_dict())


def test_with_bank_graphs_every_bank_gets_its_own_graph_wrapper(monkeypatch):
    monkeypatch.setattr(bank_graphs, "check_device", lambda device: None)
    monkeypatch.setattr(bank_graphs, "GraphedBankUpdate", StandInGraphs)
    named, opt, _ = recording_optimizer(monkeypatch, bank_graphs=True)
    wrappers = [opt.banks[label].update_fn for label in BANKS]
    # Graphs replayed side by side must not share a memory pool: one wrapper (one pool) per bank.
    assert all(isinstance(w, StandInGraphs) for w in wrappers) and len({id(w) for w in wrappers}) == len(
        BANKS
    )
    ref_named, ref = build(False)
    run(named, opt, range(STEPS))
    run(ref_named, ref, range(STEPS))
    assert all(w.captures == 1 for w in wrappers)
    assert_tree_equal(snapshot(named), snapshot(ref_named))


@gpu
@pytest.mark.parametrize("bank_graphs_on", [False, True])
@pytest.mark.parametrize("bank_update", ["eager", "triton"])
def test_on_cuda_streamed_banks_train_bitwise_like_the_serial_order(bank_update, bank_graphs_on):
    cfg = dict(bank_update=bank_update, bank_graphs=bank_graphs_on)
    streamed_named, streamed = build(True, "cuda", **cfg)
    serial_named, serial = build(False, "cuda", **cfg)
    assert len(streamed._bank_streams.streams) == len(BANKS)
    run(streamed_named, streamed, range(STEPS))
    run(serial_named, serial, range(STEPS))
    assert_tree_equal(snapshot(streamed_named), snapshot(serial_named))
    assert_tree_equal(streamed.state_dict(), serial.state_dict())


@gpu
def test_on_cuda_the_track1_banks_on_streams_match_the_serial_order_bitwise():
    # The bench's optimizer at the record's bank shapes (cuBLAS picks its kernels by shape, per stream its own
    # workspace): streamed and serial steps from the same weights and gradients end on the same bits.
    bench = load_perf_script("bench_optimizer")
    device = torch.device("cuda")
    runs = [
        bench.build(bench.TRACK1_BANKS, device, "triton", "folded", True, bank_streams=streams)
        for streams in (False, True)
    ]
    step_side_by_side(runs, 3)
    (serial_named, serial, _), (streamed_named, streamed, _) = runs
    assert_tree_equal(snapshot(streamed_named), snapshot(serial_named))
    assert_tree_equal(streamed.state_dict(), serial.state_dict())
