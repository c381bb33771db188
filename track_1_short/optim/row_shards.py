"""Dim-0 sharding of one tensor over the ranks, padded so that any world size works.

A tensor of ``rows`` rows (for a bank: matrices) is cut into ``world`` equal chunks of ``chunk = ceil(rows /
world)`` rows; rank r owns rows [r * chunk, (r + 1) * chunk). When ``world`` does not divide ``rows``, the
last chunks run past the end into pad rows that exist only in persistent pad buffers: their gradient is zero,
their optimizer state stays zero and their values stay zero, so they never change a real row. When it divides
(always on the record's 8 GPUs), the gradient is reduce-scattered straight from ``.grad`` and the shard is a
view of the parameter itself, gathered in place, with no copies.

All buffers are allocated once and keep their addresses for the optimizer's life.
"""

from __future__ import annotations

import torch

from track_1_short import distributed


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # NCCL and gloo move float types; integer state (the uint16 mantissa) travels as raw bytes.
    return t if t.is_floating_point() else t.view(torch.uint8)


class RowShards:
    """This rank's rows of a tensor of ``full_shape`` sharded on dim 0, and the collectives that move them."""

    def __init__(
        self, full_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, world: int, rank: int
    ):
        self.full_shape = tuple(full_shape)
        self.rows = self.full_shape[0]
        self.world, self.rank = world, rank
        self.chunk = -(-self.rows // world)
        self.padded_rows = self.chunk * world
        self.start = rank * self.chunk
        # Real rows of this rank's chunk: [start, real_stop); the rest of the chunk (if any) is padding.
        self.real_stop = min(self.start + self.chunk, self.rows)
        self.n_real = max(0, self.real_stop - self.start)
        self.padded = self.padded_rows != self.rows
        self.shard_shape = (self.chunk, *self.full_shape[1:])
        # Reduce-scatter destination: this rank's averaged gradient rows.
        self.grad = torch.zeros(self.shard_shape, dtype=dtype, device=device)
        if self.padded:
            # Zero-padded copies of the full gradient and the full parameter; the pad rows stay zero forever.
            self._grad_full = torch.zeros(
                (self.padded_rows, *self.full_shape[1:]), dtype=dtype, device=device
            )
            self._param_full = torch.zeros_like(self._grad_full)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """The [chunk, ...] rows of ``full`` (the parameter) this rank updates: a view of ``full`` when
        unpadded, else of the pad buffer (call :meth:`load_shard` before each update)."""
        if self.padded:
            return self._param_full[self.start : self.start + self.chunk]
        return full[self.start : self.start + self.chunk]

    def load_shard(self, full: torch.Tensor) -> None:
        """Refresh the padded shard from the parameter (someone may have loaded new weights into it)."""
        if self.padded and self.n_real:
            self._param_full[self.start : self.real_stop].copy_(full[self.start : self.real_stop])

    def scatter_grad(self, grad: torch.Tensor) -> distributed.Handle:
        """Launch the averaging reduce-scatter of the full gradient ``grad`` into :attr:`grad`."""
        if self.padded:
            self._grad_full[: self.rows].copy_(grad)
            grad = self._grad_full
        return distributed.reduce_scatter_avg(self.grad, grad, async_op=True)

    def gather(self, full: torch.Tensor) -> distributed.Handle:
        """Launch the all_gather of every rank's updated shard into ``full`` (or the pad buffer: then call
        :meth:`finish_gather` after the wait)."""
        if self.padded:
            return distributed.all_gather_into(self._param_full, self.shard(full), async_op=True)
        return distributed.all_gather_into(full, self.shard(full), async_op=True)

    def finish_gather(self, full: torch.Tensor) -> None:
        if self.padded:
            full.copy_(self._param_full[: self.rows])

    def gather_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` ([chunk, ...], any dtype) concatenated, pad rows dropped: [rows, ...].

        A collective: every rank must call it, in the same order."""
        out = torch.empty((self.padded_rows, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        distributed.all_gather_into(_as_bytes(out), _as_bytes(shard.contiguous())).wait()
        return out[: self.rows]

    def take_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's [chunk, ...] rows of a full [rows, ...] tensor, zero in the pad rows (a new tensor)."""
        out = torch.zeros((self.chunk, *full.shape[1:]), dtype=full.dtype, device=full.device)
        out[: self.n_real].copy_(full[self.start : self.real_stop])
        return out
