"""AnvilAndAdam: one optimizer for the whole model, owning every gradient collective and their order.

Three classes of parameters, named by the model's param table (:mod:`track_1_short.optim.param_config`):

- ANVIL banks (``optim="anvil"``, bf16 stacks of projection matrices): reduce_scatter matrix by matrix, each
  rank runs the ANVIL update on its chunk (:mod:`track_1_short.optim.anvil_bank`), all_gather. Every step.
- Sharded Adam (``optim="adam", comms="sharded"``: the embedding tables): reduce_scatter on dim 0, Adam on
  this rank's rows, all_gather. Adam steps only.
- Replicated Adam (the small tensors): all_reduce, every rank runs the full update; through the flat fused
  path (``OptimConfig.replicated_impl="fused"``, :class:`track_1_short.perf.replicated_adam.ReplicatedAdam`)
  or one all_reduce and one reference Adam call per parameter (``"reference"``). Adam steps only.

Adam runs on steps with ``step % adam_every == adam_every - 1``; on the other steps Adam gradients are left in
``.grad`` to accumulate, so an Adam update sees the sum of ``adam_every`` steps' gradients. Reductions average
over ranks (the loss is a per-rank sum or mean; either way the normalised updates absorb its scale).

``value_embeds`` follows upstream's n-gram cadence (``ngram_table.is_update_step``,
``training.value_embed_betas_and_wd_mul``): from ``OptimConfig.value_embed_period4_start`` (336) it updates
on every other Adam step only (steps = 3 mod 4 at adam_every 2), its gradient summing over the 4-step cycle,
and since one update then stands for two, both its betas are squared ((0.75, 0.95) -> (0.5625, 0.9025)) and
its wd_mul doubles (5 -> 10). Before that step it is an Adam parameter like any other. Upstream exchanges its
rows sparsely; here it is a dense sharded Adam tensor, with the same arithmetic on the rows that move.

``step(do_adam)`` issues its collectives in a fixed order (the communication schedule), the same on all ranks:

    Phase 0  (Adam steps) launch the replicated all_reduce(s)
    Phase 1  walking scatter_order: launch the async reduce_scatter of each sharded label due this step
    Phase 2  walking work_order: wait its reduce, update, launch its async all_gather; at the first replicated
             label, update every replicated parameter at once (with ``bank_streams``, each bank's update
             goes on its own stream, and the banks' gathers follow all of them, still in work order)
    Phase 3  wait the gathers; copy lm_head^T into a tied embed; clear the gradients just used

Dim 0 of sharded tensors (rows, or matrices of a bank) is padded to a multiple of the world size, so any world
size works. While ``embed`` is tied to ``lm_head`` (param table ``tied_to``), embed's gradient is added,
transposed, into lm_head's before the reduce, embed is not optimised, and after lm_head's update embed is set
to lm_head^T; ``split_embed()`` unties them, giving embed lm_head's moments, transposed.

Provenance: the scatter/work-order design, ANVIL and the Adam arithmetic are those of the upstream track-1
record "#360 (ANVIL2)" (modded-nanogpt ``track_1_short/optim/anvil.py``: ``AnvilAndAdam``, ``NorMuonAndAdam``
before it). Differences: any world size (upstream: exactly 8), label-keyed world-size-portable state dicts
(upstream: id() keyed), CUDA graphs per bank opt-in (``bank_graphs``), no row-sparse value-embedding path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from track_1_short import distributed
from track_1_short.optim import adam as reference_adam
from track_1_short.optim.anvil_bank import (
    AnvilBank,
    bank_update_,
    scalar_row,
    scalars_size,
    triton_bank_update_,
)
from track_1_short.optim.param_config import (
    ParamConfig,
    ParamTableError,
    build_param_configs,
    labelled_params,
)
from track_1_short.optim.polar_express import GRAMS
from track_1_short.optim.row_shards import RowShards

__all__ = [
    "AnvilAndAdam",
    "AnvilBank",
    "OptimConfig",
    "OptimizerStateError",
    "ParamConfig",
    "ParamTableError",
]

STATE_FORMAT = "anvil_adam/1"
"""Tag of the state_dict layout; load_state_dict refuses any other."""

REPLICATED_IMPLS = ("fused", "reference")
BANK_UPDATES = ("eager", "triton")
CASCADE_GRAMS = GRAMS


@dataclass
class OptimConfig:
    """Hyperparameters of AnvilAndAdam (the ``optim`` config group). Defaults: the upstream track-1 record."""

    adam_lr: float = 0.008
    """Adam's base lr (before the schedule multiplier and each parameter's lr_mul)."""
    adam_eps: float = 1e-10
    """Adam's epsilon, added to sqrt(v)."""
    adam_weight_decay: float = 0.005
    """Adam's base weight decay; the applied decay is (lr * lr_mul)^2 * weight_decay * wd_mul, cautious."""
    anvil_lr: float = 0.023
    """ANVIL's base lr (before the schedule multiplier, the shape factor and per-matrix multipliers)."""
    anvil_weight_decay: float = 2.25
    """ANVIL's base decay: per step the master shrinks by lr * wd_mul * weight_decay * eff_lr, if aligned."""
    anvil_momentum: float = 0.95
    """ANVIL's Nesterov lookahead until the first set_schedule() (which sets it to the rail beta)."""
    anvil_beta2: float = 0.9
    """Decay of ANVIL's per-lane energy EMA (the lane equaliser)."""
    slow_rail_beta: float = 0.98
    """Beta of ANVIL's slow momentum rail, which also gates the decay by its sign."""
    rail_engage_step: int = 514
    """From this step on, the fast rail runs at engaged_fast_beta and is blended with the slow rail."""
    engaged_fast_beta: float = 0.85
    """Fast-rail beta once the rails are engaged (before: the scheduled rail beta)."""
    engaged_fast_weight: float = 0.4385
    """Weight of the fast rail in the blend once engaged (before: 1.0, the fast rail alone)."""
    frobenius_margin: float = 1.05
    """The cascade divides by margin * ||X||_F; its maps are derived for 1.05."""
    replicated_impl: str = "fused"
    """Replicated Adam: "fused" (flat buffers, one all_reduce and one Triton launch per dtype:
    track_1_short/perf/replicated_adam.py) or "reference" (per-parameter all_reduce and Adam step,
    optim/adam.py). Both give the same parameters, bitwise (tests/optim/test_anvil.py). Figure:
    perf/RESULTS.md, "Replicated Adam"."""
    replicated_graphs: bool = True
    """On CUDA, replay the fused replicated Adam step (the table's upload and each dtype's kernel) as one CUDA
    graph (perf/replicated_adam_graphs.py). A graph is trusted only after one replay matched the eager step
    bit for bit, so the parameters are the same either way; false launches every kernel from Python."""
    bank_update: str = "eager"
    """How each ANVIL bank's update runs: "eager" (op by op, track_1_short/optim/anvil_bank.py, the reference)
    or "triton" (the phases outside the cascade as three Triton kernels:
    track_1_short/perf/kernels/anvil_bank.py), the rails bitwise eager and the step within fp32 summation
    bounds (tests/perf/test_anvil_bank_triton.py). "triton" needs CUDA, or Triton's interpreter on the CPU.
    The record presets use it. Figure: perf/RESULTS.md, "Optimizer step"."""
    cascade_gram: str = "bmm"
    """How the cascade's products run (track_1_short/optim/polar_express.py): "bmm" (torch bmm/baddbmm, the
    reference), "squared" (the application a X + X B folded into X (a I + B) and b A + c A A computed as the
    square of the shifted Gram, so that no baddbmm copies X or A) or "gram_space" (the rounds on the fp16
    Gram matrix, X formed again every two rounds, on the banks where it pays; "squared" on the others). The
    routes agree within rounding, their spectra in the same band (tests/optim/test_polar_express.py). The
    record presets use "gram_space". Figure: perf/RESULTS.md, "Optimizer step"."""
    bank_graphs: bool = False
    """Capture each bank's update (whichever ``bank_update``) in a CUDA graph on its first step and replay it
    afterwards: one launch a bank instead of 25 to 100 from Python (track_1_short/perf/bank_graphs.py). The
    graph is kept only if its bits equal the eager run's (tests/perf/test_bank_graphs.py). CUDA only; on in
    the one-GPU preset. Figure: perf/RESULTS.md, "Train step"."""
    bank_streams: bool = False
    """Run each bank's update on a CUDA stream of its own, all launched before any is waited for
    (track_1_short/perf/bank_streams.py); the gathers follow once every update is done. Bitwise the serial
    order (tests/perf/test_bank_streams.py). CUDA only; on in the one-GPU preset, off in the 8-GPU one until
    measured there. Figure: perf/RESULTS.md, "Train step"."""
    adam_every: int = 2
    """Adam updates on steps with step % adam_every == adam_every - 1 (upstream: odd steps)."""
    value_embed_period4_start: int = 336
    """From this step the label value_embeds updates every 2 * adam_every steps (step % (2 adam_every) ==
    2 adam_every - 1), its gradient accumulating over the cycle, with squared betas and doubled wd_mul
    (upstream NGRAM_ADAM_PERIOD4_START = 336); -1 = on every Adam step throughout. A multiple of
    2 * adam_every, so the last short cycle is followed by whole long ones."""

    def __post_init__(self) -> None:
        validate_optim_config(self)


