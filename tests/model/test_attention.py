"""Attention paths against a naive masked softmax over the full [S, S] score matrix, and the block lists.

Tolerances: both paths compute the same fp32 softmax over the same visible keys; they differ only in summation
order (blocked einsum vs one matmul), so 1e-5 absolute on O(1) outputs bounds them with room to spare.
"""

from __future__ import annotations

import pytest
import torch

from track_1_short.model.attention import (
    AttnSpec,
    PackedSequence,
    causal_self_attention,
    flex_attention_varlen,
    kv_block_lists,
    reference_attention,
)
from track_1_short.model.layers import document_ids, document_starts, rope_base_frequencies


def naive_attention(q, k, v, doc_ids, window):
    """softmax over the full [S, S] scores with the mask spelled out element by element."""
    s = q.size(0)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & (j <= i) & (i - j <= window)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double())
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def random_case(doc_lens, heads=2, dq=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(doc_lens)
    cu = torch.tensor([0, *doc_lens]).cumsum(0).to(torch.int32)
    q, k = (torch.randn(s, heads, dq, generator=g) for _ in range(2))
    v = torch.randn(s, heads, dv, generator=g)
    return q, k, v, document_ids(cu, s), cu


CASES = [
    ([300], 64),  # one document, window shorter than it
    ([100, 1, 250, 49], 16),  # a one-token document, window not a block multiple
    ([37, 400, 3], 1000),  # window longer than every document: plain document-causal
    ([129, 127, 256], 128),  # documents straddling block edges
]


@pytest.mark.parametrize("doc_lens,window", CASES)
def test_reference_attention_equals_naive_masked_softmax(doc_lens, window):
    q, k, v, doc, _ = random_case(doc_lens)
    got = reference_attention(q, k, v, doc, window, block=32)
    torch.testing.assert_close(got, naive_attention(q, k, v, doc, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("doc_lens,window", CASES)
def test_flex_attention_forward_equals_naive_masked_softmax_on_cpu(doc_lens, window):
    # FlexAttention on the CPU is unfused and forward-only: this checks the mask_mod, padding and layout.
    q, k, v, doc, _ = random_case(doc_lens, dq=16, dv=16)
    got = flex_attention_varlen(q, k, v, doc, window, block=128)
    torch.testing.assert_close(got, naive_attention(q, k, v, doc, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("doc_lens,window", CASES + [([1000, 24], 300), ([5] * 200, 256)])
def test_block_lists_cover_every_visible_pair(doc_lens, window):
    block = 64
    s = sum(doc_lens)
    pad = -s % block
    doc = document_ids(torch.tensor([0, *doc_lens]).cumsum(0).to(torch.int32), s)
    doc = torch.cat([doc, torch.full((pad,), -1, dtype=doc.dtype)])
    num, idx = kv_block_lists(doc, window, block)
    n = doc.numel()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j <= i) & (i - j <= window)
    needed = allowed.view(n // block, block, n // block, block).any(3).any(1)  # [q blocks, kv blocks]
    listed = torch.zeros_like(needed)
    for qb in range(n // block):
        listed[qb, idx[qb, : num[qb]].long()] = True
        assert len(set(idx[qb, : num[qb]].tolist())) == int(num[qb])  # no block listed twice
    assert not (needed & ~listed).any()  # nothing visible is skipped
    # and nothing is listed beyond the window's reach or after the query block
    assert (num <= -(-window // block) + 1).all()
    assert not (listed & torch.ones_like(listed).triu(1).bool()).any()


def _spec(**kw):
    base = dict(num_heads=2, head_dim=32, qk_dim=32, v_dim=32, paired=False, key_offset=False, xsa=False)
    return AttnSpec(**{**base, **kw})


def _layer_inputs(t=96, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    w = lambda *s: torch.randn(*s, generator=g) * d**-0.5  # noqa: E731
    return x, w


@pytest.mark.parametrize(
    "spec_kw",
    [
        dict(),
        dict(paired=True),
        dict(key_offset=True, qk_dim=32),
        dict(v_dim=16),
        dict(xsa=True),
        dict(qk_dim=16),
    ],
)
def test_attention_layer_never_reads_another_document_or_the_future(spec_kw):
    spec = _spec(**spec_kw)
    t, d, h = 96, 64, 2
    x, w = _layer_inputs(t, d)
    qk_w, v_w, o_w = w(2 * h * spec.qk_dim, d), w(h * spec.v_dim, d), w(d, h * spec.v_dim)
    cu = torch.tensor([0, 40, 41, 96], dtype=torch.int32)
    seq = PackedSequence(document_ids(cu, t), document_starts(cu, t), block=16, impl="reference")
    g = torch.Generator().manual_seed(1)
    alpha = torch.randn(t, h, generator=g)
    freq = rope_base_frequencies(8)
    one = torch.tensor(1.0)

    def run(inp):
        return causal_self_attention(
            inp, qk_w, v_w, o_w, spec, seq, 1000, freq, torch.tensor(0.2), one, one, xsa_alpha=alpha
        )

    base = run(x)
    p = 60  # a token of the third document
    x2 = x.clone()
    x2[p] += 1.0
    out = run(x2)
    assert torch.equal(out[:p], base[:p])  # earlier tokens (and other documents): bitwise unchanged
    assert not torch.equal(out[p], base[p])  # the token itself does change
    assert (out[p:] != base[p:]).any(-1).all()  # every later token of its document reads it
    x3 = x.clone()
    x3[10] += 1.0  # first document: the other documents must not move at all
    out = run(x3)
    assert torch.equal(out[40:], base[40:])


def test_attention_layer_respects_the_window():
    spec = _spec()
    t, d, h = 200, 64, 2
    x, w = _layer_inputs(t, d)
    qk_w, v_w, o_w = w(2 * h * 32, d), w(h * 32, d), w(d, h * 32)
    cu = torch.tensor([0, t], dtype=torch.int32)
    seq = PackedSequence(document_ids(cu, t), document_starts(cu, t), block=16, impl="reference")
    one = torch.tensor(1.0)
    freq = rope_base_frequencies(8)

    def run(inp, win):
        return causal_self_attention(inp, qk_w, v_w, o_w, spec, seq, win, freq, one, one, one)

    x2 = x.clone()
    x2[50] += 1.0
    window = 30
    changed = (run(x2, window) != run(x, window)).any(-1)
    assert changed.nonzero().flatten().tolist() == list(range(50, 50 + window + 1))  # i - 50 <= window


def test_key_offset_reads_the_previous_token_of_its_own_document_only():
    spec = _spec(key_offset=True)
    t, d, h = 64, 64, 2
    x, w = _layer_inputs(t, d)
    qk_w, v_w, o_w = w(2 * h * 32, d), w(h * 32, d), w(d, h * 32)
    cu = torch.tensor([0, 20, t], dtype=torch.int32)
    seq = PackedSequence(document_ids(cu, t), document_starts(cu, t), block=16, impl="reference")
    one = torch.tensor(1.0)
    freq = rope_base_frequencies(8)  # 8 rotating dims, 24 stationary: the key offset has dims to shift

    def run(inp):
        return causal_self_attention(inp, qk_w, v_w, o_w, spec, seq, 1000, freq, one, one, one)

    x2 = x.clone()
    x2[19] += 1.0  # last token of document 0; token 20 (BOS of document 1) must not pick up its key
    assert torch.equal(run(x2)[20:], run(x)[20:])
    # Within a document the shifted key reaches one token further back: with a window of 1, query 6 sees keys
    # 5 and 6 only, so token 4 reaches it only through key 5's stationary dims.
    x4 = x.clone()
    x4[4] += 1.0
    for s, reaches in ((spec, True), (_spec(), False)):
        base = causal_self_attention(x, qk_w, v_w, o_w, s, seq, 1, freq, one, one, one)
        out = causal_self_attention(x4, qk_w, v_w, o_w, s, seq, 1, freq, one, one, one)
        assert torch.equal(out[6], base[6]) != reaches


def test_paired_heads_see_their_partners_keys_and_halve_the_window():
    t, d, h = 64, 64, 2
    x, w = _layer_inputs(t, d)
    spec = _spec(paired=True)
    qk_w, v_w, o_w = w(2 * h * 32, d), w(h * 32, d), w(d, h * 32)
    cu = torch.tensor([0, t], dtype=torch.int32)
    seq = PackedSequence(document_ids(cu, t), document_starts(cu, t), block=16, impl="reference")
    one = torch.tensor(1.0)
    freq = rope_base_frequencies(8)

    def run(inp, win):
        return causal_self_attention(inp, qk_w, v_w, o_w, spec, seq, win, freq, one, one, one)

    x2 = x.clone()
    x2[30] += 1.0
    # A window of 2 stream rows reaches back one token: only tokens 30 and 31 can move.
    changed = (run(x2, 2) != run(x, 2)).any(-1)
    assert changed.nonzero().flatten().tolist() == [30, 31]


@pytest.mark.gpu
@pytest.mark.parametrize("doc_lens,window", CASES)
def test_flex_attention_on_cuda_matches_naive_forward_and_backward(doc_lens, window):
    q, k, v, doc, _ = random_case(doc_lens, dq=64, dv=64)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out = flex_attention_varlen(qc, kc, vc, doc.cuda(), window, block=128)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qr, kr, vr, doc, window)
    # fp32 inputs: FlexAttention's kernel may use TF32 dot products, hence 2e-2 rather than 1e-5
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=0)
    g = torch.randn_like(ref)
    out.backward(g.cuda())
    ref.backward(g)
    for a, b in ((qc, qr), (kc, kr), (vc, vr)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=5e-2, rtol=0)


@pytest.mark.parametrize("heads, differing", [(6, {1, 4}), (2, set()), (4, {1, 2})])
def test_paired_rotary_positions_are_stream_rows_and_differ_from_upstreams_only_where_documented(
    heads, differing
):
    t = 5
    # Where causal_self_attention's reshape puts head h of token t: [T, H, d] -> [2T, H/2, d].
    rows = torch.arange(t * heads).view(t, heads, 1).reshape(2 * t, heads // 2, 1)
    stream_row = {int(rows[r, j, 0]): r for r in range(2 * t) for j in range(heads // 2)}
    for tok in range(t):
        for h in range(heads):
            ours = stream_row[tok * heads + h]
            assert ours == 2 * tok + (h >= heads // 2)
            upstream = 2 * tok + h % 2  # qkv_rope.py: factor_offset = (logical_head % 2) * qk_dim
            assert (ours != upstream) == (h in differing), (tok, h)
