"""Replicated Adam per Adam step: the per-parameter path, the fused paths and torch.optim.Adam, in one run.

    python perf/bench_replicated_adam.py --out perf/results/replicated_adam.json             # CUDA
    python perf/bench_replicated_adam.py --record                                   # record set, short table
    python perf/bench_replicated_adam.py --record --phases          # and host us per phase of each path
    python perf/bench_replicated_adam.py --device cpu --out /tmp/replicated_adam.json         # CPU smoke
    torchrun --nproc_per_node=2 perf/bench_replicated_adam.py --out /tmp/ra2.json         # with all_reduces

Sets: ``record``, the record's 13 replicated tensors (shapes, dtypes, betas and multipliers of upstream's
param table, about 212k elements, 69 of them fp32); ``synthetic``, 100 tensors of 17 shapes (1 to 2,048
elements, bf16 and fp32, three beta pairs). Paths, each from the same initial values and gradients:

- ``per_param``: per parameter one async all_reduce(AVG) and one ``adam_update_`` (compiled on CUDA);
- ``fused``: ``ReplicatedAdam(impl="fused")``: host table, one foreach copy, all_reduce and kernel per dtype;
- ``device``: ``ReplicatedAdam(impl="device")``: gradients gathered on the device through a table of their
  addresses, its scalars computed on the device, one kernel for all of it and every dtype, CUDA graphs on
  CUDA;
- ``torch_adam``: ``torch.optim.Adam`` (fused=True on CUDA), one group per tensor, after per-parameter
  all_reduces; its arithmetic differs (no cautious decay), so it is timed, not compared;
- ``device_split`` (only when named in ``--paths``): ``device`` laid out as with several processes, the
  gather replayed in launch_reduce() and the update in update(), where one process has one replay per step;
- ``device_python`` (only when named in ``--paths``): ``device`` with the Python reference of its per-step
  host work (``host="python"``, perf/host_step.py) where ``device`` runs the C++ one;
- ``device_torch_replay`` (only when named): ``device`` with its update graph replayed by torch after the
  host step has staged the rows, where ``device`` launches it from the host step;
- ``device_rows_in_place`` (only when named): ``device`` with its update kernel reading the pinned rows
  in place, where ``device``'s update graph copies them up first;
- two floors (only when named; they update nothing, so they are timed, never compared):
  ``device_fence_graph``, ``device`` with its update graph swapped for the fence signal alone (what the
  graph's content costs the host beyond a graph of two small nodes), and ``device_floor``, the least
  any device-mode step can do with one process (take the gradients, one graph launch from C++, drop them).

Method. One repetition of a path is its whole training-step share: one backward that delivers precomputed
gradients (a new scale each step) as fresh tensors, the way a model's backward does (whatever a path hooks
into the backward runs inside it; its forward is built before the clock starts), then the Adam step. The
baseline ``backward_only`` is the same backward with the gradients dropped. Every round runs each path and the
baseline once, in a fresh seeded order (A B A B ..., so drift and cache effects fall on all of them), with the
garbage collector off. A path's step cost is the median over rounds of its repetition minus the baseline's of
the same round, with a bootstrap 95% interval of that median; a cost whose interval reaches zero is "below
noise": no number and no ratio is made from it. On CUDA each repetition starts on an idle queue behind a spin
kernel longer than the repetition's enqueue (the GPU stays busy ahead of the host, as behind a training step's
backward), so CUDA events around it time the device's work, not the host's pace. The event that closes a
repetition is recorded inside its host clock, the baseline's too: a training step always makes a CUDA call
after its backward, and whichever call comes first pays for the backward's hand-over (see
interleaved_samples). Columns:

- ``host_us``, ``device_us``: the step cost in host enqueue time and in device time (events; None on CPU),
  or "below noise"; ``*_ci``: the 95% interval of that median;
- ``total_host_us``, ``total_device_us``: median of a whole repetition (backward + step; backward alone on the
  ``backward_only`` row), ``*_iqr``: its interquartile range;
- ``starved``: repetitions whose enqueue outlasted the spin kernel (their device time includes host time);
- ``launches``: per step, host calls that launch GPU work (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch,
  cudaMemcpyAsync, ...), the baseline's backward subtracted (profiler): what a path adds to the backward
  counts. On the CPU: dispatched aten ops plus Triton launches,
  the calls that would be launches on a GPU;
- ``kernels``: GPU kernels and copies executed per step, those inside CUDA graphs included, the baseline's
  subtracted likewise (None on CPU);
- ``speedup``, ``vs_fused``: per_param's (fused's) host step cost over this path's;
- ``bitwise``: after the run, parameters and moments equal the per_param path's bit for bit.

``--hand-over`` records a CUDA event right after the backward in every repetition, the baseline's too,
inside the host clock. Without it the backward's hand-over falls on a path's first CUDA call after the
backward, or on the baseline's closing event after it has dropped the gradients (by when part of the
hand-over is over). In the trainer AnvilAndAdam's Phase 1 (the banks' and tables' reduce-scatters, copies
with one process) makes CUDA calls before the replicated update, so the replicated paths never pay it there.
With it every path pays the same call at the same point, and a path's cost is what its own calls add in the
trainer's order. Both are reported; the default stays as it was.

``--phases`` adds a table: each path's host time per phase of a repetition (the backward, then
ReplicatedAdam's launch_reduce, update and zero_grad, or the whole step), the median of as many
more repetitions as rounds, nothing subtracted: where a path's step cost goes, not what it costs.

At world size 1 the project's collectives are no-ops, so a one-process run measures everything but the
all_reduces; run it under torchrun for those (rank 0 prints and writes). On the CPU the Triton kernels run in
the interpreter (slow: the CPU run is a smoke of the whole benchmark, its figures say little).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from track_1_short.perf.graph_check import same_bits
from track_1_short.perf.host_step import STATIC_SAME, InstrumentedHostStep

# label, shape, dtype, betas, lr_mul, wd_mul: the record's replicated Adam tensors (upstream-optim notes 5).
RECORD = [
    ("scalars", (24,), torch.float32, (0.9, 0.99), 5.0, 0.0),
    ("smear_gate", (1, 12), torch.bfloat16, (0.9, 0.99), 0.01, 0.0),
    ("ve_gate_bank", (3, 6, 12), torch.bfloat16, (0.9, 0.99), 1.0, 1.0),
    ("post_lambdas", (11, 2), torch.float32, (0.9, 0.95), 1.0, 0.0),
    ("resid_lambdas", (11, 2), torch.float32, (0.9, 0.95), 5.0, 0.0),
    ("mudd_w1", (2, 64, 768), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_w2", (2, 14, 64), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_w2g", (14, 12, 64), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_b2", (2, 14), torch.bfloat16, (0.9, 0.99), 0.25, 0.0),
    ("mudd_gate_w1", (2, 64, 768), torch.bfloat16, (0.9, 0.99), 0.1, 1.0),
    ("mudd_gate_w2", (2, 23, 64), torch.bfloat16, (0.9, 0.99), 0.1, 1.0),
    ("mudd_gate_b2", (2, 23), torch.bfloat16, (0.9, 0.99), 0.1, 0.0),
    ("_mudd_gate_scale", (), torch.float32, (0.9, 0.99), 0.1, 0.0),
]
ADAM_LR, ADAM_EPS, ADAM_WD = 0.008, 1e-10, 0.005  # the record's Adam settings
PATHS = ("per_param", "fused", "device", "torch_adam")
# Selectable with --paths, not run by default: the device path laid out as with several processes, with its
# host step in Python, with its update graph replayed by torch after the host step, with its kernel reading
# the pinned rows in place; and two floors under it.
EXTRA_PATHS = (
    "device_split",
    "device_python",
    "device_torch_replay",
    "device_rows_in_place",
    "device_fence_graph",
    "device_floor",
)
SETS = ("record", "synthetic")
# The device path's host step launches its graph through the driver (cuGraphLaunch); torch uses the runtime.
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaGraphLaunch",
    "cuGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
# aten ops that only allocate or re-describe memory: no kernel on a GPU, not counted as launches on the CPU.
NO_KERNEL_OPS = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::view", "aten::_reshape_alias", "aten::reshape", "aten::as_strided", "aten::alias", "aten::detach",
    "aten::t", "aten::expand", "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view",
}  # fmt: skip


def synthetic_set() -> list[tuple]:
    """100 tensors of 17 shapes (so the compiled per-parameter path needs 17 graphs), sizes 1..2048."""
    shapes = [(1,), (3,), (8,), (12,), (24,), (2, 14), (11, 2), (64,), (3, 6, 12), (2, 64), (256,), (4, 96),
              (2, 23, 8), (512,), (1000,), (32, 48), (2048,)]  # fmt: skip
    betas = [(0.9, 0.99), (0.9, 0.95), (0.5, 0.95)]
    out = []
    for k in range(100):
        j = (k * 7) % len(shapes)  # spreads the 17 shapes over the 100 tensors
        dtype = torch.bfloat16 if j % 2 else torch.float32
        out.append((f"t{k}", shapes[j], dtype, betas[j % 3], (0.25, 1.0, 5.0)[k % 3], float(k % 2)))
    return out


class Cfg:
    """The attributes an Adam step reads (a stand-in for optim/anvil.py's ParamConfig)."""

    def __init__(self, betas, lr_mul, wd_mul):
        self.adam_betas, self.lr, self.lr_mul = list(betas), ADAM_LR, lr_mul
        self.eps, self.weight_decay, self.wd_mul = ADAM_EPS, ADAM_WD, wd_mul


def build(spec: list[tuple], device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params, cfgs, states = [], [], []
    for label, shape, dtype, betas, lr_mul, wd_mul in spec:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype).to(device))
        p.label = label
        params.append(p)
        cfgs.append(Cfg(betas, lr_mul, wd_mul))
        states.append(
            {
                "step": 0,
                "exp_avg": torch.zeros(shape, dtype=torch.float32, device=device),
                "exp_avg_sq": torch.zeros(shape, dtype=torch.float32, device=device),
            }
        )
    return params, cfgs, states


