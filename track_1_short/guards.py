"""Run guards: stop (or skip) a step whose gradients hold NaN/inf, and stop when replicas drift apart.

Two silent failures this module turns into errors that name the parameter:

1. A non-finite gradient. Once the optimizer consumes it, NaN spreads to every parameter through the
   reductions, and a checkpoint written later would hold it. :meth:`Guards.grads_ok` runs after the backward
   and before ``opt.step``: one ``_foreach_norm`` (L1) over every local gradient gives one number per label;
   a sum propagates NaN and inf on every backend (a max need not), so a non-finite norm means a non-finite
   gradient (or one beyond 1e38 in sum, broken as well). The flags of every rank are summed by one small
   all_reduce, so every rank takes the same decision from one host read per step (the n-gram table's
   row-gradient flag, ngram_cycle.py, rides along). ``guards.nan_policy``: "stop" raises
   :class:`NonFiniteGradError` naming the step, the labels and how many ranks saw them; "skip" drops every
   gradient of the step on every rank and leaves parameters and optimizer state as they were (on an Adam
   step this also drops the Adam gradients accumulated since the last Adam step: they are summed in ``.grad``
   and cannot be told apart); "off" leaves the check out (the loss read-back still stops a run whose loss is
   non-finite).
2. Replicas that differ. Replicated parameters are updated on every rank from the same reduced gradients,
   so they and their Adam moments must stay bitwise equal; a rank that drifts (a bad reduction, a bit flip,
   a kernel that is not deterministic) trains a different model silently. Every ``guards.checksum_every``
   steps, and before every checkpoint, :meth:`Guards.assert_replicas_agree` takes two int64 checksums of the
   bits of each replicated label's value, exp_avg and exp_avg_sq (a plain sum and an index-weighted sum, in
   wrapping int64 arithmetic, so the order of the reduction does not matter), gathers them in one all_gather
   (6 int64 per label, about 80 for the tiny model) and raises :class:`ReplicaDivergenceError` naming the
   label, the tensor and the ranks that disagree.

Cost: the gradient check is one fused norm, one all_reduce of n_labels floats and one device-to-host read
per step; the checksum is O(replicated elements), about 212k for track1, every K steps.

Test hooks (:class:`FaultInjectionConfig`, the ``fault_injection`` config group, off by default) put a NaN
or inf into one gradient, or flip one bit of one rank's replica, at a chosen step: they exist so the tests
can show the guards work; a real run never sets them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from track_1_short import distributed
from track_1_short.checkpoint import NonFiniteError

NAN_POLICIES = ("stop", "skip", "off")
INJECTED_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bits of a dtype by width
_CHECKED = ("value", "exp_avg", "exp_avg_sq")  # per replicated label, the tensors compared across ranks


class GuardConfigError(ValueError):
    """A guards or fault_injection setting that cannot work (unknown policy, unknown label)."""


@dataclass
class GuardConfig:
    """The ``guards`` config group: cheap run-time checks (see track_1_short/guards.py)."""

    nan_policy: str = "stop"
    """What a NaN/inf gradient does: "stop" the run naming step and label, "skip" the step on every rank,
    or "off" (no per-step check: saves one small all_reduce and one device sync per step)."""
    checksum_every: int = 100
    """Compare checksums of the replicated parameters and moments across ranks every this many steps (and
    before each checkpoint); 0 = never. One all_gather of about 6 int64 per replicated label."""

    def __post_init__(self) -> None:
        if self.nan_policy not in NAN_POLICIES:
            raise GuardConfigError(
                f"guards.nan_policy={self.nan_policy!r} must be one of {list(NAN_POLICIES)}."
            )
        if self.checksum_every < 0:
            raise GuardConfigError(f"guards.checksum_every={self.checksum_every} must be >= 0 (0 = never).")


@dataclass
class FaultInjectionConfig:
    """The ``fault_injection`` group: a test facility that breaks a run on purpose so the tests can show the
    guards catch it. Off by default (step -1); never set it in a real run."""

    nan_grad_step: int = -1
    """Training step whose gradient gets a non-finite element (after the backward); -1 = never."""
    nan_grad_label: str = ""
    """Label of the parameter whose gradient is poisoned (element 0)."""
    nan_grad_rank: int = -1
    """Rank that poisons its local gradient; -1 = every rank."""
    nan_grad_value: str = "nan"
    """The value written: "nan", "inf" or "-inf"."""
    diverge_step: int = -1
    """Training step after whose update one rank's replica of ``diverge_label`` is changed; -1 = never. Pick a
    step that a checksum follows at once (``(diverge_step + 1) % checksum_every == 0``): an update in between
    can round the one-ulp change away (p - u on a tie rounds to the same even float from p and p + 1 ulp)."""
    diverge_label: str = ""
    """Replicated label whose element 0 gets its lowest bit flipped on ``diverge_rank`` only."""
    diverge_rank: int = 1
    """The rank whose replica is changed."""

    def __post_init__(self) -> None:
        if self.nan_grad_value not in INJECTED_VALUES:
            raise GuardConfigError(
                f"fault_injection.nan_grad_value={self.nan_grad_value!r} must be one of "
                f"{list(INJECTED_VALUES)}."
            )


class NonFiniteGradError(NonFiniteError):
    """A gradient held NaN or inf at a step; the step was not applied (``guards.nan_policy=stop``)."""

    def __init__(self, step: int, labels: Sequence[str], ranks: Sequence[int], world: int) -> None:
        self.step, self.labels = step, list(labels)
        where = ", ".join(f"{label!r} (on {n} of {world} rank(s))" for label, n in zip(labels, ranks))
        super().__init__(
            f"non-finite gradient at step {step} in {where}; the run stops before the update, so no "
            "parameter and no checkpoint holds it. Resume from the last checkpoint (a resume may lower "
            "optim.adam_lr; the seed stays the run's), or set guards.nan_policy=skip to drop such steps."
        )


class ReplicaDivergenceError(RuntimeError):
    """Replicated tensors differ between ranks: the ranks no longer train one model."""

    def __init__(self, step: int, diffs: Sequence[tuple[str, str, list[list[int]]]]) -> None:
        self.step = step
        self.labels = sorted({label for label, _, _ in diffs})
        parts = [f"{label!r} {what} (ranks agreeing: {groups})" for label, what, groups in diffs]
        super().__init__(
            f"replicas diverged by step {step}: {'; '.join(parts)}. Every rank must hold the same bits; "
            "the run stops so no checkpoint records a split model. Resume from the last checkpoint."
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat integer tensor of the same width."""
    flat = t.detach().reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]) if flat.is_floating_point() else flat


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[len(tensors), 2] int64: per tensor, the sum of its bits and the sum of bits * (index + 1).

    Sums wrap modulo 2^64, which is associative: any reduction order gives the same value, so equal bits
    give equal checksums on every rank and backend. The weighted sum makes a permutation visible.
    """
    out = []
    for t in tensors:
        b = _bits(t)
        weights = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64)
        out.append(torch.stack([b.sum(dtype=torch.int64), (b.to(torch.int64) * weights).sum()]))
    if not out:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack(out)


def nonfinite_flags(grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """[len(grads)] fp32 on the grads' device: 1.0 where a gradient holds NaN or inf, 0.0 elsewhere (and for
    None). One fused L1 norm: a sum propagates NaN and inf on every backend; a max-reduction need not."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return torch.zeros(len(grads))
    norms = torch._foreach_norm([grads[i] for i in present], 1)
    bad = (~torch.isfinite(torch.stack([n.float() for n in norms]))).float()
    flags = torch.zeros(len(grads), device=bad.device)
    flags[present] = bad
    return flags


