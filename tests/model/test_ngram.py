"""The hashed n-gram embedding on one rank: the hashes against a restatement from their definition, the
embedding against a dense table, and where the model injects it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from tests.model.conftest import load_config, packed_batch
from track_1_short.model.config import ModelConfigError, NgramConfig
from track_1_short.model.gpt import GPT
from track_1_short.model.ngram import (
    NgramTable,
    ngram_embed,
    ngram_embedding,
    ngram_indices,
    ngram_indices_of,
)

# Upstream ngram_table.py @ f380c1f0, written out here so that a changed default fails a test.
UPSTREAM = dict(
    rows=84_602_880,
    dim=768,
    sign_pool_rows=8192,
    bigram_row_muls=[36313, 27191],
    trigram_row_muls=[17351, 60961, 45259],
    bigram_sign_muls=[48271, 30011],
    trigram_sign_muls=[58699, 39779, 26801],
    inject_layers=[0, 1, 4, 5, 9],
    lr_mul=70.0,
    wd_mul=5.0,
    beta2=0.95,
)


def tiny_ngram(**ngram) -> dict:
    """Overrides of model=tiny with a small table (tiny's pre gate needs two more lanes for it)."""
    spec = dict(enabled=True, rows=1000, dim=64, sign_pool_rows=16, inject_layers=[0, 1, 3, 6])
    spec.update(ngram)
    return dict(compute_dtype="float32", mudd_gate_lanes=10, ngram=spec)


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2**32 if v >= 2**31 else v


def _plain_hash(tokens: list[int], muls: list[int]) -> int:
    out = 0
    for x, m in zip(tokens, muls):
        out ^= _int32(x * m)
    return out


def plain_indices(tokens: list[int], starts: list[bool], cfg: NgramConfig) -> tuple[list[int], list[int]]:
    """Row ids and sign rows from the definition, one position at a time in Python integers."""
    half = cfg.rows // 2
    bigram_rows, trigram_rows, bigram_signs, trigram_signs = [], [], [], []
    for t, x in enumerate(tokens):
        has_prev = not starts[t]
        has_two = has_prev and t >= 2 and not starts[t - 1]
        if has_prev:
            h = _plain_hash([x, tokens[t - 1]], cfg.bigram_row_muls)
            bigram_rows.append(h % (half - 1))
            bigram_signs.append(_plain_hash([x, tokens[t - 1]], cfg.bigram_sign_muls) % cfg.sign_pool_rows)
        else:
            bigram_rows.append(half - 1)
            bigram_signs.append(0)
        if has_two:
            h = _plain_hash([x, tokens[t - 1], tokens[t - 2]], cfg.trigram_row_muls)
            trigram_rows.append(half + h % (cfg.rows - half - 1))
            sign = _plain_hash([x, tokens[t - 1], tokens[t - 2]], cfg.trigram_sign_muls)
            trigram_signs.append(sign % cfg.sign_pool_rows)
        else:
            trigram_rows.append(cfg.rows - 1)
            trigram_signs.append(0)
    return bigram_rows + trigram_rows, bigram_signs + trigram_signs


def test_defaults_are_upstreams_constants():
    cfg = NgramConfig()
    for name, value in UPSTREAM.items():
        assert getattr(cfg, name) == value, name


@pytest.mark.parametrize("rows", [84_602_880, 1000, 10])
@pytest.mark.parametrize("cross_documents", [False, True])
def test_hashes_equal_the_definition(rows, cross_documents):
    cfg = NgramConfig(enabled=True, rows=rows, sign_pool_rows=8192 if rows > 100 else 4)
    g = torch.Generator().manual_seed(rows + cross_documents)
    for _trial in range(4):
        t = 300
        # GPT-2-sized ids (products past 2**31 wrap) and ids near the top, documents of 1, 2 and more tokens
        tokens = torch.randint(0, 50257, (t,), generator=g)
        tokens[:5] = torch.tensor([50256, 50255, 1, 0, 50256])
        cuts = sorted(set(torch.randint(1, t, (12,), generator=g).tolist()) | {1, 2, 4})
        cu = torch.tensor([0, *cuts, t], dtype=torch.int32)
        starts = [False] * t
        for c in cu[:-1].tolist() if not cross_documents else [0]:
            starts[c] = True
        got_rows, got_signs = ngram_indices(tokens.to(torch.int32), torch.tensor(starts), cfg)
        want_rows, want_signs = plain_indices(tokens.tolist(), starts, cfg)
        assert got_rows.tolist() == want_rows
        assert got_signs.tolist() == want_signs
        assert got_rows.dtype == torch.int64 and 0 <= int(got_rows.min()) and int(got_rows.max()) < rows


def test_history_less_positions_read_the_reserved_rows():
    cfg = NgramConfig(enabled=True, rows=1000, sign_pool_rows=16)
    tokens = torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32)
    starts = torch.tensor([True, False, False, True, False])
    rows, signs = ngram_indices(tokens, starts, cfg)
    assert rows[:5].tolist()[0] == 499 and rows[3].item() == 499  # bigram: document starts
    assert [rows[5 + t].item() == 999 for t in range(5)] == [True, True, False, True, True]
    assert signs[0].item() == 0 and signs[5].item() == signs[6].item() == signs[8].item() == 0