class Gradients:
    """Precomputed gradients (a few distinct sets, cycled), delivered by a real backward.

    ``forward(params, step)`` builds, per parameter, ``(p * g).sum()`` with ``g`` the step's gradient and a
    ones seed per output; ``backward`` runs autograd through it. Each gradient then leaves a multiply as a
    fresh tensor that nothing else holds, as a model's backward hands it over: autograd takes it as .grad
    when there is none and adds it in place into an existing .grad. Feeding the sets as ``grad_tensors`` of
    the parameters would make autograd clone each one (the caller still holds it), a cost that a path
    accumulating in place would skip: the baseline would then charge every other path for it. The gradient
    is ``1 * g``: the same bits as g.
    """

    def __init__(self, params, seed: int = 1, variants: int = 4):
        gen = torch.Generator().manual_seed(seed)
        base = [torch.randn(p.shape, generator=gen) for p in params]
        self.sets = [
            [(b * (1.0 + 0.25 * v)).to(p.dtype).to(p.device) for b, p in zip(base, params)]
            for v in range(variants)
        ]
        self.seeds = [torch.ones((), dtype=p.dtype, device=p.device) for p in params]

    def forward(self, params, step: int) -> list[torch.Tensor]:
        """The outputs whose backward delivers step ``step``'s gradients (built outside the timed region)."""
        return [(p * g).sum() for p, g in zip(params, self.sets[step % len(self.sets)])]

    def backward(self, outputs: list[torch.Tensor]) -> None:
        torch.autograd.backward(outputs, grad_tensors=self.seeds)


