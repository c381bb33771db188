"""The model's param table, checked, turned into one :class:`ParamConfig` per labelled parameter.

The model gives every parameter a unique ``label`` and a table entry (``model.param_table()``) saying which
optimizer updates it (``optim``: "adam" | "anvil"), how its gradient travels (``comms``: "replicated":
all_reduce and every rank updates all of it; "sharded": reduce_scatter on dim 0, update this rank's rows,
all_gather), Adam's betas, lr and weight-decay multipliers, and for ANVIL banks the 3-D view the bank is
sharded by, matrix by matrix. It also gives two orders over the labels (``scatter_order``: when gradient
reductions are launched; ``work_order``: when each label is waited for, updated and gathered), which must each
cover every label once.

Everything here is checked before the optimizer touches a tensor, and each problem is reported with the label
and the fix, all problems of one kind at once (e.g. every missing and every unknown label).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

OPTIMS = ("adam", "anvil")
COMMS = ("replicated", "sharded")
TABLE_KEYS = frozenset(
    {"optim", "comms", "adam_betas", "lr_mul", "wd_mul", "reshape", "matrix_lr_mul", "tied_to"}
)
"""Keys a param-table entry may have (the model/optimizer contract); any other key is a typo and refused."""


class ParamTableError(ValueError):
    """The model's parameters, param table or label orders do not fit together; nothing was modified."""


@dataclass(slots=True)
class ParamConfig:
    """Everything the optimizer knows about one parameter. ``lr`` is the only field that changes per step
    (``AnvilAndAdam.set_schedule``), plus ``momentum`` for ANVIL banks and ``adam_betas`` / ``wd_mul`` where
    the training loop schedules them."""

    label: str
    """Key into the param table; the parameter's name with ``.weight`` stripped."""
    optim: str
    """"adam" or "anvil"."""
    comms: str
    """"replicated" (all_reduce, full update on every rank) or "sharded" (reduce_scatter/all_gather dim 0)."""
    shape: tuple[int, ...]
    """The parameter's shape."""
    adam_betas: tuple[float, float] | None
    """Adam's (beta1, beta2); None for ANVIL."""
    lr_mul: float
    """lr multiplier; for ANVIL the shape factor sqrt(max(1, rows / cols)) is folded in at build time."""
    wd_mul: float
    """Weight-decay multiplier."""
    initial_lr: float
    """Base lr (OptimConfig.adam_lr or anvil_lr)."""
    lr: float
    """Current lr = initial_lr * the schedule's multiplier, set every step."""
    weight_decay: float
    """Base weight decay (OptimConfig.adam_weight_decay or anvil_weight_decay)."""
    eps: float
    """Adam's epsilon (unused by ANVIL)."""
    reshape: tuple[int, int, int] | None = None
    """ANVIL: the [n_matrices, rows, cols] view the bank is sharded by; None for Adam."""
    chunk_size: int | None = None
    """Rows (Adam) or matrices (ANVIL) per rank, padded to a multiple of the world size; None: replicated."""
    momentum: float = 0.0
    """ANVIL: the Nesterov lookahead, set every step to the scheduled rail beta."""
    beta2: float = 0.0
    """ANVIL: decay of the lane-energy EMA."""
    matrix_lr_mul: tuple[float, ...] | None = None
    """ANVIL: lr multiplier of each of the n_matrices matrices (0.0 = frozen or pad); None = all 1.0."""
    tied_to: str | None = None
    """Sharded Adam: the label whose transpose this parameter is while tied (embed -> lm_head)."""


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x))


def _is_seq(x: object) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str)