def test_model_hashes_stop_at_documents_unless_cross_document():
    inputs, _, cu = packed_batch([7, 9], vocab=2000)
    for cross in (False, True):
        cfg = load_config("tiny", cross_document_lookback=cross, **tiny_ngram())
        model = GPT(cfg, device="meta")
        rows, _ = model.ngram_indices(inputs, cu)
        assert (rows[7].item() == 499) != cross  # the second document's first token
        assert (rows[16 + 8].item() == 999) != cross  # its second token's trigram


def test_a_cycles_batches_hashed_as_one_stream_equal_each_hashed_alone():
    # The cycle hashes its micro batches in one call: each batch's first token must start its look-back
    # (the previous batch's tokens are another context), padded cu_seqlens included.
    from track_1_short.data import fixed_boundaries

    batches = [
        packed_batch(lengths, vocab=2000, seed=i) for i, lengths in enumerate([[7, 9], [16], [3, 5, 8]])
    ]
    for cross in (False, True):
        model = GPT(load_config("tiny", cross_document_lookback=cross, **tiny_ngram()), device="meta")
        given = [
            (inputs, fixed_boundaries(cu, inputs.numel()) if i else cu)
            for i, (inputs, _, cu) in enumerate(batches)
        ]
        together = ngram_indices_of(given, model.cfg.ngram, cross)
        alone = [model.ngram_indices(inputs, cu) for inputs, cu in given]
        assert len(together) == len(alone)
        for (r1, s1), (r2, s2) in zip(together, alone):
            assert torch.equal(r1, r2) and torch.equal(s1, s2)


