"""ANVIL's bank updates, each on a CUDA stream of its own (``OptimConfig.bank_streams = true``).

What it replaces: every bank's update enqueued on the caller's stream, one after another in work order. The
small banks leave most of the GPU idle while they run: their cascades (the qk bank's 48 matrices of
256 x 768, the vo bank's 16 of 768 x 768) take several times their matmul floor (perf/RESULTS.md, "Optimizer
step"), chains of small matmuls each too short to fill the SMs, and the MLP bank starts only when they are
done.

Why it is faster: each bank's update goes on its own stream, which first waits for what the caller's stream
has queued so far (the bank's reduce-scatter, its shard load, the step's scalar upload). The caller's stream
waits for the bank streams once, after every bank is launched, and only then launches their all-gathers. The
GPU runs the three banks' kernels side by side, and the Adam updates queued on the caller's stream in between
run beside them too.

Invariants:
1. The same kernels on the same operands in each bank: parameters and optimizer state are bitwise those of the
   serial order (tests/perf/test_bank_streams.py, on CUDA, with and without bank graphs).
2. AnvilAndAdam launches every bank before it joins any (a join inside the loop would put each bank behind
   the last one again), and launches a bank's all-gather only after the join: the gathers, the tied
   embedding's copy, the clearing of the gradients and the next forward all follow the updates on the caller's
   stream (CPU test with a recording stand-in).
3. Memory: a bank update allocates its temporaries on its own stream, and its operands are the bank's
   persistent tensors, so nothing the caller's stream frees is still in use on a bank stream. With
   ``bank_graphs`` every bank gets its own graph wrapper, hence its own memory pool: graphs that share a pool
   may reuse each other's temporaries, which is safe only when they replay one after another.

Provenance: the streams-and-events pattern of PyTorch's CUDA semantics notes (``wait_stream`` to fork and
join, allocations tied to the stream that made them); overlapping independent optimizer work on side streams
is what FSDP and DDP do for their collectives. Upstream's record runs the bank updates in order on one stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def check_device(device: torch.device | str) -> None:
    """Raise a RuntimeError naming the setting unless ``device`` is a CUDA device (streams are CUDA's)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            "optim.bank_streams=true runs each bank update on its own CUDA stream, which needs a CUDA "
            f"device; the parameters are on {device.type}. Set optim.bank_streams=false on this device."
        )


class BankStreams:
    """One CUDA stream per bank label: :meth:`launch` forks a bank's update onto its stream, :meth:`join`
    makes the caller's stream wait for every bank launched since the last join (module docstring)."""

    def __init__(self, labels: Iterable[str], device: torch.device | str):
        check_device(device)
        self.device = torch.device(device)
        self.streams = {label: torch.cuda.Stream(self.device) for label in labels}
        self._launched: list[str] = []

    def launch(self, label: str, update: Callable[[], None]) -> None:
        """Enqueue ``update()`` on ``label``'s stream, behind everything the caller's stream holds now."""
        stream = self.streams[label]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            update()
        self._launched.append(label)

    def join(self) -> list[str]:
        """Make the caller's stream wait for every bank launched since the last join; returns their labels in
        launch order."""
        caller = torch.cuda.current_stream(self.device)
        launched, self._launched = self._launched, []
        for label in launched:
            caller.wait_stream(self.streams[label])
        return launched
