"""value_embeds on upstream's n-gram cadence (training.py value_embed_betas_and_wd_mul and
ngram_table.is_update_step at 55865738): odd steps until 336, then steps = 3 mod 4, with squared betas and
wd_mul 10 from 336."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim import fake_model as fm
from tests.optim.test_anvil import lr_multiplier, snapshot
from track_1_short.optim import adam as reference_adam
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig, value_embed_cadence

UPSTREAM_PERIOD4_START = 336  # NGRAM_ADAM_PERIOD4_START


def upstream_is_update_step(step: int) -> bool:
    if step >= UPSTREAM_PERIOD4_START:
        return step % 4 == 3
    return step % 2 == 1


def upstream_betas_and_wd_mul(step: int):
    if step >= UPSTREAM_PERIOD4_START:
        return (0.75**2, 0.95**2), 10.0
    return (0.75, 0.95), 5.0


def test_cadence_betas_and_wd_mul_are_upstreams_at_every_step_of_the_record():
    cfg = OptimConfig()  # the record's: adam_every 2, value_embed_period4_start 336
    for step in range(1194):
        due, betas, wd_mul = value_embed_cadence(cfg, step, (0.75, 0.95), 5.0)
        updates = due and step % cfg.adam_every == cfg.adam_every - 1
        assert updates == upstream_is_update_step(step), step
        assert (betas, wd_mul) == upstream_betas_and_wd_mul(step), step
    assert upstream_betas_and_wd_mul(336) == ((0.5625, 0.9025), 10.0)  # the numbers, to the bit


def test_off_switch_updates_value_embeds_on_every_adam_step():
    cfg = OptimConfig(value_embed_period4_start=-1)
    assert all(
        value_embed_cadence(cfg, s, (0.75, 0.95), 5.0) == (True, (0.75, 0.95), 5.0) for s in range(800)
    )


@pytest.mark.parametrize("start", [-2, 6, 3])
def test_a_start_off_the_long_cycle_is_refused(start):
    with pytest.raises(ValueError, match="value_embed_period4_start"):
        OptimConfig(value_embed_period4_start=start)


def test_after_the_start_value_embeds_sums_four_steps_and_updates_with_squared_betas_and_doubled_decay():
    start, steps = 4, 12
    named = fm.make_params()
    init = snapshot(named)
    cfg = OptimConfig(replicated_impl="reference", rail_engage_step=3, value_embed_period4_start=start)
    opt = AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, cfg)
    ve = dict((p.label, p) for _, p in named)["value_embeds"]
    moved_at, head_moved_at = [], []
    for s in range(steps):
        opt.set_schedule(lr_multiplier(s), 0.85, s)
        fm.accumulate(named, fm.rank_grads(s))
        before, head = ve.detach().clone(), snapshot(named)["lm_head"]
        opt.step(do_adam=s % 2 == 1)
        if not torch.equal(ve.detach(), before):
            moved_at.append(s)
        if not torch.equal(snapshot(named)["lm_head"], head):
            head_moved_at.append(s)
        if s in (5, 9):  # an Adam step inside a long cycle: value_embeds' gradient is still accumulating
            assert ve.grad is not None
    assert moved_at == [1, 3, 7, 11]
    assert head_moved_at == [1, 3, 5, 7, 9, 11]  # the other Adam parameters keep the short cadence

    # Reference: adam.py on the whole tensor, one update per event, fed the gradient summed since the last.
    table = opt.param_cfgs["value_embeds"]
    p = init["value_embeds"].clone()
    state = {"step": 0, "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    events = [(1, (0, 1)), (3, (2, 3)), (7, (4, 5, 6, 7)), (11, (8, 9, 10, 11))]
    for s, summed in events:
        g = fm.rank_grads(summed[0])["value_embeds"].clone()
        for k in summed[1:]:
            g += fm.rank_grads(k)["value_embeds"]
        event_cfg = copy.copy(table)
        event_cfg.lr = table.initial_lr * lr_multiplier(s)
        event_cfg.adam_betas, event_cfg.wd_mul = (
            ((0.75, 0.95), 5.0) if s < start else ((0.5625, 0.9025), 10.0)
        )
        reference_adam.adam_update_(p, g, state, event_cfg)
    assert torch.equal(ve.detach(), p)
    assert opt.states["value_embeds"]["step"] == 4
