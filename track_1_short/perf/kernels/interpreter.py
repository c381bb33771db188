"""Where this project's Triton kernels can run: on CUDA tensors, or on any device under Triton's interpreter.

Triton picks the interpreter (TRITON_INTERPRET=1) when a kernel is decorated, so whether a kernel module
runs interpreted is a fact of one of its kernels, fixed when the module was imported.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def runs_interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter.

    Call it once, when the kernel's module is imported, and keep the answer: the modules' device checks run
    inside torch.compile'd code, and Dynamo cannot trace an isinstance test of a compiled Triton kernel."""
    return isinstance(kernel, InterpretedFunction)


def check_device(
    device: torch.device | str, what: str, interpreted: bool, kernels: str, instead: str
) -> None:
    """Raise a RuntimeError naming ``what`` unless a kernel module can run on ``device``: a CUDA device, or
    any device when it runs ``interpreted``. ``kernels`` names the module in the message, ``instead`` is the
    setting to use on this device."""
    device = torch.device(device)
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"{what}: the {kernels} kernels run on CUDA tensors, or elsewhere only under Triton's "
            f"interpreter (TRITON_INTERPRET=1 set before track_1_short.perf.kernels.{kernels} is "
            f"imported); got a {device.type} tensor. Use {instead} on this device."
        )
