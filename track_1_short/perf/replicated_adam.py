"""Replicated Adam in one launch per dtype: the small replicated parameters updated over flat buffers.

What it replaces (OptimConfig.replicated_impl = "fused"; "reference" keeps the per-parameter path of
optim/adam.py): for each small replicated parameter (scalars, lambdas, gates, MUDD weights: 13-16 tensors,
about 212k elements, bf16 and fp32), one async all_reduce and one compiled Adam call with two 0-D scalar
uploads, about a hundred tiny launches per Adam step.

Why it is faster: parameters, gradients and both moments lie end to end in one flat buffer per dtype. One
foreach copy and one all_reduce(AVG) per dtype move the gradients, and one Triton launch per dtype updates
every element, reading its parameter's hyperparameters from an [n_params, 8] scalar table by segment id; the
table is built on the host (three of its eight columns a step, straight into a pinned slot: HostScalarTable)
and uploaded once per step, and each launch replays the compiled kernel bound to the group's buffers
(kernels.BoundLaunch) instead of going through Triton's JIT binder; on CUDA the upload and the launches are
one CUDA graph replay per step (perf/replicated_adam_graphs.py; ``use_cuda_graphs=False`` launches them
eagerly). Upstream measured about 7.5x fewer
microseconds per step than the per-parameter path on an H200 for the 13-tensor set;
perf/bench_replicated_adam.py measures ours (perf/RESULTS.md, "Replicated Adam").

Invariants (each tested in tests/perf/test_replicated_adam.py):
1. After construction every parameter's .data and its exp_avg / exp_avg_sq are views into the flat buffers,
   bitwise equal to before, and nothing rebinds them: assert_views_intact() checks, loads copy in place.
2. The gradient views tile each flat gradient buffer exactly, in parameter order.
3. Segment ids are parameter indices, grouped by dtype in first-seen order: identical on every rank.
4. On CUDA the table reaches the device through a ring of pinned slots, a slot rewritten only after its
   previous upload retired (one event per slot, recorded after the slot's copy or graph replay); on the
   CPU through a plain copy.
5. A parameter with no gradient this step is skipped whole: its step, moments and value stay as they were.
   (Every rank must see the same parameters without a gradient, as every rank runs the same model.)
6. The hot-path table is adam_scalar_table's bit for bit, across ring slots and mid-run changes of betas/eps.

Calling convention: ``flatten_replicated``, ``adam_scalar_table`` and ``ReplicatedAdam`` take ``param_cfgs``
and ``param_states`` either as sequences in ``params`` order (this project's optimizer) or as mappings keyed
by parameter, and ``active`` either as one bool per parameter or as a set of parameters (the seed module's own
convention, so code written against it runs unchanged); both give the same bits. ``FlatGroup.params`` lists
a group's members; ``FlatGroup.grad_views`` answers by position (``views[k]``) or by parameter (``views[p]``).

Provenance: modded-nanogpt's track_1_short package (record #360: perf/replicated_adam.py with
flatten_replicated, adam_scalar_table, ReplicatedAdam, and the fused_adam_ kernel), rewritten for this
project.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np
import torch

from track_1_short import distributed
from track_1_short.optim.hyper import AdamParamConfig, adam_step_scalars
from track_1_short.perf.graph_check import same_bits
from track_1_short.perf.kernels import replicated_adam as kernels
from track_1_short.perf.kernels.replicated_adam import SCALAR_COLUMNS

# Pinned slots in the table upload ring. The host never runs more than a couple of Adam steps ahead of the
# GPU, so with 8 slots the wait on a slot's event returns at once; it only guards against overwriting a slot
# whose copy has not run yet.
SCALAR_TABLE_SLOTS = 8
FLAT_BUFFERS = ("param", "grad", "exp_avg", "exp_avg_sq")  # a FlatGroup's buffers, in snapshot order

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_CFG_ATTRIBUTES = ("adam_betas", "lr", "lr_mul", "eps", "weight_decay", "wd_mul")


class ReplicatedAdamError(RuntimeError):
    """A ReplicatedAdam method was called out of order (launch_reduce twice, update without launch_reduce)."""


class FlatViewError(ReplicatedAdamError):
    """A parameter's .data or a moment no longer points into its flat buffer."""


