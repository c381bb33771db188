"""Canonical-token mask for the final validation: which (previous, current) GPT-2 token pairs BPE never emits.

GPT-2's tokenizer is deterministic, so some token pairs never occur in tokenized text: "t" followed by "he"
cannot, because the BPE of "the" merges the seam first. At the final validation the logits of such tokens
(given the previous input token) are set to -60 after the softcap (whose outputs lie in (0, cap)), so they
drop out of the softmax; a correct mask can only lower the loss of canonically tokenized text. Upstream:
record #91 (PR #350), built in ``canonical_mask.py`` of KellerJordan/modded-nanogpt; this is its idea with
our own derivation, below, and a stricter choice of what is left unmasked.

Layout: uint8 [V, V / 8] for the model's padded vocabulary V; bit ``c % 8`` (little-endian) of byte
``[p, c // 8]`` set means "c never follows p". Rows and columns of the end-of-text id and of the padding are
all zero (never dropped).

Why a set bit is right. Suppose p and c are both emitted, adjacent, inside one pretoken. Until one of them
is complete, no merge crosses their outer ends (else neither would be emitted), so each region replays the
merges its own bytes make alone; when both tokens' merge sequences increase in rank, the two interleave by
rank. Let ``a`` be p's last piece for merge ranks [c_a, e_a) and ``b`` c's first piece for ranks (c_b, e_b]
(a tie goes to the leftmost pair: p's own merge beats the seam, the seam beats c's), and let ``a + b`` be a
token of rank r in both intervals. Then at rank r the seam pair is present and the cheapest, so it merges
and p, c are not emitted: a contradiction. So a set bit needs (i) such a seam merge, and (ii) that the
seam can never be a pretoken boundary. (ii) is decided by the characters either side, for GPT-2's pattern
(gpt2_vocab.PAT_STR): letter|letter, number|number, other|other and ' '|non-space are always one pretoken;
a whitespace run can split anywhere, and a letter run splits after a contraction ('s, 't, ...).

Left unmasked, to stay correct in every context: tokens that are not whole UTF-8 text (a seam inside a
character), tokens ending in a contraction, tokens whose own merges do not increase in rank or do not
rebuild the token, and the end-of-text id.
"""

from __future__ import annotations

import os
import tempfile
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from track_1_short import gpt2_vocab

FILL = -60.0
"""The value dropped logits get, after the softcap (whose outputs lie in (0, cap)): exp(-60 - 23) is far below
an fp32 ulp of any softmax normaliser, so a dropped token adds nothing."""

_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
# Seam classes of GPT-2's pattern: a token's last character is ' ', other \s, \p{L}, \p{N} or the rest; its
# first character the same, with every \s in one class.
_SPACE, _OTHER_SPACE, _LETTER, _NUMBER, _OTHER = range(5)
_JOINED = np.zeros((5, 5), dtype=bool)
_JOINED[_SPACE, [_LETTER, _NUMBER, _OTHER]] = True  # " ?\p{L}+" and its kin take one leading space
for _c in (_LETTER, _NUMBER, _OTHER):
    _JOINED[_c, _c] = True  # a run of one class is one pretoken (a contraction's end is excluded apart)


def _char_class(ch: str) -> int:
    # Python's isspace() also accepts U+001C..U+001F, which the pattern's \s (Unicode White_Space) does not.
    if ch.isspace() and not "\x1c" <= ch <= "\x1f":
        return _SPACE if ch == " " else _OTHER_SPACE
    cat = unicodedata.category(ch)[0]
    return _LETTER if cat == "L" else _NUMBER if cat == "N" else _OTHER


