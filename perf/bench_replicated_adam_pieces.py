"""Where a replicated-Adam step's host time goes: each call inside the fused and device paths' public calls,
timed in place, and the host cost of the CUDA calls that any step makes.

    python perf/bench_replicated_adam_pieces.py --out perf/results/replicated_adam_pieces.json      # CUDA
    python perf/bench_replicated_adam_pieces.py --device cpu --reps 5                               # smoke

perf/bench_replicated_adam.py says what each path costs; this says where that cost sits, so that a target
can be set against what is left. Method: the record set, its gradients delivered by a real backward, every
repetition behind a spin kernel (the GPU busy ahead of the host, as behind a training step's backward), the
garbage collector off. The public calls (launch_reduce, update, zero_grad) run unchanged; the calls inside
them are replaced, on the instance only, by wrappers that read the clock around them (a few hundred
nanoseconds each, charged to the piece). Pieces:

- device (its host step in C++) and device_python (in Python, perf/host_step.py), one call of the host
  step per public call: ``read_gradients`` (the 13 .grad reads and their addresses), ``fence_wait`` (the
  check, without a CUDA call, that the last graph has copied the pinned rows), ``stage_and_replay`` (one
  process: the held gradients' versions, the step counters, the per-step rows and the addresses, then the
  launch of the update graph, which gathers, fills the table and runs Adam), ``drop_gradients`` (zero_grad:
  every .grad = None); with several processes ``write_addresses`` and ``gather_replay`` in launch_reduce
  and ``write_inputs`` and ``update_replay`` in update;
- fused: ``foreach_copy`` (one per dtype), ``ring_wait`` (the upload ring's slot: with CUDA graphs a check
  of the fence they signal), ``table_write``, then on CUDA ``graph_replay`` (the slot's upload and both
  launches) and ``ring_mark`` (the slot's fence ticket), without CUDA graphs
  ``upload`` (the copy and its event) and ``launch_0``/``launch_1`` (one Triton launch per dtype);
- ``rest``: the call's time minus its pieces in the same repetition (Python between them, the no-op reduces
  of one process, the row writes into pinned memory).

Reference rows (CUDA): a CUDA graph of one kernel replayed, the same kernel between the copies that the
update graph made before it became one copy and one kernel (CopiesGraph) replayed, an event recorded, a
finished event waited on, a kernel launched, and the same event record as the first CUDA call after the
backward (the backward's last kernels are launched from autograd's device thread; the first call from the
main thread after it pays for the hand-over). Each row is the median and the 10th and 90th percentiles over
the repetitions. The wrapped paths end bitwise equal to each other (``bitwise``), as unwrapped ones do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_replicated_adam as bench  # noqa: E402 - the sibling script, importable from its own folder

from track_1_short.perf.graph_check import same_bits  # noqa: E402
from track_1_short.perf.graph_fence import GraphFence  # noqa: E402
from track_1_short.perf.host_step import InstrumentedHostStep  # noqa: E402
from track_1_short.perf.kernels.replicated_adam import STEP_INPUTS  # noqa: E402
from track_1_short.perf.replicated_adam import SCALAR_TABLE_SLOTS  # noqa: E402

PATHS = ("fused", "device", "device_python")
SPIN_S = 0.003  # the spin kernel ahead of each repetition: longer than any path's enqueue (~1 ms at most)


class Clock:
    """Host microseconds per piece within the current repetition (a piece called twice adds up)."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.samples: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.call = ""

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += (time.perf_counter() - start) * 1e6

        return timed

    def run_call(self, call: str, fn) -> None:
        """Run one public call, then file its pieces, its total and its rest."""
        self.current.clear()
        start = time.perf_counter()
        fn()
        total = (time.perf_counter() - start) * 1e6
        for name, us in self.current.items():
            self.samples[(call, name)].append(us)
        self.samples[(call, "(call)")].append(total)
        self.samples[(call, "rest")].append(total - sum(self.current.values()))