def validate_optim_config(cfg) -> None:
    """Raise ValueError naming the ``optim.*`` field and the fix (works on OptimConfig or a DictConfig)."""
    for name in ("adam_lr", "adam_weight_decay", "anvil_lr", "anvil_weight_decay"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"optim.{name}={value} must be a finite number >= 0.")
    if not cfg.adam_eps > 0:
        raise ValueError(f"optim.adam_eps={cfg.adam_eps} must be > 0.")
    for name in (
        "anvil_momentum",
        "anvil_beta2",
        "slow_rail_beta",
        "engaged_fast_beta",
        "engaged_fast_weight",
    ):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"optim.{name}={value} must lie in [0, 1].")
    if not cfg.frobenius_margin > 1.0:
        raise ValueError(f"optim.frobenius_margin={cfg.frobenius_margin} must be > 1 (the maps need it).")
    if cfg.replicated_impl not in REPLICATED_IMPLS:
        raise ValueError(
            f"optim.replicated_impl={cfg.replicated_impl!r} must be one of {list(REPLICATED_IMPLS)}."
        )
    if cfg.bank_update not in BANK_UPDATES:
        raise ValueError(f"optim.bank_update={cfg.bank_update!r} must be one of {list(BANK_UPDATES)}.")
    if not isinstance(cfg.replicated_graphs, bool):
        raise ValueError(f"optim.replicated_graphs={cfg.replicated_graphs!r} must be true or false.")
    if not isinstance(cfg.bank_graphs, bool):
        raise ValueError(f"optim.bank_graphs={cfg.bank_graphs!r} must be true or false.")
    if not isinstance(cfg.bank_streams, bool):
        raise ValueError(f"optim.bank_streams={cfg.bank_streams!r} must be true or false.")
    if cfg.cascade_gram not in CASCADE_GRAMS:
        raise ValueError(f"optim.cascade_gram={cfg.cascade_gram!r} must be one of {list(CASCADE_GRAMS)}.")
    if cfg.adam_every < 1:
        raise ValueError(f"optim.adam_every={cfg.adam_every} must be >= 1 (1 = Adam on every step).")
    if cfg.rail_engage_step < 0:
        raise ValueError(f"optim.rail_engage_step={cfg.rail_engage_step} must be >= 0.")
    start, cycle = cfg.value_embed_period4_start, 2 * cfg.adam_every
    if start != -1 and (start < 0 or start % cycle):
        raise ValueError(
            f"optim.value_embed_period4_start={start} must be -1 (off) or a step >= 0 divisible by "
            f"2 * optim.adam_every = {cycle} (upstream 336)."
        )


