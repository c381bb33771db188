"""Attention paths against a naive masked softmax over the full [S, S] score matrix, and the block lists.

Tolerances: both paths compute the same fp32 softmax over the same visible keys; they differ only in summation
order (blocked einsum vs one matmul), so 1e-5 absolute on O(1) outputs bounds them with room to spare.
FlexAttention with and without full blocks: see the tests of kv_block_lists_split below for the bounds.
"""

from __future__ import annotations

import functools

import pytest
import torch

import track_1_short.model.attention as attention
from track_1_short.model.attention import (
    AttnSpec,
    PackedSequence,
    causal_self_attention,
    flex_attention_varlen,
    kv_block_lists,
    kv_block_lists_split,
    reference_attention,
    visible,
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


@pytest.mark.parametrize("full_blocks", [True, False])
@pytest.mark.parametrize("doc_lens,window", CASES)
def test_flex_attention_forward_equals_naive_masked_softmax_on_cpu(doc_lens, window, full_blocks):
    # FlexAttention on the CPU is unfused and forward-only: this checks the mask_mod, padding and layout.
    q, k, v, doc, _ = random_case(doc_lens, dq=16, dv=16)
    got = flex_attention_varlen(q, k, v, doc, window, block=128, full_blocks=full_blocks)
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


# -- full blocks (kv_block_lists_split) ---------------------------------------------------------------------


def _random_packing(seed, block):
    """doc_ids of random documents, some shorter, some longer than a block, padded with -1 to a block edge."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * block + 1, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
    # One document of over four blocks, somewhere: windows of two blocks or more then have full blocks.
    lens.insert(int(torch.randint(0, len(lens) + 1, (), generator=g)), 4 * block + lens[0])
    s = sum(lens)
    doc = document_ids(torch.tensor([0, *lens]).cumsum(0).to(torch.int32), s)
    return torch.cat([doc, torch.full((-s % block,), -1, dtype=doc.dtype)])


def _row(num, idx, qb):
    return idx[qb, : int(num[qb])].tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block", [1, 16, 64])
@pytest.mark.parametrize("reach", ["under a block", "blocks", "past every document", "blocks as a tensor"])
def test_split_block_lists_classify_each_block_by_its_visible_pairs(seed, block, reach):
    doc = _random_packing(seed, block) if block > 1 else _random_packing(seed, 16)[:150]
    window = {
        "under a block": max(block // 2 - 1, 0),
        "blocks": 2 * block + 7,
        "past every document": doc.numel(),
        "blocks as a tensor": torch.tensor(3 * block + block // 2),
    }[reach]
    n = doc.numel() // block
    num, idx = kv_block_lists(doc, window, block)
    part_num, part_idx, full_num, full_idx = kv_block_lists_split(doc, window, block)
    assert all(t.dtype == torch.int32 for t in (part_num, part_idx, full_num, full_idx))
    assert part_idx.shape == full_idx.shape == (n, n)
    # Entries past a row's count are ignored, but a kernel may still load them: all must be block indices.
    assert ((part_idx >= 0) & (part_idx < n) & (full_idx >= 0) & (full_idx < n)).all()
    pos = torch.arange(doc.numel())
    pairs = visible(doc[:, None], doc[None, :], pos[:, None], pos[None, :], window)
    pairs = pairs.view(n, block, n, block).transpose(1, 2)  # [q block, kv block, query, key]
    some, every = pairs.any((2, 3)), pairs.all((2, 3))
    for qb in range(n):
        listed, part, full = _row(num, idx, qb), _row(part_num, part_idx, qb), _row(full_num, full_idx, qb)
        assert part == sorted(set(part)) and full == sorted(set(full))  # FlexAttention's ordered layout
        assert not set(part) & set(full)
        assert set(part) | set(full) == set(listed)  # the same blocks kv_block_lists visits
        # kv_block_lists lists exactly the blocks holding a visible pair; of those, full means all visible.
        assert set(listed) == set(some[qb].nonzero().flatten().tolist())
        assert set(full) == set(every[qb].nonzero().flatten().tolist())
    if block > 1 and reach != "under a block":
        assert full_num.sum() > 0  # the case does exercise full blocks


# At block 32 each has full blocks, bounded by a document start, by block edges in documents, by the window.
FULL_CASES = [([37, 400, 3], 1000), ([129, 127, 256], 128), ([1000, 24], 300)]


@pytest.mark.parametrize("doc_lens,window", CASES + [([1000, 24], 300)])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_flex_attention_with_full_blocks_is_bitwise_without_them_on_the_cpu(doc_lens, window, as_tensor):
    # Eager FlexAttention (the CPU's path) scores every pair and applies mask_mod densely: it never reads the
    # block lists, so listing full blocks apart cannot change a bit there. The lists' use by a kernel is
    # checked by the compiled test below and on CUDA.
    q, k, v, doc, _ = random_case(doc_lens, dq=16, dv=16)
    w = torch.tensor(window) if as_tensor else window
    with_full = flex_attention_varlen(q, k, v, doc, w, block=32, full_blocks=True)
    assert torch.equal(with_full, flex_attention_varlen(q, k, v, doc, w, block=32, full_blocks=False))
    torch.testing.assert_close(with_full, naive_attention(q, k, v, doc, window), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("doc_lens,window", FULL_CASES)
def test_flex_attention_full_blocks_in_the_compiled_cpu_kernel(doc_lens, window, monkeypatch):
    # Inductor's CPU FlexAttention kernel does read the lists: it skips mask_mod on full blocks, so a partial
    # block listed as full lets masked pairs through and fails this test. It visits partial blocks before full
    # ones, so the online softmax sums in another order than without full blocks: not bitwise. The outputs are
    # convex combinations of rows of v, so the reordering error scales with max |v|: measured at most
    # 1.6 eps * max |v| (eps = 2^-23, fp32) over 6 seeds of these cases at block 32; 3 eps * max |v| asserted.
    pytest.importorskip("torch._inductor")
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # a fresh cache: past the recompile limit Dynamo would quietly run flex eagerly
    compiled = torch.compile(flex_attention, dynamic=False)
    monkeypatch.setattr(attention, "_flex_function", lambda device_type: compiled)
    q, k, v, doc, _ = random_case(doc_lens, dq=16, dv=16)
    w = torch.tensor(window)
    with_full = flex_attention_varlen(q, k, v, doc, w, block=32, full_blocks=True)
    without = flex_attention_varlen(q, k, v, doc, w, block=32, full_blocks=False)
    expected = naive_attention(q, k, v, doc, window)
    torch.testing.assert_close(with_full, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(without, expected, atol=1e-5, rtol=0)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(with_full, without, atol=3 * eps * v.abs().max().item(), rtol=0)


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


# At block 128 the last two have full blocks (windows of two blocks and more); of CASES only the third has.
CUDA_CASES = CASES + [([1000, 24], 300), ([700, 200, 124], 400)]


@pytest.mark.gpu
@pytest.mark.parametrize("full_blocks", [True, False])
@pytest.mark.parametrize("doc_lens,window", CUDA_CASES)
def test_flex_attention_on_cuda_matches_naive_forward_and_backward(doc_lens, window, full_blocks):
    # Every case is a new compile (shapes, the window and whether full lists are given are all guarded); a
    # fresh cache keeps Dynamo under its recompile limit, past which it would quietly run FlexAttention
    # unfused.
    torch._dynamo.reset()
    q, k, v, doc, _ = random_case(doc_lens, dq=64, dv=64)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out = flex_attention_varlen(qc, kc, vc, doc.cuda(), window, block=128, full_blocks=full_blocks)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qr, kr, vr, doc, window)
    # fp32 inputs: FlexAttention's kernel may use TF32 dot products, hence 2e-2 rather than 1e-5
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=0)
    g = torch.randn_like(ref)
    out.backward(g.cuda())
    ref.backward(g)
    for a, b in ((qc, qr), (kc, kr), (vc, vr)):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=5e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("full_blocks", [True, False])
@pytest.mark.parametrize("doc_lens,window", [c for c in CUDA_CASES if c[1] >= 2 * 128])
def test_flex_attention_in_a_compiled_graph_on_cuda_matches_naive_forward_and_backward(
    doc_lens, window, full_blocks
):
    # The compiled model's path: FlexAttention traced into the caller's graph, its block mask built there from
    # a window given as a device tensor. Only the cases with full blocks: each is a compile of its own. Bounds
    # as in the test above (TF32 dot products).
    torch._dynamo.reset()
    q, k, v, doc, _ = random_case(doc_lens, dq=64, dv=64)
    attend = functools.partial(flex_attention_varlen, block=128, full_blocks=full_blocks)
    f = torch.compile(attend, dynamic=False)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    out = f(qc, kc, vc, doc.cuda(), torch.tensor(window, device="cuda"))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qr, kr, vr, doc, window)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-2, rtol=0)
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


@pytest.mark.parametrize("seed", range(6))
def test_document_firsts_are_each_runs_first_position(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
    ids = [k for k, n in enumerate(lengths) for _ in range(n)]
    if seed % 2:
        ids += [-1] * int(torch.randint(1, 20, (1,), generator=gen))  # pads at the end, one run of their own
    got = attention._document_firsts(torch.tensor(ids, dtype=torch.int32))
    expected = [next(j for j in range(t, -1, -1) if j == 0 or ids[j - 1] != ids[t]) for t in range(len(ids))]
    assert got.dtype == torch.int64 and got.tolist() == expected
