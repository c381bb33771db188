"""The Triton kernel modules' device checks run inside torch.compile'd code (the cascade calls sym_gram's
from orthogonalize). On a GPU the module's kernel is a compiled Triton function, and Dynamo cannot trace an
isinstance test of one, so whether a module runs interpreted must be read once at import, never from the
kernel at call time. The CPU runs the interpreter, so each test puts a plain JITFunction (what @triton.jit
gives outside the interpreter) where the module's kernel is, and compiles the check with fullgraph."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import JITFunction

from track_1_short.perf.kernels import anvil_bank, relu2_mlp, sym_gram


def _gpu_style_kernel(x_ptr):  # only its type matters: it is never launched
    pass


@pytest.mark.parametrize(
    ("module", "kernel_name"),
    [
        (sym_gram, "_sym_gram_kernel"),
        (anvil_bank, "_rails_kernel"),
        (relu2_mlp, "_linear_relu2_kernel"),
    ],
)
def test_device_check_compiles_whole_when_the_kernel_is_a_jit_function(monkeypatch, module, kernel_name):
    monkeypatch.setattr(module, kernel_name, JITFunction(_gpu_style_kernel))
    torch._dynamo.reset()

    def checked(x):
        module.check_device(x.device, "the test")
        return x + 1

    x = torch.zeros(3)
    # The CPU tests run interpreted, so the check passes, and the result proves the compiled call ran.
    assert torch.equal(torch.compile(checked, fullgraph=True, backend="eager")(x), torch.ones(3))
    torch._dynamo.reset()
