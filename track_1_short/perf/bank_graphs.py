"""ANVIL's per-bank update replayed as a CUDA graph (``OptimConfig.bank_graphs = true``).

What it replaces: the bank update (eager or Triton: ``OptimConfig.bank_update``) launched op by op
from Python on every step. For one bank that is the cascade's 6 rounds of bmm/baddbmm with their casts and
normalisation, and the rails, equaliser and master kernels: 25 to 100 launches, each with Python and
dispatcher work on the host. The small banks (qk: 48 matrices of 256 x 768) are short enough on the GPU that
the host's launching is what the step waits for.

Why it is faster: each bank's update is captured once into a CUDA graph and replayed every step afterwards:
one launch a bank, the kernels back to back on the GPU with no host work between them. Capture is possible
because :class:`track_1_short.optim.anvil_bank.AnvilBank` keeps every operand at a fixed address for the
optimizer's life and reads everything that changes between steps (momentum, decay, rail betas, each matrix's
lr) from its device ``scalars`` tensor, never as a Python number; the keyword constants are fixed per bank.

Invariants (tests/perf/test_bank_graphs.py; the CUDA ones in the same file, marked gpu):
1. The first call for a set of operands runs the update eagerly on the capture stream (Triton's JIT, cuBLAS'
   workspace and every other lazy set-up happen there, outside the capture), rewinds the state it wrote,
   captures the update, replays it, and keeps the graph only if the replay wrote the same bits as the eager
   run (else a RuntimeError names the bank's tensors that differ). Later calls with the same operands
   (addresses, shapes, strides, dtypes) and constants only replay; new operands are captured anew.
2. Replays give the parameters and optimizer state of the ungraphed update bit for bit over many steps
   (CUDA test, every ``bank_update`` route).
3. The graphs share one memory pool and are replayed one after another on one stream, so the temporaries of
   one bank may reuse those of another; none outlives its replay. The operands are held by the wrapper, so
   their memory cannot be handed to another tensor while a graph writes there.

Provenance: upstream's track-1 record #360 replays each bank's compiled update in a CUDA graph (its
``track_1_short/optim/anvil.py``); PyTorch's ``torch.cuda.graph`` capture and its rule of warming up on a side
stream. The eager-then-check capture is this project's (:mod:`track_1_short.perf.graph_check`), as in
:mod:`track_1_short.perf.replicated_adam_graphs`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from track_1_short.perf.graph_check import same_bits

# The operands AnvilBank.update passes, in order; the update writes the ones in _WRITTEN in place.
_OPERANDS = ("grad", "weight", "velocity", "lane_energy", "mantissa", "scalars")
_WRITTEN = ("weight", "velocity", "lane_energy", "mantissa")


def check_device(device: torch.device | str) -> None:
    """Raise a RuntimeError naming the setting unless ``device`` is a CUDA device (graphs are CUDA's)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(
            f"optim.bank_graphs=true captures the bank updates in CUDA graphs, which need a CUDA device; the "
            f"parameters are on {device.type}. Set optim.bank_graphs=false on this device."
        )


class GraphedBankUpdate:
    """A bank update function (called like :func:`track_1_short.optim.anvil_bank.bank_update_`) that captures
    one CUDA graph per set of operands on its first call and replays it afterwards (module docstring).

    ``update_fn``: the update to capture (eager, compiled or Triton); ``device``: the CUDA device the banks
    live on. ``captures``: graphs made so far; ``replays``: calls answered by a replay alone.
    """

    def __init__(self, update_fn: Callable[..., None], device: torch.device | str):
        check_device(device)
        self.update_fn = update_fn
        self.device = torch.device(device)
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, operands kept alive)
        self._stream: torch.cuda.Stream | None = None  # made at the first capture
        self._pool = None

    @staticmethod
    def _key(operands: tuple[torch.Tensor, ...], constants: dict) -> tuple:
        layout = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in operands)
        return layout, tuple(sorted(constants.items()))

    def __call__(self, *operands: torch.Tensor, **constants) -> None:
        if len(operands) != len(_OPERANDS):
            raise TypeError(
                f"GraphedBankUpdate takes the {len(_OPERANDS)} operands {', '.join(_OPERANDS)} (as "
                f"AnvilBank.update passes them); got {len(operands)}."
            )
        key = self._key(operands, constants)
        entry = self._graphs.get(key)
        if entry is None:
            self._graphs[key] = (self._capture(operands, constants), operands)
            self.captures += 1
            return
        entry[0].replay()
        self.replays += 1

    def _capture(self, operands: tuple[torch.Tensor, ...], constants: dict) -> torch.cuda.CUDAGraph:
        """Run this step eagerly, rewind, capture, replay; return the graph if its bits equal the eager run's.

        On return, or on the error, the operands hold this step's update as the eager run wrote it."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        named = dict(zip(_OPERANDS, operands))
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            before = {role: named[role].clone() for role in _WRITTEN}
            # The warm-up on the capture stream, and the reference bits.
            self.update_fn(*operands, **constants)
            eager = {role: named[role].clone() for role in _WRITTEN}
            for role in _WRITTEN:
                named[role].copy_(before[role])
            del before
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                self.update_fn(*operands, **constants)
            graph.replay()
            differing = [role for role in _WRITTEN if not same_bits(named[role], eager[role])]
            if differing:  # leave the step as the eager update wrote it
                for role in _WRITTEN:
                    named[role].copy_(eager[role])
        caller.wait_stream(self._stream)
        if differing:
            raise RuntimeError(
                f"the CUDA graph of a bank update (operands {tuple(operands[0].shape)}) wrote other bits "
                f"than the same update run eagerly, in {', '.join(differing)}; set optim.bank_graphs=false."
            )
        return graph
