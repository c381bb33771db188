"""The n-gram table's optimizer: row-sparse Adam with beta1 = 0 and one fp32 second moment per row.

With e the update (event) count after incrementing it, g a touched row's gradient (fp32, summed over ranks),
ms its mean square over the row, and lr the Adam base lr times the schedule:

    lr'       = lr * ngram.lr_mul
    step_size = lr' * sqrt(1 - beta2^e)                 Python doubles, rounded once to fp32 (no beta1 term)
    eff_wd    = lr' * lr' * weight_decay * wd_mul        as every Adam of the project (optim/adam.py)
    v = beta2 * v + sq_mul * ms,   sq_mul = (1 - beta2) * grad_mul^2
    u = (g * grad_mul) / (sqrt(v) + eps) * step_size     grad_mul = 1 / world: the ranks' average
    u = u + eff_wd * p   where u * p > 0                 cautious decay
    p = p - u                                            bf16, round to nearest even

beta2 and wd_mul follow value_embeds' cadence (optim/anvil.py ``value_embed_cadence``): updates on Adam steps,
from optim.value_embed_period4_start every other one, then with beta2 squared and wd_mul doubled.

Lazy decay: an untouched row has g = 0, so u = 0, the cautious decay (gated on u * p > 0) is 0 and p does not
move; only its v owes each event's beta2. Each row records the event its v is current to, a history keeps
every event's beta2, and the next update of the row first multiplies v by the missed events' beta2 in event
order, the eager decay's multiplies in the eager order: the same bits as decaying every row at every event
(beta2 * v + sq_mul * 0 is beta2 * v exactly). So an update costs only the rows it touches.

``model.ngram.adam_impl``: "reference" (torch ops, here) or "triton" (one program per row,
track_1_short/perf/kernels/ngram_adam.py); the same bits (tests/optim/test_ngram_adam.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from track_1_short.model.config import NgramConfig
from track_1_short.model.ngram import NgramTable
from track_1_short.optim.adam import _sqrt_rn
from track_1_short.optim.anvil import value_embed_cadence


def ngram_cadence(optim_cfg, step: int, cfg: NgramConfig) -> tuple[bool, float, float]:
    """(the table updates at the end of ``step``, beta2, wd_mul): Adam steps, thinned and retuned as
    value_embeds' from optim.value_embed_period4_start."""
    adam_step = step % optim_cfg.adam_every == optim_cfg.adam_every - 1
    due, betas, wd_mul = value_embed_cadence(optim_cfg, step, (0.0, cfg.beta2), cfg.wd_mul)
    return adam_step and due, betas[1], wd_mul


def row_mean_sq(grads: Tensor) -> Tensor:
    """Each row's mean square fp32 [N] of gradients fp32 [N, dim]: what the second moment takes in. NaN or inf
    in a row (or a finite row whose squares overflow fp32) makes it non-finite, so it also serves as the
    update's finiteness check at 1/dim of the gradient's size."""
    return (grads * grads).mean(1)


def _f32(x: float, device) -> Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