def labelled_params(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.nn.Parameter]:
    """label -> parameter, in the given order; every parameter needs a unique ``label``."""
    params: dict[str, torch.nn.Parameter] = {}
    names: dict[str, str] = {}
    unlabelled, duplicates = [], []
    for name, p in named_params:
        label = getattr(p, "label", None)
        if not isinstance(label, str) or not label:
            unlabelled.append(name)
        elif label in params:
            duplicates.append(f"{label!r} ({names[label]} and {name})")
        else:
            params[label], names[label] = p, name
    if unlabelled:
        raise ParamTableError(
            f"parameters without a string .label: {', '.join(unlabelled)}; the model must set p.label on "
            "each."
        )
    if duplicates:
        raise ParamTableError(
            f"labels used by two parameters: {'; '.join(duplicates)}; labels must be unique."
        )
    if not params:
        raise ParamTableError("named_params is empty: pass model.named_parameters().")
    return params


def check_label_cover(what: str, labels: Iterable[str], expected: Iterable[str]) -> None:
    """Raise unless ``labels`` holds every label of ``expected`` exactly once, listing what is wrong."""
    labels, expected_set = list(labels), set(expected)
    counts = Counter(labels)
    missing = sorted(expected_set - set(labels))
    unknown = sorted(set(labels) - expected_set)
    repeated = sorted(k for k, n in counts.items() if n > 1)
    if missing or unknown or repeated:
        parts = []
        if missing:
            parts.append(f"missing labels {missing}")
        if unknown:
            parts.append(f"unknown labels {unknown}")
        if repeated:
            parts.append(f"labels listed twice {repeated}")
        raise ParamTableError(
            f"{what} must cover every parameter label exactly once: {'; '.join(parts)}. "
            "Fix the model's param table / orders so they match its parameters."
        )


def _check_entry(label: str, entry: object, p: torch.nn.Parameter) -> None:
    def fail(msg: str) -> None:
        raise ParamTableError(f"param table entry {label!r}: {msg}")

    if not isinstance(entry, Mapping):
        fail(f"must be a dict, got {type(entry).__name__}.")
    extra = sorted(set(entry) - TABLE_KEYS)
    if extra:
        fail(f"unknown keys {extra}; allowed keys are {sorted(TABLE_KEYS)}.")
    optim, comms = entry.get("optim"), entry.get("comms")
    if optim not in OPTIMS:
        fail(f"optim={optim!r} is not one of {list(OPTIMS)}.")
    if comms not in COMMS:
        fail(f"comms={comms!r} is not one of {list(COMMS)}.")
    for key in ("lr_mul", "wd_mul"):
        value = entry.get(key, 1.0)
        if not _is_number(value) or value < 0:
            fail(f"{key}={value!r} must be a finite number >= 0.")
    betas = entry.get("adam_betas")
    if optim == "adam":
        if not _is_seq(betas) or len(betas) != 2 or not all(_is_number(b) and 0.0 <= b < 1.0 for b in betas):
            fail(f"adam_betas={betas!r} must be two numbers in [0, 1) for an Adam parameter.")
        for key in ("reshape", "matrix_lr_mul"):
            if entry.get(key) is not None:
                fail(f"{key} is for ANVIL banks only; drop it or set optim='anvil'.")
        if comms == "sharded" and p.dim() == 0:
            fail("a 0-D parameter cannot be sharded on dim 0; use comms='replicated'.")
    else:
        if betas is not None:
            fail("adam_betas must be None for an ANVIL bank.")
        if comms != "sharded":
            fail("ANVIL banks are sharded matrix by matrix; set comms='sharded'.")
        if p.dtype != torch.bfloat16:
            fail(f"ANVIL banks must be bf16 (the fp32 master lives in the optimizer), got {p.dtype}.")
        if not p.is_contiguous():
            fail("an ANVIL bank must be contiguous so that it can be viewed as its reshape.")
        reshape = entry.get("reshape")
        if (
            not _is_seq(reshape)
            or len(reshape) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in reshape)
        ):
            fail(f"reshape={reshape!r} must be [n_matrices, rows, cols], three positive ints.")
        if math.prod(reshape) != p.numel():
            fail(
                f"reshape={list(reshape)} holds {math.prod(reshape)} elements but the parameter "
                f"{list(p.shape)} has {p.numel()}."
            )
        mults = entry.get("matrix_lr_mul")
        if mults is not None and (
            not _is_seq(mults) or len(mults) != reshape[0] or not all(_is_number(m) and m >= 0 for m in mults)
        ):
            fail(f"matrix_lr_mul must be None or {reshape[0]} numbers >= 0 (one per matrix), got {mults!r}.")
    if entry.get("tied_to") is not None and (optim, comms) != ("adam", "sharded"):
        fail("tied_to is only for a sharded Adam table (embed tied to lm_head).")