# ---- the paths ---------------------------------------------------------------------------------------------


class PerParam:
    def __init__(self, params, cfgs, states, device, block):
        from track_1_short.optim.adam import new_scalar_buffers

        self.params, self.cfgs, self.states = params, cfgs, states
        self.scalars = new_scalar_buffers()

    def step(self) -> None:
        from track_1_short import distributed
        from track_1_short.optim.adam import adam_update_

        pending = [
            (i, distributed.all_reduce_avg(p.grad, async_op=True))
            for i, p in enumerate(self.params)
            if p.grad is not None
        ]
        for i, handle in pending:
            handle.wait()
            p = self.params[i]
            adam_update_(p.data, p.grad, self.states[i], self.cfgs[i], self.scalars)
        for p in self.params:
            p.grad = None


class Fused:
    impl = "fused"
    host = "native"  # impl="device" only: who does its per-step host work (perf/host_step.py)

    def __init__(self, params, cfgs, states, device, block):
        from track_1_short.perf.replicated_adam import ReplicatedAdam

        self.opt = ReplicatedAdam(params, cfgs, states, device, impl=self.impl, block=block, host=self.host)

    def step(self) -> None:
        self.opt.launch_reduce()
        self.opt.update()
        self.opt.zero_grad()

    def step_phases(self) -> list[tuple[str, Callable[[], None]]]:
        """step() as its public calls, in order (the --phases table times each)."""
        return [
            ("launch_reduce", self.opt.launch_reduce),
            ("update", self.opt.update),
            ("zero_grad", self.opt.zero_grad),
        ]


class Device(Fused):
    impl = "device"


class DeviceSplit(Device):
    """impl="device" laid out as with several processes: the gather replayed in launch_reduce(), the update
    in update(). With one process the gather otherwise waits for update() and rides in its graph (one replay
    per Adam step); this path measures what that saves."""

    def __init__(self, params, cfgs, states, device, block):
        super().__init__(params, cfgs, states, device, block)
        self.opt._device_mode.gather_in_update = False


class DevicePython(Device):
    """impl="device" with the Python reference of its per-step host work: what the C++ host step saves."""

    host = "python"


class DeviceTorchReplay(Device):
    """impl="device" with its update graph launched as before the host step launched it: the host step stages
    the rows (stage_update), then torch.cuda.CUDAGraph.replay() from Python: what stage_and_replay saves."""

    def __init__(self, params, cfgs, states, device, block):
        super().__init__(params, cfgs, states, device, block)
        self.opt._device_mode.replay_in_host_step = False


class DeviceRowsInPlace(Device):
    """impl="device" with its update kernel reading the pinned rows in place over the bus and the fence's own
    two nodes after it, where ``device`` copies the rows up in one node and its kernel signals the fence."""

    def __init__(self, params, cfgs, states, device, block):
        super().__init__(params, cfgs, states, device, block)
        self.opt._device_mode.rows_in_place = True