def _dense_reference(table: torch.Tensor, rows, signs, pool):
    """The embedding as a dense table lookup: F.embedding, times the sign rows, summed."""
    t = rows.numel() // 2
    looked = F.embedding(rows, table) * pool[signs].to(table.dtype)
    return looked[:t] + looked[t:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_and_row_gradients_equal_a_dense_table(dtype):
    cfg = NgramConfig(enabled=True, rows=64, dim=8, sign_pool_rows=4)
    torch.manual_seed(0)
    table = NgramTable(cfg, dtype=dtype)
    table.shard.copy_(torch.randn(64, 8))
    pool = torch.where(torch.randn(4, 8) >= 0, 1.0, -1.0).to(torch.bfloat16)
    batches = [torch.randint(0, 40, (50,), dtype=torch.int32) for _ in range(3)]
    starts = torch.zeros(50, dtype=torch.bool)
    starts[[0, 20]] = True
    indices = [ngram_indices(b, starts, cfg) for b in batches]
    table.pull([r for r, _ in indices])
    dense = table.shard.detach().clone().requires_grad_(True)
    for rows, signs in indices:
        # integer upstream gradients: every sum below is exact whatever its order, so bits can be compared
        weight = torch.randint(-3, 4, (50, 8)).to(dtype)
        out = ngram_embed(table.lookup(rows), pool, signs)
        ref = _dense_reference(dense, rows, signs, pool)
        assert torch.equal(out, ref)
        (out.float() * weight.float()).sum().backward()
        (ref.float() * weight.float()).sum().backward()
    got_rows, got = table.row_grads()
    touched = dense.grad.abs().sum(1) > 0
    assert set(torch.nonzero(touched).flatten().tolist()) <= set(got_rows.tolist())
    full = torch.zeros(64, 8)
    full[got_rows] = got
    assert torch.equal(full, dense.grad.float())


def test_sign_pool_rows_multiply_the_rows():
    cached = torch.randn(4, 8)
    pool = torch.ones(4, 8)
    pool[2, :3] = -1
    out = ngram_embedding(cached, pool, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(out[0], cached[0] + pool[2] * cached[2])
    assert torch.equal(out[1], cached[1] + cached[3])


def test_zero_table_leaves_the_model_unchanged():
    """A zero table adds exact zeros everywhere it enters: the loss equals the model without the table."""
    cfg_on = load_config("tiny", **tiny_ngram())
    torch.manual_seed(3)
    on = GPT(cfg_on)
    off = GPT(load_config("tiny", compute_dtype="float32", mudd_gate_lanes=10))
    # the same layout apart from the n-gram lanes; copy what matches lane by lane
    with torch.no_grad():
        for name, p in off.named_parameters():
            p.copy_(dict(on.named_parameters())[name])
    table = NgramTable(cfg_on.ngram)
    on.attach_ngram(table)
    inputs, targets, cu = packed_batch([200, 56], vocab=2000)
    table.pull([on.ngram_indices(inputs, cu)[0]])
    with torch.no_grad():
        # the n-gram lanes of the on model sit where the off model has x0 / skip lanes: zero every gate weight
        # and bias that differs, so both read the same gates
        for model in (on, off):
            model.mudd_gate_w2.zero_()
        topo_on, topo_off = on.topo, off.topo
        for block, (lanes_on, lanes_off) in enumerate(
            ((topo_on.pre_lanes, topo_off.pre_lanes), (topo_on.post_lanes, topo_off.post_lanes))
        ):
            for kind in ("xsa", "attn_gate", "x0", "skip"):
                for layer, (a, w) in lanes_off[kind].items():
                    b, _ = lanes_on[kind][layer]
                    off.mudd_gate_b2[block, a : a + w] = on.mudd_gate_b2[block, b : b + w]
    assert torch.equal(on(inputs, targets, cu, (1, 2)), off(inputs, targets, cu, (1, 2)))


def test_every_injection_site_gets_a_gradient():
    """With a random table each n-gram gate lane and MUDD coefficient 11 move the loss; with the table off
    coefficient 11 is never read."""
    cfg = load_config("tiny", **tiny_ngram())
    torch.manual_seed(4)
    model = GPT(cfg)
    table = NgramTable(cfg.ngram)
    table.shard.copy_(torch.randn_like(table.shard, dtype=torch.float32))
    model.attach_ngram(table)
    inputs, targets, cu = packed_batch([200, 56], vocab=2000)
    table.pull([model.ngram_indices(inputs, cu)[0]])
    model(inputs, targets, cu, (1, 2)).backward()
    for block, lanes in enumerate((model.topo.pre_lanes, model.topo.post_lanes)):
        for layer, (a, _) in lanes["ngram"].items():
            assert model.mudd_gate_b2.grad[block, a] != 0, (block, layer)
    assert sorted(list(model.topo.pre_lanes["ngram"]) + list(model.topo.post_lanes["ngram"])) == [0, 1, 3, 6]
    assert model.mudd_b2.grad[0, 11] != 0
    rows, grads = table.row_grads()
    assert rows.numel() and grads.abs().sum() > 0

    off = GPT(load_config("tiny", compute_dtype="float32"))
    off(inputs, targets, cu, (1, 2)).backward()
    assert off.mudd_b2.grad[0, 11] == 0


def test_bad_configs_and_a_missing_table_are_refused():
    with pytest.raises(ModelConfigError, match="mudd_gate_lanes"):
        load_config("tiny", ngram=dict(enabled=True, rows=1000, dim=64, inject_layers=[0, 1, 3, 6]))
    with pytest.raises(ModelConfigError, match="sign_pool_rows"):
        NgramConfig(enabled=True, sign_pool_rows=100).validate(768, 11)
    with pytest.raises(ModelConfigError, match="rows"):
        NgramConfig(enabled=True, rows=1001).validate(768, 11)
    with pytest.raises(ModelConfigError, match="coefficient 11"):
        load_config("tiny", **tiny_ngram(inject_layers=[0, 7]))
    cfg = load_config("tiny", **tiny_ngram())
    model = GPT(cfg)
    inputs, targets, cu = packed_batch([64], vocab=2000)
    with pytest.raises(ModelConfigError, match="attach_ngram"):
        model(inputs, targets, cu, (1, 2))
    table = NgramTable(cfg.ngram)
    model.attach_ngram(table)
    table.pull([torch.tensor([1, 2])])
    with pytest.raises(RuntimeError, match="did not fetch"):
        model(inputs, targets, cu, (1, 2))
    assert copy.deepcopy(model).ngram_table is not None


def _graphs_and_grads(model, table, inputs, targets, cu, lookup_outside: bool):
    """(graphs compiled for one training forward and backward, the table's row gradient, the loss)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    rows, signs = model.ngram_indices(inputs, cu)
    table.pull([rows])
    ngram = {"ngram": model.ngram_rows(rows, signs)} if lookup_outside else {}
    loss = compiled(inputs, targets, cu, (1, 2), **ngram)
    loss.backward()
    rows, grads = table.row_grads()
    torch._dynamo.reset()
    return counter.frame_count, (rows, grads), loss.detach()


@pytest.mark.slow
def test_a_lookup_outside_the_compiled_forward_leaves_its_graph_whole():
    """The trainer looks the rows up before the compiled forward (model.ngram_rows) and passes them in: the
    forward then makes as many graphs as the model without the table (a lookup inside splits it), and its
    loss and row gradient are those of the lookup inside, bitwise (the same ops, moved)."""
    cfg = load_config("tiny", **tiny_ngram())
    torch.manual_seed(5)
    model = GPT(cfg)
    table = NgramTable(cfg.ngram)
    table.shard.copy_(torch.randn_like(table.shard, dtype=torch.float32))
    model.attach_ngram(table)
    inputs, targets, cu = packed_batch([200, 56], vocab=2000)
    outside = _graphs_and_grads(model, table, inputs, targets, cu, lookup_outside=True)
    model.zero_grad(set_to_none=True)
    inside = _graphs_and_grads(model, table, inputs, targets, cu, lookup_outside=False)
    torch.manual_seed(5)
    off = GPT(load_config("tiny", compute_dtype="float32", mudd_gate_lanes=10))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    torch.compile(off, backend=counter, dynamic=False)(inputs, targets, cu, (1, 2)).backward()
    torch._dynamo.reset()
    assert outside[0] == counter.frame_count
    assert inside[0] > counter.frame_count  # the break this avoids: the test can tell
    assert torch.equal(outside[2], inside[2])
    assert torch.equal(outside[1][0], inside[1][0]) and torch.equal(outside[1][1], inside[1][1])


def test_a_pull_refuses_row_ids_outside_the_table_and_takes_an_empty_one():
    cfg = load_config("tiny", **tiny_ngram()).ngram
    table = NgramTable(cfg)
    for bad in (-1, cfg.rows):
        with pytest.raises(ValueError, match=rf"row ids in \[{min(bad, 0)}, {max(bad, 5)}\] outside"):
            table.pull([torch.tensor([0, 5, bad])])
    table.pull([torch.tensor([cfg.rows - 1, 0])])  # both ends of the table are rows
    assert table.want.tolist() == [0, cfg.rows - 1]
    table.reset_cache()
    table.pull([torch.zeros(0, dtype=torch.int64)])
    rows, grads = table.row_grads()
    assert rows.numel() == 0 and grads.shape == (0, cfg.dim)
