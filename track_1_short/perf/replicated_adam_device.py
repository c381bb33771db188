"""Replicated Adam with the host taken out of the step: the "device" mode of ReplicatedAdam.

What it replaces (``ReplicatedAdam(..., impl="device")``, OptimConfig.replicated_impl = "device"; "fused" is
perf/replicated_adam.py's host path): per Adam step, the NumPy scalar table, its pinned upload and event wait,
the foreach copy of the gradients into the flat buffers, one all_reduce and one Triton launch per dtype.

Why it is faster: the host writes two small rows of numbers into pinned memory and replays CUDA graphs; with
one process that is one replay per Adam step and no other CUDA call, launched by the host step itself in the
same call that writes the rows (cuGraphLaunch from C++, where torch.cuda.CUDAGraph.replay() was a second call
from Python). Reading the gradients and configs and
writing those rows is the host step of perf/host_step.py (C++ by default, its Python reference selectable).
- Gradients are gathered on the device. Autograd leaves each .grad where it likes (a fresh tensor every
  step); their 13 data pointers (0 for a parameter without a gradient) go into a pinned int64 row, and each
  element of the flat buffers reads its gradient's element through that row by segment id. No gradient
  hooks, no views, no in-place adds in the backward: the backward is the same as for the other paths, and a
  graph that reads addresses as data follows tensors that move every step.
- The table is computed on the device. Per step the host writes six fp64 numbers per parameter (lr, lr_mul,
  weight_decay, wd_mul, step, active) into pinned memory; each element computes its row's step_size and
  eff_wd in fp64 from bias-correction tables the host computed once in Python doubles. The step counters stay
  the state dicts' ints (what checkpoints save and load) and ride in that same row, so a loaded checkpoint
  cannot leave a stale counter on the device.
- One launch does it all (kernels.device_step_): with one process the gather, the scalars and Adam for every
  dtype; with several, the gather is its own launch before the reduce and this one reads the reduced
  buffers. Under CUDA graphs the update graph is two nodes: one copy of both pinned rows (one buffer) and
  that launch, which also signals the fence as it starts. It held seven: two uploads, the gather, a table
  kernel, Adam and the fence's two nodes; the host's launch of a graph grows with its nodes. With
  ``rows_in_place`` the launch reads the pinned rows over the bus instead of a copy, and the fence's own
  two nodes follow it (three nodes); off by default, as on one H100 it saved the host 6.5 to 7.9 us (inside
  the noise) and cost the kernel 27 to 29 us more GPU time
  (perf/results/replicated_adam_floors_one_launch_h100.json). Without graphs the rows go up through
  UploadRing.
- On CUDA the gather, the reduce (NCCL, with several processes) and the update are CUDA graphs, replayed.
  With one process there is no reduce to start early, so the gather waits for update() and rides in the
  update graph: one replay per Adam step (``stage_and_replay``). launch_reduce() then only reads the
  addresses and holds the gradients. With several processes launch_reduce() replays the
  gather and the reduce, update() the update.
- The host learns that the last update graph has read the pinned rows from a fence (perf/graph_fence.py)
  that the graph signals into pinned memory: a load from memory where an event's record and wait were two
  CUDA calls.
Measured in perf/RESULTS.md (perf/bench_replicated_adam.py, the record's 13 tensors, gradients arriving fresh
from a backward; "Replicated Adam per Adam step").

Invariants (each tested in tests/perf/test_replicated_adam_device.py):
1. The same bits as the per-parameter and fused paths: across gradient accumulation over non-Adam steps,
   missing gradients, checkpoint round trips, hyperparameter changes and two ranks.
2. The device table equals adam_scalar_table's bit for bit: fp64 multiplies and div.rn are IEEE on both sides,
   the bias corrections are the host's own doubles (tabulated per beta up to the step where ``1 - beta^t``
   becomes exactly 1.0), and the one rounding to fp32 is to nearest even on both sides.
3. The gather copies each gradient's bits as they are and writes zeros for a parameter without one; a
   parameter is active when it has a .grad at launch_reduce(), as in the fused path; a gradient that is not
   contiguous is refused, naming the parameter, before anything is written.
4. A pinned row is rewritten only after the last update graph's fence signal has run, which follows the last
   read of the rows in stream order (the rows' copy, before the kernel that signals as it starts; with
   rows_in_place the kernel itself, before the fence's own nodes) and the last gather. A gradient dropped or
   replaced after launch_reduce() is safe: with the gather in launch_reduce() its block is reused only by
   work queued behind the gather on the same stream; with the gather in update() launch_reduce() holds it.
   A gradient changed in place in between (an explicit in-place op, or a backward accumulating into it) is
   refused in update(), naming the parameter, before anything is written: the fused path would have copied
   the old values.
5. A CUDA graph is trusted only after one replay matched the eager step bit for bit (a reduce graph that does
   not match is dropped on every rank, the reduce then stays eager).

Provenance: the issue "a replicated-Adam step with no host work"; device-side step counters and a device lr
follow PyTorch's capturable Adam and microsoft/dion's scalar optimizers, graph capture of the whole step
with NCCL inside follows dion's cuda_graph.py; gathering through a table of device pointers is the
pointer-array form of cuBLAS's batched GEMM and of PyTorch's multi-tensor-apply kernels, whose tensor lists
reach the device as address tables.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from track_1_short import distributed
from track_1_short.optim.adam import first_moment_correction, second_moment_correction
from track_1_short.perf.graph_check import same_bits
from track_1_short.perf.graph_fence import GraphFence
from track_1_short.perf.host_step import STATIC_CHANGED, host_step
from track_1_short.perf.kernels import replicated_adam as kernels
from track_1_short.perf.kernels.replicated_adam import STEP_INPUTS
from track_1_short.perf.replicated_adam import (
    ReplicatedAdamError,
    UploadRing,
    describe,
)

# A correction table covers t = 0..last, where beta^last <= 2^-54 makes 1 - beta^t exactly 1.0 for every later
# t. last grows like 37 / (1 - beta): 3.7k entries for 0.99, 374k for 0.9999. The cap (8 MB of fp64 per beta)
# refuses betas closer to 1 than about 1 - 3.6e-5.
MAX_CORRECTION_STEPS = 1 << 20
_SATURATED = 2.0**-54  # beta^t at or below this: 1 - beta^t rounds to 1.0 in double precision


def correction_table(beta: float, correction) -> list[float]:
    """``[correction(beta, t) for t = 0..last]`` where ``correction(beta, t)`` is 1.0 for every t >= last."""
    values = []
    t = 0
    while True:
        values.append(correction(beta, t))
        if t >= 1 and beta**t <= _SATURATED:
            assert values[-1] == 1.0
            return values
        t += 1
        if t > MAX_CORRECTION_STEPS:
            raise ValueError(f"beta {beta} needs more than {MAX_CORRECTION_STEPS} tabulated steps")


def correction_length(beta: float) -> int:
    """An upper bound on len(correction_table(beta, ...)), computed without building it."""
    if beta == 0.0:
        return 2
    return int(math.ceil(math.log(_SATURATED) / math.log(beta))) + 2


class DeviceStep:
    """The per-step machinery of impl="device" (ReplicatedAdam delegates launch_reduce/update/zero_grad)."""

    @staticmethod
    def validate(params: Sequence[torch.Tensor], param_cfgs: Sequence) -> None:
        for i, cfg in enumerate(param_cfgs):
            for beta in cfg.adam_betas:
                if correction_length(float(beta)) > MAX_CORRECTION_STEPS:
                    raise ValueError(
                        f"{describe(params, i)}: beta {beta} is too close to 1 for impl='device' (its "
                        f"bias-correction table would exceed {MAX_CORRECTION_STEPS} steps); use impl='fused'"
                    )

    def __init__(self, owner, use_cuda_graphs: bool = True, host: str = "native"):
        self.owner = owner
        self.params = owner.params
        self.cfgs = owner.param_cfgs
        self.states = owner.param_states
        self.groups = owner.groups
        device = owner.device
        n = len(self.params)
        self.group_args = [
            (group.param, group.grad, group.exp_avg, group.exp_avg_sq, group.segment) for group in self.groups
        ]
        # The per-step rows in one buffer, so that one copy uploads both: the inputs (fp64 [len(STEP_INPUTS),
        # n], STEP_INPUTS order) and where each parameter's gradient is this step (int64 [n], 0: none).
        rows = len(STEP_INPUTS) + 1
        self.rows = torch.zeros((rows, n), dtype=torch.float64, device=device)
        self.inputs = self.rows[: len(STEP_INPUTS)]
        self.addresses = self.rows[len(STEP_INPUTS)].view(torch.int64)
        # Where each parameter's flat slice starts.
        starts = [0] * n
        for group in self.groups:
            for k, i in enumerate(group.indices):
                starts[i] = group.offsets[k]
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self._gather = kernels.bind_gather_grads(
            [(group.grad, group.segment) for group in self.groups], self.addresses, self.starts, owner.block
        )
        # Everything that depends only on betas and eps is uploaded when they change (see _refresh_static).
        self.use_graphs = use_cuda_graphs and device.type == "cuda"
        if self.use_graphs:
            # The graphs read fixed pinned rows. The host rewrites them only once the last update graph's
            # fence signal has run, which follows its reads of the rows and the last gather in stream order.
            self._pinned_rows = torch.zeros(self.rows.shape, dtype=torch.float64, pin_memory=True)
            self._pinned_inputs = self._pinned_rows[: len(STEP_INPUTS)]
            self._pinned_addresses = self._pinned_rows[len(STEP_INPUTS)].view(torch.int64)
            self._fence = GraphFence(device)
        else:
            self.address_ring = UploadRing(self.addresses)
            self.ring = UploadRing(self.inputs)
        # Reads the gradients and configs and writes the rows, per step (perf/host_step.py).
        self.host = host_step(self.params, self.cfgs, self.states, host)
        self.corrections = torch.zeros(0, dtype=torch.float64, device=device)
        self.correction_index = torch.zeros((4, n), dtype=torch.int32, device=device)
        self._static_key: list[tuple] | None = None
        self._refresh_static()

        self._reduce_pending = False
        self._handles: list[distributed.Handle] = []
        # With one process there is no reduce to start early, so the gather waits for update() and rides in
        # its graph: one replay per Adam step. launch_reduce() has the host step hold this step's gradients
        # (alive, whoever drops .grad meanwhile) and their versions (a gradient changed in place in between
        # is refused).
        self.gather_in_update = distributed.world_size() == 1

        # NCCL can be captured; with one process there is no collective to capture.
        self.reduce_in_graph = self.use_graphs and not self.gather_in_update
        self.graphs_trusted = False
        self.gather_graph = None
        self.reduce_graph = None
        self.update_graph = None
        self._update_exec = 0
        # The host step launches the trusted update graph in the call that stages its rows (stage_and_replay);
        # off, update() replays it through torch after stage_update (the bench's device_torch_replay path).
        self.replay_in_host_step = True
        # Off (the default), the update graph copies both pinned rows up in one node and its kernel signals
        # the fence as it starts: two nodes. On, the kernel reads the pinned rows in place over the bus and
        # the fence's own two nodes follow it (the bench's device_rows_in_place path). Set before the first
        # Adam step: the graph is captured then.
        self.rows_in_place = False
        # The CUDA device whose current stream the host step launches on ("cuda" alone: the current one).
        current = device.type == "cuda" and device.index is None
        self._device_index = torch.cuda.current_device() if current else (device.index or 0)
        self._pre_reduce: list[torch.Tensor] | None = None

    # ---- static data --------------------------------------------------------------------------------------

    def _static_keys(self) -> list[tuple]:
        return [(float(c.adam_betas[0]), float(c.adam_betas[1]), float(c.eps)) for c in self.cfgs]

    def _refresh_static(self) -> None:
        """Upload the bias-correction tables and the table's beta/eps columns for the current configs."""
        keys = self._static_keys()
        tables: dict[tuple[str, float], tuple[int, int]] = {}
        values: list[float] = []
        index = [[0] * len(keys) for _ in range(4)]
        for i, (beta1, beta2, _eps) in enumerate(keys):
            for slot, (kind, beta, fn) in enumerate(
                (("first", beta1, first_moment_correction), ("second", beta2, second_moment_correction))
            ):
                if (kind, beta) not in tables:
                    table = correction_table(beta, fn)
                    tables[(kind, beta)] = (len(values), len(table) - 1)
                    values += table
                start, last = tables[(kind, beta)]
                index[2 * slot][i], index[2 * slot + 1][i] = start, last
        device = self.owner.device
        self.corrections = torch.tensor(values, dtype=torch.float64, device=device)
        self.correction_index.copy_(torch.tensor(index, dtype=torch.int32))
        self.host.set_static(keys)
        static = [[b1, 1.0 - b1, b2, 1.0 - b2, eps] for b1, b2, eps in keys]
        self.owner.table[:, :5].copy_(torch.tensor(static, dtype=torch.float64).to(torch.float32))
        self._static_key = keys
        # The corrections tensor moved: a captured update graph would read freed memory.
        self.graphs_trusted = False
        self.update_graph = None

    # ---- the step -----------------------------------------------------------------------------------------

    def _read_gradients(self) -> None:
        """Hold this step's gradients and note their addresses (0: none); refuses a gradient the gather cannot
        read as its parameter's elements in order (autograd's own are contiguous, as the parameters are)."""
        bad = self.host.read_gradients()
        if bad >= 0:
            grad = self.params[bad].grad
            raise ValueError(
                f"{describe(self.params, bad)}: .grad is not contiguous (strides {grad.stride()}); "
                "impl='device' gathers gradients as flat memory: assign p.grad = g.contiguous()"
            )

    def _stage_update(self) -> tuple[bool, bool]:
        """One process: refuse a gradient changed in place since launch_reduce() (the deferred gather would
        read the new values, where the fused path copied the old ones) before anything is written, then write
        this step's inputs and addresses, in one host-step call; once the update graph is trusted that call
        also launches it, unless a beta or eps changed. Returns (whether a beta or eps changed, whether the
        update graph was launched)."""
        replay = (
            self.replay_in_host_step
            and self.use_graphs
            and self.graphs_trusted
            and self.update_graph is not None
        )
        if self.use_graphs:
            self._fence.wait()  # the last graph has read both pinned rows
            if replay:
                answer = self.host.stage_and_replay(
                    self._pinned_addresses, self._pinned_inputs, self._update_exec, self._device_index
                )
            else:
                answer = self.host.stage_update(self._pinned_addresses, self._pinned_inputs)
        else:
            answer = self.host.stage_update(self.address_ring.host_tensor(), self.ring.host_tensor())
        if answer >= 0:
            raise ReplicatedAdamError(
                f"{describe(self.params, answer)}: .grad was changed in place between launch_reduce() and "
                "update(); with one process impl='device' reads the gradients in update(): finish "
                "changing them before launch_reduce(), or use impl='fused'"
            )
        if not self.use_graphs:
            self.address_ring.upload()
            self.ring.upload()
        changed = answer == STATIC_CHANGED
        return changed, replay and not changed

    def _upload_and_gather(self) -> None:
        if self.use_graphs:
            # Inside the graph that gathers: one host-to-device copy node from the one pinned row.
            self.addresses.copy_(self._pinned_addresses, non_blocking=True)
        self._gather()

    def launch_reduce(self) -> None:
        if self._reduce_pending:
            raise ReplicatedAdamError("launch_reduce() called twice without update() in between")
        self._read_gradients()  # may raise: nothing is written before it returns
        self._reduce_pending = True
        if self.gather_in_update:
            # No CUDA call: update() writes the addresses with the inputs and replays one graph.
            return
        self._write_addresses()
        if not self.use_graphs:
            self._gather()
        elif self.gather_graph is not None:
            self.gather_graph.replay()
        else:
            self._capture_gather()
        if self.use_graphs and not self.graphs_trusted and self.reduce_in_graph:
            # The first step is also the reduce graph's check: keep the gradients as they were before it.
            self._pre_reduce = [group.grad.clone() for group in self.groups]
        if self.reduce_graph is not None and self.graphs_trusted:
            self.reduce_graph.replay()
            self._handles = []
        else:
            self._handles = [distributed.all_reduce_avg(group.grad, async_op=True) for group in self.groups]

    def _write_addresses(self) -> None:
        """Several processes: this step's gradient addresses into the row the gather reads (uploaded at once
        without graphs)."""
        if self.use_graphs:
            self._fence.wait()  # the last graph has read both pinned rows
            self.host.write_addresses(self._pinned_addresses)
        else:
            self.host.write_addresses(self.address_ring.host_tensor())
            self.address_ring.upload()

    def zero_grad(self) -> None:
        if self._reduce_pending:
            raise ReplicatedAdamError("zero_grad() called between launch_reduce() and update()")
        self.host.drop_gradients()  # every .grad = None; the held gradients released

    def _write_inputs(self) -> bool:
        """Several processes: write this step's per-parameter inputs (STEP_INPUTS order) and count the active
        parameters' steps.

        Returns whether a beta or eps changed since the static data was built (read in the same pass).
        """
        if self.use_graphs:
            # Free to rewrite: the fence has seen the last update graph run.
            return self.host.write_inputs(self._pinned_inputs)
        changed = self.host.write_inputs(self.ring.host_tensor())
        self.ring.upload()
        return changed

    def _launch_step_kernels(self) -> None:
        """What the update graph holds: the rows' upload (one copy node) and the one launch, which signals
        the fence as it starts; or, with rows_in_place, the launch reading the pinned rows and the fence's own
        signal after it. The launch gathers too when the gather waits for update() (one process)."""
        in_place = self.use_graphs and self.rows_in_place
        if self.use_graphs and not in_place:
            self.rows.copy_(self._pinned_rows, non_blocking=True)
        self._launch_update_kernels()
        if in_place:
            self._fence.signal()  # after the kernel's reads of the pinned rows

    def _launch_update_kernels(self) -> None:
        # The gather, the scalars and Adam for every dtype in one launch; with several processes the gather
        # ran in launch_reduce() and the launch reads the reduced flat buffers.
        in_place = self.use_graphs and self.rows_in_place
        kernels.launch_device_step(
            self.group_args,
            self.owner.table,
            self._pinned_addresses if in_place else self.addresses,
            self.starts,
            self._pinned_inputs if in_place else self.inputs,
            self.corrections,
            self.correction_index,
            self.owner.block,
            gather=self.gather_in_update,
            # Once the launch has started, the copy before it has read the pinned rows: they may be rewritten.
            fence=self._fence.signal_targets() if self.use_graphs and not in_place else None,
        )

    def update(self) -> None:
        if not self._reduce_pending:
            raise ReplicatedAdamError("update() called without launch_reduce(); call launch_reduce() first")
        # Either may raise: nothing is written before it does.
        if self.gather_in_update:
            static_changed, replayed = self._stage_update()
        else:
            static_changed, replayed = self._write_inputs(), False
        if static_changed:  # then nothing was launched
            self._refresh_static()
        if replayed:  # the host step launched the update graph
            self._fence.count()
        elif self.use_graphs and not self.graphs_trusted:
            self._capture_and_check()
        else:
            for handle in self._handles:  # none when the reduce is a graph
                handle.wait()
            if self.update_graph is not None:
                self.update_graph.replay()
                self._fence.count()
            else:
                self._launch_step_kernels()
        # The held gradients go at zero_grad() or the next launch_reduce(), not here (one host call fewer per
        # step): nothing needs them after the replay just enqueued, since a block freed now is reused only
        # behind it on this stream.
        self._handles = []
        self._reduce_pending = False

    # ---- CUDA graphs --------------------------------------------------------------------------------------

    def _capture_gather(self) -> None:
        """Gather eagerly, then capture the gather (upload and kernel) and trust the graph only if one replay
        writes the same bits into buffers overwritten in between."""
        self._upload_and_gather()
        eager = [group.grad.clone() for group in self.groups]
        torch.cuda.synchronize(self.owner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._upload_and_gather()
        for group in self.groups:
            group.grad.fill_(float("nan"))  # a replay that writes nothing cannot pass
        graph.replay()
        differing = [str(g.dtype) for g, e in zip(self.groups, eager) if not same_bits(g.grad, e)]
        if differing:
            raise RuntimeError(
                "the CUDA graph of the replicated gradient gather disagrees with the eager gather in the "
                f"{', '.join(differing)} buffer; construct ReplicatedAdam with use_cuda_graphs=False"
            )
        self.gather_graph = graph

    def _capture_and_check(self) -> None:
        """Run this step eagerly, then rewind, capture, replay, and trust the graphs only if the bits agree.

        The reduce is captured too when this step's reduce ran eagerly (the first step); after a change of
        betas or eps only the update graph is captured again, behind the trusted reduce graph. A reduce graph
        whose result differs from the eager all_reduce on any rank (NCCL may pick another algorithm inside a
        graph) is dropped on every rank and the reduce stays eager, with a warning; an update graph that
        differs is an error.
        """
        for handle in self._handles:
            handle.wait()
        capture_reduce = self.reduce_in_graph and self._pre_reduce is not None
        reduced = [group.grad.clone() for group in self.groups]
        before = self.owner._flat_snapshot()
        self._launch_step_kernels()
        self._fence.count()
        eager = self.owner._flat_snapshot()

        if self.gather_in_update:  # the graph gathers again: a replay that writes nothing cannot pass
            grads_before = [torch.full_like(g.grad, float("nan")) for g in self.groups]
        else:
            grads_before = self._pre_reduce if capture_reduce else reduced
        self.owner._load_flat_snapshot(before, grads_before)
        torch.cuda.synchronize(self.owner.device)
        if capture_reduce:
            self.reduce_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.reduce_graph, capture_error_mode="thread_local"):
                for group in self.groups:
                    distributed.all_reduce_avg(group.grad)
        self.update_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.update_graph, capture_error_mode="thread_local"):
            self._launch_step_kernels()
        # What the host step launches (stage_and_replay); valid while update_graph holds the graph.
        self._update_exec = self.update_graph.raw_cuda_graph_exec()
        if capture_reduce:
            self.reduce_graph.replay()
            differs = torch.tensor(
                [float(not all(same_bits(g.grad, r) for g, r in zip(self.groups, reduced)))],
                device=self.owner.device,
            )
            distributed.all_reduce_max(differs)  # one decision on every rank: the collectives must match
            if differs.item() != 0.0:
                warnings.warn(
                    "the all_reduce captured in a CUDA graph reduced differently from the eager one; the "
                    "replicated reduce stays eager (the update is still a graph)",
                    stacklevel=3,
                )
                self.reduce_graph = None
                self.reduce_in_graph = False
                for group, grad in zip(self.groups, reduced):
                    group.grad.copy_(grad)
        self.update_graph.replay()
        self._fence.count()
        self._pre_reduce = None
        differing = self.owner._flat_snapshot_differences(eager, self.owner._flat_snapshot())
        if differing:
            self.reduce_graph = self.update_graph = None
            raise RuntimeError(
                "the CUDA graph of the replicated Adam step disagrees with the eager step in "
                f"{', '.join(differing)}; construct ReplicatedAdam with use_cuda_graphs=False"
            )
        self.graphs_trusted = True