class DeviceFenceGraph(Device):
    """impl="device" with its update graph swapped, once trusted, for a graph that holds only the fence signal
    (two nodes: a counter increment and its copy into pinned memory): the host step, its launch and the fence
    are the device path's; the rows' copy and the kernel (the gather, the scalars, Adam and the fence's
    signal) are gone. What the update graph's content costs the host beyond a graph of two small nodes.
    After the swap it updates nothing: timed, never compared. Without CUDA graphs (the CPU) there is nothing
    to swap and it runs as ``device``."""

    def __init__(self, params, cfgs, states, device, block):
        super().__init__(params, cfgs, states, device, block)
        self.swapped_graph: torch.cuda.CUDAGraph | None = None

    def _swap_once_trusted(self) -> None:
        mode = self.opt._device_mode
        if self.swapped_graph is not None or not mode.graphs_trusted:
            return
        torch.cuda.synchronize(self.opt.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            mode._fence.signal()  # what update() counts after each launch: the protocol stays whole
        mode.update_graph, mode._update_exec = graph, graph.raw_cuda_graph_exec()
        self.swapped_graph = graph

    def _launch_reduce(self) -> None:
        self._swap_once_trusted()  # an attribute test per step once swapped (well under a microsecond)
        self.opt.launch_reduce()

    def step(self) -> None:
        self._launch_reduce()
        self.opt.update()
        self.opt.zero_grad()

    def step_phases(self) -> list[tuple[str, Callable[[], None]]]:
        return [("launch_reduce", self._launch_reduce), *super().step_phases()[1:]]


class DeviceFloor:
    """Not an optimizer: the least host work of a device-mode step with one process, a floor under ``device``.

    Each public call does only what no such step can skip: launch_reduce takes this step's gradients (the C++
    host step's read_gradients: each .grad held, its address noted), update makes the one CUDA call (the host
    step's replay of a graph of one kernel, through the driver as stage_and_replay launches), zero_grad drops
    the gradients (drop_gradients). It reads no config, counts no step, writes no row and waits on no fence;
    it updates nothing: timed, never compared. Off CUDA the call is one tensor op, as a smoke."""

    def __init__(self, params, cfgs, states, device, block):
        from track_1_short.perf.host_step import host_step

        self.host = host_step(params, cfgs, states, "native")
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        # Driver launches made: the profiler does not trace them, so profile_counts reads this count.
        self.launched = 0
        self.graph, self.graph_exec, self.device_index = None, 0, 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.count.add_(1)
            self.graph_exec = self.graph.raw_cuda_graph_exec()
            self.device_index = torch.cuda.current_device() if device.index is None else device.index

    def launch_reduce(self) -> None:
        bad = self.host.read_gradients()
        if bad >= 0:
            raise ValueError(f"device_floor: parameter {bad}'s .grad is not contiguous")

    def update(self) -> None:
        if self.graph_exec:
            self.host.replay(self.graph_exec, self.device_index)
            self.launched += 1
        else:
            self.count.add_(1)

    def zero_grad(self) -> None:
        self.host.drop_gradients()

    def step(self) -> None:
        self.launch_reduce()
        self.update()
        self.zero_grad()

    def step_phases(self) -> list[tuple[str, Callable[[], None]]]:
        return [("launch_reduce", self.launch_reduce), ("update", self.update), ("zero_grad", self.zero_grad)]


class TorchAdam:
    def __init__(self, params, cfgs, states, device, block):
        self.params, self.cfgs = params, cfgs
        groups = [
            {
                "params": [p],
                "lr": c.lr * c.lr_mul,
                "betas": tuple(c.adam_betas),
                "eps": c.eps,
                "weight_decay": 0.0,
            }
            for p, c in zip(params, cfgs)
        ]
        cuda = device.type == "cuda"
        self.opt = torch.optim.Adam(groups, fused=True if cuda else None, foreach=None if cuda else False)

    def step(self) -> None:
        from track_1_short import distributed

        pending = [
            distributed.all_reduce_avg(p.grad, async_op=True) for p in self.params if p.grad is not None
        ]
        for handle in pending:
            handle.wait()
        for group, cfg in zip(self.opt.param_groups, self.cfgs):
            group["lr"] = cfg.lr * cfg.lr_mul  # what a schedule does every step
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class BackwardOnly:
    """The baseline: the same backward, gradients dropped."""

    def __init__(self, params, cfgs, states, device, block):
        self.params = params

    def step(self) -> None:
        for p in self.params:
            p.grad = None


PATH_CLASSES = {
    "per_param": PerParam,
    "fused": Fused,
    "device": Device,
    "torch_adam": TorchAdam,
    "device_split": DeviceSplit,
    "device_python": DevicePython,
    "device_torch_replay": DeviceTorchReplay,
    "device_rows_in_place": DeviceRowsInPlace,
    "device_fence_graph": DeviceFenceGraph,
    "device_floor": DeviceFloor,
}


# ---- measuring ---------------------------------------------------------------------------------------------

BELOW_NOISE = "below noise"
CONFIDENCE = 0.95  # two-sided level of the interval that decides "below noise"
RESAMPLES = 2000  # bootstrap resamples: the 2.5 and 97.5 percentiles of a median settle well before this
# The spin kernel ahead of a CUDA repetition lasts LEAD_FACTOR times the repetition's median enqueue plus
# LEAD_MARGIN_S, so that an enqueue a few times slower than usual still finishes before the GPU gets to it.
LEAD_FACTOR, LEAD_MARGIN_S = 3.0, 200e-6
CALIBRATION_ROUNDS = 5  # rounds that measure each path's enqueue time, to size its spin kernel (CUDA only)
SPIN_CALIBRATION_CYCLES = 10_000_000  # about 5 ms at H200 clocks: long enough to time the clock rate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One repetition of a path: the backward (anything the path hooks into it runs in it), the Adam step.

    ``prepare()`` builds the repetition's forward graph; the timing loops call it before they start the
    clock, and a repetition that finds none prepared builds its own. ``hand_over``, when given, is called
    right after the backward, before the path's step (``--hand-over``): the same call in every runner.
    """

    def __init__(self, path, params, grads: Gradients, hand_over: Callable[[], None] | None = None):
        self.path, self.params, self.grads = path, params, grads
        self.hand_over = hand_over
        self.step = 0  # indexes the gradient sets: every path sees the same sequence
        self._outputs: list[torch.Tensor] | None = None

    def prepare(self) -> None:
        if self._outputs is None:
            self._outputs = self.grads.forward(self.params, self.step)

    def backward(self) -> None:
        self.prepare()
        outputs, self._outputs = self._outputs, None
        self.grads.backward(outputs)

    def __call__(self) -> None:
        self.backward()
        if self.hand_over is not None:
            self.hand_over()
        self.path.step()
        self.step += 1


@contextlib.contextmanager
def collector_off():
    """The cyclic garbage collector off inside, restored after: a collection pause inside one repetition would
    be charged to whichever path happened to allocate last."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def phase_times(runner: Runner, count: int, device: torch.device) -> list[dict]:
    """Host microseconds of each phase of a repetition, the median of ``count`` (one row per phase).

    Phases: "backward" (whatever the path hooks into it included), "hand_over" with ``--hand-over``, then the
    path's step as its public calls where it has step_phases() (ReplicatedAdam: launch_reduce, update,
    zero_grad), else "step", then on CUDA "event", the event that closes a repetition in interleaved_samples.
    Each repetition starts on an idle queue, as in interleaved_samples; no baseline is subtracted.
    """
    path = runner.path
    step = getattr(path, "step_phases", lambda: [("step", path.step)])()
    if runner.hand_over is not None:
        step = [("hand_over", runner.hand_over), *step]
    if device.type == "cuda":
        event = torch.cuda.Event()
        step = [*step, ("event", event.record)]
    names = ["backward", *(n for n, _ in step)]
    times = {n: np.empty(count) for n in names}
    with collector_off():
        for r in range(count):
            runner.prepare()
            sync(device)
            t = [time.perf_counter()]
            runner.backward()
            t.append(time.perf_counter())
            for _, fn in step:
                fn()
                t.append(time.perf_counter())
            runner.step += 1
            for i, n in enumerate(names):
                times[n][r] = t[i + 1] - t[i]
    sync(device)
    return [{"phase": n, "host_us": float(np.median(times[n])) * 1e6} for n in names]


def run_steps(runner: Runner, count: int, device) -> None:
    for _ in range(count):
        runner()
    sync(device)


class SpinLead:
    """A spin kernel of a given duration on the current stream (torch.cuda._sleep counts GPU clock cycles)."""

    def __init__(self, device: torch.device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        torch.cuda._sleep(SPIN_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        self.cycles_per_s = SPIN_CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e-3)

    def __call__(self, seconds: float) -> None:
        torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))


