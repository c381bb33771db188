"""The embedded corpus: seeded documents over GPT-2 token ids whose per-token entropy is known exactly.

It gives the CPU run and the tests real data with no download. A document is BOS, one word drawn uniformly,
then a sequence of *free positions*, each of which is one of:

- **end** (``end_prob``): the next token is the next document's BOS;
- **copy** (``copy_prob``, once the document holds a run of ``max(copy_lengths)`` words without a marker):
  a marker token naming the length L (one marker id per length, drawn uniformly), then a copy of L words
  starting at a source position drawn uniformly among the earlier marker-free spans of L words of the same
  document. After its first token or two a copy is predictable only by looking back (induction), so attention
  matters;
- **Markov step** (the rest): one of the ``branching`` successors of the previous word, ranked by the word
  before it (the previous-but-one word rotates the ranking), with probabilities proportional to
  ``successor_decay ** rank``. A bigram model sees ~log(branching) nats here, a trigram model H(rank probs).

The ordinary words are ``n_words`` ids drawn from the GPT-2 range; BOS and the markers are distinct from them.

**The floor is exact, not a bound.** BOS, markers and words are disjoint, every successor row is distinct, and
the copy length is announced, so every hidden choice but the copy source is visible in the tokens; the source
is uniform, so given the copied prefix it is uniform over the sources that agree with it. Hence the process's
predictive distribution of every token given its document so far is known in closed form, and the generator
records, per predicted token, H(X_t | x_<t) and -log P(x_t | x_<t). The sidecar's ``entropy_floor`` is the
mean of the first over the predicted tokens of a split: the expected cross-entropy of the best possible
predictor (the process itself) on those contexts; ``empirical_nll`` is the mean of the second, what that
predictor actually scores. Their difference is a martingale average and shrinks as 1/sqrt(tokens). A model
that sees less context (e.g. a validation slice starting inside a document) can only do worse than the floor.

**How it is sampled fast.** A stream is cut into groups of GROUP_TOKENS, each from its own child of the
split's seed, so groups build in separate processes (one per core) with files that do not depend on the
count. Inside a group, ``sample_group`` advances up to MAX_SLOTS documents in lockstep, one token per slot per
NumPy step; a slot whose document ends starts the next one. A copy's laws need the sources sharing its
prefix: the first token's from running per-word source counts, the rest (when still ambiguous) in one pass
after the loop. The per-token H and -log P are the same closed forms as above, in a different order of float
operations. Rough figures (2-core shared machine, CPU time of one process, 4M tokens of the default process):
7.1-7.4 s for the previous per-document Python loop (GENERATOR_VERSION 1), 2.2-2.3 s now (~3.2x); a
16-core machine builds the groups of 25M tokens (7) side by side, in about one group's time (~2-3 s here),
against ~80 s before.

The corpus is built once per parameter set into ``<cache_dir>/synthetic-<hash>/`` (a temporary directory,
renamed when complete, so an interrupted build is never reused) and reused afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from track_1_short.data import DataConfig, SyntheticConfig, write_shard

GENERATOR_VERSION = 2  # bump when the sampling code changes, so that cached corpora are rebuilt
SIDECAR_NAME = "synthetic.json"
PREFIX = "synthetic"
# The sampler's shape. These fix the byte stream (changing one needs a GENERATOR_VERSION bump) but not its
# law, and set speed and memory only; none is a property of the corpus a user would tune.
GROUP_TOKENS = 1 << 22  # tokens per group: one seed child each, the unit of work of a build process
MAX_SLOTS = 1024  # documents sampled side by side (each step's ~60 NumPy calls are shared by this many)
SLOT_TOKENS = 2048  # tokens per slot at least: a small stream uses fewer slots, so starts few unkept docs
_COUNT_ENTRIES = 1 << 23  # cap on copy lengths x slots x n_words, the int32 first-word counts (32 MiB)
_DRAW_STEPS = 64  # steps of uniforms drawn from the generator at a time


def seeds(seed: int) -> dict[str, np.random.SeedSequence]:
    """Independent streams for the tables and the two splits, all from one seed."""
    tables, train, val = np.random.SeedSequence(seed).spawn(3)
    return {"tables": tables, "train": train, "val": val}


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class Source:
    """The process's tables, drawn from the seed; words are referred to by index into ``words``."""

    cfg: SyntheticConfig
    bos_id: int
    words: np.ndarray  # int64 [n_words], GPT-2 ids of the ordinary tokens
    markers: np.ndarray  # int64 [len(copy_lengths)], marker id announcing a copy of copy_lengths[i]
    successors: np.ndarray  # int64 [n_words, branching], distinct word indices per row
    rotation_prev2: np.ndarray  # int64 [n_words + 1], the previous-but-one word's ranking shift (last: BOS)
    rotation_prev1: np.ndarray  # int64 [n_words], the previous word's ranking shift
    rank_probs: np.ndarray  # float64 [branching], probability of the successor of each rank

    @classmethod
    def from_config(cls, cfg: SyntheticConfig, vocab_size: int, bos_id: int) -> Source:
        n_lengths = len(cfg.copy_lengths)
        if cfg.n_words + n_lengths > vocab_size - 1:
            raise ValueError(
                f"data.synthetic.n_words={cfg.n_words} plus {n_lengths} copy markers do not fit the "
                f"vocabulary of {vocab_size} ids (BOS excluded): lower n_words."
            )
        rng = np.random.default_rng(seeds(cfg.seed)["tables"])
        ids = rng.choice(
            np.delete(np.arange(vocab_size), bos_id), size=cfg.n_words + n_lengths, replace=False
        )
        successors = np.stack(
            [rng.choice(cfg.n_words, cfg.branching, replace=False) for _ in range(cfg.n_words)]
        )
        probs = cfg.successor_decay ** np.arange(cfg.branching, dtype=np.float64)
        return cls(
            cfg=cfg,
            bos_id=bos_id,
            words=ids[: cfg.n_words].astype(np.int64),
            markers=ids[cfg.n_words :].astype(np.int64),
            successors=successors.astype(np.int64),
            rotation_prev2=rng.integers(0, cfg.branching, size=cfg.n_words + 1),
            rotation_prev1=rng.integers(0, cfg.branching, size=cfg.n_words),
            rank_probs=probs / probs.sum(),
        )

    def ranked_successors(self, prev2: int, prev1: int) -> np.ndarray:
        """Word indices that may follow (prev2, prev1), most likely first; prev2 = n_words stands for BOS."""
        shift = (self.rotation_prev2[prev2] + self.rotation_prev1[prev1]) % self.cfg.branching
        return np.roll(self.successors[prev1], -shift)

    def free_position_law(self, copy_eligible: bool) -> tuple[float, float, float]:
        """(P(end), P(copy), P(Markov step)) at a free position."""
        p_copy = self.cfg.copy_prob if copy_eligible else 0.0
        return self.cfg.end_prob, p_copy, 1.0 - self.cfg.end_prob - p_copy

    def free_position_entropy(self, copy_eligible: bool) -> float:
        """H of the next token at a free position: end, one marker per length, or a ranked successor."""
        p_end, p_copy, p_step = self.free_position_law(copy_eligible)
        n_lengths = len(self.cfg.copy_lengths)
        law = np.concatenate(([p_end], np.full(n_lengths, p_copy / n_lengths), p_step * self.rank_probs))
        return _entropy(law)


