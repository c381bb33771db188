"""Run a script that compiles Triton kernels for sm_90 with the wheel's own ptxas, outside the interpreter.

The interpreter accepts code that Triton's compiler rejects (it once took a helper whose constexpr branches
returned different dtypes), so the GPU variants of the kernels are compiled here too, with no GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile


def compile_outside_the_interpreter(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python without TRITON_INTERPRET; its stdout and stderr are captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_kernels_compile(module: str, kernels: dict[str, dict[str, str]], consts: dict, num_warps: int = 4):
    """Compile each kernel of ``module`` (kernel name -> its runtime signature) for sm_90 with the constexprs
    ``consts``, in a fresh Python outside the interpreter, and assert that every one produced a cubin."""
    script = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import {module} as k

consts = {consts!r}
for name, sig in {kernels!r}.items():
    sig = {{**sig, **dict.fromkeys(consts, "constexpr")}}
    src = ASTSource(fn=getattr(k, name), signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {num_warps}}})
    assert compiled.asm["cubin"], name
print("compiled", len({kernels!r}))
"""
    proc = compile_outside_the_interpreter(script)
    assert proc.returncode == 0 and f"compiled {len(kernels)}" in proc.stdout, proc.stderr[-3000:]


def assert_pipelined(compiled, stages: int, *what) -> None:
    """Assert that a kernel compiled for sm_90 software-pipelines its operand loads: cp.async copies into
    shared memory, at least two a stage beyond the first (``what`` names the variant in the message)."""
    copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
    assert copies >= 2 * (stages - 1), ("operand loads not pipelined", *what, copies)


def spill_bytes(compiled) -> int:
    """Bytes of registers spilled to local memory (stores), from the wheel's own ``ptxas -v`` on the
    kernel's PTX for sm_90a."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"(\d+) bytes spill stores", report.stdout + report.stderr)
    assert found, "ptxas -v printed no spill figure"
    return int(found.group(1))