class _TimedGraph:
    def __init__(self, graph, clock: Clock, name: str):
        self.replay = clock.wrap(name, graph.replay)


def instrument_device(opt, clock: Clock) -> None:
    """Clocks around the device path's inner calls (its graphs must be captured: run a few steps first)."""
    step = opt._device_mode
    step.host = InstrumentedHostStep(step.host, clock.wrap)
    if step.use_graphs:
        step._fence.wait = clock.wrap("fence_wait", step._fence.wait)
        if step.gather_graph is not None:
            step.gather_graph = _TimedGraph(step.gather_graph, clock, "gather_replay")
        step.update_graph = _TimedGraph(step.update_graph, clock, "update_replay")


def instrument_fused(opt, clock: Clock) -> None:
    """Clocks around the fused path's inner calls (on CUDA its slot graphs must be captured: run the ring's
    slot count of steps first)."""
    opt._host_table.write = clock.wrap("table_write", opt._host_table.write)
    opt._ring.host_buffer = clock.wrap("ring_wait", opt._ring.host_buffer)
    if opt._graphs is not None:
        opt._graphs.run = clock.wrap("graph_replay", opt._graphs.run)
        opt._ring.mark_uploaded = clock.wrap("ring_mark", opt._ring.mark_uploaded)
    else:
        opt._ring.upload = clock.wrap("upload", opt._ring.upload)
        opt._launches = [clock.wrap(f"launch_{k}", launch) for k, launch in enumerate(opt._launches)]


def measure_path(path_name: str, device, reps: int, warmup: int, block: int, spin) -> tuple[Clock, list]:
    params, cfgs, states = bench.build(bench.RECORD, device)
    path = bench.PATH_CLASSES[path_name](params, cfgs, states, device, block)
    runner = bench.Runner(path, params, bench.Gradients(params))
    for _ in range(warmup):
        runner()  # captures the device path's graphs
    bench.sync(device)
    clock = Clock()
    (instrument_fused if path_name == "fused" else instrument_device)(path.opt, clock)
    foreach_copy = torch._foreach_copy_
    if path_name == "fused":
        torch._foreach_copy_ = clock.wrap("foreach_copy", foreach_copy)  # looked up by name at each call
    try:
        with bench.collector_off():
            for _ in range(reps):
                runner.prepare()
                bench.sync(device)
                if spin is not None:
                    spin(SPIN_S)
                runner.backward()
                for call, fn in path.step_phases():
                    clock.run_call(call, fn)
                runner.step += 1
    finally:
        torch._foreach_copy_ = foreach_copy
    bench.sync(device)
    return clock, params


class CopiesGraph:
    """A CUDA graph of one kernel between the copies that the device path's update graph made before 0fb84b1:
    two uploads from pinned rows (its addresses, int64 [13], and its inputs, fp64 [STEP_INPUTS, 13]) and the
    download of its fence (GraphFence.signal: the counter's add, the kernel, and its copy into pinned
    memory). Replayed beside the one-kernel graph, it says what those copy nodes add to a launch's host
    time: what folding them into one copy and the kernel (the update graph since then) saves."""

    def __init__(self, device, n: int = len(bench.RECORD)):
        self.host_addresses = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self.host_inputs = torch.zeros((len(STEP_INPUTS), n), dtype=torch.float64, pin_memory=True)
        self.addresses = torch.zeros(n, dtype=torch.int64, device=device)
        self.inputs = torch.zeros((len(STEP_INPUTS), n), dtype=torch.float64, device=device)
        self.fence = GraphFence(device)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.addresses.copy_(self.host_addresses, non_blocking=True)
            self.inputs.copy_(self.host_inputs, non_blocking=True)
            self.fence.signal()

    def replay(self) -> None:
        self.graph.replay()
        self.fence.count()