class Guards:
    """The guards of one run, built after the optimizer; every rank calls every method at the same step.

    ``params``: label -> parameter (the optimizer's ``params``); ``states``: label -> Adam state (with
    ``exp_avg``, ``exp_avg_sq``); ``replicated``: the replicated labels; ``log``: where notes go (a skip).
    """

    def __init__(
        self,
        cfg: GuardConfig,
        faults: FaultInjectionConfig,
        params: Mapping[str, torch.nn.Parameter],
        states: Mapping[str, Mapping],
        replicated: Sequence[str],
        log: Callable[[str], None] = lambda _msg: None,
        drop_grads: Callable[[], None] | None = None,
    ) -> None:
        for name, label in (
            ("nan_grad_label", faults.nan_grad_label),
            ("diverge_label", faults.diverge_label),
        ):
            step = faults.nan_grad_step if name == "nan_grad_label" else faults.diverge_step
            if step >= 0 and label not in (params if name == "nan_grad_label" else replicated):
                kind = "parameter" if name == "nan_grad_label" else "replicated parameter"
                choices = sorted(params if name == "nan_grad_label" else replicated)
                raise GuardConfigError(
                    f"fault_injection.{name}={label!r} is not a {kind} label of this model; one of {choices}."
                )
        self.cfg, self.faults, self.log = cfg, faults, log
        self.labels = list(params)
        self.params = dict(params)
        self.replicated = [label for label in self.labels if label in set(replicated)]
        self._drop_grads = drop_grads
        self.states = states
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.skipped_steps: list[int] = []

    # -- gradients --
    def grads_ok(self, step: int, extra: Mapping[str, torch.Tensor] | None = None) -> bool:
        """After the backward of ``step``, before ``opt.step``: True to apply the update.

        "skip": False, every gradient dropped, on every rank alike. "stop": raises NonFiniteGradError.
        ``extra``: name -> a [1] flag (1.0: non-finite) of a gradient no parameter here holds (the n-gram
        table's row gradients: ngram_cycle.py), read with the parameters' in the step's one host read and
        judged like them.
        """
        self._inject_nan(step)
        if self.cfg.nan_policy == "off":
            return True
        extra = dict(extra or {})
        flags = nonfinite_flags([self.params[label].grad for label in self.labels])
        if extra:
            flags = torch.cat(
                [flags, *(f.reshape(1).to(flags.device, torch.float32) for f in extra.values())]
            )
        distributed.all_reduce_sum(flags)  # every rank sees how many ranks found each label non-finite
        counts = flags.tolist()  # the one device-to-host read of the check
        labels = self.labels + list(extra)
        bad = [(label, int(n)) for label, n in zip(labels, counts) if n > 0]
        if not bad:
            return True
        if self.cfg.nan_policy == "stop":
            raise NonFiniteGradError(step, [b[0] for b in bad], [b[1] for b in bad], self.world)
        if self._drop_grads is not None:
            self._drop_grads()  # the optimizer's own clear: whatever it holds besides .grad goes too
        else:
            for p in self.params.values():
                p.grad = None
        self.skipped_steps.append(step)
        self.log(
            f"step {step} skipped: non-finite gradient in {[b[0] for b in bad]} (guards.nan_policy=skip)"
        )
        return False

    def _inject_nan(self, step: int) -> None:
        f = self.faults
        if step != f.nan_grad_step or f.nan_grad_rank not in (-1, self.rank):
            return
        grad = self.params[f.nan_grad_label].grad
        if grad is not None:
            with torch.no_grad():
                grad.view(-1)[0] = INJECTED_VALUES[f.nan_grad_value]

    # -- replicas --
    def after_update(self, step: int) -> None:
        """After ``opt.step`` of ``step``: compare replicas when ``step + 1`` steps are a multiple of K."""
        f = self.faults
        if step == f.diverge_step and self.rank == f.diverge_rank:
            with torch.no_grad():
                bits = _bits(self.params[f.diverge_label].data)
                bits[0] ^= 1  # one ulp: the smallest change a replica can suffer
        k = self.cfg.checksum_every
        if k > 0 and (step + 1) % k == 0:
            self.assert_replicas_agree(step + 1)

    def _replica_tensors(self) -> list[torch.Tensor]:
        out = []
        for label in self.replicated:
            state = self.states[label]
            out += [self.params[label].data, state["exp_avg"], state["exp_avg_sq"]]
        return out

    def assert_replicas_agree(self, steps_done: int) -> None:
        """One all_gather of the replicas' checksums; raises ReplicaDivergenceError naming what differs.

        A collective (every rank must call it); a no-op for one rank or with ``checksum_every=0``."""
        if self.world == 1 or self.cfg.checksum_every == 0 or not self.replicated:
            return
        local = checksums(self._replica_tensors()).reshape(-1)  # [n_labels * 3 * 2]
        gathered = torch.empty(self.world * local.numel(), dtype=torch.int64, device=local.device)
        distributed.all_gather_into(gathered, local)
        table = gathered.view(self.world, len(self.replicated), len(_CHECKED), 2).cpu()
        if bool((table == table[:1]).all()):
            return
        diffs = []
        for i, label in enumerate(self.replicated):
            for j, what in enumerate(_CHECKED):
                sums = [tuple(table[r, i, j].tolist()) for r in range(self.world)]
                if len(set(sums)) > 1:
                    groups: dict[tuple, list[int]] = {}
                    for r, s in enumerate(sums):
                        groups.setdefault(s, []).append(r)
                    diffs.append((label, what, sorted(groups.values())))
        raise ReplicaDivergenceError(steps_done, diffs)