def describe(params: Sequence[torch.Tensor], index: int) -> str:
    """'parameter 3 (smear_gate)': the index and, where the model set one, the label."""
    label = getattr(params[index], "label", None)
    return f"parameter {index} ({label})" if label else f"parameter {index}"


def per_parameter(params: Sequence[torch.Tensor], values, what: str) -> list:
    """``values`` as a list in ``params`` order: a sequence as given, or a mapping keyed by parameter (the
    seed's convention; keys beyond ``params`` are ignored, as the seed passes its whole optimizer's dicts)."""
    if not isinstance(values, Mapping):
        return list(values)
    missing = [describe(params, i) for i, p in enumerate(params) if p not in values]
    if missing:
        raise ValueError(
            f"{what} is a mapping without an entry for {', '.join(missing)}; key it by every parameter "
            "(or pass a sequence in parameter order)"
        )
    return [values[p] for p in params]


def active_flags(params: Sequence[torch.Tensor], active) -> list[bool]:
    """``active`` as one bool per parameter: a sequence of bools as given, or a set of parameters (the
    seed's)."""
    if not isinstance(active, AbstractSet):
        return [bool(a) for a in active]
    members = {id(x) for x in active}
    stray = len(members - {id(p) for p in params})
    if stray:
        raise ValueError(
            f"active holds {stray} object(s) that are not among params; pass a subset of params, or one bool "
            "per parameter"
        )
    return [id(p) in members for p in params]


class GradViews(Sequence):
    """A group's gradient slices, member k's shaped like its parameter: ``views[k]`` by position, as a list,
    or ``views[p]`` by parameter, as the seed's dict. Iteration and ``len`` are the list's; ``in``,
    ``keys()``, ``items()`` and ``get()`` are the mapping's (by parameter identity: tensors do not compare
    with ==)."""

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._by_id: dict[int, torch.Tensor] = {}

    def add(self, param: torch.Tensor, view: torch.Tensor) -> None:
        self._params.append(param)
        self._views.append(view)
        self._by_id[id(param)] = view

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, key):
        if isinstance(key, int | slice):
            return self._views[key]
        view = self._by_id.get(id(key))
        if view is None:
            raise KeyError(f"{describe([key], 0)} is not a member of this group")
        return view

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._views)

    def __contains__(self, param: object) -> bool:
        return id(param) in self._by_id

    def get(self, param: torch.Tensor, default=None):
        return self._by_id.get(id(param), default)

    def keys(self) -> list[torch.Tensor]:
        return list(self._params)

    def values(self) -> list[torch.Tensor]:
        return list(self._views)

    def items(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self._params, self._views))


@dataclass(eq=False)
class FlatGroup:
    """The replicated parameters of one dtype, laid end to end.

    ``indices[k]`` is the parameter index (and segment id) of member k, whose elements are
    ``[offsets[k], offsets[k + 1])`` of every flat buffer.
    """

    dtype: torch.dtype
    indices: list[int]
    offsets: list[int]  # len(indices) + 1 entries, offsets[-1] == numel
    param: torch.Tensor  # [N] dtype: the storage of every member's .data
    grad: torch.Tensor  # [N] dtype: the gradients, copied in, then reduced
    exp_avg: torch.Tensor  # [N] fp32
    exp_avg_sq: torch.Tensor  # [N] fp32
    segment: torch.Tensor  # [N] int32: the parameter index of each element
    grad_views: GradViews = field(default_factory=GradViews)  # member k's grad slice, by k or by parameter
    params: list[torch.Tensor] = field(default_factory=list)  # the members, in order (params[indices[k]])

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def span(self, k: int) -> slice:
        return slice(self.offsets[k], self.offsets[k + 1])


def _storage_span(t: torch.Tensor) -> tuple[int, int, int]:
    start = t.data_ptr()
    return t.untyped_storage().data_ptr(), start, start + max(t.numel(), 1) * t.element_size()