def value_embed_cadence(cfg, step: int, betas, wd_mul: float) -> tuple[bool, tuple[float, float], float]:
    """(updates this step if it is an Adam step, betas, wd_mul) of value_embeds at ``step``, from its table
    betas and wd_mul: upstream's is_update_step and value_embed_betas_and_wd_mul."""
    start, cycle = cfg.value_embed_period4_start, 2 * cfg.adam_every
    if start < 0 or step < start:
        return True, (float(betas[0]), float(betas[1])), float(wd_mul)
    return step % cycle == cycle - 1, (float(betas[0]) ** 2, float(betas[1]) ** 2), 2.0 * float(wd_mul)


class OptimizerStateError(ValueError):
    """A state dict that does not belong to this optimizer's parameters; nothing was loaded."""


class AnvilAndAdam:
    """The model's optimizer: ANVIL for the banks, Adam (sharded or replicated) for everything else.

    ``named_params``: ``model.named_parameters()``, each parameter carrying a unique ``.label``;
    ``param_table``, ``scatter_order``, ``work_order``: from the model (see the module docstring);
    ``cfg``: :class:`OptimConfig`. The process group (if any) must exist already; every rank must build the
    optimizer with the same arguments and call every method in the same order.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        param_table: Mapping[str, Mapping],
        scatter_order: Iterable[str],
        work_order: Iterable[str],
        cfg: OptimConfig,
    ):
        validate_optim_config(cfg)
        self.cfg = cfg
        self.world, self.rank = distributed.world_size(), distributed.rank()
        self.params = labelled_params(named_params)
        self.scatter_order, self.work_order = list(scatter_order), list(work_order)
        self.param_cfgs = build_param_configs(
            self.params, param_table, self.scatter_order, self.work_order, cfg, self.world
        )
        devices = {p.device for p in self.params.values()}
        if len(devices) != 1:
            raise ParamTableError(
                f"parameters live on several devices {sorted(map(str, devices))}; move the model."
            )
        self.device = devices.pop()

        # Everything is checked; from here on, state is built.
        self.tie = next(((c.label, c.tied_to) for c in self.param_cfgs.values() if c.tied_to), None)
        self.tied = self.tie is not None
        self.shards: dict[str, RowShards] = {}
        self.banks: dict[str, AnvilBank] = {}
        self.states: dict[str, dict] = {}
        self.replicated_labels: list[str] = []
        bank_shards: dict[str, RowShards] = {}  # banks are built below, once their scalars have a home
        for label, p in self.params.items():
            c = self.param_cfgs[label]
            if c.comms == "replicated":
                self.replicated_labels.append(label)
                self.states[label] = self._new_adam_state(p.shape)
                continue
            full = self._sharded_view(label)
            shards = RowShards(tuple(full.shape), p.dtype, self.device, self.world, self.rank)
            self.shards[label] = shards
            if c.optim == "adam":
                self.states[label] = self._new_adam_state(shards.shard_shape)
            else:
                bank_shards[label] = shards
        self._bank_staging = None
        if bank_shards:
            from track_1_short.perf.bank_scalars import BankScalarStaging

            sizes = {label: scalars_size(shards.chunk) for label, shards in bank_shards.items()}
            self._bank_staging = BankScalarStaging(sizes, self.device)
        update_fn = None  # eager: AnvilBank's own bank_update_
        if bank_shards and cfg.bank_update == "triton":
            from track_1_short.perf.kernels.anvil_bank import check_device

            check_device(self.device, "optim.bank_update=triton")  # here, not at the first step
            update_fn = triton_bank_update_
        self._bank_streams = None
        if bank_shards and cfg.bank_streams:
            from track_1_short.perf.bank_streams import BankStreams

            self._bank_streams = BankStreams(bank_shards, self.device)  # refuses a non-CUDA device
        update_fns = dict.fromkeys(bank_shards, update_fn)
        if bank_shards and cfg.bank_graphs:
            from track_1_short.perf.bank_graphs import GraphedBankUpdate

            base = bank_update_ if update_fn is None else update_fn
            if self._bank_streams is None:
                # One wrapper for every bank: one capture stream and one memory pool, replayed in work order.
                shared = GraphedBankUpdate(base, self.device)
                update_fns = dict.fromkeys(bank_shards, shared)
            else:  # graphs replayed side by side must not share a pool (perf/bank_streams.py)
                update_fns = {label: GraphedBankUpdate(base, self.device) for label in bank_shards}
        for label, shards in bank_shards.items():
            c = self.param_cfgs[label]
            self.banks[label] = AnvilBank(
                label,
                shards.grad,
                shards.shard(self._sharded_view(label)),
                beta2=c.beta2,
                slow_beta=cfg.slow_rail_beta,
                margin=cfg.frobenius_margin,
                scalars=None if self._bank_staging is None else self._bank_staging.view(label),
                update_fn=update_fns[label],
                gram=cfg.cascade_gram,
            )
        self._fused = None
        if self.replicated_labels and cfg.replicated_impl == "fused":
            from track_1_short.perf.replicated_adam import ReplicatedAdam

            labels = self.replicated_labels
            self._fused = ReplicatedAdam(
                [self.params[k] for k in labels],
                [self.param_cfgs[k] for k in labels],
                [self.states[k] for k in labels],
                self.device,
                use_cuda_graphs=cfg.replicated_graphs,
            )
        # value_embeds' table betas and wd_mul, which set_schedule squares / doubles on the long cadence, and
        # the Adam labels whose update waits for a later Adam step (their gradient keeps accumulating).
        ve = self.param_cfgs.get("value_embeds")
        self._ve_table = (ve.adam_betas, ve.wd_mul) if ve is not None and ve.optim == "adam" else None
        self._deferred: frozenset[str] = frozenset()
        self._reference_reduces: list[tuple[str, distributed.Handle]] = []
        # Adam's (step_size, eff_wd) as two reused 0-D fp32 tensors: a compiled step never sees a new input.
        self._adam_scalar_buffers = reference_adam.new_scalar_buffers()
        self._addresses = self._current_addresses()
        self.set_schedule(1.0, cfg.anvil_momentum, 0)

    # -- construction helpers --
    def _new_adam_state(self, shape) -> dict:
        return {
            "step": 0,
            "exp_avg": torch.zeros(shape, dtype=torch.float32, device=self.device),
            "exp_avg_sq": torch.zeros(shape, dtype=torch.float32, device=self.device),
        }

    def _sharded_view(self, label: str) -> torch.Tensor:
        """The parameter's data as the tensor sharded on dim 0: the bank's [n, rows, cols] view, or itself."""
        p, c = self.params[label], self.param_cfgs[label]
        return p.data.view(c.reshape) if c.optim == "anvil" else p.data

    def _current_addresses(self) -> dict[tuple[str, str], int]:
        out = {}
        for label, bank in self.banks.items():
            for role, t in bank.tensors().items():
                out[(label, role)] = t.data_ptr()
        for label, state in self.states.items():
            for role in ("exp_avg", "exp_avg_sq"):
                out[(label, role)] = state[role].data_ptr()
        for label, shards in self.shards.items():
            if not shards.padded:
                out[(label, "param")] = self.params[label].data_ptr()
        return out

    # -- schedule --
    def set_schedule(self, lr_multiplier: float, rail_beta: float, step: int) -> None:
        """Set every lr to initial_lr * lr_multiplier and the ANVIL rails for training step ``step``."""
        if not (math.isfinite(lr_multiplier) and lr_multiplier >= 0):
            raise ValueError(f"set_schedule: lr_multiplier={lr_multiplier} must be a finite number >= 0.")
        if not 0.0 <= rail_beta <= 1.0:
            raise ValueError(f"set_schedule: rail_beta={rail_beta} must lie in [0, 1].")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"set_schedule: step={step!r} must be an int >= 0.")
        engaged = step >= self.cfg.rail_engage_step
        fast_beta = self.cfg.engaged_fast_beta if engaged else rail_beta
        fast_weight = self.cfg.engaged_fast_weight if engaged else 1.0
        for c in self.param_cfgs.values():
            c.lr = c.initial_lr * lr_multiplier
            if c.optim == "anvil":
                c.momentum = rail_beta
        if self._ve_table is not None:
            c = self.param_cfgs["value_embeds"]
            due, c.adam_betas, c.wd_mul = value_embed_cadence(self.cfg, step, *self._ve_table)
            self._deferred = frozenset() if due else frozenset({"value_embeds"})
        rows: dict[str, list[float]] = {}
        for label in self.banks:
            c, shards = self.param_cfgs[label], self.shards[label]
            mults = c.matrix_lr_mul or (1.0,) * c.reshape[0]
            # Matrices past the end (world padding) get 0: they never move.
            owned = [
                mults[j] if j < shards.rows else 0.0 for j in range(shards.start, shards.start + shards.chunk)
            ]
            values = dict(
                momentum=c.momentum,
                eff_wd=c.lr * c.wd_mul * c.weight_decay,
                fast_beta=fast_beta,
                fast_weight=fast_weight,
                eff_lr=[c.lr * c.lr_mul * m for m in owned],
            )
            rows[label] = scalar_row(**values)
        if self._bank_staging is not None:
            self._bank_staging.stage(rows)  # one upload for every bank (AnvilBank.stage: one per bank)

    # -- the step --
    def step(self, do_adam: bool) -> None:
        """Reduce, update and gather every parameter due this step (ANVIL always, Adam if ``do_adam``)."""
        do_adam = bool(do_adam)
        # Phase 0: the replicated reduce(s), launched first so they overlap everything below.
        if do_adam:
            self._launch_replicated_reduce()
        # Phase 1: reduce_scatters in scatter_order.
        reduces: dict[str, distributed.Handle] = {}
        for label in self.scatter_order:
            c, p = self.param_cfgs[label], self.params[label]
            if c.comms == "replicated" or (c.optim == "adam" and not do_adam) or p.grad is None:
                continue
            if label in self._deferred:
                continue  # its cycle is not over: the gradient keeps accumulating
            if self.tied and label == self.tie[0]:
                continue  # folded into lm_head's gradient below
            grad = p.grad
            if self.tied and label == self.tie[1]:
                embed_grad = self.params[self.tie[0]].grad
                if embed_grad is not None:
                    grad.add_(embed_grad.mT)
            if c.optim == "anvil":
                grad = grad.view(c.reshape)
            reduces[label] = self.shards[label].scatter_grad(grad)
        # Phase 2: wait, update, gather in work_order.
        gathers: list[tuple[str, distributed.Handle]] = []
        replicated_done = False
        for label in self.work_order:
            c = self.param_cfgs[label]
            if c.comms == "replicated":
                if do_adam and not replicated_done:
                    self._update_replicated()
                    replicated_done = True
                continue
            if label not in reduces:
                continue
            reduces.pop(label).wait()
            shards, full = self.shards[label], self._sharded_view(label)
            shards.load_shard(full)
            if c.optim == "anvil" and self._bank_streams is not None:
                self._bank_streams.launch(label, self.banks[label].update)
                continue  # its gather waits for the join below
            if c.optim == "anvil":
                self.banks[label].update()
            else:
                self._adam_shard_update(label)
            gathers.append((label, shards.gather(full)))
        if self._bank_streams is not None:
            # Every bank is launched: now the caller's stream waits for them, then gathers them (work order).
            for label in self._bank_streams.join():
                gathers.append((label, self.shards[label].gather(self._sharded_view(label))))
        # Phase 3: land the gathers, refresh a tied embed, clear the gradients that were used.
        for label, handle in gathers:
            handle.wait()
            self.shards[label].finish_gather(self._sharded_view(label))
        if self.tied and do_adam:
            embed, lm_head = (self.params[k] for k in self.tie)
            embed.data.copy_(lm_head.data.mT)
        # Every path leaves .grad to autograd, the replicated ones too: dropping it is the clear.
        for label, p in self.params.items():
            used = self.param_cfgs[label].optim == "anvil" or do_adam
            if used and label not in self._deferred:
                p.grad = None

    def zero_grad(self) -> None:
        """Drop every gradient (a skipped step): .grad = None."""
        for p in self.params.values():
            p.grad = None

    def _launch_replicated_reduce(self) -> None:
        if self._fused is not None:
            self._fused.launch_reduce()
            return
        self._reference_reduces = [
            (label, distributed.all_reduce_avg(self.params[label].grad, async_op=True))
            for label in self.replicated_labels
            if self.params[label].grad is not None
        ]

    def _update_replicated(self) -> None:
        if self._fused is not None:
            self._fused.update()
            return
        for label, handle in self._reference_reduces:
            handle.wait()
            p, state = self.params[label], self.states[label]
            self._adam_step(self.param_cfgs[label], p.data, p.grad, state)
        self._reference_reduces = []

    def _adam_shard_update(self, label: str) -> None:
        shards = self.shards[label]
        self._adam_step(
            self.param_cfgs[label], shards.shard(self.params[label].data), shards.grad, self.states[label]
        )

    def _adam_step(self, cfg: ParamConfig, param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        reference_adam.adam_update_(param, grad, state, cfg, self._adam_scalar_buffers)

    # -- tied embeddings --
    def split_embed(self) -> None:
        """Untie embed from lm_head: embed takes lm_head's moments, transposed, and is updated on its own.

        A collective (lm_head's moments are gathered). Call it on every rank at the same step."""
        if self.tie is None:
            raise ValueError("split_embed: no parameter of the param table is tied (no 'tied_to' entry).")
        if not self.tied:
            raise ValueError("split_embed: embed is already split from lm_head; split once per run.")
        embed_label, head_label = self.tie
        head_state, embed_state = self.states[head_label], self.states[embed_label]
        for key in ("exp_avg", "exp_avg_sq"):
            full = self.shards[head_label].gather_rows(head_state[key])  # [model_dim, vocab]
            embed_state[key].copy_(self.shards[embed_label].take_rows(full.mT))
        embed_state["step"] = head_state["step"]
        self.tied = False

    # -- state --
    def state_dict(self) -> dict:
        """Label-keyed optimizer state with every sharded tensor gathered whole (CPU copies): loads into any
        world size. It includes the Adam gradients accumulated since the last Adam step (rank-averaged), so a
        state saved between Adam steps resumes exactly. A collective: call it on every rank."""
        params = {}
        for label in self.params:
            c = self.param_cfgs[label]
            if c.optim == "adam":
                state = self.states[label]
                entry = {"optim": "adam", "step": int(state["step"])}
                for key in ("exp_avg", "exp_avg_sq"):
                    t = state[key]
                    if c.comms == "sharded":
                        t = self.shards[label].gather_rows(t)
                    entry[key] = t.detach().to("cpu", copy=True)
            else:
                bank, shards = self.banks[label], self.shards[label]
                entry = {"optim": "anvil"}
                entry["velocity"] = torch.stack(
                    [shards.gather_rows(bank.velocity[k]) for k in range(2)]
                ).cpu()
                entry["lane_energy"] = shards.gather_rows(bank.lane_energy).to("cpu", copy=True)
                entry["mantissa"] = shards.gather_rows(bank.mantissa).to("cpu", copy=True)
            params[label] = entry
        # Adam gradients still accumulating (saved between Adam steps), averaged over ranks: loaded on every
        # rank of any world size, the next reduce then averages to the same gradient as the uninterrupted
        # run's.
        pending = {}
        for label, p in self.params.items():
            if self.param_cfgs[label].optim == "adam" and p.grad is not None:
                grad = p.grad.detach().clone()
                distributed.all_reduce_avg(grad).wait()
                pending[label] = grad.cpu()
        return {"format": STATE_FORMAT, "tied": self.tied, "params": params, "pending_grads": pending}

    def _expected_state(self, label: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        c = self.param_cfgs[label]
        if c.optim == "adam":
            return {k: (c.shape, torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        n, rows, cols = c.reshape
        lanes = (n, rows, 1) if rows >= cols else (n, 1, cols)
        return {
            "velocity": ((2, n, rows, cols), torch.float32),
            "lane_energy": (lanes, torch.float32),
            "mantissa": ((n, rows, cols), torch.uint16),
        }

    def _check_state_dict(self, sd: object) -> None:
        def fail(msg: str) -> None:
            raise OptimizerStateError(f"load_state_dict: {msg} Load a state saved by this model's optimizer.")

        if (
            not isinstance(sd, Mapping)
            or sd.get("format") != STATE_FORMAT
            or not isinstance(sd.get("params"), dict)
        ):
            fail(f"not an AnvilAndAdam state dict of format {STATE_FORMAT!r}.")
        if not isinstance(sd.get("tied"), bool) or (sd["tied"] and self.tie is None):
            fail(
                f"'tied'={sd.get('tied')!r} does not fit this model (tied embedding: {self.tie is not None})."
            )
        pending = sd.get("pending_grads")
        if not isinstance(pending, Mapping):
            fail("'pending_grads' is missing.")
        for label, grad in pending.items():
            p = self.params.get(label)
            if p is None or self.param_cfgs[label].optim != "adam":
                fail(f"'pending_grads' holds {label!r}, which is not an Adam parameter of this model.")
            if not isinstance(grad, torch.Tensor) or grad.shape != p.shape or grad.dtype != p.dtype:
                got = (
                    (tuple(grad.shape), grad.dtype) if isinstance(grad, torch.Tensor) else type(grad).__name__
                )
                fail(f"pending gradient of {label!r} is {got}, expected shape {tuple(p.shape)} of {p.dtype}.")
        params = sd["params"]
        missing, unknown = sorted(set(self.params) - set(params)), sorted(set(params) - set(self.params))
        if missing or unknown:
            fail(f"labels differ from this model's: missing {missing}, unknown {unknown}.")
        for label in self.params:
            entry, c = params[label], self.param_cfgs[label]
            if not isinstance(entry, Mapping) or entry.get("optim") != c.optim:
                got = entry.get("optim") if isinstance(entry, Mapping) else entry
                fail(f"{label!r} was saved for optim={got!r}, this model's is {c.optim!r}.")
            if c.optim == "adam":
                step = entry.get("step")
                if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                    fail(f"{label!r}: step={step!r} must be an int >= 0.")
            for key, (shape, dtype) in self._expected_state(label).items():
                t = entry.get(key)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                    got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                    fail(f"{label!r}[{key!r}] is {got}, expected shape {shape} of {dtype}.")

    def load_state_dict(self, sd: Mapping) -> None:
        """Copy a :meth:`state_dict` (from any world size) into this optimizer's state in place.

        Everything is checked first; a foreign or mismatched state dict raises OptimizerStateError and loads
        nothing. Tensors keep their storage (flat-buffer views and captured addresses stay valid). Adam
        parameters' ``.grad`` become the saved pending gradients (None where none was pending), so load it
        after anything else that touches gradients."""
        self._check_state_dict(sd)
        for label, entry in sd["params"].items():
            c = self.param_cfgs[label]
            if c.optim == "adam":
                state = self.states[label]
                for key in ("exp_avg", "exp_avg_sq"):
                    src = entry[key].to(self.device)
                    if c.comms == "sharded":
                        src = self.shards[label].take_rows(src)
                    state[key].copy_(src)
                state["step"] = int(entry["step"])
            else:
                bank, shards = self.banks[label], self.shards[label]
                for k in range(2):
                    bank.velocity[k].copy_(shards.take_rows(entry["velocity"][k].to(self.device)))
                bank.lane_energy.copy_(shards.take_rows(entry["lane_energy"].to(self.device)))
                bank.mantissa.copy_(shards.take_rows(entry["mantissa"].to(self.device)))
        for label, p in self.params.items():
            if self.param_cfgs[label].optim != "adam":
                continue
            grad = sd["pending_grads"].get(label)
            if grad is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(grad)
            else:
                p.grad = grad.to(self.device, copy=True)
        self.tied = bool(sd["tied"])

    def reset(self) -> None:
        """Zero every bank's rails, lane energies and mantissas, re-tie embed; leave the Adam state alone."""
        for bank in self.banks.values():
            bank.reset()
        self.tied = self.tie is not None

    def assert_views_intact(self) -> None:
        """Raise RuntimeError naming the label if any parameter or state tensor was rebound since construction
        (a load or reset that rebinds instead of copying would silently detach the optimizer's buffers)."""
        if self._fused is not None:
            self._fused.assert_views_intact()
        now = self._current_addresses()
        for key, ptr in self._addresses.items():
            if now.get(key) != ptr:
                label, role = key
                raise RuntimeError(
                    f"{label!r}: its {role} tensor moved (rebound since the optimizer was built); state "
                    "must be loaded in place with copy_, never by assignment."
                )
