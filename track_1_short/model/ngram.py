"""The hashed n-gram embedding: a table of ``model.ngram.rows`` rows no rank holds whole, read through a
per-rank cache of the rows an optimizer cycle uses.

Every position t reads two rows of one table: a bigram row (hash of x[t-1], x[t]) from the first half and a
trigram row (hash of x[t-2], x[t-1], x[t]) from the second half. Each is multiplied by a +-1 row of a small
sign pool chosen by an independent hash of the same tokens, and the two signed rows are summed; the model
adds the sum, gated per token, into the residual's first ``ngram.dim`` channels (model/gpt.py).

Hashes (record #92, upstream ngram_table.py @ f380c1f0): each token times a fixed multiplier in wrapping int32
arithmetic, XOR, then the non-negative remainder modulo the channel's size less one; the sign hash is reduced
with a mask of the pool size. A position whose n-gram reaches before its document's start (or before the
batch, with ``cross_document_lookback``) reads the channel's reserved last row and sign row 0. Deliberate
difference: upstream's bigram hash at batch position 1 reads the reserved row id as its previous token (an
artefact of hashing in place); here position 1 hashes (x[0], x[1]).

Sharding: rank r owns rows [r * per_rank, (r + 1) * per_rank), per_rank = ceil(rows / world); the last
shard's rows past ``rows`` are padding, never read (every hash lands below ``rows``). The table changes only
at its optimizer's updates, so a cycle's rows (the steps up to and including one update) are pulled once:
counts, then row ids, then the owners' rows, each one all-to-all through ``distributed``; the rows a rank owns
are copied locally and never go on the wire. The forward reads the batch's rows from the cache through a
custom op (:func:`ngram_embed`) whose gradient lands on a [2T, dim] leaf it never reads (the sink). At the
update the sinks' gradients are summed per cached row (fp32), sent back to the owners along the pull's
routes, and summed per row in rank order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from track_1_short import distributed
from track_1_short.model.config import ModelConfigError, NgramConfig
from track_1_short.model.layers import document_starts


def _wrap32(values: Tensor) -> Tensor:
    return values.to(torch.int32)


def _hash(tokens: list[Tensor], muls) -> Tensor:
    """XOR of token * multiplier over the n-gram's tokens, products wrapping in int32 (as upstream's)."""
    out = None
    for x, m in zip(tokens, muls):
        term = _wrap32(x) * int(m)  # an int32 tensor times a Python int stays int32: the product wraps
        out = term if out is None else torch.bitwise_xor(out, term)
    return out


def ngram_indices(tokens: Tensor, lookback_start: Tensor, cfg: NgramConfig) -> tuple[Tensor, Tensor]:
    """(row ids int64 [2T], sign-pool rows int64 [2T]) of a packed batch: the first T the bigram channel's,
    the last T the trigram channel's. ``lookback_start`` bool [T]: True where the look-back stops (document
    starts, or only position 0 with cross-document look-back), as model/layers.py ``lookback_starts``
    gives it."""
    x = tokens.to(torch.int32)
    t = x.numel()
    half = cfg.rows // 2
    bigram_mod, trigram_mod = half - 1, cfg.rows - half - 1
    pool_mask = cfg.sign_pool_rows - 1
    prev1 = torch.cat([x[:1], x[:-1]])
    prev2 = torch.cat([x[:2], x[:-2]])[:t]
    start = lookback_start.bool()
    # bigram needs x[t-1] in the same document; trigram needs x[t-2] too (t-1 is no start either)
    no_bigram = start
    no_trigram = start | torch.cat([start[:1], start[:-1]])
    if t:
        no_trigram[:2] = True
    bigram_row = torch.remainder(_hash([x, prev1], cfg.bigram_row_muls), bigram_mod)
    trigram_row = torch.remainder(_hash([x, prev1, prev2], cfg.trigram_row_muls), trigram_mod) + half
    bigram_row = torch.where(no_bigram, bigram_mod, bigram_row)
    trigram_row = torch.where(no_trigram, cfg.rows - 1, trigram_row)
    bigram_sign = torch.bitwise_and(_hash([x, prev1], cfg.bigram_sign_muls), pool_mask)
    trigram_sign = torch.bitwise_and(_hash([x, prev1, prev2], cfg.trigram_sign_muls), pool_mask)
    bigram_sign = torch.where(no_bigram, 0, bigram_sign)
    trigram_sign = torch.where(no_trigram, 0, trigram_sign)
    rows = torch.cat([bigram_row, trigram_row]).long()
    signs = torch.cat([bigram_sign, trigram_sign]).long()
    return rows, signs


def ngram_indices_of(
    batches: list[tuple[Tensor, Tensor]], cfg: NgramConfig, cross_document: bool
) -> list[tuple[Tensor, Tensor]]:
    """:func:`ngram_indices` of each (inputs, cu_seqlens) of ``batches`` as the model hashes it (look-backs
    stop at document starts, or with ``cross_document`` only at the batch's first token), hashed as one
    stream: every batch's first token starts its look-back, so the result is each batch's own, in one set of
    launches instead of one per batch (an optimizer cycle's micro batches: the pull's host time)."""
    if not batches:
        return []
    sizes = [inputs.numel() for inputs, _ in batches]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    # Where the look-back stops, on the stream: each batch's documents' starts shifted to its offset (with
    # cross-document look-back, only each batch's first token), built on the device from its cu_seqlens (a
    # host-made index would be a copy that waits for the stream).
    marks = torch.cat([(cu[:1] if cross_document else cu) + off for (_, cu), off in zip(batches, offsets)])
    start = document_starts(marks, sum(sizes))
    rows, signs = ngram_indices(torch.cat([inputs.reshape(-1) for inputs, _ in batches]), start, cfg)
    # [2N] as (bigram rows, trigram rows) of the whole stream -> each batch's [2T] in the same layout
    rows, signs = rows.view(2, -1).split(sizes, dim=1), signs.view(2, -1).split(sizes, dim=1)
    return [(r.reshape(-1), s.reshape(-1)) for r, s in zip(rows, signs)]


def new_sign_pool(cfg: NgramConfig) -> Tensor:
    """The +-1 sign pool [sign_pool_rows, dim] bf16, drawn from torch's global RNG (upstream: sign(randn))."""
    draw = torch.randn(cfg.sign_pool_rows, cfg.dim)
    return torch.where(draw >= 0, 1.0, -1.0).to(torch.bfloat16)


def ngram_embedding(rows: Tensor, sign_pool: Tensor, signs: Tensor) -> Tensor:
    """The sum of the two signed rows: rows [2T, dim] (bigram rows, then trigram rows), signs [2T] -> [T, dim]
    in rows' dtype (the signs are exact, so only the sum rounds)."""
    t = rows.shape[0] // 2
    signed = rows * sign_pool[signs].to(rows.dtype)
    return signed[:t] + signed[t:]


def ngram_embedding_grad(grad: Tensor, sign_pool: Tensor, signs: Tensor) -> Tensor:
    """The gradient [2T, dim] of :func:`ngram_embedding`'s rows from its output's [T, dim]: each channel's
    rows get the output's gradient times their sign rows (exact)."""
    return torch.cat([grad, grad]) * sign_pool[signs].to(grad.dtype)


class NgramRows(NamedTuple):
    """A batch's rows as the forward reads them (:meth:`NgramTable.lookup`): the cycle's cache, each
    position's slot in it [2T] (bigram positions, then trigram), and the sink [2T, dim], a leaf that is never
    read and catches the rows' gradient (None outside a training cycle)."""

    cache: Tensor
    slots: Tensor
    sink: Tensor | None


@torch.library.custom_op("track_1_short::ngram_embed", mutates_args=())
def _embed_op(
    cache: Tensor, slots: Tensor, sign_pool: Tensor, signs: Tensor, sink: Tensor | None, impl: str
) -> Tensor:
    if impl == "triton":
        # imported here: the kernel module's interpreter choice is fixed when it is imported
        from track_1_short.perf.kernels.ngram_embed import embed_forward

        return embed_forward(cache, slots, sign_pool, signs)
    return ngram_embedding(cache[slots], sign_pool, signs)


@_embed_op.register_fake
def _embed_fake(cache, slots, sign_pool, signs, sink, impl):
    return cache.new_empty((slots.shape[0] // 2, cache.shape[1]))


@torch.library.custom_op("track_1_short::ngram_embed_grad", mutates_args=())
def _embed_grad_op(grad: Tensor, sign_pool: Tensor, signs: Tensor, impl: str) -> Tensor:
    if impl == "triton":
        from track_1_short.perf.kernels.ngram_embed import embed_backward

        return embed_backward(grad, sign_pool, signs)
    return ngram_embedding_grad(grad, sign_pool, signs)


@_embed_grad_op.register_fake
def _embed_grad_fake(grad, sign_pool, signs, impl):
    return grad.new_empty((2 * grad.shape[0], grad.shape[1]))


def _embed_setup(ctx, inputs, output) -> None:
    _, _, sign_pool, signs, _, impl = inputs
    ctx.save_for_backward(sign_pool, signs)
    ctx.impl = impl


def _embed_backward(ctx, grad):
    sign_pool, signs = ctx.saved_tensors
    return None, None, None, None, _embed_grad_op(grad.contiguous(), sign_pool, signs, ctx.impl), None


_embed_op.register_autograd(_embed_backward, setup_context=_embed_setup)


def ngram_embed(rows: NgramRows, sign_pool: Tensor, signs: Tensor, impl: str = "reference") -> Tensor:
    """The embedding [T, dim] (the cache's dtype) of a batch's looked-up rows, its gradient on ``rows.sink``:
    :func:`ngram_embedding` of the gathered rows, as one custom op each way whose gathers the compiler cannot
    recompute in every consumer of the embedding; ``impl`` (model.ngram.embed_impl): "reference" (torch ops)
    or "triton" (perf/kernels/ngram_embed.py: one kernel each way, the same bits)."""
    return _embed_op(rows.cache, rows.slots, sign_pool, signs, rows.sink, impl)


class PullPlan(NamedTuple):
    """What :meth:`NgramTable.plan` found: the sorted unique rows (int64, on the device), the first slot of
    each rank's rows in them and their end (host ints), and the carried gradient the pull consumed."""

    want: Tensor
    cuts: list[int]
    carry: tuple[Tensor, Tensor] | None


class NgramTable:
    """This rank's shard of the table and the model's cache of the live cycle's rows.

    Every method marked collective is called by all ranks at the same point, in the same order.
    """

    def __init__(
        self,
        cfg: NgramConfig,
        *,
        rank: int = 0,
        world: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not cfg.enabled:
            raise ModelConfigError("NgramTable: model.ngram.enabled is false; enable it or build no table.")
        if not 0 <= rank < world:
            raise ValueError(f"NgramTable: rank={rank} must lie in [0, world={world}).")
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device(device)
        self.per_rank = math.ceil(cfg.rows / world)
        self.first_row = rank * self.per_rank
        # upstream zero-initialises the table
        self.shard = torch.zeros(self.per_rank, cfg.dim, dtype=dtype, device=self.device)
        self.reset_cache()

    @property
    def bounds(self) -> list[int]:
        """First row of each rank's shard, then the padded end."""
        return [r * self.per_rank for r in range(self.world + 1)]

    def reset_cache(self) -> None:
        """Forget the cached rows and the cycle's gradient (the table and a carried gradient stay)."""
        self.want: Tensor | None = None  # sorted unique row ids the cache holds, int64
        self.cache: Tensor | None = None
        self.per_slot: Tensor | None = None  # the cycle's gradient so far, summed per cached row (fp32)
        self.sinks: list[tuple[Tensor, Tensor]] = []
        self._routes: tuple[int, int, list[int], list[int], Tensor] | None = None
        self._stash: tuple | None = None
        if not hasattr(self, "carry"):
            self.carry: tuple[Tensor, Tensor] | None = None

    @torch.no_grad()
    def zero_(self) -> None:
        """The initial table, in place (the post-warmup reset)."""
        self.shard.zero_()
        self.carry = None
        self.reset_cache()

    def carry_gradient(self, rows: Tensor, grads: Tensor) -> None:
        """A cycle's gradient so far (row ids, fp32 sums, as :meth:`pending` gave them at a checkpoint): the
        next pull fetches these rows too and starts their sums from these values."""
        self.carry = (rows.to(self.device, torch.int64), grads.to(self.device, torch.float32))

    # -- the pull --

    @torch.no_grad()
    def pull(self, row_ids: list[Tensor]) -> None:
        """Collective: fill the cache with every row of ``row_ids`` (a cycle's batches, or between
        :meth:`begin_eval` and :meth:`end_eval` a validation batch's) from its owner."""
        self.fill(self.plan(row_ids))

    @torch.no_grad()
    def plan(self, row_ids: list[Tensor]) -> PullPlan:
        """The index half of :meth:`pull`: the sorted unique rows and the shard cuts, read to the host (the
        one sync of a pull). Local work only, so it may run on a side stream (ngram_cycle.py): the read then
        waits for that stream's hashing, not for the step queued before it."""
        if self._stash is None and (self.sinks or self.per_slot is not None):
            raise RuntimeError(
                "NgramTable.pull: the live cycle's gradient was never returned (row_grads()) or dropped "
                "(reset_cache())."
            )
        carry = None
        if self._stash is None:
            carry, self.carry = self.carry, None
        ids = [r.reshape(-1).to(self.device, torch.int64) for r in row_ids]
        if carry is not None:
            ids.append(carry[0])
        want = torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64, device=self.device)
        # the shard cuts and the id range in one read to the host (one sync, not three)
        bounds = torch.tensor(self.bounds, device=self.device)
        host = torch.cat([torch.searchsorted(want, bounds), want[:1], want[-1:]]).tolist()
        if want.numel() and (host[-2] < 0 or host[-1] >= self.cfg.rows):
            raise ValueError(
                f"NgramTable.pull: row ids in [{host[-2]}, {host[-1]}] outside the table's "
                f"[0, {self.cfg.rows}); hash with the same model.ngram.rows."
            )
        return PullPlan(want, host[: self.world + 1], carry)

    @torch.no_grad()
    def fill(self, plan: PullPlan) -> None:
        """Collective, the data half of :meth:`pull` (on the stream the forward reads from): the exchanges,
        the local rows and the cycle's gradient sums."""
        want, cuts, carry = plan
        lo, hi = cuts[self.rank], cuts[self.rank + 1]
        send_counts = [0 if r == self.rank else cuts[r + 1] - cuts[r] for r in range(self.world)]
        recv_counts = distributed.exchange_counts(send_counts, self.device)
        asked = distributed.exchange_rows(torch.cat([want[:lo], want[hi:]]), send_counts, recv_counts)
        received = distributed.exchange_rows(self.shard[asked - self.first_row], recv_counts, send_counts)
        cache = self.shard.new_empty((want.numel(), self.cfg.dim))
        cache[:lo] = received[:lo]
        cache[hi:] = received[lo:]
        # gathered straight into the cache: no table-rows-sized temporary and copy (at world size 1 every
        # row is local, so this is the whole cache)
        torch.index_select(self.shard, 0, want[lo:hi] - self.first_row, out=cache[lo:hi])
        # a cycle's cache has its own row count: one compiled forward reads every cycle's (no recompile)
        torch._dynamo.mark_dynamic(cache, 0)
        self.want, self.cache = want, cache
        self._routes = (lo, hi, send_counts, recv_counts, asked)
        if self._stash is None:  # a training cycle: its gradient starts here, or from the carried sums
            self.per_slot = torch.zeros(want.numel(), self.cfg.dim, dtype=torch.float32, device=self.device)
            if carry is not None:
                self.per_slot[torch.searchsorted(want, carry[0])] = carry[1]

    # -- the forward --

    def lookup(self, row_ids: Tensor, check: bool = True) -> NgramRows:
        """The rows of ``row_ids`` [2T] as :func:`ngram_embed` reads them: the cache and their slots in it; in
        a training cycle under autograd, with a sink that catches their gradient (folded into the cycle's
        sums by :meth:`fold_sinks`)."""
        if self.want is None:
            raise RuntimeError(
                "NgramTable.lookup: no rows were pulled; call pull() with this cycle's row ids first."
            )
        slots = torch.searchsorted(self.want, row_ids)
        if check:
            found = slots < self.want.numel()
            found &= self.want[slots.clamp(max=max(self.want.numel() - 1, 0))] == row_ids
            if not bool(found.all()):
                raise RuntimeError(
                    "NgramTable.lookup: the batch reads rows this cycle's pull did not fetch; pull every "
                    "batch of the cycle (and each validation batch) before its forward."
                )
        sink = None
        if torch.is_grad_enabled() and self.per_slot is not None:
            # never read, so never filled: only its gradient is (the op's backward writes it whole)
            sink = self.cache.new_empty((row_ids.numel(), self.cfg.dim)).requires_grad_()
            self.sinks.append((slots, sink))
        return NgramRows(self.cache, slots, sink)

    # -- the cycle's gradient --

    @torch.no_grad()
    def fold_sinks(self) -> None:
        """Add the gradients of the forwards since the last call into the per-row sums, in call order."""
        for slots, sink in self.sinks:
            if sink.grad is None:
                continue
            if self.cfg.fold_impl == "triton":
                # imported here: the kernel module's interpreter choice is fixed when it is imported
                from track_1_short.perf.kernels.ngram_fold import fold_rows_

                fold_rows_(self.per_slot, slots, sink.grad)
            else:
                self.per_slot.index_add_(0, slots, sink.grad.float())
        self.sinks = []

    @torch.no_grad()
    def pending(self) -> tuple[Tensor, Tensor]:
        """(row ids, fp32 sums) of the live cycle's gradient so far (or of a carried one); empty if none."""
        if self.per_slot is not None:
            self.fold_sinks()
            return self.want.clone(), self.per_slot.clone()
        if self.carry is not None:
            return self.carry[0].clone(), self.carry[1].clone()
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return empty, torch.zeros(0, self.cfg.dim, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def row_grads(self) -> tuple[Tensor, Tensor]:
        """Collective: the cycle's gradient summed per row, on the rows' owners; ends the cycle.

        Returns (local row indices int64 [N], unique and sorted; gradients fp32 [N, dim]): each row's sum
        over ranks in rank order of each rank's sum over its forwards (in call order)."""
        if self.per_slot is None:
            raise RuntimeError("NgramTable.row_grads: no training cycle was pulled.")
        self.fold_sinks()
        lo, hi, send_counts, recv_counts, asked = self._routes
        per_slot = self.per_slot
        if self.world == 1:
            # Every row is local and appears once: the per-slot sums are the answer (the general path's sort,
            # zeroed buffer and scatter-add over up to cycle-rows x dim fp32 would only copy them). Its 0 + x
            # differs only in turning a -0.0 gradient into +0.0: the update then differs at most in the sign
            # of a zero table entry (-0 - -0 = +0), a value that reads as zero everywhere.
            rows = self.want - self.first_row
            self.reset_cache()
            return rows, per_slot
        received = distributed.exchange_rows(
            torch.cat([per_slot[:lo], per_slot[hi:]]), send_counts, recv_counts
        )
        own = self.want[lo:hi] - self.first_row
        parts, at = [], 0
        for r in range(self.world):
            if r == self.rank:
                parts.append((own, per_slot[lo:hi]))
            else:
                n = recv_counts[r]
                parts.append((asked[at : at + n] - self.first_row, received[at : at + n]))
                at += n
        rows = torch.unique(torch.cat([p[0] for p in parts]))
        grads = torch.zeros(rows.numel(), self.cfg.dim, dtype=torch.float32, device=self.device)
        for ids, g in parts:  # rank order; a row appears at most once per rank, so each add is one term
            grads.index_add_(0, torch.searchsorted(rows, ids), g)
        self.reset_cache()
        return rows, grads

    # -- validation pulls, beside a live training cycle --

    def begin_eval(self) -> None:
        """Set the live cycle's cache aside while validation pulls its own batches (no re-exchange after)."""
        if self._stash is None:
            self._stash = (self.want, self.cache, self.per_slot, self.sinks, self._routes)
            self.want = self.cache = self.per_slot = None
            self.sinks = []

    def end_eval(self) -> None:
        if self._stash is not None:
            self.want, self.cache, self.per_slot, self.sinks, self._routes = self._stash
            self._stash = None
