"""The host learns that the GPU has run past a point of its stream by reading memory, with no CUDA call.

What it replaces: a CUDA event recorded behind each replay of a graph, and synchronized before the host
rewrites the pinned rows that the graph copies from. That is two CUDA calls per step: 7 to 18 host us on the
H100 hosts measured in perf/RESULTS.md ("Replicated Adam: where each path's host time goes").

Why it is faster: the graph ends with ``signal()``, two stream-ordered nodes: a device counter incremented,
then copied into pinned host memory (or a kernel of the graph writes both itself: ``signal_targets()``).
The host counts the signals it has enqueued (``count()``) and compares that with the pinned copy, one load
from memory. Only when the GPU is behind does the host wait, spinning on that load.

Invariants (tests/perf/test_graph_fence.py):
1. The pinned count never exceeds the signals enqueued, and ``wait()`` returns only once every signal
   enqueued has run. Every node enqueued before the last signal has then run too, since the stream runs them
   in order.
2. A count that never arrives (a signal counted but never enqueued) raises after ``timeout_s``, naming both
   counts; the host does not hang.

Provenance: host-polled flags in pinned memory, as NCCL's proxy thread uses them and as CUDA's stream memory
operations write them (cuStreamWriteValue32); PyTorch's capturable Adam keeps its step counter on the device
for the same reason, so that a replayed graph needs no host value.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# A replicated Adam step runs in microseconds; a GPU this far behind its host has stopped, and an error that
# says so beats a silent hang.
DEFAULT_TIMEOUT_S = 60.0


class GraphFence:
    """A device counter, its pinned host copy, and the number of signals the host has enqueued."""

    def __init__(
        self,
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._device_count = torch.zeros(1, dtype=torch.int64, device=device)
        self._host_count = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._seen = self._host_count.numpy()  # a view: each read is a load from the pinned memory
        self.enqueued = 0
        self.timeout_s = timeout_s
        self._clock = clock

    def signal(self) -> None:
        """Enqueue a signal on the current stream: eagerly, or as two nodes of a graph being captured.

        Whoever enqueues it also calls count() once for each time it will run (an eager call, a replay).
        """
        self._device_count.add_(1)
        self._host_count.copy_(self._device_count, non_blocking=True)

    def signal_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device counter, pinned host count): what a kernel writes to signal the fence itself, where
        signal() takes two nodes of their own. One program of the launch loads the counter, adds one and
        stores the sum into both; the caller counts it as a signal (count()), as after signal()."""
        return self._device_count, self._host_count

    def count(self) -> None:
        """One more signal enqueued: after an eager signal(), or after a replay of a graph that holds one."""
        self.enqueued += 1

    @property
    def arrived(self) -> int:
        """The signals that have run so far (the pinned copy of the device counter)."""
        return int(self._seen[0])

    def wait(self) -> None:
        """Return once every signal enqueued has run; raise RuntimeError after ``timeout_s`` without it."""
        self.wait_for(self.enqueued)

    def wait_for(self, enqueued: int) -> None:
        """Return once the first ``enqueued`` signals have run; raise RuntimeError after ``timeout_s``."""
        seen = self._seen
        if seen[0] >= enqueued:
            return
        deadline = self._clock() + self.timeout_s
        while seen[0] < enqueued:
            if self._clock() > deadline:
                raise RuntimeError(
                    f"the GPU has run {int(seen[0])} of the {enqueued} fence signals enqueued after waiting "
                    f"{self.timeout_s:g} s: it has stopped, or a signal was counted that was never enqueued"
                )
            time.sleep(0)  # give the GIL to other threads while the GPU catches up


class FenceTicket:
    """An event-shaped mark on a fence, for UploadRing's ``event_factory``.

    ``record()`` notes how many signals have been enqueued, those of the work that reads the slot included;
    ``synchronize()`` waits until they have run. No CUDA call either way: the ring's wait and record become a
    comparison and an assignment, where the work that reads the slot (a replayed graph) signals the fence.
    """

    def __init__(self, fence: GraphFence):
        self.fence = fence
        self.ticket = 0

    def record(self) -> None:
        self.ticket = self.fence.enqueued

    def synchronize(self) -> None:
        self.fence.wait_for(self.ticket)
