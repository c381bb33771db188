"""ANVIL's update of one rank's chunk of a bank of matrices: rails, cascade, lane equaliser, fp32-master step.

For this rank's chunk G (bf16 [chunk, rows, cols], the rank-averaged gradient), with all state in fp32:

1. Twin-rail Nesterov momentum. Fast rail vf <- vf + (1 - bf)(g - vf) at the scheduled beta bf; slow rail
   vs <- vs + (1 - bs)(g - vs) at bs = 0.98; blend b = w vf + (1 - w) vs (w = 1 until the rails engage, then
   the engaged weight); lookahead u = g + mu (b - g) with mu the scheduled rail beta.
2. The orthogonalisation cascade (:mod:`track_1_short.optim.polar_express`) of bf16(u): V, singular
   values ~ 1.
3. Lane-energy equaliser. Lanes are rows when rows >= cols, else columns; P = mean of V^2 along each lane (the
   reduced length is L). E <- beta2 E + (1 - beta2) P (persistent); each lane is divided by sqrt(E) and the
   matrix is rescaled to its Frobenius norm before equalising, so only the balance between lanes changes.
   V stays fp32 here (upstream rounds it back to bf16; one rounding fewer, the same direction).
4. Update of an fp32 master p32 = (bf16 weight bits << 16) | mantissa (uint16 low half, kept by the
   optimizer): p32 <- p32 - [vs * p32 >= 0] * eff_wd * eff_lr_j * p32 - eff_lr_j * V, where eff_lr_j = lr *
   lr_mul * matrix_lr_mul[j] and eff_wd = lr * wd_mul * weight_decay. The decay gate is the slow rail's sign
   (zero counts as aligned). The weight takes the high 16 bits (truncation), the mantissa the low 16, so the
   pair is exactly the master and small steps accumulate instead of rounding away.

Pad and frozen matrices (eff_lr_j = 0) never move: both terms of the step carry eff_lr_j. A pad matrix's
gradient is zero, the cascade maps 0 to 0, so its rails and lane energy stay zero too.

Per-step values live in a small fp32 device tensor per bank (``scalars``: its own, written by ``stage()``,
or a slice of one buffer every bank shares, written by one upload for all of them:
:mod:`track_1_short.perf.bank_scalars`), so the update reads no Python scalar that changes between steps and
its persistent tensors are allocated once (the preconditions for capturing it as a CUDA graph, which this
project does not do yet).

Provenance: upstream record #360 ("ANVIL2"): ``anvil_bank_update``, ``_rail_equalizer`` and
``_sign_aligned_decay_update`` in modded-nanogpt's ``track_1_short/optim/anvil.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from track_1_short.optim.bank_layout import N_SCALARS, scalar_row, scalars_size  # noqa: F401
from track_1_short.optim.polar_express import orthogonalize, route_for

EQUALISER_EPS = 1e-10
"""Floor of the lane energy and of the post-equalisation norm: an all-zero (pad) matrix stays 0, not NaN."""


def split_master(p32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 high half by truncation, uint16 low half) of an fp32 tensor; exact: see :func:`join_master`."""
    bits = p32.contiguous().view(torch.int32)
    high = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    low = (bits & 0xFFFF).to(torch.uint16)
    return high, low


