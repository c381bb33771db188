"""Process-group setup, rank helpers and the project's only collective calls.

Every collective in the project goes through this module, so the order of calls here is the communication
schedule, and the same order must be issued on every rank. The wrappers:

- work with no process group at all (one process, no torchrun): reductions are then the identity, and the
  scatter/gather calls are local copies, so single-process code needs no special case;
- keep one spelling across torch versions: torch 2.13 deprecated ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` in favour of ``all_gather_single`` and ``reduce_scatter_single``, which torch 2.11
  (the GPU image) does not have yet, so the newer name is used where it exists;
- return a :class:`Handle` whose ``wait()`` is always valid, finished or not.

This is also the only module that reads torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if is_initialized() else 0


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init(
    device_type: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> torch.device:
    """Join the process group (torchrun's environment, or explicit rank/world_size/init_method).

    With neither torchrun's variables nor an explicit world size, no group is created and the process is a
    world of one. Returns the device this rank computes on.
    """
    if rank is None and world_size is None and launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method = init_method or "env://"
    if world_size is not None and not is_initialized():
        dist.init_process_group(
            backend=backend_for(device_type),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if device_type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        return device
    return torch.device(device_type)


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


@dataclass
class Handle:
    """A pending collective; ``wait()`` makes its result visible to later work on this rank."""

    work: object | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    @property
    def pending(self) -> bool:
        return self.work is not None


def all_reduce_avg(tensor: torch.Tensor, async_op: bool = False) -> Handle:
    """Average ``tensor`` in place over all ranks."""
    if world_size() == 1:
        return Handle()
    return Handle(dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=async_op))


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False) -> Handle:
    if world_size() == 1:
        return Handle()
    return Handle(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op))


def all_reduce_max(tensor: torch.Tensor, async_op: bool = False) -> Handle:
    if world_size() == 1:
        return Handle()
    return Handle(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=async_op))


def reduce_scatter_avg(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
    """Average ``input`` over ranks; ``output`` gets this rank's dim-0 slice (input.shape[0] / world rows)."""
    if world_size() == 1:
        output.copy_(input)
        return Handle()
    return Handle(_reduce_scatter_single(output, input, op=dist.ReduceOp.AVG, async_op=async_op))


def all_gather_into(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
    """Concatenate every rank's ``input`` along dim 0 into ``output``."""
    if world_size() == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle()
    return Handle(_all_gather_single(output, input, async_op=async_op))


def broadcast_(tensor: torch.Tensor, src: int = 0) -> None:
    if world_size() > 1:
        dist.broadcast(tensor, src=src)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank (used off the hot path: run dirs, configs)."""
    if world_size() == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: object) -> list:
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# -- row exchanges (the n-gram table's pull and gradient return) ---------------------------------------

wire_bytes_sent = 0
"""Bytes this process has sent to other ranks through :func:`exchange_rows` (its own block never counts: it is
never sent). Tests read it to show which rows travel."""


def exchange_counts(send_counts: list[int], device: torch.device | str = "cpu") -> list[int]:
    """All-to-all of one count per rank: entry j of the result is what rank j sends this rank. ``device``:
    where the backend exchanges (a CUDA device under NCCL, the CPU under gloo)."""
    if world_size() == 1:
        return list(send_counts)
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return [int(n) for n in recv.tolist()]


def exchange_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """All-to-all of variable-length row blocks: ``rows`` holds the blocks for ranks 0, 1, ...
    (``send_counts`` rows each, this rank's own count 0); returns what the ranks sent here, in rank order
    (``recv_counts`` rows from each). The same call on every rank, in the same order."""
    global wire_bytes_sent
    if world_size() == 1:
        return rows[:0].clone()
    me = rank()
    if send_counts[me] or recv_counts[me]:
        raise ValueError(
            f"exchange_rows: rank {me} would send itself {send_counts[me]} rows; keep them local."
        )
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    wire_bytes_sent += rows[: sum(send_counts)].numel() * rows.element_size()
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
    return out
