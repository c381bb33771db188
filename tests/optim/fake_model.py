"""A tiny stand-in for the model's parameters, in the param-table contract, for the optimizer tests.

It has every kind the optimizer handles: a wide bank with a frozen matrix, a square bank, a tall bank with
per-matrix multipliers, a lm_head / embed pair tied by ``tied_to``, a table whose 39 rows do not divide by 2
ranks, and replicated tensors in bf16 and fp32 (one of them 0-D). Banks of 3 matrices are padded at world
size 2.

Gradients are small integers over 16 whose average over the ranks does not depend on the world size (see
:func:`rank_grads`); every sum and average the optimizer forms of them is exact in bf16, so a run on W ranks
and a single process fed the averaged gradients see bitwise the same gradient.
"""

from __future__ import annotations

import torch

from track_1_short.model.config import ParamTableConfig

BF16, FP32 = torch.bfloat16, torch.float32

# The Adam multipliers come from the model's own param table settings (model/config.py ParamTableConfig), so
# the optimizer tests exercise the record's betas and multipliers; gate_w and _gate_scale stand in for the
# MUDD weights and their gate scale. The shapes are the stand-in's own (small, with the edge cases above).
_TABLE = ParamTableConfig()
_HYPER_OF = {"gate_w": "mudd_w1", "_gate_scale": "mudd_gate_scale"}


def _adam_entry(label: str, **extra) -> dict:
    hyper = getattr(_TABLE, _HYPER_OF.get(label, label))
    return {"adam_betas": list(hyper.betas), "lr_mul": hyper.lr_mul, "wd_mul": hyper.wd_mul, **extra}


_MLP_MULS = [1.0, _TABLE.mlp_proj_lr_mul] * 2  # c_fc, c_proj of each of the two layers

# label: (shape, dtype, param-table entry)
SPECS: dict[str, tuple[list[int], torch.dtype, dict]] = {
    "qk_bank": (
        [3, 8, 24],
        BF16,
        {"optim": "anvil", "reshape": [3, 8, 24], "matrix_lr_mul": [1.0, 1.0, 0.0]},
    ),
    "vo_bank": ([2, 16, 16], BF16, {"optim": "anvil", "reshape": [2, 16, 16]}),
    "mlp_bank": ([2, 2, 24, 8], BF16, {"optim": "anvil", "reshape": [4, 24, 8], "matrix_lr_mul": _MLP_MULS}),
    "lm_head": ([16, 40], BF16, _adam_entry("lm_head", optim="adam", comms="sharded")),
    "embed": ([40, 16], BF16, _adam_entry("embed", optim="adam", comms="sharded", tied_to="lm_head")),
    "value_embeds": ([39, 16], BF16, _adam_entry("value_embeds", optim="adam", comms="sharded")),
    "scalars": ([5], FP32, _adam_entry("scalars")),
    "smear_gate": ([1, 12], BF16, _adam_entry("smear_gate")),
    "post_lambdas": ([3, 2], FP32, _adam_entry("post_lambdas")),
    "gate_w": ([2, 3, 4], BF16, _adam_entry("gate_w")),
    "_gate_scale": ([], FP32, _adam_entry("_gate_scale")),
}
REPLICATED = ["scalars", "smear_gate", "post_lambdas", "gate_w", "_gate_scale"]
SCATTER_ORDER = ["qk_bank", "vo_bank", "mlp_bank", "value_embeds", "lm_head", "embed", *REPLICATED]
WORK_ORDER = ["qk_bank", "vo_bank", "lm_head", "embed", "value_embeds", *REPLICATED, "mlp_bank"]


def param_table(tied: bool = True) -> dict[str, dict]:
    table = {}
    for label, (_, _, entry) in SPECS.items():
        entry = dict(entry)
        entry.setdefault("comms", "sharded" if entry.get("optim") == "anvil" else "replicated")
        entry.setdefault("optim", "adam")
        entry.setdefault("adam_betas", None)
        entry.setdefault("lr_mul", 1.0)
        entry.setdefault("wd_mul", 1.0)
        if not tied:
            entry.pop("tied_to", None)
        table[label] = entry
    return table


def make_params(seed: int = 0, device: str | torch.device = "cpu") -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) pairs with ``.label`` set; the same values for the same seed on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, (shape, dtype, _) in SPECS.items():
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(device, dtype))
        p.label = label
        out.append((f"{label}.weight" if p.dim() >= 2 else label, p))
    with torch.no_grad():
        by_label = {p.label: p for _, p in out}
        by_label["embed"].copy_(by_label["lm_head"].mT)  # tied: embed starts as lm_head^T
    return out


def clone_params(named) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for name, p in named:
        q = torch.nn.Parameter(p.detach().clone())
        q.label = p.label
        out.append((name, q))
    return out


def missing_grad(label: str, step: int) -> bool:
    """Parameters that get no gradient on some steps (the same on every rank), to exercise the skips."""
    return (label == "_gate_scale" and step % 4 == 1) or (label == "vo_bank" and step == 2)


def _ints(shape, step: int, index: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((step * 1009 + index) * 1013 + rank + 1)
    return torch.randint(-4, 5, shape, generator=gen).float()


def rank_grads(step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradient of every parameter at training step ``step``, out of ``world`` ranks.

    g_r = (base + e_r - e_{r+1 mod world}) / 16 with small random integers base, e: the ranks differ, but
    their average is base / 16 for any world size, and every partial sum the reductions form is an integer of
    at most 7 bits over 16, exact in bf16.
    """
    out = {}
    for i, (label, (shape, dtype, _)) in enumerate(SPECS.items()):
        if missing_grad(label, step):
            continue
        g = _ints(shape, step, i, -1)
        if world > 1:
            g = g + _ints(shape, step, i, rank) - _ints(shape, step, i, (rank + 1) % world)
        out[label] = (g / 16).to(dtype)
    return out


def mean_grads(step: int) -> dict[str, torch.Tensor]:
    """The exact average over any number of ranks of :func:`rank_grads` (= a world of one's gradient)."""
    return rank_grads(step)


def accumulate(named, grads: dict[str, torch.Tensor]) -> None:
    """What backward does: set .grad where it is None, else add into it."""
    for _, p in named:
        g = grads.get(p.label)
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.to(p.device, copy=True)
        else:
            p.grad.add_(g.to(p.device))