@dataclass
class Samples:
    """One runner's repetitions in round order: host seconds, device seconds (None off CUDA)."""

    host: np.ndarray
    device: np.ndarray | None = None
    starved: int | None = None  # CUDA: repetitions whose enqueue outlasted their spin kernel


def interleaved_samples(
    runners: dict[str, Callable[[], None]],
    rounds: int,
    device: torch.device,
    *,
    lead_s: dict[str, float] | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Samples]:
    """``rounds`` rounds, each running every runner once in a fresh seeded order; one Samples per runner.

    On CUDA ``lead_s`` gives each runner's spin-kernel length; each repetition starts on an idle queue (synced
    before, outside the host timing) and its device time is the CUDA-event interval around it. The order
    depends only on ``seed``, so every rank of a torchrun runs the same collectives in the same order.

    The closing event is recorded inside the host clock. The first CUDA call after a backward costs more host
    time than the same call later (10 us more on a fast H100 host, 54 us more on a slow one: perf/RESULTS.md,
    "where each path's host time goes"), and it lands on whichever call comes first. In a training step some
    call always follows the backward, whatever the optimizer, so that cost belongs to the backward: timed this
    way the baseline pays it at its closing event, and a path's cost is what its own calls add.
    """
    names = list(runners)
    cuda = device.type == "cuda"
    if cuda and (lead_s is None or set(lead_s) != set(names)):
        raise ValueError("interleaved_samples on CUDA needs lead_s with one spin length per runner")
    spin = SpinLead(device) if cuda else None
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    host = {n: np.empty(rounds) for n in names}
    dev = {n: np.empty(rounds) for n in names}
    starved = dict.fromkeys(names, 0)
    order = np.random.default_rng(seed)
    with collector_off():
        for r in range(rounds):
            for j in order.permutation(len(names)):
                name = names[j]
                prepare = getattr(runners[name], "prepare", None)
                if prepare is not None:  # untimed: a Runner's forward graph
                    prepare()
                if cuda:
                    torch.cuda.synchronize(device)
                    spin(lead_s[name])
                    start.record()
                t0 = clock()
                runners[name]()
                if cuda:
                    end.record()  # inside the host clock (the docstring says why)
                t1 = clock()
                host[name][r] = t1 - t0
                if cuda:
                    end.synchronize()
                    dev[name][r] = start.elapsed_time(end) * 1e-3
                    starved[name] += (t1 - t0) > lead_s[name]
    return {n: Samples(host[n], dev[n] if cuda else None, starved[n] if cuda else None) for n in names}


