"""The sampled softmax: the candidate set, the loss over it in both paths against the full loss and a plain
restatement, its schedule, and the evaluation forward that never samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from tests.model.test_layers import CAP, SHIFT, TEMP
from tests.model.test_prefix_targets import assert_gemm_grads_close
from track_1_short import schedule
from track_1_short.config import to_object
from track_1_short.model.layers import softcap, softcapped_cross_entropy_sum
from track_1_short.model.sampled_softmax import (
    NEGATIVE_STRIDE,
    candidate_set,
    candidates_for,
    sweep_offset,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
IMPLS = ["reference", "fused"]


def negatives_by_definition(targets: list[int], vocab: int, p: int, offset: int) -> list[int]:
    """The stride rule spelled out: walk j = offset, offset + 1, ... over j * stride mod V and keep the
    classes that are not targets, until the targets and the kept classes make p."""
    marked, kept, j = set(targets), [], offset
    while len(marked) + len(kept) < p:
        c = (j * NEGATIVE_STRIDE) % vocab
        if c not in marked and c not in kept:
            kept.append(c)
        j += 1
    return kept


@pytest.mark.parametrize("offset", [0, 7, 300])
def test_the_set_holds_every_target_and_the_sweeps_next_negatives_in_ascending_order(offset):
    g = torch.Generator().manual_seed(offset)
    vocab, p = 384, 160
    targets = torch.randint(0, vocab, (150,), generator=g)
    got = candidate_set(targets, vocab, p, torch.tensor(offset)).tolist()
    distinct = set(targets.tolist())
    assert 100 < len(distinct) < p  # room for a few dozen negatives
    assert len(got) == p and got == sorted(set(got))
    assert distinct <= set(got)
    assert set(got) - distinct == set(negatives_by_definition(targets.tolist(), vocab, p, offset))


def test_p_equal_to_the_vocabulary_is_every_column_in_order():
    targets = torch.tensor([5, 3, 3, 60, 17])
    assert torch.equal(candidate_set(targets, 64, 64, 9), torch.arange(64))


def test_micro_batches_and_ranks_start_the_sweep_at_staggered_offsets():
    vocab, p = 50304, 10240
    # Four micro batches of a step (two ranks x two): a quarter of the vocabulary apart; a step later, P on.
    offsets = [sweep_offset(3, g, 4, p, vocab) for g in range(4)]
    assert offsets == [(i * vocab // 4 + 3 * p) % vocab for i in range(4)]
    assert sweep_offset(4, 0, 4, p, vocab) - sweep_offset(3, 0, 4, p, vocab) == p
    # Different offsets draw different negatives for the same targets.
    targets = torch.arange(0, 2000, 3)
    a, b = (set(candidate_set(targets, vocab, p, o).tolist()) for o in offsets[:2])
    assert a != b and len(a & b) < p // 2


def test_candidates_scale_with_a_larger_micro_batch_and_become_the_full_softmax_at_the_vocabulary():
    assert candidates_for(10240, 49152, 49152, 50304) == 10240
    assert candidates_for(10240, 32768, 49152, 50304) == 10240  # never fewer than the schedule's
    # 65,536-token micro batches (record_1gpu): x 4/3, rounded up to a multiple of 128.
    assert candidates_for(10240, 65536, 49152, 50304) == 13696  # 13,653.3 -> 107 x 128
    assert candidates_for(24576, 65536, 49152, 50304) == 32768
    assert candidates_for(24576, 131072, 49152, 50304) == 0  # 65,536 >= V: the full softmax
    assert candidates_for(0, 65536, 49152, 50304) == 0


# -- the loss over the set --


def _case(dtype, seed=0, t=40, d=16, v=256):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 2).to(dtype)
    w = (torch.randn(d, v, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, v // 2, (t,), generator=g)  # targets in the lower half: negatives matter
    prefix = torch.randint(-1, v, (t,), generator=g)
    prefix[3] = targets[3]
    return x, w, targets, prefix


def _run(x, w, targets, mtp, impl, chunk=16, **kw):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = softcapped_cross_entropy_sum(xx, ww, targets, mtp, CAP, SHIFT, TEMP, chunk, impl, **kw)
    loss.backward()
    return loss.detach(), xx.grad, ww.grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_p_equal_to_v_is_the_full_loss_and_gradients_bitwise(impl, dtype):
    # Every column a candidate, in order: the same logits, targets and kernel, so the same bits.
    x, w, targets, prefix = _case(dtype)
    kw = dict(prefix_targets=prefix, prefix_weight=0.2)
    full = _run(x, w, targets, [1.0, 0.5, 0.25], impl, **kw)
    cand = candidate_set(targets, w.size(1), w.size(1), 0)
    sampled = _run(x, w, targets, [1.0, 0.5, 0.25], impl, candidates=cand, **kw)
    assert all(torch.equal(a, b) for a, b in zip(full, sampled))


def restated_sampled_loss(x, w, targets, prefix, cand, prefix_weight):
    """The sampled loss in plain PyTorch (one MTP target): softcapped logits of the candidates' columns only,
    CE against each target's position among them, plus the prefix weight x CE against the prefix target's
    position where it is a candidate (else nothing)."""
    z = softcap(x @ w[:, cand], CAP, SHIFT, TEMP)
    pos = {int(c): i for i, c in enumerate(cand)}
    t_pos = torch.tensor([pos[int(t)] for t in targets])
    p_pos = torch.tensor([pos.get(int(p), -1) if p >= 0 else -1 for p in prefix])
    ce = F.cross_entropy(z, t_pos, reduction="sum")
    return ce + prefix_weight * F.cross_entropy(z, p_pos, ignore_index=-1, reduction="sum")


@pytest.mark.parametrize("impl", IMPLS)
def test_p_below_v_equals_a_plain_restatement_over_the_same_set(impl):
    x, w, targets, prefix = _case(torch.float32, seed=1)
    cand = candidate_set(targets, w.size(1), 96, 11)
    dropped = [p for p in prefix.tolist() if p >= 0 and p not in set(cand.tolist())]
    assert dropped  # some prefix targets fall outside the set: the restatement drops them too
    got = _run(x, w, targets, [1.0], impl, candidates=cand, prefix_targets=prefix, prefix_weight=0.3)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = restated_sampled_loss(xx, ww, targets, prefix, cand, 0.3)
    loss.backward()
    # fp32: the same quantities summed in other orders (see assert_gemm_grads_close for the gradients).
    torch.testing.assert_close(got[0], loss.detach(), rtol=1e-5, atol=0)
    assert_gemm_grads_close(got, (loss.detach(), xx.grad, ww.grad), x, w)
    # lm_head's gradient: dense, exactly zero outside the set.
    outside = torch.ones(w.size(1), dtype=torch.bool)
    outside[cand] = False
    assert torch.all(got[2][:, outside] == 0) and torch.all(got[2][:, cand].abs().sum(0) > 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_mtp_targets_over_the_set_match_the_restated_loss(impl):
    x, w, targets, prefix = _case(torch.float32, seed=2)
    cand = candidate_set(targets, w.size(1), 96, 5)
    got = _run(x, w, targets, [1.0, 0.5, 0.25], impl, candidates=cand)
    z = softcap(x @ w[:, cand], CAP, SHIFT, TEMP)
    pos = torch.full((w.size(1),), -1, dtype=torch.int64)
    pos[cand] = torch.arange(cand.numel())
    t = x.size(0)
    mtp = [1.0, 0.5, 0.25]
    want = sum(
        wk * F.cross_entropy(z[: t - k], pos[targets[k:]], reduction="sum") for k, wk in enumerate(mtp)
    )
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=0)


def test_a_target_missing_from_the_set_is_refused():
    x, w, targets, _ = _case(torch.float32, seed=3)
    cand = candidate_set(targets, w.size(1), 96, 0)
    keep = cand[cand != targets[7]]
    cand = torch.cat([keep, torch.tensor([255])]).sort().values  # same size, one target swapped out
    with pytest.raises(ValueError, match=r"more distinct targets than its 96 candidates; raise the stage's"):
        _run(x, w, targets, [1.0], "reference", candidates=cand)
    many = torch.arange(200)  # 200 distinct targets cannot fit 96 candidates
    xx = torch.randn(200, 16)
    with pytest.raises(ValueError, match=r"more distinct targets than its 96 candidates"):
        softcapped_cross_entropy_sum(
            xx, w, many, [1.0], CAP, SHIFT, TEMP, 64, candidates=candidate_set(many, w.size(1), 96, 0)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_on_cuda_a_short_set_is_scored_without_a_device_assert(impl):
    # The GPU never waits on the check: the run goes on to CandidateSets.check's one-line stop (tested above).
    many = torch.arange(200, device="cuda")  # 200 distinct targets cannot fit 96 candidates
    x = torch.randn(200, 16, device="cuda")
    w = torch.randn(16, 256, device="cuda") * 0.5
    cand = candidate_set(many, 256, 96, 0)
    loss = softcapped_cross_entropy_sum(x, w, many, [1.0], CAP, SHIFT, TEMP, 64, impl, candidates=cand)
    assert bool(torch.isfinite(loss))  # the read synchronises: a device assert would raise here


# -- schedule --


def _load_schedule(name):
    with initialize_config_dir(str(CONFIGS), version_base=None):
        return to_object(compose("train", overrides=[f"schedule={name}"])).schedule


def test_record_schedule_plans_upstreams_candidate_counts_at_every_step():
    # Upstream's steps for the default 1194-step run: 10240 on 0-680, 14336 on 681-964, 24576 on 965-1106,
    # the full softmax from 1107 (its sampled_softmax.py docstring).
    cfg = _load_schedule("track1")
    got = [schedule.plan(cfg, s, 2).sampled_candidates for s in range(schedule.total_steps(cfg))]
    want = [10240] * 681 + [14336] * (965 - 681) + [24576] * (1107 - 965) + [0] * (1194 - 1107)
    assert got == want


def test_record_1gpu_schedule_ramps_over_the_thirds_of_its_stage_2():
    cfg = _load_schedule("track1_1gpu")  # stages of 40/40/40/8/6 steps: stage 2 is steps 80..119
    got = [schedule.plan(cfg, s, 2).sampled_candidates for s in range(schedule.total_steps(cfg))]
    assert got == [10240] * 80 + [14336] * 27 + [24576] * 13 + [0] * 14  # parts (s - 80) * 3 // 40


@pytest.mark.parametrize("name", ["track1", "track1_1gpu"])
def test_the_warmup_makes_every_candidate_count_of_every_stage(name):
    cfg = _load_schedule(name)
    key = lambda s: (schedule.plan(cfg, s, 2).sampled_candidates, schedule.stage_index(cfg, s))  # noqa: E731
    reached = {key(s) for s in range(schedule.total_steps(cfg))}
    warmed = {key(s) for s in schedule.warmup_steps(cfg, 2)}
    assert reached == warmed and len({p for p, _ in reached}) == 4


# -- evaluation --


@pytest.fixture(scope="module")
def tiny_model_and_batch():
    from tests.model.conftest import load_config, packed_batch
    from track_1_short.model.gpt import GPT

    torch.manual_seed(5)
    model = GPT(load_config("tiny", compute_dtype="float32"))
    return model, packed_batch([100, 60]), (1, 2)


def test_an_evaluation_forward_never_samples(tiny_model_and_batch):
    model, (inputs, targets, cu), windows = tiny_model_and_batch
    model.eval()
    with torch.no_grad():
        full = model(inputs, targets, cu, windows)
        cand = model.candidate_sets.build(targets, 256, 3)
        sampled_args = model(inputs, targets, cu, windows, None, None, cand)
        val = model.val_loss_sum(inputs, targets, cu, windows)
    assert torch.equal(full, sampled_args) and torch.equal(full, val)
    model.train()
    trained = model(inputs, targets, cu, windows, None, None, cand)
    assert not torch.equal(trained.detach(), full)  # the training forward does sample


def test_a_set_short_of_a_target_is_flagged_and_the_check_stops_with_one_line(tiny_model_and_batch):
    # The GPU's path: the set is built without a host sync, and the trainer's next device read stops the run.
    from track_1_short.model.config import ModelConfigError

    model, (inputs, targets, cu), _ = tiny_model_and_batch
    distinct = int(targets.unique().numel())
    sets = model.candidate_sets
    sets.build(targets, distinct, 0)
    sets.check()  # exactly enough: no error
    sets.build(targets, distinct - 1, 0)
    sets.build(targets, distinct, 5)  # a later good set does not clear the flag
    with pytest.raises(ModelConfigError, match="more distinct targets than its candidate count P"):
        sets.check()
    sets.check()  # read and cleared


# -- any world size, any number of micro batches --

MICROS, T_MICRO, D, V, P = 6, 32, 16, 256, 96


def _step_data():
    """One step's global batch: 6 micro batches of hidden states, targets and prefix targets, and lm_head."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(MICROS, T_MICRO, D, generator=g) * 2
    targets = torch.randint(0, V, (MICROS, T_MICRO), generator=g)
    prefix = torch.randint(-1, V, (MICROS, T_MICRO), generator=g)
    w = torch.randn(D, V, generator=g) * 0.5
    return x, targets, prefix, w


