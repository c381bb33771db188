"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels run in its interpreter. The interpreter is chosen when ``@triton.jit``
decorates a kernel, so TRITON_INTERPRET must be set before any kernel module is imported: that is why it
happens here, at collection time, and why spawned ranks (tests/distributed_harness.py) inherit it through
the environment.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