def spin_lengths(
    runners: dict[str, Callable[[], None]],
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Per runner, a spin-kernel length in seconds from its median enqueue time over a few rounds."""
    leads = dict.fromkeys(runners, LEAD_MARGIN_S)
    probe = interleaved_samples(runners, CALIBRATION_ROUNDS, device, lead_s=leads, seed=1, clock=clock)
    return {n: LEAD_FACTOR * float(np.median(s.host)) + LEAD_MARGIN_S for n, s in probe.items()}


@dataclass
class PairedCost:
    """Median over rounds of (path - baseline) and its bootstrap interval, in the samples' unit."""

    median: float
    low: float
    high: float

    @property
    def figure(self) -> float | str:
        """The median, or BELOW_NOISE when the interval reaches zero: smaller than its own spread."""
        return self.median if self.low > 0 else BELOW_NOISE


def paired_cost(path: np.ndarray, base: np.ndarray, seed: int = 0) -> PairedCost:
    """The step cost of ``path`` over ``base``, paired round by round (both in round order)."""
    path, base = np.asarray(path, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if path.shape != base.shape or path.ndim != 1 or path.size < 2:
        raise ValueError(
            f"paired_cost needs two equal-length 1-D sample arrays of at least 2 rounds, got {path.shape} "
            f"and {base.shape}; run more rounds (--reps)"
        )
    diff = path - base
    rng = np.random.default_rng(seed)
    medians = np.median(diff[rng.integers(0, diff.size, size=(RESAMPLES, diff.size))], axis=1)
    tail = (1.0 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return PairedCost(float(np.median(diff)), float(low), float(high))


def ratio(num: float | str | None, den: float | str | None) -> float | str | None:
    """num / den of two step costs; BELOW_NOISE when either is, None when either was not measured."""
    if num is None or den is None:
        return None
    if isinstance(num, str) or isinstance(den, str):
        return BELOW_NOISE
    return num / den


def _count_triton_launches(counter: list[int]) -> Callable[[], None]:
    """Wrap the kernel module's launch functions (called by attribute) and BoundLaunch replays to count and
    mark CPU launches."""
    from track_1_short.perf.kernels import replicated_adam as kernels

    originals = {}
    for name in ("launch_fused_adam", "launch_fused_adam_groups", "launch_device_step"):
        original = getattr(kernels, name)
        originals[name] = original

        def counted(*args, _original=original, **kwargs):
            counter[0] += 1
            with torch.profiler.record_function("triton_launch"):
                return _original(*args, **kwargs)

        setattr(kernels, name, counted)

    # The fused path replays BoundLaunch objects (one per flat group) instead of calling the functions.
    bound_call = kernels.BoundLaunch.__call__

    def counted_bound(self, _original=bound_call):
        counter[0] += 1
        with torch.profiler.record_function("triton_launch"):
            return _original(self)

    kernels.BoundLaunch.__call__ = counted_bound

    def restore() -> None:
        for name, original in originals.items():
            setattr(kernels, name, original)
        kernels.BoundLaunch.__call__ = bound_call

    return restore


def _outermost(evt, names=("triton_launch",)) -> bool:
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") or parent.name in names:
            return False
        parent = parent.cpu_parent
    return True


@contextlib.contextmanager
def _driver_launches(path):
    """Count the update-graph launches the device mode's host step makes (stage_and_replay answering
    STATIC_SAME) while inside, in ``[count]`` (device_floor: the launches it counted itself; 0 for a path that
    has neither); put the host step back after.
    The host step launches through the driver's cuGraphLaunch, which the profiler's trace of the CUDA API
    leaves out (it reads 0 launches for that path), so the bench counts them here."""
    counted = [0]
    mode = getattr(getattr(path, "opt", None), "_device_mode", None)
    if mode is None:
        before = getattr(path, "launched", None)  # device_floor counts its own driver launches
        yield counted
        if before is not None:
            counted[0] = path.launched - before
        return

    def wrap(name, call):
        if name != "stage_and_replay":
            return call

        def launch(*args):
            answer = call(*args)
            counted[0] += answer == STATIC_SAME
            return answer

        return launch

    host = mode.host
    mode.host = InstrumentedHostStep(host, wrap)
    try:
        yield counted
    finally:
        mode.host = host


def profile_counts(runner: Runner, count: int, device) -> dict:
    """Per-step launches and device kernels of ``count`` repetitions (profiler): deterministic counts."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    triton = [0]
    restore = _count_triton_launches(triton) if device.type == "cpu" else None
    try:
        with _driver_launches(runner.path) as driver, torch.profiler.profile(activities=activities) as prof:
            run_steps(runner, count, device)
    finally:
        if restore is not None:
            restore()
    events = prof.events()
    if device.type == "cuda":
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(1 for e in events if e.name.startswith(LAUNCH_CALLS))
        if not any(e.name.startswith("cuGraphLaunch") for e in events):
            launches += driver[0]  # untraced: counted by the host step's wrapper
        return {"launches": launches / count, "kernels": len(gpu) / count}
    aten = sum(
        1 for e in events if e.name.startswith("aten::") and e.name not in NO_KERNEL_OPS and _outermost(e)
    )
    return {"launches": (aten + triton[0]) / count, "kernels": None}


def _us(value: float | str) -> float | str:
    return value * 1e6 if isinstance(value, float) else value


def _spread_us(samples: np.ndarray) -> list[float]:
    return [float(q) * 1e6 for q in np.percentile(samples, [25, 75])]


BASELINE = "backward_only"
# Timed, not compared bit for bit: other arithmetic (torch_adam), or no update at all (the floors).
NOT_COMPARED = ("torch_adam", "device_fence_graph", "device_floor")


def hand_over_call(device: torch.device) -> Callable[[], None]:
    """What ``--hand-over`` calls right after each backward: a CUDA event recorded (nothing off CUDA)."""
    if device.type != "cuda":
        return lambda: None
    return torch.cuda.Event().record


def measure_set(
    name,
    spec,
    paths,
    device,
    reps,
    warmup,
    profile_steps,
    block,
    classes=None,
    seed=0,
    phases=None,
    hand_over=False,
) -> list[dict]:
    """The ``backward_only`` row, then one row per path of ``paths`` (classes: name -> path class).

    With ``phases`` (a dict), each runner's phase_times over ``reps`` more repetitions go into it, keyed by
    path, after the interleaved samples and the profile (so neither sees them). With ``hand_over`` every
    runner, the baseline's too, makes hand_over_call(device) right after its backward."""
    classes = {BASELINE: BackwardOnly, **PATH_CLASSES} if classes is None else classes
    names = [BASELINE, *paths]
    runners, finals = {}, {}
    for path_name in names:
        params, cfgs, states = build(spec, device)
        runners[path_name] = Runner(
            classes[path_name](params, cfgs, states, device, block),
            params,
            Gradients(params),
            hand_over_call(device) if hand_over else None,
        )
        finals[path_name] = (params, states)
        run_steps(runners[path_name], warmup, device)
    lead_s = spin_lengths(runners, device) if device.type == "cuda" else None
    samples = interleaved_samples(runners, reps, device, lead_s=lead_s, seed=seed)
    counts = {n: profile_counts(runners[n], profile_steps, device) for n in names}
    if phases is not None:
        for n in names:
            phases[n] = phase_times(runners[n], reps, device)

    base = samples[BASELINE]
    n_elements = sum(torch.Size(s[1]).numel() for s in spec)
    rows, host_cost = [], {}
    for path_name in names:
        got = samples[path_name]
        row = {
            "set": name,
            "tensors": len(spec),
            "elements": n_elements,
            "dtypes": len({entry[2] for entry in spec}),
            "path": path_name,
            "host_us": None,
            "host_us_ci": None,
            "device_us": None,
            "device_us_ci": None,
        }
        if path_name != BASELINE:
            host = paired_cost(got.host, base.host, seed)
            host_cost[path_name] = host.figure
            row["host_us"], row["host_us_ci"] = _us(host.figure), [host.low * 1e6, host.high * 1e6]
            if got.device is not None:
                dev = paired_cost(got.device, base.device, seed)
                row["device_us"], row["device_us_ci"] = _us(dev.figure), [dev.low * 1e6, dev.high * 1e6]
        row["total_host_us"] = float(np.median(got.host)) * 1e6
        row["total_host_iqr"] = _spread_us(got.host)
        row["total_device_us"] = None if got.device is None else float(np.median(got.device)) * 1e6
        row["total_device_iqr"] = None if got.device is None else _spread_us(got.device)
        row["starved"] = got.starved
        other = counts[BASELINE]
        if path_name == BASELINE:
            row["launches"] = row["kernels"] = None  # the figures below are what a path adds to this backward
        else:
            row["launches"] = counts[path_name]["launches"] - other["launches"]
            kernels = counts[path_name]["kernels"]
            row["kernels"] = None if kernels is None else kernels - other["kernels"]
        rows.append(row)

    for row in rows:
        path_name = row["path"]
        own = host_cost.get(path_name)
        row["speedup"] = ratio(host_cost.get("per_param"), own)
        row["vs_fused"] = ratio(host_cost.get("fused"), own)
        if path_name == BASELINE or path_name in NOT_COMPARED or "per_param" not in finals:
            row["bitwise"] = None
            continue
        ref_params, ref_states = finals["per_param"]
        params, states = finals[path_name]
        row["bitwise"] = all(
            same_bits(p, q)
            and same_bits(s["exp_avg"], t["exp_avg"])
            and same_bits(s["exp_avg_sq"], t["exp_avg_sq"])
            for p, q, s, t in zip(params, ref_params, states, ref_states)
        )
    return rows


def _cell(value, width: int, digits: int = 1) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, str):
        return f"{value:>{width}}"
    if isinstance(value, list):
        return f"{'[' + ', '.join(f'{v:.{digits}f}' for v in value) + ']':>{width}}"
    if isinstance(value, bool):
        return f"{str(value):>{width}}"
    return f"{value:>{width}.{digits}f}"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'set':<10}{'path':<14}{'host us':>12}{'host 95% CI':>22}{'device us':>12}{'device 95% CI':>22}"
        f"{'total host':>12}{'launches':>10}{'kernels':>9}{'speedup':>12}{'vs fused':>12}{'bitwise':>8}"
    )
    for r in rows:
        print(
            f"{r['set']:<10}{r['path']:<14}{_cell(r['host_us'], 12)}{_cell(r['host_us_ci'], 22)}"
            f"{_cell(r['device_us'], 12)}{_cell(r['device_us_ci'], 22)}{_cell(r['total_host_us'], 12)}"
            f"{_cell(r['launches'], 10)}{_cell(r['kernels'], 9)}{_cell(r['speedup'], 12, 2)}"
            f"{_cell(r['vs_fused'], 12, 2)}{_cell(r['bitwise'], 8)}"
        )