def _merge_trajectory(b: bytes, ranks: dict[bytes, int]) -> tuple[list, list, bool]:
    """Replay BPE on one token's bytes as tiktoken does (cheapest adjacent pair first, leftmost on a tie).

    Returns (firsts, lasts, ok): the first piece's and the last piece's tenures as [piece, created, ended]
    in merge ranks (created -1 for a single byte, ended inf while the piece stands at the end), and ok =
    the merges increased in rank and rebuilt the token."""
    pieces = [bytes([c]) for c in b]
    firsts, lasts = [[pieces[0], -1, np.inf]], [[pieces[-1], -1, np.inf]]
    previous = -1
    ok = True
    while len(pieces) > 1:
        best, at = None, -1
        for i in range(len(pieces) - 1):
            r = ranks.get(pieces[i] + pieces[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        ok &= best > previous
        previous = best
        merged = pieces[at] + pieces[at + 1]
        if at == 0:
            firsts[-1][2] = best
            firsts.append([merged, best, np.inf])
        if at + 1 == len(pieces) - 1:
            lasts[-1][2] = best
            lasts.append([merged, best, np.inf])
        pieces[at : at + 2] = [merged]
    return firsts, lasts, ok and len(pieces) == 1


def _index(tenures: dict[bytes, list]) -> dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """piece -> (created, ended, token) as arrays, for selecting by rank without a Python loop."""
    dtypes = (np.float64, np.float64, np.int64)
    return {
        piece: tuple(np.asarray(col, dtype=dt) for col, dt in zip(zip(*rows), dtypes))
        for piece, rows in tenures.items()
    }


def build(vocab_padded: int, ranks: dict[bytes, int] | None = None) -> np.ndarray:
    """The packed mask uint8 [vocab_padded, vocab_padded // 8] from GPT-2's merges (module docstring)."""
    if vocab_padded % 8 or vocab_padded < gpt2_vocab.VOCAB_SIZE:
        raise ValueError(f"vocab_padded={vocab_padded} must be a multiple of 8 and hold GPT-2's vocabulary.")
    ranks = gpt2_vocab.encoding()._mergeable_ranks if ranks is None else ranks
    # piece -> (created, ended, token) of the tokens whose last (first) piece it is for a while
    lasts: dict[bytes, list] = {}
    firsts: dict[bytes, list] = {}
    end_class = np.zeros(vocab_padded, dtype=np.int64)
    start_class = np.zeros(vocab_padded, dtype=np.int64)
    for tok, tid in ranks.items():
        try:
            text = tok.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the seam would fall inside a character
        first_tenures, last_tenures, ok = _merge_trajectory(tok, ranks)
        if not ok:
            continue
        start_class[tid] = _char_class(text[0])
        for piece, made, ended in first_tenures:
            firsts.setdefault(piece, []).append((made, ended, tid))
        if text.endswith(_CONTRACTIONS):
            continue  # whether it ends its pretoken depends on the text before it
        end_class[tid] = _char_class(text[-1])
        for piece, made, ended in last_tenures:
            lasts.setdefault(piece, []).append((made, ended, tid))
    by_last, by_first = _index(lasts), _index(firsts)

    mask = np.zeros((vocab_padded, vocab_padded // 8), dtype=np.uint8)
    for tok, r in ranks.items():
        # Every split of a token's bytes into a last piece of some p and a first piece of some c.
        for k in range(1, len(tok)):
            left, right = by_last.get(tok[:k]), by_first.get(tok[k:])
            if left is None or right is None:
                continue
            ps = left[2][(left[0] <= r) & (r < left[1])]
            cs = right[2][(right[0] < r) & (r <= right[1])]
            if len(ps) and len(cs):
                _set_pairs(mask, ps, cs, end_class, start_class)
    return mask


def _set_pairs(mask: np.ndarray, ps: np.ndarray, cs: np.ndarray, end_class, start_class) -> None:
    """Set mask[p, c] for the pairs whose seam is always inside a pretoken, by the seam's characters."""
    for e in np.unique(end_class[ps]):
        cols = cs[_JOINED[e, start_class[cs]]]
        if not len(cols):
            continue
        packed = np.zeros(mask.shape[1], dtype=np.uint8)
        np.bitwise_or.at(packed, cols >> 3, (1 << (cols & 7)).astype(np.uint8))
        nz = np.flatnonzero(packed)
        rows = ps[end_class[ps] == e]
        mask[np.ix_(rows, nz)] |= packed[nz]


def unpack(mask: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """bool [len(prev), V]: True where the token (column) never follows prev."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    rows = mask[prev]  # [n, V/8]
    return ((rows.unsqueeze(-1) >> shifts) & 1).view(rows.size(0), -1).bool()


@dataclass
class Loaded:
    mask: np.ndarray
    path: Path
    built: bool
    seconds: float
    """The build's time when built, else the load's."""


def cache_path(cache_dir: str | Path, vocab_padded: int) -> Path:
    return Path(cache_dir) / f"canonical_mask-{gpt2_vocab.content_hash()}-v{vocab_padded}.npy"


def load_or_build(cache_dir: str | Path, vocab_padded: int) -> Loaded:
    """The mask from the cache, keyed by the vocabulary's content hash, or built and written there atomically
    (a temporary file moved into place: a killed build leaves no half file)."""
    path = cache_path(cache_dir, vocab_padded)
    t = time.perf_counter()
    if path.is_file():
        mask = np.load(path)
        if mask.shape == (vocab_padded, vocab_padded // 8) and mask.dtype == np.uint8:
            return Loaded(mask, path, False, time.perf_counter() - t)
    mask = build(vocab_padded)
    seconds = time.perf_counter() - t
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Loaded(mask, path, True, seconds)
