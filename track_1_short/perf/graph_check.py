"""The bitwise comparison a CUDA graph is trusted by: its replay against the same work run eagerly.

A graph replays the kernels its capture recorded, with the arguments they had then. The check that nothing
the eager path does was left out of the capture, or recorded with a value of its own (a host scalar read once,
a kernel chosen differently inside a capture), is that one step replayed writes exactly the bits of the same
step run eagerly. :mod:`track_1_short.perf.replicated_adam_graphs` and :mod:`track_1_short.perf.bank_graphs`
make it before they keep a graph.
"""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have one shape and dtype and hold the same bits (NaNs and signed zeros included,
    which ``torch.equal`` on floats would not tell apart)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.detach().reshape(-1).view(view), b.detach().reshape(-1).view(view))
