"""Shared fixtures of the replicated-Adam tests: configs, a scaled-down parameter inventory, the per-parameter
path.

The inventory has the labels, dtypes, betas and multipliers of the record's 13 replicated tensors, with shapes
shrunk so the Triton interpreter runs fifty steps in seconds (a 0-D tensor and size-1 segments included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from track_1_short import distributed
from track_1_short.model.config import ParamTableConfig
from track_1_short.optim.adam import adam_update_, new_scalar_buffers


@dataclass
class AdamCfg:
    adam_betas: list = field(default_factory=lambda: [0.9, 0.99])
    lr: float = 0.008
    lr_mul: float = 1.0
    eps: float = 1e-10
    weight_decay: float = 0.005
    wd_mul: float = 1.0


# label, shape, dtype: the record's replicated tensors, shapes scaled down; their Adam betas and multipliers
# are the model's param table settings (model/config.py ParamTableConfig).
INVENTORY = [
    ("scalars", (24,), torch.float32),
    ("smear_gate", (1, 12), torch.bfloat16),
    ("ve_gate_bank", (3, 6, 12), torch.bfloat16),
    ("post_lambdas", (11, 2), torch.float32),
    ("resid_lambdas", (11, 2), torch.float32),
    ("mudd_w1", (2, 8, 24), torch.bfloat16),
    ("mudd_w2", (2, 14, 8), torch.bfloat16),
    ("mudd_w2g", (1,), torch.bfloat16),
    ("mudd_b2", (2, 14), torch.bfloat16),
    ("mudd_gate_w1", (2, 8, 24), torch.bfloat16),
    ("mudd_gate_w2", (2, 23, 8), torch.bfloat16),
    ("mudd_gate_b2", (1,), torch.float32),
    ("_mudd_gate_scale", (), torch.float32),
]


def make_inventory(seed: int = 0, wd_boost: float = 1.0, device: str = "cpu"):
    """(params, cfgs, states): fresh leaf parameters with random values and zero moments.

    ``wd_boost`` multiplies every wd_mul, so the cautious decay moves values visibly in few steps.
    """
    gen = torch.Generator().manual_seed(seed)
    params, cfgs, states = [], [], []
    table = ParamTableConfig()
    for label, shape, dtype in INVENTORY:
        hyper = getattr(table, label.lstrip("_"))  # _mudd_gate_scale's entry is mudd_gate_scale
        betas, lr_mul, wd_mul = hyper.betas, hyper.lr_mul, hyper.wd_mul
        value = torch.randn(shape, generator=gen).to(dtype)
        p = torch.nn.Parameter(value.to(device))
        p.label = label
        params.append(p)
        cfgs.append(
            AdamCfg(adam_betas=list(betas), lr_mul=lr_mul, wd_mul=wd_mul * wd_boost, weight_decay=0.5)
        )
        states.append(
            {
                "step": 0,
                "exp_avg": torch.zeros(shape, dtype=torch.float32, device=device),
                "exp_avg_sq": torch.zeros(shape, dtype=torch.float32, device=device),
            }
        )
    return params, cfgs, states


def clone_inventory(params, cfgs, states):
    """Independent copies (new leaves, new state tensors, same configs)."""
    new_params = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.label = getattr(p, "label", None)
        new_params.append(q)
    new_states = [
        {"step": s["step"], "exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone()}
        for s in states
    ]
    return new_params, [AdamCfg(**vars(c)) for c in cfgs], new_states


def random_grads(params, gen: torch.Generator, missing: set[int] = frozenset(), scale: float = 1.0):
    """One gradient per parameter (None for indices in ``missing``), in the parameter's dtype."""
    return [
        None if i in missing else (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
        for i, p in enumerate(params)
    ]


def per_parameter_step(params, cfgs, states, scalars=None) -> None:
    """The reference path: per parameter with a gradient, one all_reduce(AVG) and one adam_update_."""
    scalars = scalars or new_scalar_buffers()
    for p, cfg, state in zip(params, cfgs, states):
        if p.grad is None:
            continue
        distributed.all_reduce_avg(p.grad)
        with torch.no_grad():
            adam_update_(p.data, p.grad, state, cfg, scalars)
        p.grad = None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a tensor (for bitwise equality with torch.equal)."""
    t = t.detach().reshape(-1)
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    differing = (a != b).sum().item()
    assert differing == 0, f"{what}: {differing} of {a.numel()} elements differ in their bits"


def pack(t: torch.Tensor):
    """A tensor as plain picklable data: a spawned rank may exit before a shared-memory tensor is received."""
    t = t.detach().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), bits(t).numpy().copy()


def unpack(packed) -> torch.Tensor:
    dtype_name, shape, raw = packed
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def wrong_inside_the_capture(monkeypatch, owner, method: str, corrupt) -> None:
    """Make ``owner.<method>`` run as before, then, on its second call (the one inside a CUDA graph capture,
    after the eager one), also ``corrupt()``: the graph then writes one more value than the eager call did."""
    original = getattr(owner, method)
    calls = [0]

    def eager_then_wrong(*args):
        original(*args)
        calls[0] += 1
        if calls[0] == 2:
            corrupt()

    monkeypatch.setattr(owner, method, eager_then_wrong)
