"""The fused path's update as one CUDA graph per upload slot: the table's copy and each dtype's launch.

What it replaces (``ReplicatedAdam`` on CUDA with ``use_cuda_graphs=True``, the default): per
Adam step, the pinned table slot's copy to the device (a ``Tensor.copy_`` through torch's dispatcher) and one
bound Triton launch per dtype, three host calls that each read the current stream and launch.

Why it is faster: the three become one ``CUDAGraph.replay()`` (perf/RESULTS.md, "Replicated Adam"). The
host still builds the table (the fused path's own HostScalarTable) and writes it into the
ring's next pinned slot; each slot has its own graph, whose copy node reads that slot, so the data of every
step (step sizes, weight decay, active flags, betas) travels as it did and nothing is captured but addresses
that never change: the slot, the device table and the flat buffers. The graph always launches every dtype's
kernel; a dtype whose parameters all lack a gradient is left as it was by the kernel itself (its rows have
active = 0), where the eager path skips the launch.

Invariants (tests/perf/test_replicated_adam.py, GPU): the graphs give the eager path's bits over steps
that cycle through every slot, with missing gradients, a dtype with none and a change of betas; a graph is
trusted only after one replay matched the eager step bit for bit (a mismatch warns and the path stays eager,
the step's eager result kept); a slot is rewritten only once the event recorded after its last replay (or
eager launch) has passed.

Provenance: the fused path and its ring are perf/replicated_adam.py's; replaying a fixed-address step as a
CUDA graph follows PyTorch's capturable optimizers.
"""

from __future__ import annotations

import warnings

import torch


class SlotGraphs:
    """One CUDA graph per ring slot of a fused ReplicatedAdam: ``run(slot)`` uploads that slot's table and
    launches every group's kernel, as a replay once the slot's graph is captured and checked, eagerly once
    the graphs were refused. The owner records the slot's event after it."""

    def __init__(self, owner):
        self.owner = owner
        self.graphs: list[torch.cuda.CUDAGraph | None] = [None] * owner._ring.slots
        self.enabled = True

    def _eager(self, slot: int) -> None:
        owner = self.owner
        owner.table.copy_(owner._ring.slot_tensor(slot), non_blocking=True)
        for launch in owner._launches:
            launch()

    def run(self, slot: int) -> None:
        graph = self.graphs[slot]
        if graph is not None:
            graph.replay()
            return
        if not self.enabled:
            self._eager(slot)
            return
        owner = self.owner
        before = owner._flat_snapshot()
        self._eager(slot)
        # Triton compiles and binds on a kernel's first launch, outside any capture: only now may it be
        # captured (the eager launch above was that first launch for this slot's step at the latest).
        eager = owner._flat_snapshot()
        owner._load_flat_snapshot(before)
        torch.cuda.synchronize(owner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._eager(slot)
        graph.replay()
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
