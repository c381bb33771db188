"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels run in its interpreter. The interpreter is chosen when ``@triton.jit``
decorates a kernel, so TRITON_INTERPRET must be set before any kernel module is imported: that is why it
happens here, at collection time, and why spawned ranks (tests/distributed_harness.py) inherit it through
the environment.

One intra-op thread a process, set here before torch is imported: ``pytest -n auto`` runs one worker a core,
and the runs and ranks they spawn inherit the setting through the environment. More threads a process only
fight over the cores (the suite takes about a fifth longer on a 2-core machine without it).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_REASON = "needs a CUDA device (run `pytest -m gpu` on a GPU machine)"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fold the skip report (``-ra``) to one line per reason: a skip mark reports each test's own line, so
    the GPU tests alone would print one line each. The GPU skips are reported at this file, the others at
    their test file, without a line number; pytest counts each group."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and not hasattr(report, "wasxfail"):
        path, _, reason = report.longrepr
        if reason.endswith(GPU_REASON):
            path = os.path.relpath(__file__, item.config.rootpath)
        report.longrepr = (path, None, reason)
