"""The fused path's update as one CUDA graph per upload slot: the table's copy and each dtype's launch.

What it replaces (``ReplicatedAdam(impl="fused")`` on CUDA with ``use_cuda_graphs=True``, the default): per
Adam step, the pinned table slot's copy to the device (a ``Tensor.copy_`` through torch's dispatcher) and one
bound Triton launch per dtype, three host calls that each read the current stream and launch.

Why it is faster: the three become one ``CUDAGraph.replay()``. Measured on an H100 (perf/RESULTS.md,
replicated_adam.json, a slow host): fused 256.7 host us per Adam step against device mode's 219.8, where with
eager launches device mode needed 2.15x fewer (replicated_adam_fused_eager.json, another H100); launches per
step 5 -> 3. The host still builds the table (the fused path's own HostScalarTable) and writes it into the
ring's next pinned slot; each slot has its own graph, whose copy node reads that slot, so the data of every
step (step sizes, weight decay, active flags, betas) travels as it did and nothing is captured but addresses
that never change: the slot, the device table and the flat buffers. The graph always launches every dtype's
kernel; a dtype whose parameters all lack a gradient is left as it was by the kernel itself (its rows have
active = 0), where the eager path skips the launch.

Invariants (tests/perf/test_replicated_adam.py, GPU): the graphs give the eager path's bits over steps
that cycle through every slot, with missing gradients, a dtype with none and a change of betas; a graph is
trusted only after one replay matched the eager step bit for bit (a mismatch warns and the path stays eager,
the step's eager result kept); a slot is rewritten only once the fence signal at the end of its last
graph (or eager launch) has run (perf/graph_fence.py: a load from pinned memory where an event's record and
wait were two CUDA calls).

Provenance: the fused path and its ring are perf/replicated_adam.py's; replaying a fixed-address step as a
CUDA graph follows PyTorch's capturable optimizers and the device mode (perf/replicated_adam_device.py).
"""

from __future__ import annotations

import warnings

import torch

from track_1_short.perf.graph_fence import GraphFence


class SlotGraphs:
    """One CUDA graph per ring slot of a fused ReplicatedAdam: ``run(slot)`` uploads that slot's table and
    launches every group's kernel, as a replay once the slot's graph is captured and checked, eagerly once
    the graphs were refused. Either way the work ends with a signal of ``fence``, which the ring's slots
    wait on (FenceTicket) before the host rewrites them."""

    def __init__(self, owner, fence: GraphFence):
        self.owner = owner
        self.fence = fence
        self.graphs: list[torch.cuda.CUDAGraph | None] = [None] * owner._ring.slots
        self.enabled = True

    def _eager(self, slot: int) -> None:
        owner = self.owner
        owner.table.copy_(owner._ring.slot_tensor(slot), non_blocking=True)
        for launch in owner._launches:
            launch()
        self.fence.signal()  # the slot may be rewritten once this has run

    def run(self, slot: int) -> None:
        graph = self.graphs[slot]
        if graph is not None:
            graph.replay()
            self.fence.count()
            return
        if not self.enabled:
            self._eager(slot)
            self.fence.count()
            return
        owner = self.owner
        before = owner._flat_snapshot()
        self._eager(slot)
        self.fence.count()
        # Triton compiles and binds on a kernel's first launch, outside any capture: only now may it be
        # captured (the eager launch above was that first launch for this slot's step at the latest).
        eager = owner._flat_snapshot()
        owner._load_flat_snapshot(before)
        torch.cuda.synchronize(owner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._eager(slot)
        graph.replay()
        self.fence.count()
        differing = owner._flat_snapshot_differences(eager, owner._flat_snapshot())
        if differing:
            owner._load_flat_snapshot(eager)
            self.enabled = False
            self.graphs = [None] * len(self.graphs)
            warnings.warn(
                "the CUDA graph of the fused replicated Adam update disagrees with the eager update in "
                f"{', '.join(differing)}; the fused path launches eagerly from now on "
                "(use_cuda_graphs=False says so from the start)",
                stacklevel=3,
            )
            return
        self.graphs[slot] = graph