def _trainer_offset(rank, world, step, micro, accum):
    from types import SimpleNamespace

    from track_1_short.trainer import Trainer

    model = SimpleNamespace(topo=SimpleNamespace(vocab_padded=V))
    fake = SimpleNamespace(rank=rank, world=world, device="cpu", model=model)
    return Trainer._sweep_offset(fake, step, micro, accum, P)


def sampled_step_worker(rank, world, step):
    """This rank's micro batches of the step (the trainer's split: rank r holds micro batches r * accum ..),
    each over the candidate set of its global index, the lm_head gradient summed over ranks."""
    from track_1_short import distributed

    x, targets, prefix, w = _step_data()
    accum = MICROS // world
    w = w.clone().requires_grad_()
    loss_sum = torch.zeros(())
    for m in range(accum):
        gi = rank * accum + m
        # The trainer's own offset of this rank's micro batch m (uploaded as a tensor, as it is there).
        cand = candidate_set(targets[gi], V, P, _trainer_offset(rank, world, step, m, accum))
        loss = softcapped_cross_entropy_sum(
            x[gi],
            w,
            targets[gi],
            [1.0, 0.5],
            CAP,
            SHIFT,
            TEMP,
            16,
            prefix_targets=prefix[gi],
            prefix_weight=0.2,
            candidates=cand,
        )
        loss.backward()
        loss_sum += loss.detach()
    distributed.all_reduce_sum(w.grad)
    distributed.all_reduce_sum(loss_sum)
    return loss_sum, w.grad


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_two_and_three_gloo_ranks_with_several_micro_batches_equal_one_rank(world):
    from tests.distributed_harness import run_ranks

    one_loss, one_grad = sampled_step_worker_alone(step=4)
    results = run_ranks(sampled_step_worker, world, 4)
    # Each micro batch's loss and gradient are the same bits on every layout (its candidate set depends on
    # its global index only); only the order of the fp32 sums over 6 micro batches differs: each partial sum
    # rounds once, so the difference stays within 6 fp32 ulps of the sum of the magnitudes.
    per_micro = per_micro_grads(step=4)
    bound = 6 * 2.0**-23 * per_micro.abs().sum(0)
    for loss, grad in results:
        torch.testing.assert_close(loss, one_loss, rtol=6 * 2.0**-23, atol=0)
        assert torch.all((grad - one_grad).abs() <= bound)
    assert not torch.equal(per_micro[0], per_micro[1])  # the micro batches really differ