@dataclass
class Stream:
    """Sampled documents, concatenated and cut to a length; per token, what the process predicted for it."""

    tokens: np.ndarray  # uint16 [n]
    entropy: np.ndarray  # float64 [n], H(X_t | x_<t) in nats; NaN at t = 0 (no prediction)
    nll: np.ndarray  # float64 [n], -log P(x_t | x_<t) in nats; NaN at t = 0
    in_copy: np.ndarray  # bool [n], the token was copied from earlier in its document


def _xlogx(c: np.ndarray) -> np.ndarray:
    """c * log(c) of counts, 0 at c = 0."""
    x = np.asarray(c, dtype=np.float64)
    return x * np.log(np.maximum(x, 1.0))


# What a slot emits next: the word after BOS, a free position, a copied word; or nothing (its group is done).
_FIRST, _FREE, _COPY, _IDLE = 0, 1, 2, 3
# Word codes in the slot buffers: a word index (>= 0), BOS, or -2 - i for the marker of copy_lengths[i].
_BOS_CODE = -1


def _slot_count(src: Source, n_tokens: int) -> int:
    """Documents sampled side by side: enough to share each step's NumPy calls, few enough that a small
    stream does not start far more documents than it keeps, and the first-word counts stay small."""
    by_memory = _COUNT_ENTRIES // (len(src.cfg.copy_lengths) * src.cfg.n_words)
    return int(max(1, min(MAX_SLOTS, by_memory, n_tokens // SLOT_TOKENS)))


def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap, a.shape[1]), dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def sample_group(src: Source, seed, n_tokens: int, on_tokens=None) -> tuple[Stream, float, float]:
    """Whole documents from ``seed`` (what np.random.default_rng takes) until they hold >= ``n_tokens``.

    Returns (stream, H, -log P of the BOS that would follow the last document). The stream's first token is a
    BOS whose prediction is NaN: it belongs to whatever precedes the group. ``on_tokens(k)`` is told, now and
    then, that k more of the ``n_tokens`` were sampled.

    S slots each sample one document at a time, one token per step for all slots at once, so every active
    slot writes the same position (the buffers are [position, slot]: a step writes one row). A slot whose
    document ends starts the next document (numbered in order of starting) while fewer than ``n_tokens``
    tokens have been emitted. The kept documents are those numbered up to the first at which the lengths
    reach ``n_tokens``: each uniform drives one document only, so documents are i.i.d. in that order, and the
    cut is a stopping time; the kept ones are distributed as serial sampling's.
    A copy's source is drawn uniformly by rejection over the document's positions (a window is a source if
    the marker-free run at its last word covers it). Its first token's law comes from running counts of the
    sources' first words per (length, slot): H = log n - sum(c log c) / n. The later copied tokens' laws need
    the sources that agree with the copy so far; when the first word already leaves one (the usual case) they
    are 0, otherwise ``_resolve_copies_`` finds them after the loop.
    """
    cfg = src.cfg
    nw, branching = cfg.n_words, cfg.branching
    lengths = np.asarray(cfg.copy_lengths, dtype=np.int64)
    nl, longest = lengths.size, int(np.argmax(lengths))
    p_end, p_copy = cfg.end_prob, cfg.copy_prob
    cdf = np.cumsum(src.rank_probs)
    cdf[-1] = 1.0  # so that searchsorted never runs past the last rank
    free_h = np.array([src.free_position_entropy(e) for e in (False, True)])
    step_nll = np.array([-np.log(src.free_position_law(e)[2] * src.rank_probs) for e in (False, True)])
    marker_nll = -math.log(p_copy / nl) if p_copy > 0 else math.inf
    log_nw = math.log(nw)
    succ, rot2, rot1 = src.successors, src.rotation_prev2, src.rotation_prev1

    slots = _slot_count(src, n_tokens)
    rng = np.random.default_rng(seed)
    # The last documents run past n_tokens / slots: by ~ln(slots) mean document lengths (more is grown).
    cap = n_tokens // slots + int(2 / p_end * math.log(slots + 1)) + 16
    code = np.zeros((cap, slots), dtype=np.int32)  # [position, slot] word code
    run_at = np.zeros((cap, slots), dtype=np.int32)  # [position, slot] marker-free words ending there
    ent = np.zeros((cap, slots))  # [position, slot] H of the token; copied tokens past the first stay 0 ...
    nll = np.zeros((cap, slots))  # ... until the ambiguous copies are resolved
    copied = np.zeros((cap, slots), dtype=bool)
    prev_seen = np.zeros((cap, slots), dtype=np.int32)  # [position, slot] the word's previous position, or -1
    last_seen = np.full((slots, nw), -1, dtype=np.int32)  # [slot, word] its last position (maybe an old doc)
    xlogx = _xlogx(np.arange(cap + 1))
    # The current documents' copy sources (windows of a length inside one marker-free run), by length and
    # slot: how many, how many per first word, and the sum of c log c over those per-word counts.
    n_src = np.zeros((nl, slots), dtype=np.int64)
    per_word = np.zeros((nl, slots, nw), dtype=np.int32)
    clogc = np.zeros((nl, slots))
    flat_n_src, flat_per_word, flat_clogc = n_src.reshape(-1), per_word.reshape(-1), clogc.reshape(-1)

    code[0] = _BOS_CODE
    t = 1  # the position every active slot writes next
    mode = np.full(slots, _FIRST, dtype=np.int8)
    prev1 = np.zeros(slots, dtype=np.int64)
    prev2 = np.full(slots, nw, dtype=np.int64)  # nw stands for BOS
    run = np.zeros(slots, dtype=np.int64)  # marker-free words ending at the last position
    copy_from = np.zeros(slots, dtype=np.int64)
    copy_left = np.zeros(slots, dtype=np.int64)
    doc_of, doc_begin = np.arange(slots), np.zeros(slots, dtype=np.int64)
    doc_slot, doc_start = [np.arange(slots)], [np.zeros(slots, dtype=np.int64)]
    ends: list[tuple[np.ndarray, ...]] = []  # (doc ids, end positions, eligible at the end)
    ambiguous: list[
        tuple[np.ndarray, ...]
    ] = []  # copies whose first word has > 1 source (see _resolve_copies_)
    emitted, reported, next_doc, step = slots, 0, slots, 0

    while True:
        if step % _DRAW_STEPS == 0:
            draws = rng.random((_DRAW_STEPS, 3, slots))
            if on_tokens is not None and min(emitted, n_tokens) > reported:
                on_tokens(min(emitted, n_tokens) - reported)
                reported = min(emitted, n_tokens)
        u = draws[step % _DRAW_STEPS]
        step += 1
        first, free, cp = ((mode == m).nonzero()[0] for m in (_FIRST, _FREE, _COPY))
        if not (first.size or free.size or cp.size):
            break
        if t + 2 >= cap:  # +2: a copy writes its first token's law one position ahead
            cap = cap * 3 // 2
            code, run_at, ent, nll, copied, prev_seen = (
                _grow(a, cap) for a in (code, run_at, ent, nll, copied, prev_seen)
            )
            xlogx = _xlogx(np.arange(cap + 1))
        row_code, row_run, row_ent, row_nll = code[t], run_at[t], ent[t], nll[t]

        if first.size:  # the word after BOS: uniform
            w = np.minimum((u[1, first] * nw).astype(np.int64), nw - 1)
            row_code[first], row_ent[first], row_nll[first] = w, log_nw, log_nw
            prev2[first], prev1[first], run[first] = nw, w, 1
            row_run[first] = 1
            mode[first] = _FREE

        if free.size:
            # Eligible for a copy once the document holds a marker-free run of the longest copy length.
            eligible = n_src[longest, free] > 0
            ue = u[0, free]
            is_end = ue < p_end
            is_copy = ~is_end & eligible & (ue < p_end + p_copy)
            is_step = ~(is_end | is_copy)

            s, e = free[is_step], eligible[is_step].astype(np.int64)
            rank = np.searchsorted(cdf, u[1, s], side="right")
            a, b = prev2[s], prev1[s]
            w = succ[b, (rank + rot2[a] + rot1[b]) % branching]
            row_code[s], row_ent[s], row_nll[s] = w, free_h[e], step_nll[e, rank]
            prev2[s], prev1[s] = b, w
            run[s] += 1
            row_run[s] = run[s]

            c = free[is_copy]
            if c.size:
                which = np.minimum((u[1, c] * nl).astype(np.int64), nl - 1)
                length = lengths[which]
                # The source, uniform over the windows in one run: the window's last word, by rejection.
                lo = doc_begin[c] + length
                span = t - lo  # >= 1: the document holds a run of the longest length
                last = np.empty(c.size, dtype=np.int64)
                todo, r = np.arange(c.size), u[2, c]
                while todo.size:
                    q = lo[todo] + np.minimum((r * span[todo]).astype(np.int64), span[todo] - 1)
                    ok = run_at[q, c[todo]] >= length[todo]
                    last[todo[ok]] = q[ok]
                    todo = todo[~ok]
                    r = rng.random(todo.size)
                start = last - length + 1
                n = n_src[which, c]
                first_word = code[start, c]
                agree = per_word[which, c, first_word]  # sources sharing the chosen one's first word
                row_code[c], row_ent[c], row_nll[c] = -2 - which, free_h[1], marker_nll
                ent[t + 1, c] = np.log(n) - clogc[which, c] / n
                nll[t + 1, c] = np.log(n) - np.log(agree)
                many = agree > 1
                if many.any():
                    seen = last_seen[c[many], first_word[many]]
                    ambiguous.append(
                        (c[many], np.full(int(many.sum()), t), start[many], length[many], lo[many], seen)
                    )
                mode[c], copy_from[c], copy_left[c], run[c] = _COPY, start, length, 0

            d = free[is_end]
            if d.size:
                ends.append((doc_of[d], np.full(d.size, t), eligible[is_end]))
                if emitted < n_tokens:  # start the next documents here
                    row_code[d] = _BOS_CODE
                    doc_of[d] = np.arange(next_doc, next_doc + d.size)
                    next_doc += d.size
                    doc_slot.append(d)
                    doc_start.append(np.full(d.size, t))
                    doc_begin[d] = t
                    mode[d], run[d] = _FIRST, 0
                    n_src[:, d], per_word[:, d], clogc[:, d] = 0, 0, 0.0
                else:
                    mode[d] = _IDLE

        if cp.size:  # copied words: read from the source; their laws come from the copy's event
            w = code.ravel()[copy_from[cp] * slots + cp].astype(np.int64)
            row_code[cp], copied[t, cp] = w, True
            prev2[cp], prev1[cp] = prev1[cp], w
            run[cp] += 1
            row_run[cp] = run[cp]
            copy_from[cp] += 1
            copy_left[cp] -= 1
            mode[cp[copy_left[cp] == 0]] = _FREE

        # Each new word completes one window of each length its run now covers: a new copy source.
        words = np.concatenate((first, s, cp)) if free.size else np.concatenate((first, cp))
        word = row_code[words]
        prev_seen[t, words] = last_seen[words, word]
        last_seen[words, word] = t
        li, wi = np.nonzero(run[words] >= lengths[:, None])
        if li.size:
            slot = words[wi]
            row = li * slots + slot
            key = row * nw + code.ravel()[(t + 1 - lengths[li]) * slots + slot]
            before = flat_per_word[key]
            flat_per_word[key] = before + 1
            flat_clogc[row] += xlogx[before + 1] - xlogx[before]
            flat_n_src[row] += 1
        emitted += int((mode != _IDLE).sum())
        t += 1

    if ambiguous:
        _resolve_copies_(
            code, run_at, prev_seen, ent, nll, *(np.concatenate(col) for col in zip(*ambiguous)), nw
        )
    if on_tokens is not None and n_tokens > reported:
        on_tokens(n_tokens - reported)

    # Kept documents, in the order they were started.
    doc_slot_a, doc_start_a = np.concatenate(doc_slot), np.concatenate(doc_start)
    end_doc, end_pos, end_eligible = (np.concatenate(col) for col in zip(*ends))
    doc_len = np.empty(next_doc, dtype=np.int64)
    doc_len[end_doc] = end_pos - doc_start_a[end_doc]
    doc_eligible = np.empty(next_doc, dtype=np.int64)
    doc_eligible[end_doc] = end_eligible
    kept = int(np.searchsorted(np.cumsum(doc_len), n_tokens)) + 1
    lens = doc_len[:kept]
    offsets = np.cumsum(lens) - lens
    # Token k of a kept document sits at [doc_start + k, doc_slot]: flat index (doc_start + k) * slots + slot.
    first_cell = (doc_start_a[:kept] - offsets) * slots + doc_slot_a[:kept]
    flat = np.repeat(first_cell, lens) + np.arange(int(lens.sum())) * slots
    lut = np.concatenate((src.markers[::-1], [src.bos_id], src.words))  # lut[code + nl + 1]
    tokens = lut[code.ravel()[flat] + nl + 1].astype(np.uint16)
    entropy, neg_log_p = ent.ravel()[flat], nll.ravel()[flat]
    # A document's BOS is predicted at the end of the document before it.
    entropy[offsets[1:]], neg_log_p[offsets[1:]] = free_h[doc_eligible[: kept - 1]], -math.log(p_end)
    entropy[0] = neg_log_p[0] = math.nan
    stream = Stream(tokens, entropy, neg_log_p, copied.ravel()[flat])
    return stream, float(free_h[doc_eligible[kept - 1]]), -math.log(p_end)


def _resolve_copies_(code, run_at, prev_seen, ent, nll, slot, marker, start, length, lo, seen, nw) -> None:
    """Write H and -log P of the copied tokens after the first, for copies whose first word has > 1 source.

    A copy: its slot, marker position, chosen source start, length, lo = the document's first position +
    length (the least last word of a source), and the last position of its first word before the marker (the
    word's earlier positions chain back through prev_seen). Given the first i copied tokens the source is
    uniform over the candidates that agree with them (those of the chosen first word, then narrowing):
    H = log a - sum(g log g) / a over the groups g of candidates by their next word, and -log P = log a -
    log(the chosen word's group). A copy left with one candidate is certain from there on (the buffers
    already hold 0).
    """
    slots, flat_code, flat_run, flat_prev = code.shape[1], code.ravel(), run_at.ravel(), prev_seen.ravel()
    # The candidates: the first word's positions in the document that start a window inside one run.
    found_copy, found_start = [], []
    copy, p = np.arange(slot.size), seen.astype(np.int64)
    while copy.size:
        inside = p > lo[copy] - length[copy]  # not BOS or an earlier document
        copy, p = copy[inside], p[inside]
        last = p + length[copy] - 1
        ok = last < marker[copy]
        ok[ok] = flat_run[last[ok] * slots + slot[copy[ok]]] >= length[copy[ok]]
        found_copy.append(copy[ok])
        found_start.append(p[ok])
        p = flat_prev[p * slots + slot[copy]].astype(np.int64)
    copy, cand = np.concatenate(found_copy), np.concatenate(found_start)
    n_copies = slot.size
    for i in range(1, int(length.max())):
        alive = np.bincount(copy, minlength=n_copies)  # candidates agreeing with copied tokens 0..i-1
        keep = (alive[copy] > 1) & (length[copy] > i)
        copy, cand = copy[keep], cand[keep]
        if not copy.size:
            break
        s = slot[copy]
        word = flat_code[(cand + i) * slots + s].astype(np.int64)
        match = word == flat_code[(start[copy] + i) * slots + s]
        groups, group_size = np.unique(copy * nw + word, return_counts=True)
        glogg = np.bincount(groups // nw, weights=_xlogx(group_size), minlength=n_copies)
        live = np.unique(copy)
        a = alive[live]
        after = np.bincount(copy[match], minlength=n_copies)[live]
        at = marker[live] + 1 + i
        ent[at, slot[live]] = np.log(a) - glogg[live] / a
        nll[at, slot[live]] = np.log(a) - np.log(after)
        copy, cand = copy[match], cand[match]


def _group_job(args) -> tuple[Stream, float, float]:
    return sample_group(*args)


def sample_stream(src: Source, seed, n_tokens: int, workers: int = 1, on_tokens=None) -> Stream:
    """Documents from ``seed`` (a SeedSequence or what it takes), concatenated and cut to ``n_tokens``.

    The stream is made of groups of GROUP_TOKENS (the last one shorter), each sampled by ``sample_group`` from
    its own child of the seed, so groups can be built in ``workers`` processes with the same result.
    """
    root = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    sizes = [min(GROUP_TOKENS, n_tokens - lo) for lo in range(0, n_tokens, GROUP_TOKENS)]
    jobs = [
        (src, np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, g)), n)
        for g, n in enumerate(sizes)
    ]
    if workers > 1 and len(jobs) > 1:
        # fork: the children need only NumPy and this module, and start in milliseconds.
        context = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        )
        with context.Pool(min(workers, len(jobs))) as pool:
            results = []
            for job, result in zip(jobs, pool.imap(_group_job, jobs)):
                results.append(result)
                if on_tokens is not None:
                    on_tokens(job[2])
    else:
        results = [sample_group(*job, on_tokens=on_tokens) for job in jobs]
    for (stream, _, _), (_, h, neg_log_p) in zip(results[1:], results[:-1]):
        stream.entropy[0], stream.nll[0] = h, neg_log_p
    columns = zip(*((s.tokens, s.entropy, s.nll, s.in_copy) for s, _, _ in results))
    tokens, entropy, nll, in_copy = (np.concatenate(column)[:n_tokens] for column in columns)
    return Stream(tokens, entropy, nll, in_copy)