def build_param_configs(
    params: Mapping[str, torch.nn.Parameter],
    param_table: Mapping[str, Mapping],
    scatter_order: Iterable[str],
    work_order: Iterable[str],
    optim_cfg,
    world_size: int,
) -> dict[str, ParamConfig]:
    """Check the table and both orders against ``params`` and return label -> ParamConfig (params' order)."""
    if not isinstance(param_table, Mapping):
        raise ParamTableError(f"param_table must be a dict label -> entry, got {type(param_table).__name__}.")
    check_label_cover("param_table", list(param_table), params)
    check_label_cover("scatter_order", scatter_order, params)
    check_label_cover("work_order", work_order, params)
    for label, p in params.items():
        _check_entry(label, param_table[label], p)
    for label, p in params.items():
        target = param_table[label].get("tied_to")
        if target is None:
            continue
        if target not in params or target == label:
            raise ParamTableError(f"param table entry {label!r}: tied_to={target!r} is not another label.")
        other = param_table[target]
        if (other["optim"], other["comms"]) != ("adam", "sharded") or other.get("tied_to") is not None:
            raise ParamTableError(
                f"param table entry {label!r}: tied_to={target!r} must name an untied sharded Adam parameter."
            )
        if p.dim() != 2 or tuple(params[target].shape) != tuple(p.shape)[::-1]:
            raise ParamTableError(
                f"param table entry {label!r}: shape {list(p.shape)} is not the transpose of "
                f"{target!r}'s {list(params[target].shape)}."
            )
    cfgs = {}
    for label, p in params.items():
        entry = param_table[label]
        common = dict(
            label=label,
            optim=entry["optim"],
            comms=entry["comms"],
            shape=tuple(p.shape),
            wd_mul=float(entry.get("wd_mul", 1.0)),
        )
        if entry["optim"] == "adam":
            chunk = -(-p.shape[0] // world_size) if entry["comms"] == "sharded" else None
            cfgs[label] = ParamConfig(
                **common,
                adam_betas=(float(entry["adam_betas"][0]), float(entry["adam_betas"][1])),
                lr_mul=float(entry.get("lr_mul", 1.0)),
                initial_lr=optim_cfg.adam_lr,
                lr=optim_cfg.adam_lr,
                weight_decay=optim_cfg.adam_weight_decay,
                eps=optim_cfg.adam_eps,
                chunk_size=chunk,
                tied_to=entry.get("tied_to"),
            )
        else:
            n, rows, cols = (int(v) for v in entry["reshape"])
            mults = entry.get("matrix_lr_mul")
            cfgs[label] = ParamConfig(
                **common,
                adam_betas=None,
                # Orthogonalised updates have unit spectral norm; tall matrices need sqrt(rows/cols) more lr
                # for the same per-element RMS (upstream's shape factor, folded in once here).
                lr_mul=float(entry.get("lr_mul", 1.0)) * math.sqrt(max(1.0, rows / cols)),
                initial_lr=optim_cfg.anvil_lr,
                lr=optim_cfg.anvil_lr,
                weight_decay=optim_cfg.anvil_weight_decay,
                eps=0.0,
                reshape=(n, rows, cols),
                chunk_size=-(-n // world_size),
                momentum=optim_cfg.anvil_momentum,
                beta2=optim_cfg.anvil_beta2,
                matrix_lr_mul=tuple(float(m) for m in mults) if mults is not None else None,
            )
    return cfgs
