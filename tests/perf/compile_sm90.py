"""Run a script that compiles Triton kernels for sm_90 with the wheel's own ptxas, outside the interpreter.

The interpreter accepts code that Triton's compiler rejects (it once took a helper whose constexpr branches
returned different dtypes), so the GPU variants of the kernels are compiled here too, with no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys


def compile_outside_the_interpreter(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python without TRITON_INTERPRET; its stdout and stderr are captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
