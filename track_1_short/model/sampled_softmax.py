"""Sampled softmax for the training loss: early steps normalise over a candidate set of P columns of lm_head.

Each micro batch's loss is a softmax over a shared candidate set C of P classes instead of all V: every class
that is a target of the micro batch (the MTP targets t + k are targets of other rows, so they are in), plus
negatives up to P from a fixed stride sweep of the vocabulary. The loss then runs the same code as the full
softmax (model/layers.py, the reference and the fused kernel alike) on a P-wide vocabulary: logits x W[:, C],
targets replaced by their position in C. A prefix target outside C is dropped for its row (its term and its
share of the normaliser), as upstream drops it: prefix targets never force classes into C.

How it relates to the full loss: the softcap, the MTP weights, the S_w normaliser and loss_sum_ranks are the
full loss's, with the log-sum-exp over C only. That misses the non-candidate mass, so the sampled loss is a
biased (lower) estimate of the full one, and its gradient is the full gradient of that estimate: exact over
C's columns of lm_head, zero elsewhere, dense [D, V] as the optimizer gets it from the full loss. Upstream
applies no correction for the sampling (no log-Q term, no reweighting of the negatives): the schedule ramps
P up through the last main stage and the run ends on the full softmax instead. With P = V the candidate
set is every column in order and the loss is the full loss bit for bit (tests/model/test_sampled_softmax.py).
Validation never samples.

Negatives: the sweep visits j * NEGATIVE_STRIDE mod V for j = o, o + 1, ... (a permutation of the vocabulary,
the stride being prime and not dividing V) and takes the first unmarked classes it meets. The offset o of a
micro batch is g * V // G + step * P for micro batch g of the step's G (g = rank * accumulation + micro
index): the ranks, and the micro batches of a rank, start at staggered offsets, and every step moves on by P,
so across steps every class is drawn about equally often, with no random state to save or restore. Upstream
keeps a per-rank cursor that advances by about 1.7 x its draw; here the offset is a function of the step and
the micro batch, so a resumed or re-warmed run draws the same sets, and one micro batch's set does not depend
on the world size that holds it. The build is a few passes over [V] on the device with fixed shapes and no
host sync, outside the compiled forward (CandidateSets.build), which takes sets of any P with one graph.

P and the micro batch: the set must hold every distinct target. Upstream's counts are for its per-rank micro
batch of 49,152 tokens (about 11k distinct targets at P = 14,336). A larger micro batch holds more distinct
targets, so ``candidates_for`` scales P with the micro batch's tokens (rounded up to a multiple of 128; P >=
V is the full softmax); a micro batch that still holds more distinct targets than its P stops the run with one
line naming the fix (model/layers.py). Provenance: record #92 ("ANVIL2", upstream sampled_softmax.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEGATIVE_STRIDE = 20011
CANDIDATE_MULTIPLE = 128  # a scaled P stays a multiple of the padded vocabulary's GEMM-friendly width


def check_vocabulary(vocab: int) -> None:
    """The stride sweep is a permutation of [0, vocab) only where the stride and vocab are coprime."""
    if math.gcd(NEGATIVE_STRIDE, vocab) != 1:
        raise ValueError(
            f"sampled softmax: the negative stride {NEGATIVE_STRIDE} shares a factor with the padded "
            f"vocabulary {vocab}, so its sweep would miss classes; change model.vocab_multiple."
        )


def candidates_for(p: int, micro_tokens: int, reference_tokens: int, vocab: int) -> int:
    """The candidate count for a micro batch of ``micro_tokens``: the schedule's ``p`` (set for micro batches
    of ``reference_tokens``), scaled up in proportion for larger ones, rounded up to CANDIDATE_MULTIPLE; 0
    (the full softmax) for p = 0 or once it reaches the vocabulary."""
    if p <= 0:
        return 0
    if micro_tokens > reference_tokens:
        p = -(-p * micro_tokens // reference_tokens)
    p = -(-p // CANDIDATE_MULTIPLE) * CANDIDATE_MULTIPLE
    return 0 if p >= vocab else p


def sweep_offset(step: int, micro_index: int, micros_per_step: int, p: int, vocab: int) -> int:
    """Where micro batch ``micro_index`` (of the step's ``micros_per_step``, all ranks') starts the sweep."""
    return (micro_index * vocab // micros_per_step + step * p) % vocab


def candidate_set(targets: Tensor, vocab: int, p: int, offset: Tensor | int) -> Tensor:
    """int64 [p], ascending: every class in ``targets`` (int64 [T]), then the sweep's first unmarked classes
    from ``offset`` (an int, or a 0-D int64 tensor on the targets' device) until there are p.

    If the targets hold more than p distinct classes the set cannot hold them all: some are left out, and the
    loss (model/layers.py) refuses the micro batch.
    """
    return _candidate_set(targets, vocab, p, offset)[0]


def _candidate_set(targets: Tensor, vocab: int, p: int, offset: Tensor | int) -> tuple[Tensor, Tensor]:
    """:func:`candidate_set`, and the targets' distinct count (0-D, on the device) that it counts anyway."""
    device = targets.device
    marked = torch.zeros(vocab, dtype=torch.bool, device=device)
    marked[targets] = True
    distinct = marked.sum()
    wanted = p - distinct
    j = torch.arange(vocab, dtype=torch.int64, device=device)
    sweep = ((j + offset) * NEGATIVE_STRIDE) % vocab  # the sweep's classes in the order it visits them
    free = ~marked[sweep]
    taken = free & (torch.cumsum(free, 0) <= wanted)
    chosen = marked.scatter(0, sweep, taken | marked[sweep])
    # Chosen classes first, in ascending order, then the others: a permutation, so the scatter writes every
    # slot once (deterministic on any device) and its first p slots are the set.
    n_chosen = torch.cumsum(chosen, 0)
    place = torch.where(chosen, n_chosen - 1, n_chosen[-1] + j - n_chosen)
    return torch.empty_like(j).scatter(0, place, j)[:p], distinct


class CandidateSets:
    """The candidate sets of a model's training micro batches, and the check that each held its targets.

    :meth:`build` runs outside a compiled forward and marks the set dynamic in its length: the forward only
    hands it to the loss op, so one graph takes every P of the schedule (an int P inside the graph made one
    graph, and a whole-model compile, per value). A set short of a target (more distinct targets than P) is
    flagged on the device, not checked there: a check would wait for the device every micro batch, and the
    loss cannot raise from a kernel. :meth:`check` reads the flag where the host waits anyway (the trainer's
    warmup steps and log steps)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._short: Tensor | None = None

    def build(self, targets: Tensor, p: int, offset: int | Tensor) -> Tensor:
        """The candidate set (int64 [p]) of a micro batch with these targets, its sweep starting at
        ``offset``: for the forward's ``candidates``."""
        cand, distinct = _candidate_set(targets, self.vocab, p, offset)
        torch._dynamo.mark_dynamic(cand, 0)  # read only by a compiled forward; eager ignores it
        short = distinct > p
        self._short = short if self._short is None else self._short | short
        return cand

    def check(self) -> None:
        """Raise ModelConfigError if a set built since the last call missed one of its micro batch's targets
        (on CUDA the loss scored such a target against candidate 0 meanwhile; on the CPU it has already
        refused it). A device read."""
        from track_1_short.model.config import ModelConfigError

        flag, self._short = self._short, None
        if flag is not None and bool(flag):
            raise ModelConfigError(
                "sampled softmax: a micro batch held more distinct targets than its candidate count P; raise "
                "the stages' schedule sampled_candidates, or lower micro_batch_tokens (P scales with it)."
            )
