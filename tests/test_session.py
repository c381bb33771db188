"""The test session's own set-up (tests/conftest.py): one thread a process, and a skip report that fits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_tests_and_what_they_spawn_run_one_intra_op_thread():
    assert torch.get_num_threads() == 1
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.stdout.strip() == "1", child.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run on a GPU machine")
def test_the_gpu_skips_fold_to_one_line():
    files = ["tests/test_gpu_train_step.py", "tests/test_gpu_trainer.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, out.stdout[-3000:]
    count = int(skipped[0].split("[")[1].split("]")[0])
    assert count > 1 and skipped[0].endswith("needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