def stream_facts(stream: Stream, bos_id: int) -> dict:
    """What the sidecar states about a split (nats per predicted token)."""
    counts = np.bincount(stream.tokens.astype(np.int64))
    n_docs = int((stream.tokens == bos_id).sum())
    return {
        "tokens": int(stream.tokens.size),
        "predicted_tokens": int(stream.tokens.size - 1),
        "documents": n_docs,
        "mean_document_tokens": stream.tokens.size / max(n_docs, 1),
        "copied_fraction": float(stream.in_copy.mean()),
        "distinct_tokens": int((counts > 0).sum()),
        "entropy_floor": float(np.mean(stream.entropy[1:])),
        "empirical_nll": float(np.mean(stream.nll[1:])),
        "unigram_entropy": _entropy(counts / counts.sum()),
    }


def corpus_params(cfg: DataConfig) -> dict:
    """Everything that determines the corpus (its identity: the cache directory is named by its hash)."""
    return {
        "generator_version": GENERATOR_VERSION,
        "vocab_size": cfg.vocab_size,
        "bos_id": cfg.bos_id,
        **dataclasses.asdict(cfg.synthetic),
    }


def default_workers() -> int:
    """Build processes: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_corpus(
    cfg: DataConfig, out_dir: str | os.PathLike, *, workers: int | None = None, progress: bool = True
) -> dict:
    """Write the shards and the sidecar into the existing directory ``out_dir``; returns the sidecar.

    ``workers``: build processes (None: one per core); the files do not depend on it. ``progress``: a bar
    over the tokens sampled, on stderr when it is a terminal.
    """
    out_dir = Path(out_dir)
    syn = cfg.synthetic
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (or None: one per core).")
    src = Source.from_config(syn, cfg.vocab_size, cfg.bos_id)
    with tqdm(
        total=syn.train_tokens + syn.val_tokens + 1,
        desc="synthetic corpus",
        unit="tok",
        unit_scale=True,
        disable=None if progress else True,  # None: only on a terminal
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        train = sample_stream(src, seeds(syn.seed)["train"], syn.train_tokens, workers, bar.update)
        val = sample_stream(src, seeds(syn.seed)["val"], syn.val_tokens + 1, workers, bar.update)
    train_files = []
    for i, lo in enumerate(range(0, train.tokens.size, syn.shard_tokens)):
        name = f"{PREFIX}_train_{i + 1:06d}.bin"
        write_shard(out_dir / name, train.tokens[lo : lo + syn.shard_tokens], cfg.vocab_size)
        train_files.append(name)
    val_file = f"{PREFIX}_val_000000.bin"
    write_shard(out_dir / val_file, val.tokens, cfg.vocab_size)
    val_facts = stream_facts(val, cfg.bos_id)
    sidecar = {
        "format": "track_1_short synthetic corpus",
        "params": corpus_params(cfg),
        "unit": "nats per predicted token",
        "floor": (
            "exact: entropy_floor is the mean over predicted tokens of H(X_t | x_<t) under the generating "
            "process (the best achievable expected cross-entropy given each token's document so far); "
            "empirical_nll is that process's own -log P on the same tokens"
        ),
        "entropy_floor": val_facts["entropy_floor"],
        "unigram_entropy": val_facts["unigram_entropy"],
        "train": {"files": train_files, **stream_facts(train, cfg.bos_id)},
        "val": {"files": [val_file], **val_facts},
    }
    (out_dir / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=2) + "\n")
    return sidecar


def corpus_dir(cfg: DataConfig, cache_dir: str | os.PathLike) -> Path:
    digest = hashlib.sha256(json.dumps(corpus_params(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{PREFIX}-{digest}"


def ensure_corpus(
    cfg: DataConfig, cache_dir: str | os.PathLike, *, workers: int | None = None, progress: bool = True
) -> Path:
    """The corpus directory for ``cfg.synthetic``: built on first use (``build_corpus``), reused afterwards.

    Safe to call from several processes at once: each builds into its own temporary directory and the first
    rename wins; a killed build leaves only a temporary directory that is never read.
    """
    final = corpus_dir(cfg, cache_dir)
    if final.exists():
        _check_built(final, cfg)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        build_corpus(cfg, tmp, workers=workers, progress=progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another process finished the same corpus first: use theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_built(final, cfg)
    return final


def _check_built(path: Path, cfg: DataConfig) -> None:
    sidecar = path / SIDECAR_NAME
    try:
        params = json.loads(sidecar.read_text())["params"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"the synthetic corpus directory {path} is damaged ({sidecar}: {e}): delete the directory and it "
            "will be rebuilt."
        ) from e
    if params != corpus_params(cfg):
        raise ValueError(
            f"the synthetic corpus in {path} was built from other parameters than data.synthetic asks for: "
            "delete the directory and it will be rebuilt."
        )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = DataConfig()
    parser = argparse.ArgumentParser(
        prog="python -m track_1_short.synthetic",
        description="Build (or find) the embedded synthetic corpus and print its directory and sidecar. The "
        "training run does the same on its own (data=synthetic); this command builds it ahead or explores "
        "other parameters. Flags mirror the data.synthetic config fields.",
    )
    parser.add_argument("--dir", default=defaults.dir, help="cache directory (data.dir); default %(default)s")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="build processes (the files do not depend on it); default: one per core",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)"
    )
    for f in dataclasses.fields(SyntheticConfig):
        default = getattr(defaults.synthetic, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, list):
            parser.add_argument(flag, type=int, nargs="+", default=default, help="default %(default)s")
        else:
            parser.add_argument(flag, type=type(default), default=default, help="default %(default)s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticConfig)}
    try:
        syn = SyntheticConfig(**fields)
        cfg = DataConfig(kind="synthetic", dir=args.dir, val_tokens=1, val_batch_tokens=1, synthetic=syn)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers < 1:
        print(f"error: --workers={args.workers} must be >= 1 (or left out: one per core).", file=sys.stderr)
        return 2
    path = ensure_corpus(cfg, cfg.dir, workers=args.workers, progress=not args.no_progress)
    print(path)
    print((path / SIDECAR_NAME).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