def cuda_reference(device, reps: int, spin) -> dict[str, list[float]]:
    """Host us of the CUDA calls a step is made of, each behind a spin kernel as the steps are."""
    x = torch.zeros(16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1.0)
    copies = CopiesGraph(device)
    event = torch.cuda.Event()
    params, _, _ = bench.build(bench.RECORD, device)
    grads = bench.Gradients(params)
    out: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        start = time.perf_counter()
        fn()
        out[name].append((time.perf_counter() - start) * 1e6)

    with bench.collector_off():
        for r in range(reps):
            outputs = grads.forward(params, r)
            torch.cuda.synchronize(device)
            spin(SPIN_S)
            grads.backward(outputs)
            timed("event_record, first CUDA call after the backward", event.record)
            timed("event_record", event.record)
            timed("graph_replay (one kernel)", graph.replay)
            timed("graph_replay (one kernel, two uploads and a download)", copies.replay)
            timed("kernel_launch (torch.cuda._sleep)", lambda: torch.cuda._sleep(1))
            torch.cuda.synchronize(device)
            spin(SPIN_S)
            event.record()
            torch.cuda.synchronize(device)
            timed("event_sync (finished event)", event.synchronize)
            for p in params:
                p.grad = None
    torch.cuda.synchronize(device)
    return out


def _row(path: str, call: str, piece: str, samples: list[float]) -> dict:
    a = np.asarray(samples)
    return {
        "path": path,
        "call": call,
        "piece": piece,
        "host_us": float(np.median(a)),
        "host_us_p10": float(np.percentile(a, 10)),
        "host_us_p90": float(np.percentile(a, 90)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions per path (default 400 cuda, 5 cpu)"
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed steps first (captures the graphs: 8 slots for fused)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    # The device path captures its graphs in its first two steps, the fused path one per ring slot.
    minimum = SCALAR_TABLE_SLOTS if cuda else 2
    if args.warmup < minimum:
        parser.error(
            f"--warmup {args.warmup}: at least {minimum} here, so that every graph is captured first"
        )
    reps = args.reps or (400 if cuda else 5)
    block = 1024 if cuda else 65536
    spin = bench.SpinLead(device) if cuda else None

    rows, finals = [], {}
    for path_name in PATHS:
        clock, params = measure_path(path_name, device, reps, args.warmup, block, spin)
        finals[path_name] = params
        order = {"(call)": 0, "rest": 2}
        for (call, piece), samples in sorted(clock.samples.items(), key=lambda kv: order.get(kv[0][1], 1)):
            rows.append(_row(path_name, call, piece, samples))
    calls = ["launch_reduce", "update", "zero_grad"]
    rows.sort(key=lambda r: (PATHS.index(r["path"]), calls.index(r["call"])))
    if cuda:
        rows += [_row("cuda", "-", name, s) for name, s in cuda_reference(device, reps, spin).items()]
    bitwise = all(same_bits(a, b) for name in PATHS[1:] for a, b in zip(finals["fused"], finals[name]))

    for r in rows:
        print(
            f"{r['path']:<14}{r['call']:<15}{r['piece']:<52}{r['host_us']:9.2f}  "
            f"[{r['host_us_p10']:8.2f}, {r['host_us_p90']:8.2f}]"
        )
    print(f"bitwise ({', '.join(PATHS)}, wrapped): {bitwise}")
    if args.out:
        from track_1_short.perf.bench_meta import bench_metadata, write_bench_json

        payload = {
            **bench_metadata(
                sys.argv if argv is None else ["perf/bench_replicated_adam_pieces.py", *argv], device
            ),
            "title": "Replicated Adam: where each path's host time goes",
            "repetitions": reps,
            "bitwise": bitwise,
            "rows": rows,
            "notes": [
                "host_us: median over the repetitions of one piece's host microseconds inside one public "
                "call; host_us_p10, host_us_p90: its 10th and 90th percentiles. (call): the public call "
                "itself; rest: the call minus its pieces, per repetition. Every repetition behind a "
                f"{SPIN_S * 1e3:.0f} ms spin kernel, the record set's gradients fresh from a backward.",
                "Medians do not add up: a call's (call) row is its own median, not the sum of its pieces'.",
            ],
        }
        write_bench_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