def join_master(weight: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """The fp32 master whose high 16 bits are the bf16 ``weight`` and low 16 bits the uint16 ``mantissa``."""
    bits = (weight.contiguous().view(torch.int16).to(torch.int32) << 16) | mantissa.to(torch.int32)
    return bits.view(torch.float32)


def twin_rails_(
    velocity: torch.Tensor,
    g: torch.Tensor,
    momentum: torch.Tensor,
    fast_beta: torch.Tensor,
    fast_weight: torch.Tensor,
    slow_beta: float,
) -> torch.Tensor:
    """Advance both rails in place (velocity [2, ...]: fast, slow) with fp32 ``g``; return the lookahead u."""
    fast, slow = velocity[0], velocity[1]
    fast.lerp_(g, 1.0 - fast_beta)
    slow.lerp_(g, 1.0 - slow_beta)
    blend = torch.lerp(slow, fast, fast_weight)
    return torch.lerp(g, blend, momentum)


def equalise_lanes_(v: torch.Tensor, lane_energy: torch.Tensor, beta2: float, red_dim: int) -> torch.Tensor:
    """Divide each lane of fp32 ``v`` [B, rows, cols] by the RMS of its history, keeping each matrix's
    Frobenius norm; ``lane_energy`` ([B, rows, 1] or [B, 1, cols], the reduced dim ``red_dim``) is updated in
    place."""
    power = v.square().mean(dim=red_dim, keepdim=True)  # mean square per lane
    return v.mul_(lane_scale_(power, lane_energy, beta2, v.size(red_dim)))


def lane_scale_(power: torch.Tensor, lane_energy: torch.Tensor, beta2: float, length: int) -> torch.Tensor:
    """The equaliser's factor per lane (shaped like ``lane_energy``) from this step's mean square per lane
    ``power`` over ``length`` elements; ``lane_energy`` is updated in place. Shared by the eager update and
    the Triton one (:mod:`track_1_short.perf.kernels.anvil_bank`), which computes ``power`` in a kernel."""
    pre = power.sum(dim=(-2, -1), keepdim=True).mul(length).sqrt()  # ||v||_F per matrix, [B, 1, 1]
    lane_energy.lerp_(power, 1.0 - beta2)
    gain = lane_energy.clamp_min(EQUALISER_EPS).rsqrt()
    post = (power * gain.square()).sum(dim=(-2, -1), keepdim=True).mul(length).sqrt()
    return gain * (pre / post.clamp_min(EQUALISER_EPS))


def sign_gated_step_(
    weight: torch.Tensor,
    mantissa: torch.Tensor,
    update: torch.Tensor,
    slow: torch.Tensor,
    eff_lr: torch.Tensor,
    eff_wd: torch.Tensor,
) -> None:
    """Apply the decayed update to the fp32 master held as (bf16 ``weight``, uint16 ``mantissa``) in place."""
    p32 = join_master(weight, mantissa)
    aligned = (slow * p32) >= 0
    decay = torch.where(aligned, p32 * (eff_wd * eff_lr), 0.0)
    p32 = p32 - decay - update * eff_lr
    high, low = split_master(p32)
    weight.copy_(high)
    mantissa.copy_(low)


def bank_update_(
    grad: torch.Tensor,
    weight: torch.Tensor,
    velocity: torch.Tensor,
    lane_energy: torch.Tensor,
    mantissa: torch.Tensor,
    scalars: torch.Tensor,
    *,
    beta2: float,
    slow_beta: float,
    margin: float,
    red_dim: int,
    gram: str = "bmm",
) -> None:
    """One ANVIL step of a chunk (steps 1-4 of the module docstring), in place on ``weight``, ``velocity``,
    ``lane_energy`` and ``mantissa`` (the roles of :class:`AnvilBank`).

    Everything that changes between steps is read from the device tensor ``scalars``; the keyword arguments
    are fixed for a bank's life, so a CUDA graph of this function (:mod:`track_1_short.perf.bank_graphs`) is
    captured once per bank and replayed every step, and reads no host value. ``gram``: the cascade's route
    (one of :data:`track_1_short.optim.polar_express.GRAMS`, :func:`orthogonalize`)."""
    momentum, eff_wd, fast_beta, fast_weight = scalars[:N_SCALARS].unbind()
    eff_lr = scalars[N_SCALARS:].view(-1, 1, 1)
    g = grad.float()
    u = twin_rails_(velocity, g, momentum, fast_beta, fast_weight, slow_beta)
    v = orthogonalize(u.bfloat16(), margin, gram).float()
    equalise_lanes_(v, lane_energy, beta2, red_dim)
    sign_gated_step_(weight, mantissa, v, velocity[1], eff_lr, eff_wd)


def _check_operands(grad, weight, velocity, lane_energy, mantissa, scalars, red_dim) -> None:
    chunk, rows, cols = grad.shape
    lane_shape = (chunk, rows, 1) if red_dim == -1 else (chunk, 1, cols)
    expected = {
        "grad": (grad, (chunk, rows, cols), torch.bfloat16),
        "weight": (weight, (chunk, rows, cols), torch.bfloat16),
        "velocity": (velocity, (2, chunk, rows, cols), torch.float32),
        "lane_energy": (lane_energy, lane_shape, torch.float32),
        "mantissa": (mantissa, (chunk, rows, cols), torch.uint16),
        "scalars": (scalars, (N_SCALARS + chunk,), torch.float32),
    }
    for role, (t, shape, dtype) in expected.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != grad.device:
            raise ValueError(
                f"triton_bank_update_: {role} is {tuple(t.shape)} {t.dtype} on {t.device}"
                f"{'' if t.is_contiguous() else ', not contiguous'}; the kernels need a contiguous {shape} "
                f"{dtype} on {grad.device} (AnvilBank's own tensors are)."
            )
    if red_dim not in (-1, -2):
        raise ValueError(
            f"triton_bank_update_: red_dim={red_dim} must be -1 (lanes are rows) or -2 (columns)."
        )


def triton_bank_update_(
    grad: torch.Tensor,
    weight: torch.Tensor,
    velocity: torch.Tensor,
    lane_energy: torch.Tensor,
    mantissa: torch.Tensor,
    scalars: torch.Tensor,
    *,
    beta2: float,
    slow_beta: float,
    margin: float,
    red_dim: int,
    gram: str = "bmm",
) -> None:
    """One ANVIL step of a chunk, like :func:`bank_update_` (same operands, same roles, in place), with the
    phases outside the cascade as the Triton kernels of :mod:`track_1_short.perf.kernels.anvil_bank`
    (``OptimConfig.bank_update = "triton"``; its docstring says what they replace and how closely they
    agree): kernel A (rails, lookahead), the torch cascade, kernel B (lane power), the torch
    lane scale, kernel C (master step). Every operand must be contiguous (AnvilBank's are)."""
    from track_1_short.perf.kernels.anvil_bank import check_device, lane_power, master_step_, rails_

    check_device(grad.device)
    _check_operands(grad, weight, velocity, lane_energy, mantissa, scalars, red_dim)
    u = rails_(grad, velocity, scalars, slow_beta)
    # Kernels B and C read the cascade's bf16 output and widen it as they load: no fp32 copy of V.
    v = orthogonalize(u, margin, gram).contiguous()
    power = lane_power(v, red_dim)
    scale = lane_scale_(power, lane_energy, beta2, v.size(red_dim)).contiguous()
    master_step_(weight, mantissa, v, scale, velocity[1], scalars, red_dim)


class AnvilBank:
    """The persistent tensors of one bank's ANVIL update on this rank: all allocated once, never rebound.

    ``grad``: bf16 [chunk, rows, cols], the reduce-scatter destination; ``weight``: this rank's [chunk, rows,
    cols] rows of the bank (a view of the parameter, or of a pad buffer); ``velocity`` fp32 [2, chunk, rows,
    cols]; ``lane_energy`` fp32 [chunk, rows, 1] (rows >= cols) or [chunk, 1, cols]; ``mantissa`` uint16
    [chunk, rows, cols]; ``scalars`` fp32 [4 + chunk]: momentum, eff_wd, fast_beta, fast_weight, eff_lr per
    matrix (its own tensor, or the given ``scalars``: a slice of a buffer shared by every bank).
    ``update_fn``: what :meth:`update` calls, :func:`bank_update_` (eager) unless given the Triton kernels'
    version (:func:`track_1_short.perf.kernels.anvil_bank.triton_bank_update_`). ``gram``: the cascade's route
    (``OptimConfig.cascade_gram``), passed with the other constants after
    :func:`track_1_short.optim.polar_express.route_for` has mapped it for this bank's shape ("gram_space"
    only where it pays, "squared" elsewhere).
    """

    def __init__(
        self,
        label: str,
        grad: torch.Tensor,
        weight: torch.Tensor,
        beta2: float,
        slow_beta: float,
        margin: float,
        scalars: torch.Tensor | None = None,
        update_fn: Callable[..., None] | None = None,
        gram: str = "bmm",
    ):
        chunk, rows, cols = grad.shape
        size = scalars_size(chunk)
        if scalars is not None and (
            scalars.shape != (size,) or scalars.dtype != torch.float32 or scalars.device != grad.device
        ):
            raise ValueError(
                f"AnvilBank {label!r}: scalars is {tuple(scalars.shape)} {scalars.dtype} on {scalars.device};"
                " "
                f"a chunk of {chunk} matrices needs ({size},) float32 on {grad.device}."
            )
        self.label = label
        self.grad, self.weight = grad, weight
        self.beta2, self.slow_beta, self.margin = float(beta2), float(slow_beta), float(margin)
        # Lanes along the longer side; the mean runs over the shorter one (upstream's red_dim).
        self.red_dim = -1 if rows >= cols else -2
        dev = grad.device
        self.velocity = torch.zeros((2, chunk, rows, cols), dtype=torch.float32, device=dev)
        lane_shape = (chunk, rows, 1) if self.red_dim == -1 else (chunk, 1, cols)
        self.lane_energy = torch.zeros(lane_shape, dtype=torch.float32, device=dev)
        self.mantissa = torch.zeros((chunk, rows, cols), dtype=torch.uint16, device=dev)
        if scalars is None:
            scalars = torch.zeros(size, dtype=torch.float32, device=dev)
        self.scalars = scalars
        self.momentum, self.eff_wd, self.fast_beta, self.fast_weight = self.scalars[:N_SCALARS].unbind()
        self.eff_lr = self.scalars[N_SCALARS:].view(chunk, 1, 1)
        self.constants = dict(
            beta2=self.beta2,
            slow_beta=self.slow_beta,
            margin=self.margin,
            red_dim=self.red_dim,
            gram=route_for(gram, rows, cols),  # "gram_space" only for the shapes where it pays
        )
        self.update_fn = bank_update_ if update_fn is None else update_fn

    def stage(
        self, momentum: float, eff_wd: float, fast_beta: float, fast_weight: float, eff_lr: list[float]
    ):
        """Write this step's values into ``scalars`` (one pageable host-to-device copy that the host waits
        for: the reference of :class:`track_1_short.perf.bank_scalars.BankScalarStaging`)."""
        host = torch.tensor(scalar_row(momentum, eff_wd, fast_beta, fast_weight, eff_lr), dtype=torch.float32)
        self.scalars.copy_(host, non_blocking=False)

    def update(self) -> None:
        """One ANVIL step of this chunk from ``grad`` (steps 1-4 of the module docstring):
        :func:`bank_update_` eagerly, or what was given as ``update_fn`` (the same operands)."""
        self.update_fn(
            self.grad,
            self.weight,
            self.velocity,
            self.lane_energy,
            self.mantissa,
            self.scalars,
            **self.constants,
        )

    def reset(self) -> None:
        """Zero the rails, lane energies and mantissas in place (a zero mantissa: master = bf16 weight)."""
        self.velocity.zero_()
        self.lane_energy.zero_()
        self.mantissa.zero_()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The persistent tensors by role (for the address checks)."""
        return {
            "grad": self.grad,
            "weight": self.weight,
            "velocity": self.velocity,
            "lane_energy": self.lane_energy,
            "mantissa": self.mantissa,
            "scalars": self.scalars,
        }