def _validate_params(
    params: Sequence[torch.Tensor], param_states: Sequence[dict], device: torch.device
) -> None:
    if len(params) == 0:
        raise ValueError("ReplicatedAdam needs at least one parameter; got an empty list")
    if len(param_states) != len(params):
        raise ValueError(
            f"got {len(params)} parameters but {len(param_states)} state dicts; pass one per parameter"
        )
    seen: dict[int, int] = {}
    spans: list[tuple[int, int, int, int]] = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{describe(params, i)} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(
                f"{describe(params, i)} appears twice (also at index {seen[id(p)]}); list each parameter once"
            )
        seen[id(p)] = i
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{describe(params, i)} is {p.dtype}; replicated Adam supports bfloat16 and float32"
            )
        if p.device != device:
            raise ValueError(f"{describe(params, i)} is on {p.device}, not {device}; move the model first")
        storage, lo, hi = _storage_span(p)
        for j, (other_storage, other_lo, other_hi, _) in enumerate(spans):
            if storage == other_storage and lo < other_hi and other_lo < hi:
                raise ValueError(
                    f"{describe(params, i)} shares memory with {describe(params, j)}; "
                    "each replicated parameter needs its own storage"
                )
        spans.append((storage, lo, hi, i))
        state = param_states[i]
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state.get(key) if isinstance(state, dict) else None
            if not isinstance(moment, torch.Tensor):
                raise ValueError(
                    f"{describe(params, i)}: state has no tensor '{key}'; initialise the Adam state"
                )
            if moment.dtype != torch.float32:
                raise TypeError(
                    f"{describe(params, i)}: {key} is {moment.dtype}; Adam moments must be float32"
                )
            if moment.shape != p.shape:
                raise ValueError(
                    f"{describe(params, i)}: {key} has shape {tuple(moment.shape)}, the parameter "
                    f"{tuple(p.shape)}; moments must be shaped like their parameter"
                )
            if moment.device != device:
                raise ValueError(f"{describe(params, i)}: {key} is on {moment.device}, not {device}")
        if not isinstance(state.get("step"), int):
            raise ValueError(f"{describe(params, i)}: state['step'] must be an int (Adam updates so far)")


def flatten_replicated(
    params: Sequence[torch.Tensor],
    param_states: Sequence[dict] | Mapping[torch.Tensor, dict],
    device: torch.device | str,
) -> list[FlatGroup]:
    """Move ``params`` and their moments into flat buffers, one group per dtype in first-seen order.

    Every ``p.data`` and ``state["exp_avg"]`` / ``state["exp_avg_sq"]`` is rebound to a view of its slice,
    bitwise equal to its old value. Everything is validated before anything is modified. ``param_states``: one
    dict per parameter, in order or keyed by parameter.
    """
    device = torch.device(device)
    params = list(params)
    param_states = per_parameter(params, param_states, "param_states")
    _validate_params(params, param_states, device)
    members: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        members.setdefault(p.dtype, []).append(i)

    groups = []
    for dtype, indices in members.items():
        offsets = [0]
        for i in indices:
            offsets.append(offsets[-1] + params[i].numel())
        n = offsets[-1]
        group = FlatGroup(
            dtype=dtype,
            indices=list(indices),
            offsets=offsets,
            param=torch.empty(n, dtype=dtype, device=device),
            grad=torch.zeros(n, dtype=dtype, device=device),
            exp_avg=torch.empty(n, dtype=torch.float32, device=device),
            exp_avg_sq=torch.empty(n, dtype=torch.float32, device=device),
            segment=torch.empty(n, dtype=torch.int32, device=device),
        )
        with torch.no_grad():
            for k, i in enumerate(indices):
                p, state, span = params[i], param_states[i], group.span(k)
                group.param[span].copy_(p.detach().reshape(-1))
                group.exp_avg[span].copy_(state["exp_avg"].reshape(-1))
                group.exp_avg_sq[span].copy_(state["exp_avg_sq"].reshape(-1))
                group.segment[span].fill_(i)
                p.data = group.param[span].view(p.shape)
                state["exp_avg"] = group.exp_avg[span].view(p.shape)
                state["exp_avg_sq"] = group.exp_avg_sq[span].view(p.shape)
                group.grad_views.add(p, group.grad[span].view(p.shape))
                group.params.append(p)
        groups.append(group)
    return groups


