"""The n-gram table's row-sparse Adam: its cadence, lazy decay against eager decay, and the Triton kernel
against the reference (under the interpreter on the CPU; ``gpu`` on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from track_1_short.model.config import NgramConfig
from track_1_short.model.ngram import NgramTable
from track_1_short.optim.anvil import OptimConfig
from track_1_short.optim.ngram_adam import NgramAdam, ngram_cadence

IMPLS = ["reference", "triton"]


def test_cadence_is_the_records():
    cfg, optim = NgramConfig(enabled=True), OptimConfig()
    due = [s for s in range(360) if ngram_cadence(optim, s, cfg)[0]]
    assert due == [s for s in range(336) if s % 2 == 1] + [339, 343, 347, 351, 355, 359]
    assert ngram_cadence(optim, 335, cfg)[1:] == (0.95, 5.0)
    beta2, wd_mul = ngram_cadence(optim, 339, cfg)[1:]
    assert beta2 == 0.95**2 and wd_mul == 10.0
    assert not ngram_cadence(optim, 337, cfg)[0]


def _state(rows: int, dim: int, impl: str, seed: int):
    cfg = NgramConfig(enabled=True, rows=rows, dim=dim, adam_impl=impl)
    table = NgramTable(cfg)
    g = torch.Generator().manual_seed(seed)
    table.shard.copy_(torch.randn(rows, dim, generator=g))
    return cfg, table, NgramAdam(table, cfg, OptimConfig(adam_weight_decay=0.5))


def _eager_event(p, v, grads_full, *, lr, beta2, wd_mul, grad_mul, event, optim):
    """One event over EVERY row, from the definition: untouched rows carry a zero gradient."""
    lr_eff = lr * 70.0
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    step_size = f32(lr_eff * math.sqrt(1.0 - beta2**event))
    eff_wd = f32(((lr_eff * lr_eff) * optim.adam_weight_decay) * wd_mul)
    ms = (grads_full * grads_full).mean(1)
    v_new = f32(beta2) * v + f32((1.0 - beta2) * grad_mul * grad_mul) * ms
    pf = p.float()
    u = (
        grads_full
        * f32(grad_mul)
        / (v_new.double().sqrt().float()[:, None] + f32(optim.adam_eps))
        * step_size
    )
    u = torch.where(u * pf > 0, u + eff_wd * pf, u)
    return (pf - u).to(p.dtype), v_new


@pytest.mark.parametrize("impl", IMPLS)
def test_lazy_decay_equals_eager_decay(impl):
    """Random touch patterns over 30 events with beta2 squared from event 12 (the cadence switch): rows
    touched often, rarely, only at the switch, and never; bitwise against decaying every row at every
    event."""
    rows, dim = 24, 8
    cfg, table, opt = _state(rows, dim, impl, seed=1)
    p, v = table.shard.clone(), torch.zeros(rows)
    g = torch.Generator().manual_seed(2)
    switch = 12
    for event in range(1, 31):
        beta2, wd_mul = (0.95, 5.0) if event < switch else (0.95**2, 10.0)
        touched = torch.rand(rows, generator=g) < torch.linspace(
            0.9, 0.0, rows
        )  # row 0 often, the last never
        touched[[20, 21]] = event in (switch, switch + 1)  # slept until the switch, then again
        touched[22] = event == 1  # once, then untouched for 29 events
        touched[23] = False
        ids = torch.nonzero(touched).flatten()
        grads = torch.randn(ids.numel(), dim, generator=g)
        full = torch.zeros(rows, dim)
        full[ids] = grads
        lr = 0.008 * (1.0 - event / 40)
        opt.update(ids, grads, lr=lr, beta2=beta2, wd_mul=wd_mul, grad_mul=0.5)
        p, v = _eager_event(
            p, v, full, lr=lr, beta2=beta2, wd_mul=wd_mul, grad_mul=0.5, event=event, optim=opt.optim_cfg
        )
        if event in (switch - 1, switch + 3, 30):
            assert torch.equal(table.shard, p)  # weights are current without any replay
    opt.bring_current()
    assert torch.equal(opt.exp_avg_sq, v)
    assert torch.equal(
        table.shard[23], _state(rows, dim, impl, seed=1)[1].shard[23]
    )  # never touched, never moved
    assert int(opt.last_event.min()) == 30


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernel_equals_reference(device):
    """Rows at different events, zero and huge gradients, weights of both signs: the kernel's bits."""
    rows, dim = 40, 50  # dim not a power of two: the kernel's masked lanes
    results = []
    for impl in IMPLS:
        cfg, table, opt = _state(rows, dim, impl, seed=3)
        table.shard = table.shard.to(device)
        opt.exp_avg_sq, opt.last_event = opt.exp_avg_sq.to(device), opt.last_event.to(device)
        opt.beta2_history = opt.beta2_history.to(device)
        table.device = torch.device(device)
        g = torch.Generator().manual_seed(4)
        for event in range(1, 9):
            ids = torch.randperm(rows, generator=g)[: 5 * event].sort().values.to(device)
            grads = torch.randn(ids.numel(), dim, generator=g) * torch.exp2(
                torch.randint(-20, 20, (ids.numel(), 1), generator=g)
            )
            grads[0] = 0.0
            opt.update(ids, grads.to(device), lr=0.01, beta2=0.95 if event < 5 else 0.9025, wd_mul=5.0)
        results.append((table.shard.cpu(), opt.exp_avg_sq.cpu(), opt.last_event.cpu()))
    for ref, got in zip(results[0], results[1]):
        assert torch.equal(
            ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref,
            got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
        )


def test_an_untouched_row_does_not_move_and_costs_nothing():
    cfg, table, opt = _state(16, 4, "reference", seed=5)
    before = table.shard.clone()
    for _ in range(5):
        opt.update(torch.tensor([0, 3]), torch.randn(2, 4), lr=0.01, beta2=0.95, wd_mul=5.0)
    assert torch.equal(table.shard[4:], before[4:])
    assert opt.last_event[4:].eq(0).all() and opt.exp_avg_sq[4:].eq(0).all()  # never visited
    assert not torch.equal(table.shard[:1], before[:1])