def sampled_step_worker_alone(step):
    """World size 1: the same step as one rank with all 6 micro batches, without a process group."""
    x, targets, prefix, w = _step_data()
    grads = per_micro_grads(step)
    losses = []
    for gi in range(MICROS):
        cand = candidate_set(targets[gi], V, P, sweep_offset(step, gi, MICROS, P, V))
        with torch.no_grad():
            losses.append(_micro_loss(x[gi], w, targets[gi], prefix[gi], cand))
    total = torch.zeros(())
    for loss in losses:
        total += loss
    grad = torch.zeros_like(w)
    for g in grads:
        grad += g
    return total, grad


def _micro_loss(x, w, targets, prefix, cand):
    return softcapped_cross_entropy_sum(
        x,
        w,
        targets,
        [1.0, 0.5],
        CAP,
        SHIFT,
        TEMP,
        16,
        prefix_targets=prefix,
        prefix_weight=0.2,
        candidates=cand,
    )


def per_micro_grads(step):
    x, targets, prefix, w = _step_data()
    out = []
    for gi in range(MICROS):
        ww = w.clone().requires_grad_()
        cand = candidate_set(targets[gi], V, P, sweep_offset(step, gi, MICROS, P, V))
        _micro_loss(x[gi], ww, targets[gi], prefix[gi], cand).backward()
        out.append(ww.grad)
    return torch.stack(out)