def print_short_table(rows: list[dict]) -> None:
    """The record set's figures the issue's targets are stated in: one line per path, printed last."""
    print("Adam step over backward only, record set (median of paired rounds, 95% CI; us):")
    print(
        f"{'path':<12}{'host us':>12}{'host 95% CI':>22}{'device us':>12}{'x fewer host us':>17}"
        f"{'bitwise':>8}"
    )
    for r in rows:
        if r["set"] != "record" or r["path"] == BASELINE:
            continue
        print(
            f"{r['path']:<12}{_cell(r['host_us'], 12)}{_cell(r['host_us_ci'], 22)}{_cell(r['device_us'], 12)}"
            f"{_cell(r['speedup'], 17, 2)}{_cell(r['bitwise'], 8)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {SETS}")
    parser.add_argument(
        "--record",
        action="store_true",
        help="the record set only (same as --sets record), and a short table of its step costs last",
    )
    parser.add_argument(
        "--paths", default=",".join(PATHS), help=f"comma-separated, from {PATHS + EXTRA_PATHS}"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="interleaved rounds, one repetition of each path per round (default: 300 on cuda, 10 on cpu)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per path first (default: 5 on cuda, 1 on cpu)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=None, help="steps under the profiler (default 5 / 1)"
    )
    parser.add_argument(
        "--block", type=int, default=None, help="kernel block (default: 1024 cuda, 65536 cpu)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the round order and the bootstrap")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each phase of a repetition (backward, and the step's public calls), per path",
    )
    parser.add_argument(
        "--hand-over",
        action="store_true",
        help="record a CUDA event right after each backward in every path and the baseline: the trainer's "
        "order, where AnvilAndAdam's reduce-scatters make CUDA calls before the replicated update",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    sets = [s for s in args.sets.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    if args.record:
        if args.sets != ",".join(SETS) and sets != ["record"]:
            parser.error(f"--record measures the record set only; drop --sets {args.sets}")
        sets = ["record"]
    for s in sets:
        if s not in SETS:
            parser.error(f"--sets: unknown set {s!r}; choose from {SETS}")
    for p in paths:
        if p not in PATHS + EXTRA_PATHS:
            parser.error(f"--paths: unknown path {p!r}; choose from {PATHS + EXTRA_PATHS}")
    if args.reps is not None and args.reps < 2:
        parser.error(f"--reps {args.reps}: a paired median and its interval need at least 2 rounds")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Triton's interpreter is chosen when a kernel is decorated: before the kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from track_1_short import distributed
    from track_1_short.perf.bench_meta import bench_metadata, write_bench_json

    device = (
        distributed.init(device.type)
        if device.type == "cuda" or distributed.launched_by_torchrun()
        else device
    )
    cuda = device.type == "cuda"
    reps = args.reps or (300 if cuda else 10)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    profile_steps = args.profile_steps or (5 if cuda else 1)
    block = args.block or (1024 if cuda else 65536)

    rows, tables = [], {}
    for name in sets:
        spec = RECORD if name == "record" else synthetic_set()
        per_path: dict[str, list[dict]] | None = {} if args.phases else None
        options = {"seed": args.seed, "phases": per_path, "hand_over": args.hand_over}
        rows += measure_set(name, spec, paths, device, reps, warmup, profile_steps, block, **options)
        if per_path:
            title = f"{name} set: host us per phase of a repetition (median of {reps}; nothing subtracted)"
            tables[title] = [{"path": p, **row} for p, path_rows in per_path.items() for row in path_rows]
    if distributed.is_main():
        print(
            f"{device}, world size {distributed.world_size()}, {reps} interleaved rounds after {warmup} "
            f"warmup steps; block {block}"
        )
        print_table(rows)
        for title, table in tables.items():
            print(title)
            for row in table:
                print(f"  {row['path']:<14}{row['phase']:<15}{row['host_us']:10.1f}")
        if args.out:
            payload = {
                **bench_metadata(
                    sys.argv if argv is None else ["perf/bench_replicated_adam.py", *argv], device
                ),
                "title": "Replicated Adam per Adam step",
                "world_size": distributed.world_size(),
                "rounds": reps,
                "hand_over": args.hand_over,
                "rows": rows,
                **({"tables": tables} if tables else {}),
                "notes": [
                    "host_us, device_us: the Adam step's cost, the median over rounds of (backward + step) "
                    "minus the backward_only baseline of the same round (interleaved in a seeded order); "
                    f"*_ci: bootstrap {CONFIDENCE:.0%} interval of that median. A cost whose interval "
                    f'reaches zero is "{BELOW_NOISE}", and so is any ratio made from it.',
                    "total_*: median of a whole repetition (backward + step), *_iqr its interquartile range; "
                    "device times from CUDA events behind a spin kernel longer than the enqueue; starved: "
                    "repetitions whose enqueue outlasted it. On CUDA the event that closes a repetition is "
                    "inside its host time, the baseline's too: the first CUDA call after the backward pays "
                    "for the backward's hand-over, and in a training step some call always follows it.",
                    "launches, kernels: per Adam step from the profiler, the baseline's subtracted (what a "
                    "path adds to the backward counts: the device path's in-place accumulation).",
                    "At world size 1 the collectives are no-ops; torchrun with several processes includes "
                    "them.",
                    "bitwise: parameters and moments after warmup + timed + profiled steps equal the "
                    "per_param path's bit for bit.",
                    *(
                        [
                            "--hand-over: every repetition, the baseline's too, recorded a CUDA event right "
                            "after its backward (the trainer's order: the reduce-scatters call CUDA first)."
                        ]
                        if args.hand_over
                        else []
                    ),
                ],
            }
            write_bench_json(args.out, payload)
            print(f"wrote {args.out}")
        if args.record:
            print_short_table(rows)
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
