"""Run a function on N ranks in fresh processes and collect what each returns: gloo ranks on the CPU, or
(``device="cuda"``) NCCL ranks, one GPU each.

Workers must be importable module-level functions (spawned children unpickle them by name), called as
``fn(rank, world_size, *args)``. They run with the project's process group already initialised through
``track_1_short.distributed.init`` and return picklable values (tensors are moved to the CPU by the caller).
A CUDA rank computes on GPU ``rank`` (LOCAL_RANK, as torchrun sets it) and runs Triton kernels compiled, not
interpreted.

CPU ranks are forked from a fork server (one per test process, started at its first call) that has imported
torch and the trainer once: a spawned rank spends about 2 s of CPU importing them before it does anything,
and the suite starts some thirty ranks. Each rank is still a new process that has run nothing before its
worker. The server's environment is the test process's when the server starts (TRITON_INTERPRET and one
thread a process, from tests/conftest.py). CUDA ranks are spawned, as a process that may hold a CUDA context
must not fork, and so are CPU ranks on a CUDA machine, which set TRITON_INTERPRET themselves before their
kernels are decorated.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _child(fn, rank, world_size, init_file, args, queue, device):
    if device == "cuda":
        # distributed.init picks the GPU from it; Triton stays compiled (tests/conftest.py sets
        # TRITON_INTERPRET only without CUDA, and the children inherit the parent's environment).
        os.environ["LOCAL_RANK"] = str(rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # One thread a rank: two ranks on a 2-core machine must not oversubscribe it.
    import torch

    torch.set_num_threads(1)
    from track_1_short import distributed

    try:
        distributed.init(device, rank=rank, world_size=world_size, init_method=f"file://{init_file}")
        result = fn(rank, world_size, *args)
        # Serialised to bytes: a tensor put on the queue as-is travels through shared memory, which this child
        # may tear down (by exiting) before the parent has opened it.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        distributed.destroy()


# What the fork server imports once for every CPU rank it forks: the trainer pulls in torch, Dynamo, Triton
# (its kernels decorated under TRITON_INTERPRET), Hydra and the project.
_PRELOAD = [
    "tests.distributed_harness",
    "track_1_short.distributed",
    "track_1_short.trainer",
    "tests.faults_runs",
]


def cpu_context():
    """The fork server's multiprocessing context, for CPU ranks and other processes of the trainer."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts; later calls change nothing
    return ctx


def run_ranks(fn, world_size: int, *args, device: str = "cpu", timeout_s: float = 300.0) -> list:
    """Return ``[fn(0, W, *args), ..., fn(W-1, W, *args)]``, each computed in its own process."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_ranks(device={device!r}): 'cpu' (gloo) or 'cuda' (NCCL, one GPU a rank).")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"run_ranks: {world_size} NCCL ranks need {world_size} GPUs, {torch.cuda.device_count()} visible."
        )
    # A forked rank keeps the server's kernels: interpreted only if the server ran with TRITON_INTERPRET.
    forked = device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    ctx = cpu_context() if forked else mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, init_file, args, queue, device))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout_s)
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors.append(f"rank {rank} failed:\n{payload}")
                    break
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
        return [results[r] for r in range(world_size)]
