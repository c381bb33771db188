"""The canonical-token mask (model/canonical_mask.py) on GPT-2's real vocabulary, and the masked loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from track_1_short import gpt2_vocab
from track_1_short.model import canonical_mask
from track_1_short.model.layers import softcapped_cross_entropy_eval_sum

ROOT = Path(__file__).resolve().parents[2]
PROSE = ROOT / "tests" / "fixtures" / "english_prose.txt"
VP = 50304  # GPT-2's 50,257 padded to a multiple of 128, as model=track1 pads it
CAP, SHIFT, TEMP = 23.0, 5.0, 7.5


def _real_text() -> str:
    """Public-domain prose and the project's own documentation and docstrings."""
    docs = [PROSE, ROOT / "README.md", *sorted((ROOT / "track_1_short").glob("**/*.py"))]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in docs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("canonical_mask")
    first = canonical_mask.load_or_build(cache, VP)
    return {"cache": cache, "first": first, "mask": torch.from_numpy(first.mask)}


@pytest.mark.slow
def test_every_pair_of_real_english_text_is_allowed(built):
    enc = gpt2_vocab.encoding()
    ids = enc.encode_ordinary(_real_text())
    prev, cur = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    pairs = set(zip(ids[:-1], ids[1:]))
    assert len(ids) > 50_000 and len(pairs) > 10_000, (len(ids), len(pairs))  # a test with teeth
    dropped = ((built["mask"][prev, cur // 8] >> (cur % 8).to(torch.uint8)) & 1).bool()
    bad = sorted({(int(p), int(c)) for p, c in zip(prev[dropped], cur[dropped])})
    tb = gpt2_vocab.token_bytes()
    assert not bad, f"{len(bad)} real pairs dropped, e.g. {[(tb[p], tb[c]) for p, c in bad[:10]]}"
    # ...while the mask does drop something, and a plain example at that: "t" then "he" is always "the".
    assert built["first"].mask.any()
    t, he = enc.encode_single_token(b"t"), enc.encode_single_token(b"he")
    assert canonical_mask.unpack(built["mask"], torch.tensor([t]))[0, he]


@pytest.mark.slow
def test_a_sample_of_dropped_pairs_re_encodes_otherwise_in_any_context(built):
    """Why a pair is dropped: its text encodes to other tokens, alone and between other text."""
    enc, tb = gpt2_vocab.encoding(), gpt2_vocab.token_bytes()
    mask = built["first"].mask
    assert int(np.bitwise_count(mask).sum()) > 1_000_000  # GPT-2 rules out millions of pairs
    rows, cols = np.nonzero(mask)
    rng = np.random.default_rng(0)
    contexts = [("", ""), ("The ", " end."), ("x", "y"), ("1", "2"), (". ", "\n"), ("(", ")")]
    for i in rng.choice(len(rows), 400, replace=False):
        byte = int(mask[rows[i], cols[i]])
        p, c = (
            int(rows[i]),
            8 * int(cols[i]) + int(rng.choice(np.flatnonzero([(byte >> k) & 1 for k in range(8)]))),
        )
        text = (tb[p] + tb[c]).decode("utf-8")
        for left, right in contexts:
            out = enc.encode_ordinary(left + text + right)
            adjacent = any(a == p and b == c for a, b in zip(out, out[1:]))
            assert not adjacent, f"{tb[p]!r} {tb[c]!r} in {left + text + right!r} encodes to {out}"
        assert enc.encode_ordinary(text) != [p, c]


@pytest.mark.slow
def test_the_mask_is_cached_by_the_vocabularys_content_hash_and_loaded_back_equal(built):
    first = built["first"]
    assert first.built and gpt2_vocab.content_hash() in first.path.name
    again = canonical_mask.load_or_build(built["cache"], VP)
    assert not again.built and again.path == first.path
    assert np.array_equal(again.mask, first.mask)
    assert not list(built["cache"].glob("*.tmp"))  # written through a temporary file, moved into place


def test_a_vocabulary_smaller_than_gpt2s_is_refused():
    with pytest.raises(ValueError, match="vocab_padded=1024"):
        canonical_mask.build(1024)


def _restated_masked_loss(x, w, targets, prev, mask):
    """Softcapped logits with -60 wherever bit (c % 8) of mask[prev, c // 8] is set, then summed CE."""
    logits = (CAP * torch.sigmoid((x @ w + SHIFT) / TEMP)).float()
    for t in range(logits.size(0)):
        for c in range(logits.size(1)):
            if (int(mask[prev[t], c // 8]) >> (c % 8)) & 1:
                logits[t, c] = -60.0
    return F.cross_entropy(logits, targets, reduction="sum")


@pytest.mark.parametrize("chunk_rows", [64, 5])
def test_the_masked_loss_equals_a_restatement_with_minus_60_fill(chunk_rows):
    g = torch.Generator().manual_seed(0)
    T, D, V = 37, 16, 64
    x = torch.randn(T, D, generator=g)
    w = torch.randn(D, V, generator=g)
    targets = torch.randint(0, V, (T,), generator=g)
    prev = torch.randint(0, V, (T,), generator=g)
    mask = torch.randint(0, 256, (V, V // 8), dtype=torch.uint8, generator=g)
    # Keep each target itself: the mask drops others, so the loss falls (a dropped target would raise it).
    for t in range(T):
        mask[prev[t], targets[t] // 8] &= ~(1 << (targets[t] % 8)) & 0xFF
    got = softcapped_cross_entropy_eval_sum(x, w, targets, [1.0], CAP, SHIFT, TEMP, chunk_rows, mask, prev)
    want = _restated_masked_loss(x, w, targets, prev, mask)
    plain = softcapped_cross_entropy_eval_sum(x, w, targets, [1.0], CAP, SHIFT, TEMP, 64)
    # One chunk: the same ops on the same values, so bitwise; chunks sum their CEs in another order.
    if chunk_rows >= T:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got < plain - 1.0  # the mask matters here (half the logits dropped)


def test_the_mask_needs_the_previous_tokens_and_plain_next_token_ce():
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    t = torch.zeros(4, dtype=torch.long)
    mask = torch.zeros(16, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="prev_tokens"):
        softcapped_cross_entropy_eval_sum(x, w, t, [1.0, 0.5], CAP, SHIFT, TEMP, 4, mask, t)
    with pytest.raises(ValueError, match="prev_tokens"):
        softcapped_cross_entropy_eval_sum(x, w, t, [1.0], CAP, SHIFT, TEMP, 4, mask, None)


def test_unpack_reads_row_prev_and_bit_c_mod_8():
    mask = torch.zeros(16, 2, dtype=torch.uint8)
    mask[3, 1] = 1 << 2  # (prev 3, cur 10)
    got = canonical_mask.unpack(mask, torch.tensor([3, 10]))
    assert got[0].nonzero().flatten().tolist() == [10]
    assert not got[1].any()  # not (prev 10, cur 3)
