"""The prefix-token target: GPT-2's prefix table, the loss term in both paths, its schedule, its guards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from tests.model.test_layers import CAP, SHIFT, TEMP
from track_1_short import gpt2_vocab, schedule
from track_1_short.config import ConfigError, check_run, to_object
from track_1_short.model.config import ModelConfig, ModelConfigError
from track_1_short.model.layers import softcap, softcapped_cross_entropy_sum
from track_1_short.model.prefix_targets import NO_TARGET, prefix_table

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def table():
    return prefix_table(50304).tolist()


def longest_prefix_token(b: bytes, ids: dict[bytes, int]) -> int:
    """The definition, probed length by length: the longest b[:n], n < len(b), that is a token."""
    for n in range(len(b) - 1, 0, -1):
        if b[:n] in ids:
            return ids[b[:n]]
    return NO_TARGET


def test_every_entry_is_the_longest_proper_prefix_that_is_a_token(table):
    pieces = gpt2_vocab.token_bytes()
    ids = {b: i for i, b in enumerate(pieces) if i != gpt2_vocab.EOT_ID}
    # Every entry is a proper prefix of its token (all 50,257), and the longest one on a sample of 2,500.
    for i, p in enumerate(table[: gpt2_vocab.VOCAB_SIZE]):
        if p != NO_TARGET:
            assert len(pieces[p]) < len(pieces[i]) and pieces[i].startswith(pieces[p]), i
    for i in range(0, gpt2_vocab.VOCAB_SIZE - 1, 20):
        assert table[i] == longest_prefix_token(pieces[i], ids), (i, pieces[i])
    assert sum(p != NO_TARGET for p in table) > 40000  # most tokens have one: a table of -1s would pass above


def test_hand_picked_entries(table):
    enc = gpt2_vocab.encoding()
    tok = enc.encode_single_token
    assert table[tok(b" entirely")] == tok(b" entire")
    assert table[tok(b" newfound")] == tok(b" new")  # " newf", " newfo", " newfou", " newfoun" are no tokens
    assert table[tok(b" the")] == tok(b" th")
    # Single bytes have no proper prefix; neither have the end-of-text token nor the padded rows.
    assert all(table[tok(bytes([c]))] == NO_TARGET for c in (ord("a"), ord(" "), 0xFF))
    assert table[gpt2_vocab.EOT_ID] == NO_TARGET
    assert set(table[gpt2_vocab.VOCAB_SIZE :]) == {NO_TARGET} and len(table) == 50304


def _case(dtype, seed=0, t=24, d=16, v=64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 2).to(dtype)
    w = (torch.randn(d, v, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, v, (t,), generator=g)
    prefix = torch.randint(-1, v, (t,), generator=g)
    prefix[:4] = NO_TARGET
    prefix[5], prefix[6] = targets[5], targets[8]  # the prefix column is also an MTP target of the row
    return x, w, targets, prefix


def _run(x, w, targets, mtp, impl, chunk=8, **kw):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = softcapped_cross_entropy_sum(xx, ww, targets, mtp, CAP, SHIFT, TEMP, chunk, impl, **kw)
    loss.backward()
    return loss.detach(), xx.grad, ww.grad


IMPLS = ["reference", "fused"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_zero_is_the_loss_without_the_term_bitwise(impl, dtype):
    x, w, targets, prefix = _case(dtype)
    plain = _run(x, w, targets, [1.0, 0.5, 0.25], impl)
    zero = _run(x, w, targets, [1.0, 0.5, 0.25], impl, prefix_targets=prefix, prefix_weight=torch.zeros(1))
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    weighted = _run(x, w, targets, [1.0, 0.5, 0.25], impl, prefix_targets=prefix, prefix_weight=0.3)
    assert not torch.equal(weighted[0], plain[0]) and not torch.equal(weighted[2], plain[2])


@pytest.mark.parametrize("impl", IMPLS)
def test_the_term_is_weighted_ce_against_the_prefix_target_with_its_gradient(impl):
    # One MTP target, so the normaliser weight of a row is exactly 1 + (prefix weight where it has a target)
    # and the op's gradient is the gradient of the restated loss. fp32 throughout.
    x, w, targets, prefix = _case(torch.float32, seed=1)
    got = _run(x, w, targets, [1.0], impl, prefix_targets=prefix, prefix_weight=0.3)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = softcap(xx @ ww, CAP, SHIFT, TEMP)
    loss = F.cross_entropy(z, targets, reduction="sum") + 0.3 * F.cross_entropy(
        z, prefix, ignore_index=NO_TARGET, reduction="sum"
    )
    loss.backward()
    # fp32 sums of ~30 terms of O(10) and a softcap formed in another order: a few fp32 ulps of the total.
    torch.testing.assert_close(got[0], loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], xx.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], ww.grad, rtol=1e-4, atol=1e-5)


def assert_gemm_grads_close(got, ref, x, w):
    """dx = g W^T and dW = x^T g from logit gradients g that agree to 1e-6 x cap/temp per element (the bound
    of tests/perf/test_softcapped_ce.py: the same fp32 formula with sum_e in another order): each GEMM output
    carries that times the sum of the |other operand| entries it reads, plus its own fp32 rounding."""
    per_g = 1e-6 * CAP / TEMP
    bound_x = per_g * w.abs().sum(1)[None, :] + 1e-6 * ref[1].abs()
    bound_w = per_g * x.abs().sum(0)[:, None] + 1e-6 * ref[2].abs()
    assert torch.all((got[1] - ref[1]).abs() <= bound_x)
    assert torch.all((got[2] - ref[2]).abs() <= bound_w)


def test_fused_matches_the_reference_with_the_prefix_term():
    # fp32 logits: both paths compute the same fp32 expressions, the kernel's row sum as a tree (an fp32 ulp
    # or two of each row's lse) and a column shared by a target and the prefix summed in another order.
    x, w, targets, prefix = _case(torch.float32, seed=2)
    ref = _run(x, w, targets, [1.0, 0.5], "reference", prefix_targets=prefix, prefix_weight=0.25)
    fused = _run(x, w, targets, [1.0, 0.5], "fused", prefix_targets=prefix, prefix_weight=0.25)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=0)
    assert_gemm_grads_close(fused, ref, x, w)


# -- schedule --


def _load_schedule(name):
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=[f"schedule={name}"])
    return to_object(cfg).schedule


def expected_record_weight(step, starts):
    """The record's prefix weight, from its definition: 0.25 in stage 0, 0.20/0.15/0.10/0.05 over the
    quarters of stage 1, 0 from stage 2 on."""
    s1, s2 = starts[1], starts[2]
    if step < s1:
        return 0.25
    if step < s2:
        return (0.20, 0.15, 0.10, 0.05)[(step - s1) * 4 // (s2 - s1)]
    return 0.0


@pytest.mark.parametrize("name", ["track1", "track1_1gpu"])
def test_record_presets_plan_the_records_prefix_weight_at_every_step(name):
    cfg = _load_schedule(name)
    starts = schedule.stage_starts(cfg)
    got = [schedule.plan(cfg, s, 2).prefix_weight for s in range(schedule.total_steps(cfg))]
    assert got == [expected_record_weight(s, starts) for s in range(len(got))]
    assert set(got[starts[2] :]) == {0.0}  # stage 2 on: no prefix term


def test_record_schedule_quarter_boundaries_by_hand():
    cfg = _load_schedule("track1")  # stage 1 is steps 320..680 (361 steps): quarters start 320, 411, 501, 591
    w = {
        s: schedule.plan(cfg, s, 2).prefix_weight for s in (319, 320, 410, 411, 500, 501, 590, 591, 680, 681)
    }
    assert w == {319: 0.25, 320: 0.20, 410: 0.20, 411: 0.15, 500: 0.15, 501: 0.10, 590: 0.10, 591: 0.05,
                 680: 0.05, 681: 0.0}  # fmt: skip


# -- guards --


def test_a_nonzero_prefix_weight_on_a_vocabulary_that_is_not_gpt2s_is_one_clear_error():
    # The default experiment's synthetic corpus has a compact 2,176-id vocabulary.
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = to_object(compose("train", overrides=["schedule=track1"]))
    with pytest.raises(
        ConfigError, match=r"prefix_weights is nonzero, but data.vocab_size=2176 is not GPT-2's"
    ):
        check_run(cfg, 1)


def test_the_model_refuses_a_prefix_table_for_another_vocabulary():
    with pytest.raises(
        ModelConfigError, match=r"prefix_targets=true maps GPT-2's token ids, but vocab_size=2176"
    ):
        ModelConfig(vocab_size=2176, prefix_targets=True)


# -- the model --


def test_the_models_training_loss_scores_the_prefix_of_the_next_token_and_weight_zero_changes_nothing():
    from tests.model.conftest import load_config, packed_batch
    from track_1_short.model.gpt import GPT

    torch.manual_seed(5)
    model = GPT(load_config("tiny", compute_dtype="float32", prefix_targets=True))
    inputs, targets, cu = packed_batch([100, 60])
    assert torch.equal(model.prefix_table, prefix_table(model.topo.vocab_padded))

    def loss_and_grads(**kw):
        model.zero_grad()
        loss = model(inputs, targets, cu, (1, 2), [1.0, 0.5], **kw)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = loss_and_grads()
    zero = loss_and_grads(prefix_weight=torch.zeros(1))
    assert len(zero) == len(plain) > 10 and all(torch.equal(a, b) for a, b in zip(plain, zero))
    # A nonzero weight adds weight x CE against prefix(next token) where there is one.
    with torch.no_grad():
        hidden = model.hidden(inputs, cu, (1, 2))
        z = softcap(hidden @ model.lm_head.float(), CAP, SHIFT, TEMP)
        prefix_ce = F.cross_entropy(z, model.prefix_table[targets], ignore_index=NO_TARGET, reduction="sum")
    weighted = loss_and_grads(prefix_weight=0.5)
    assert (model.prefix_table[targets] >= 0).sum() > 100  # GPT-2 ids: most tokens have a prefix token
    # The difference of two fp32 totals of ~2,600 carries a few of their ulps (2.4e-4 each): far below 1e-4 of
    # the ~700 term, while a term scored against the wrong targets would be off by tens.
    torch.testing.assert_close(weighted[0] - plain[0], 0.5 * prefix_ce, rtol=1e-4, atol=0)