def validate_param_cfgs(params: Sequence[torch.Tensor], param_cfgs: Sequence[AdamParamConfig]) -> None:
    """One clear error for a config that lacks an attribute or has betas outside [0, 1)."""
    param_cfgs = per_parameter(params, param_cfgs, "param_cfgs")
    if len(param_cfgs) != len(params):
        raise ValueError(
            f"got {len(params)} parameters but {len(param_cfgs)} configs; pass one per parameter"
        )
    for i, cfg in enumerate(param_cfgs):
        missing = [name for name in _CFG_ATTRIBUTES if not hasattr(cfg, name)]
        if missing:
            raise TypeError(f"{describe(params, i)}: its config lacks {', '.join(missing)}")
        betas = cfg.adam_betas
        if betas is None or len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"{describe(params, i)}: adam_betas must be two numbers in [0, 1), got {betas}")
        for name in ("lr", "lr_mul", "eps", "weight_decay", "wd_mul"):
            if not math.isfinite(float(getattr(cfg, name))):
                raise ValueError(f"{describe(params, i)}: {name} must be finite, got {getattr(cfg, name)}")


def adam_scalar_table(
    params: Sequence[torch.Tensor],
    param_cfgs: Sequence[AdamParamConfig] | Mapping[torch.Tensor, AdamParamConfig],
    param_states: Sequence[dict] | Mapping[torch.Tensor, dict],
    active: Sequence[bool] | AbstractSet[torch.Tensor],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The fp32 [n_params, 8] scalar table of this Adam step (columns SCALAR_COLUMNS).

    Increments ``state["step"]`` of every active parameter and writes its row with optim/adam.py's step_size
    and eff_wd (Python doubles, rounded once to fp32 here). Inactive rows have active = 0 and zero step terms.
    ``param_cfgs`` / ``param_states``: in parameter order or keyed by parameter; ``active``: one bool per
    parameter or the set of active parameters.
    """
    param_cfgs = per_parameter(params, param_cfgs, "param_cfgs")
    param_states = per_parameter(params, param_states, "param_states")
    active = active_flags(params, active)
    n = len(params)
    if not (len(param_cfgs) == len(param_states) == len(active) == n):
        raise ValueError(
            "adam_scalar_table: params, param_cfgs, param_states and active must have equal lengths"
        )
    if out is None:
        out = np.empty((n, len(SCALAR_COLUMNS)), dtype=np.float32)
    elif out.shape != (n, len(SCALAR_COLUMNS)) or out.dtype != np.float32:
        raise ValueError(f"adam_scalar_table: out must be float32 {(n, len(SCALAR_COLUMNS))}")
    values: list[float] = []
    for cfg, state, is_active in zip(param_cfgs, param_states, active):
        beta1, beta2 = cfg.adam_betas
        if is_active:
            step = state["step"] + 1
            state["step"] = step
            step_size, eff_wd = adam_step_scalars(cfg, step)
            values += (beta1, 1.0 - beta1, beta2, 1.0 - beta2, cfg.eps, step_size, eff_wd, 1.0)
        else:
            values += (beta1, 1.0 - beta1, beta2, 1.0 - beta2, cfg.eps, 0.0, 0.0, 0.0)
    out.reshape(-1)[:] = values  # float64 -> float32: round to nearest even, once
    return out


class CurrentStream:
    """``torch.cuda.current_stream(device)``, rebuilt only when the raw current stream changes.

    An event recorded without a stream asks torch for the current one, which builds a new Python Stream
    object every call (microseconds of host time on the hot path); the raw stream handle is one cheap call.
    """

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._raw: int | None = None
        self._stream: torch.cuda.Stream | None = None

    def __call__(self) -> torch.cuda.Stream:
        raw = torch._C._cuda_getCurrentRawStream(self.index)
        if raw != self._raw:
            self._stream = torch.cuda.current_stream(self.index)
            self._raw = raw
        return self._stream


class UploadRing:
    """Host -> device copies of one small tensor per step.

    On CUDA each copy reads one of ``slots`` pinned host buffers and is followed by an event; before the host
    writes a slot again it waits on that slot's event, so a copy still queued never reads a half-written slot.
    On the CPU there is one host buffer and a plain copy. ``event_factory`` builds the per-slot events (CUDA
    events by default; anything with ``record()`` and ``synchronize()``).
    """

    def __init__(
        self,
        target: torch.Tensor,
        slots: int = SCALAR_TABLE_SLOTS,
        event_factory: Callable[[], object] | None = None,
    ):
        self.target = target
        ring = target.is_cuda or event_factory is not None
        count = slots if ring else 1
        pin = target.is_cuda
        self._slots = [torch.zeros(target.shape, dtype=target.dtype, pin_memory=pin) for _ in range(count)]
        self._arrays = [slot.numpy() for slot in self._slots]
        self._events = [(event_factory or torch.cuda.Event)() for _ in range(count)] if ring else None
        self._stream = CurrentStream(target.device) if target.is_cuda and event_factory is None else None
        self._next = 0

    @property
    def slot_index(self) -> int:
        return self._next

    def host_buffer(self) -> np.ndarray:
        """The host array the next upload reads, once its previous upload has retired."""
        if self._events is not None:
            self._events[self._next].synchronize()
        return self._arrays[self._next]

    def host_tensor(self) -> torch.Tensor:
        """host_buffer()'s slot as its tensor (pinned on CUDA), for writers that take tensors."""
        self.host_buffer()
        return self._slots[self._next]

    @property
    def slots(self) -> int:
        return len(self._slots)

    def slot_tensor(self, k: int) -> torch.Tensor:
        """Slot ``k``'s host tensor (pinned on CUDA): what a CUDA graph that uploads it copies from."""
        return self._slots[k]

    def upload(self) -> None:
        """Copy the buffer returned by host_buffer() to ``target`` (stream-ordered on CUDA)."""
        k = self._next
        if self._events is None:
            self.target.copy_(self._slots[k])
            return
        self.target.copy_(self._slots[k], non_blocking=True)
        self.mark_uploaded()

    def mark_uploaded(self) -> None:
        """Record the event of the slot just copied (by upload(), or by a CUDA graph that copies it) and move
        to the next slot; host_buffer() waits for that event before the slot is written again."""
        k = self._next
        if self._stream is not None:
            self._events[k].record(self._stream())
        else:
            self._events[k].record()
        self._next = (k + 1) % len(self._slots)


class HostScalarTable:
    """The fused path's per-step scalar table, written straight into the upload ring's next pinned slot.

    What it replaces on the hot path: ``adam_scalar_table`` (the public, general form: it accepts mappings and
    sets, checks lengths, and builds all eight columns as a list of Python floats every step). Why it is
    faster: one pass over the parameters computes the three per-step columns (step_size, eff_wd, active);
    the five that depend only on betas and eps are written into a slot only when they changed since that
    slot last held them (read in the same pass, so a config whose betas change mid-run is honoured).
    Invariant (tests/perf/test_replicated_adam.py): the table is bitwise adam_scalar_table's, and the step
    counters move the same way.
    """

    def __init__(self, param_cfgs: Sequence[AdamParamConfig], param_states: Sequence[dict], slots: int):
        self.cfgs, self.states = param_cfgs, param_states
        n = len(param_cfgs)
        self._step_size, self._eff_wd, self._active = [0.0] * n, [0.0] * n, [0.0] * n
        self._version = 0
        self._slot_versions = [-1] * slots
        self._rebuild_static()

    def _rebuild_static(self) -> None:
        self._keys = [(c.adam_betas[0], c.adam_betas[1], c.eps) for c in self.cfgs]
        rows = [[b1, 1.0 - b1, b2, 1.0 - b2, eps] for b1, b2, eps in self._keys]
        self._static = np.array(rows, dtype=np.float64).astype(np.float32)  # one rounding, as the table's
        self._version += 1

    def write(self, rows: np.ndarray, slot: int, active: Sequence[bool]) -> None:
        """Fill ``rows`` (the fp32 [n, 8] host array of ring slot ``slot``) and count the active steps."""
        step_size, eff_wd, flags = self._step_size, self._eff_wd, self._active
        changed = False
        for i, (cfg, state, key) in enumerate(zip(self.cfgs, self.states, self._keys)):
            betas = cfg.adam_betas
            changed = changed or betas[0] != key[0] or betas[1] != key[1] or cfg.eps != key[2]
            if active[i]:
                step = state["step"] + 1
                state["step"] = step
                step_size[i], eff_wd[i] = adam_step_scalars(cfg, step)
                flags[i] = 1.0
            else:
                step_size[i] = eff_wd[i] = flags[i] = 0.0
        if changed:
            self._rebuild_static()
        if self._slot_versions[slot] != self._version:
            rows[:, :5] = self._static
            self._slot_versions[slot] = self._version
        rows[:, 5] = step_size  # float64 -> float32: round to nearest even, once
        rows[:, 6] = eff_wd
        rows[:, 7] = flags


class ReplicatedAdam:
    """Adam over the replicated parameters, in flat buffers; see the module docstring.

    Per Adam step: ``launch_reduce()`` (Phase 0), then ``update()`` (Phase 2): a host-built scalar table and
    one launch per dtype (on CUDA one graph replay per step). It gives the same bits as the per-parameter path
    of optim/adam.py, and leaves .grad to autograd.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        param_cfgs: Sequence[AdamParamConfig] | Mapping[torch.Tensor, AdamParamConfig],
        param_states: Sequence[dict] | Mapping[torch.Tensor, dict],
        device: torch.device | str,
        *,
        block: int = kernels.DEFAULT_BLOCK,
        use_cuda_graphs: bool = True,
    ):
        kernels._check_block(block)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        params = list(params)
        # Either convention becomes lists in parameter order; the state dicts themselves are the caller's, so
        # a mapping's entries see their moments rebound to the flat views as a sequence's do.
        param_cfgs = per_parameter(params, param_cfgs, "param_cfgs")
        param_states = per_parameter(params, param_states, "param_states")
        _validate_params(params, param_states, device)
        validate_param_cfgs(params, param_cfgs)
        self.device = device
        self.block = block
        self.params = params
        self.param_cfgs = param_cfgs
        self.param_states = param_states
        self.groups = flatten_replicated(params, param_states, device)
        self.table = torch.zeros((len(params), len(SCALAR_COLUMNS)), dtype=torch.float32, device=device)
        self._ring = UploadRing(self.table)
        self._host_table = HostScalarTable(self.param_cfgs, self.param_states, SCALAR_TABLE_SLOTS)
        # One bound kernel launch per group over its flat buffers (bf16 as int16 bits), made once.
        self._launches = [
            kernels.bind_fused_adam(g.param, g.grad, g.exp_avg, g.exp_avg_sq, g.segment, self.table, block)
            for g in self.groups
        ]
        # Per group: the members' parameter indices and gradient views, as plain lists for the hot path.
        self._members = [(list(g.indices), list(g.grad_views)) for g in self.groups]
        self._handles: list[distributed.Handle] | None = None
        self._active: list[bool] | None = None
        self._addresses = self._current_addresses()
        self._graphs = None
        if use_cuda_graphs and device.type == "cuda":
            from track_1_short.perf.replicated_adam_graphs import SlotGraphs

            self._graphs = SlotGraphs(self)

    # ---- the step ------------------------------------------------------------------------------------------

    def launch_reduce(self) -> None:
        """Phase 0: gradients into the flat buffers and one async all_reduce(AVG) per dtype."""
        if self._handles is not None:
            raise ReplicatedAdamError("launch_reduce() called twice without update() in between")
        params = self.params
        grads = [p.grad for p in params]
        active = [g is not None for g in grads]
        every = all(active)
        for indices, views in self._members:
            # One foreach copy per dtype: a list that mixes dtypes leaves the multi-tensor fast path and
            # costs one copy launch per tensor.
            if every:
                dst, src = views, [grads[i] for i in indices]
            else:  # some parameter had no gradient this step: copy the others
                dst = [v for v, i in zip(views, indices) if active[i]]
                src = [grads[i] for i in indices if active[i]]
            if dst:
                torch._foreach_copy_(dst, src)
        self._active = active
        self._handles = [distributed.all_reduce_avg(group.grad, async_op=True) for group in self.groups]

    def update(self) -> None:
        """Phase 2: wait for the reduces, build and upload the scalar table, one kernel launch per dtype."""
        if self._handles is None:
            raise ReplicatedAdamError("update() called without launch_reduce(); call launch_reduce() first")
        handles, active = self._handles, self._active
        self._handles, self._active = None, None
        for handle in handles:
            handle.wait()
        slot = self._ring.slot_index
        self._host_table.write(self._ring.host_buffer(), slot, active)
        if self._graphs is not None:
            # The slot's upload and every launch: one replay once captured, eager once refused; the slot's
            # event follows either.
            self._graphs.run(slot)
            self._ring.mark_uploaded()
            return
        self._ring.upload()
        for group, launch in zip(self.groups, self._launches):
            if any(active[i] for i in group.indices):
                launch()

    def zero_grad(self) -> None:
        """Clear the gradients: .grad = None."""
        for p in self.params:
            p.grad = None

    # ---- snapshots for the CUDA-graph checks ------------------------------------------------------------

    def _flat_snapshot(self) -> list[torch.Tensor]:
        """Copies of the table and of every group's flat buffers (FLAT_BUFFERS order), for a graph's check."""
        out = [self.table.clone()]
        for group in self.groups:
            out += [getattr(group, name).clone() for name in FLAT_BUFFERS]
        return out

    def _load_flat_snapshot(
        self, snapshot: list[torch.Tensor], grads: list[torch.Tensor] | None = None
    ) -> None:
        """Copy a _flat_snapshot() back in place; ``grads`` (one per group), if given, stand in for its
        gradients."""
        self.table.copy_(snapshot[0])
        for k, group in enumerate(self.groups):
            for j, name in enumerate(FLAT_BUFFERS):
                source = (
                    grads[k]
                    if grads is not None and name == "grad"
                    else snapshot[1 + len(FLAT_BUFFERS) * k + j]
                )
                getattr(group, name).copy_(source)

    def _flat_snapshot_differences(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> list[str]:
        """The names ("table", "<dtype> <buffer>") of the entries where two snapshots differ in their bits."""
        names = ["table"] + [f"{g.dtype} {name}" for g in self.groups for name in FLAT_BUFFERS]
        return [name for name, x, y in zip(names, a, b) if not same_bits(x, y)]

    # ---- invariants and state ------------------------------------------------------------------------------

    def _current_addresses(self) -> list[tuple[int, int, int]]:
        return [
            (p.data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr())
            for p, s in zip(self.params, self.param_states)
        ]

    def assert_views_intact(self) -> None:
        """Raise FlatViewError naming the first parameter whose .data or moment was rebound."""
        for i, (p, state) in enumerate(zip(self.params, self.param_states)):
            data, exp_avg, exp_avg_sq = self._addresses[i]
            for what, now, then in (
                (".data", p.data_ptr(), data),
                ("state['exp_avg']", state["exp_avg"].data_ptr(), exp_avg),
                ("state['exp_avg_sq']", state["exp_avg_sq"].data_ptr(), exp_avg_sq),
            ):
                if now != then:
                    raise FlatViewError(
                        f"{describe(self.params, i)}: {what} was rebound and no longer points into its flat "
                        "buffer; load values in place (tensor.copy_(...)) instead of assigning a new tensor"
                    )

    def state_dict(self) -> list[dict]:
        """Per parameter (in order): {"step": int, "exp_avg": tensor, "exp_avg_sq": tensor}, cloned."""
        return [
            {
                "step": s["step"],
                "exp_avg": s["exp_avg"].detach().clone(),
                "exp_avg_sq": s["exp_avg_sq"].clone(),
            }
            for s in self.param_states
        ]

    def load_state_dict(self, states: Sequence[dict]) -> None:
        """Copy saved per-parameter states in place (flat buffers keep their addresses); validated first."""
        if len(states) != len(self.params):
            raise ValueError(f"got {len(states)} saved states for {len(self.params)} parameters")
        for i, saved in enumerate(states):
            if not isinstance(saved.get("step"), int):
                raise ValueError(f"{describe(self.params, i)}: saved 'step' must be an int")
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if not isinstance(value, torch.Tensor) or value.shape != self.params[i].shape:
                    raise ValueError(
                        f"{describe(self.params, i)}: saved '{key}' must be a tensor of shape "
                        f"{tuple(self.params[i].shape)}"
                    )
        with torch.no_grad():
            for state, saved in zip(self.param_states, states):
                state["exp_avg"].copy_(saved["exp_avg"])
                state["exp_avg_sq"].copy_(saved["exp_avg_sq"])
                state["step"] = saved["step"]