class NgramAdam:
    """Adam state of one rank's shard: ``exp_avg_sq`` fp32 [rows], ``last_event`` int32 [rows] (the event each
    row's second moment is current to), ``beta2_history`` (entry e: event e's beta2) and ``events``."""

    def __init__(self, table: NgramTable, cfg: NgramConfig, optim_cfg) -> None:
        self.table, self.cfg, self.optim_cfg = table, cfg, optim_cfg
        rows, device = table.per_rank, table.device
        self.exp_avg_sq = torch.zeros(rows, dtype=torch.float32, device=device)
        self.last_event = torch.zeros(rows, dtype=torch.int32, device=device)
        self.beta2_history = torch.zeros(64, dtype=torch.float32, device=device)
        self.events = 0

    def reset(self) -> None:
        """The initial state, in place (the post-warmup reset)."""
        self.exp_avg_sq.zero_()
        self.last_event.zero_()
        self.beta2_history.zero_()
        self.events = 0

    def due(self, step: int) -> bool:
        return ngram_cadence(self.optim_cfg, step, self.cfg)[0]

    @torch.no_grad()
    def step(self, step: int, lr_multiplier: float) -> None:
        """Collective, at the end of a step where :meth:`due`: return the cycle's row gradients to their
        owners and update those rows."""
        due, beta2, wd_mul = ngram_cadence(self.optim_cfg, step, self.cfg)
        if not due:
            raise RuntimeError(f"NgramAdam.step: step {step} is not an update step of the n-gram table.")
        rows, grads = self.table.row_grads()
        self.update(rows, grads, lr=self.optim_cfg.adam_lr * lr_multiplier, beta2=beta2, wd_mul=wd_mul)

    @torch.no_grad()
    def update(
        self,
        rows: Tensor,
        grads: Tensor,
        *,
        lr: float,
        beta2: float,
        wd_mul: float,
        grad_mul: float | None = None,
        mean_sq: Tensor | None = None,
    ) -> None:
        """One event over ``rows`` (unique local int64 [N]) with their summed gradients fp32 [N, dim];
        ``mean_sq``: :func:`row_mean_sq` of them if the caller has it already (it is not computed again)."""
        self.events += 1
        e = self.events
        if e >= self.beta2_history.numel():  # grows by doubling: a run's event count is not known here
            grown = torch.zeros(2 * e, dtype=torch.float32, device=self.beta2_history.device)
            grown[: self.beta2_history.numel()] = self.beta2_history
            self.beta2_history = grown
        self.beta2_history[e] = beta2
        grad_mul = 1.0 / self.table.world if grad_mul is None else grad_mul
        lr_eff = lr * self.cfg.lr_mul
        scalars = dict(
            beta2=beta2,
            sq_mul=(1.0 - beta2) * grad_mul * grad_mul,
            grad_mul=grad_mul,
            eps=self.optim_cfg.adam_eps,
            step_size=lr_eff * math.sqrt(1.0 - beta2**e),
            eff_wd=((lr_eff * lr_eff) * self.optim_cfg.adam_weight_decay) * wd_mul,
        )
        if rows.numel() == 0:
            return
        grads = grads.float().contiguous()
        if mean_sq is None:
            mean_sq = row_mean_sq(grads)
        state = (self.table.shard, self.exp_avg_sq, self.last_event, self.beta2_history)
        if self.cfg.adam_impl == "triton":
            from track_1_short.perf.kernels.ngram_adam import update_rows_

            update_rows_(*state, rows, grads, mean_sq, e, **scalars)
        else:
            _update_reference(*state, rows, grads, mean_sq, e, **scalars)

    @torch.no_grad()
    def bring_current(self, rows: Tensor | None = None) -> None:
        """Replay the missed decays of ``rows`` (all rows if None) up to the last event: what eager decay
        would hold now (checkpoints and comparisons read it; the update does not need it)."""
        rows = torch.arange(self.last_event.numel(), device=self.last_event.device) if rows is None else rows
        v, last = self.exp_avg_sq[rows], self.last_event[rows]
        self.exp_avg_sq[rows] = _replay(v, last, self.beta2_history, self.events + 1)
        self.last_event[rows] = self.events


def _replay(v: Tensor, last: Tensor, history: Tensor, event: int) -> Tensor:
    """v of rows current to ``last`` decayed by the beta2 of events last + 1 .. event - 1, in event order."""
    if v.numel() == 0:
        return v
    for k in range(int(last.min()) + 1, event):
        v = torch.where(last < k, v * history[k], v)
    return v


def _update_reference(
    shard: Tensor,
    exp_avg_sq: Tensor,
    last_event: Tensor,
    beta2_history: Tensor,
    rows: Tensor,
    grads: Tensor,
    mean_sq: Tensor,
    event: int,
    *,
    beta2: float,
    sq_mul: float,
    grad_mul: float,
    eps: float,
    step_size: float,
    eff_wd: float,
) -> None:
    dev = shard.device
    beta2_t, sq_mul_t, grad_mul_t = _f32(beta2, dev), _f32(sq_mul, dev), _f32(grad_mul, dev)
    eps_t, step_t, wd_t = _f32(eps, dev), _f32(step_size, dev), _f32(eff_wd, dev)
    v = _replay(exp_avg_sq[rows], last_event[rows], beta2_history, event)
    v = beta2_t * v + sq_mul_t * mean_sq
    p = shard[rows].float()
    m = grads * grad_mul_t
    u = m / (_sqrt_rn(v)[:, None] + eps_t) * step_t
    u = torch.where(u * p > 0, u + wd_t * p, u)
    shard[rows] = (p - u).to(shard.dtype)
    exp_avg_sq[rows] = v
    last_event[rows] = event
