"""AnvilAndAdam end to end on the fake model (tests/optim/fake_model.py), at world sizes 1, 2 and 3 (gloo).

The fake gradients are exact in bf16 when averaged, so a W-rank run and one process fed the averaged gradients
receive bitwise the same gradients. Comparisons are bitwise (``torch.equal``) except for the banks' weights
across world sizes, where batched bf16 matmuls over chunks of different sizes may round differently
(:func:`assert_same_run` gives the bound and why).
"""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch

from tests.distributed_harness import run_ranks
from tests.optim import fake_model as fm
from track_1_short.optim import adam as reference_adam
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig, OptimizerStateError
from track_1_short.optim.anvil_bank import join_master

STEPS = 6
SAVE_AT = 3  # state saved after steps 0..2
SPLIT_AT = 4  # embed unties at the start of step 4
HAS_FUSED = importlib.util.find_spec("track_1_short.perf.replicated_adam") is not None


def make_cfg(impl: str = "reference", bank_update: str = "eager") -> OptimConfig:
    # Rails engage at step 3 so that both the fast-only and the blended momentum run within a few steps.
    return OptimConfig(replicated_impl=impl, rail_engage_step=3, bank_update=bank_update)


def build(impl: str = "reference", named=None, tied: bool = True, bank_update: str = "eager"):
    named = fm.make_params() if named is None else named
    cfg = make_cfg(impl, bank_update)
    opt = AnvilAndAdam(named, fm.param_table(tied), fm.SCATTER_ORDER, fm.WORK_ORDER, cfg)
    return named, opt


def lr_multiplier(step: int) -> float:
    return 1.0 - 0.1 * (step % 8)


def run_steps(named, opt, steps, grads_for, split_at: int | None = SPLIT_AT) -> None:
    """The training loop's calls, in its order, for each step."""
    for s in steps:
        if s == split_at:
            opt.split_embed()
        opt.set_schedule(lr_multiplier(s), 0.85 + 0.01 * (s % 8), s)
        fm.accumulate(named, grads_for(s))
        opt.step(do_adam=s % 2 == 1)


def snapshot(named) -> dict[str, torch.Tensor]:
    return {p.label: p.detach().clone() for _, p in named}


def load_params(named, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for _, p in named:
            p.copy_(values[p.label])


def assert_tree_equal(a, b, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.dtype == torch.uint16:  # few ops exist for uint16; compare the same bits as int16
            a, b = a.view(torch.int16), b.view(torch.int16)
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


BANKS = [label for label, (_, _, entry) in fm.SPECS.items() if entry.get("optim") == "anvil"]


def assert_same_run(got: tuple[dict, dict], want: tuple[dict, dict], where: str) -> None:
    """(params, state dict) of two runs fed the same averaged gradients on different world sizes.

    Bitwise: every Adam parameter, Adam state and pending gradient, and the banks' rails (they see bitwise the
    same gradients). Not bitwise: the banks' weights, mantissas and lane energies, because a rank runs the
    cascade's bf16 batched matmuls on its chunk of matrices, and the CPU kernels round differently by batch
    size (measured: one element of a [4, 24, 8] product one bf16 ulp apart from two [2, 24, 8] products, from
    where it spreads through the rounds). The fp32 masters then agree to 0.08% of their change since the start
    (measured); the bound is 0.5%, the cascade's own bf16 error (test_polar_express.py).
    """
    (got_params, got_sd), (want_params, want_sd) = got, want
    init = {p.label: p.detach() for _, p in fm.make_params()}
    assert_tree_equal(
        {k: v for k, v in got_params.items() if k not in BANKS},
        {k: v for k, v in want_params.items() if k not in BANKS},
        f"{where}: parameters",
    )
    strip = lambda sd: {**sd, "params": {k: v for k, v in sd["params"].items() if k not in BANKS}}
    assert_tree_equal(strip(got_sd), strip(want_sd), f"{where}: state dict")
    for label in BANKS:
        g, w = got_sd["params"][label], want_sd["params"][label]
        assert_tree_equal(g["velocity"], w["velocity"], f"{where}: {label} rails")
        shape = w["mantissa"].shape
        got_master = join_master(got_params[label].view(shape), g["mantissa"]).double()
        want_master = join_master(want_params[label].view(shape), w["mantissa"]).double()
        change = (want_master - init[label].double().view(shape)).norm()
        assert (got_master - want_master).norm() <= 5e-3 * change, f"{where}: {label} master"
        # The lane energies average the squares of those updates: the same relative bound.
        torch.testing.assert_close(
            g["lane_energy"], w["lane_energy"], rtol=5e-3, atol=0, msg=f"{where}: {label}"
        )


def to_bytes(obj) -> bytes:
    # Results cross the process boundary as bytes: a queue of tensors would share them through file
    # descriptors that vanish when the rank's process exits before the test has read them.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _world_worker(rank: int, world: int, impl: str, bank_update: str, other: bytes) -> bytes:
    other_sd, other_params = from_bytes(other)
    grads_for = lambda s: fm.rank_grads(s, rank, world)
    # A run from scratch, saving its state after SAVE_AT steps.
    named, opt = build(impl, bank_update=bank_update)
    run_steps(named, opt, range(SAVE_AT), grads_for)
    mid_sd, mid_params = opt.state_dict(), snapshot(named)
    run_steps(named, opt, range(SAVE_AT, STEPS), grads_for)
    out = {"mid_sd": mid_sd, "mid_params": mid_params, "final": snapshot(named), "final_sd": opt.state_dict()}
    # A fresh optimizer resumed from a state saved by a run of another world size.
    named, opt = build(impl, bank_update=bank_update)
    load_params(named, other_params)
    opt.load_state_dict(other_sd)
    run_steps(named, opt, range(SAVE_AT, STEPS), grads_for)
    out["resumed"], out["resumed_sd"] = snapshot(named), opt.state_dict()
    out["update_fns"] = sorted({bank.update_fn.__name__ for bank in opt.banks.values()})
    opt.assert_views_intact()
    return to_bytes(out)


@pytest.mark.parametrize(
    "world, impl, bank_update",
    [
        pytest.param(
            2, "fused", "eager", marks=pytest.mark.skipif(not HAS_FUSED, reason="no ReplicatedAdam")
        ),
        # Three ranks: lm_head's 16 rows and embed's 40 pad to 18 and 42, mlp_bank's 4 matrices to 6, so the
        # last rank's mlp chunk is all padding; the reference replicated path does one all_reduce per tensor.
        (3, "reference", "eager"),
        # The record presets' Triton bank update (interpreted here) on sharded chunks, the padding one too.
        (3, "reference", "triton"),
    ],
)
@pytest.mark.slow
def test_ranks_match_one_process_fed_averaged_grads_and_state_moves_between_world_sizes(
    world, impl, bank_update
):
    # The single-process reference: world 1, fed the exact average of the ranks' gradients.
    averaged = lambda s: fm.mean_grads(s)
    named, opt = build(impl, bank_update=bank_update)
    run_steps(named, opt, range(SAVE_AT), averaged)
    ref_mid_sd, ref_mid_params = opt.state_dict(), snapshot(named)
    run_steps(named, opt, range(SAVE_AT, STEPS), averaged)
    ref_final, ref_final_sd = snapshot(named), opt.state_dict()

    args = (impl, bank_update, to_bytes((ref_mid_sd, ref_mid_params)))
    ranks = [from_bytes(r) for r in run_ranks(_world_worker, world, *args)]
    r0 = ranks[0]
    want_fn = {"eager": "bank_update_", "triton": "triton_bank_update_"}[bank_update]
    assert all(r["update_fns"] == [want_fn] for r in ranks), [r["update_fns"] for r in ranks]
    # Saved after a non-Adam step: the state carries the accumulating Adam gradients, averaged over ranks.
    assert ref_mid_sd["pending_grads"] and set(r0["mid_sd"]["pending_grads"]) == set(
        ref_mid_sd["pending_grads"]
    )
    assert_same_run((r0["mid_params"], r0["mid_sd"]), (ref_mid_params, ref_mid_sd), f"world {world}, mid-run")
    for rank, r in enumerate(ranks[1:], start=1):
        # Every parameter, banks included, holds the same bits on every rank (the gathers copy them).
        assert_tree_equal(r["final"], r0["final"], f"world {world}: rank {rank} vs rank 0")
        assert_tree_equal(r["resumed"], r0["resumed"], f"world {world}: rank {rank} vs rank 0, resumed")
    ref = (ref_final, ref_final_sd)
    assert_same_run((r0["final"], r0["final_sd"]), ref, f"world {world} vs world 1")
    # World 1 -> world W: the ranks resumed from the single process's state end where it ended.
    assert_same_run((r0["resumed"], r0["resumed_sd"]), ref, f"world {world} resumed from world 1")
    # World W -> world 1: a single process resumed from rank 0's state ends where the W ranks ended.
    named, opt = build(impl, bank_update=bank_update)
    load_params(named, r0["mid_params"])
    opt.load_state_dict(r0["mid_sd"])
    run_steps(named, opt, range(SAVE_AT, STEPS), averaged)
    assert_same_run(
        (snapshot(named), opt.state_dict()), (r0["final"], r0["final_sd"]), f"world 1 from {world}"
    )


def test_fresh_optimizer_loaded_from_state_dict_continues_bit_identically():
    grads = lambda s: fm.rank_grads(s)
    named, opt = build()
    run_steps(named, opt, range(SAVE_AT), grads)
    sd, params = opt.state_dict(), snapshot(named)
    run_steps(named, opt, range(SAVE_AT, STEPS), grads)

    named2, opt2 = build(
        named=fm.make_params(seed=7)
    )  # other initial values: everything must come from the load
    load_params(named2, params)
    opt2.load_state_dict(sd)
    run_steps(named2, opt2, range(SAVE_AT, STEPS), grads)
    assert_tree_equal(snapshot(named2), snapshot(named))
    assert_tree_equal(opt2.state_dict(), opt.state_dict())


def _state_addresses(opt) -> dict:
    ptrs = {(k, r): t.data_ptr() for k, s in opt.states.items() for r, t in s.items() if r != "step"}
    return ptrs | {(k, r): t.data_ptr() for k, b in opt.banks.items() for r, t in b.tensors().items()}


def test_load_state_dict_copies_in_place():
    named, opt = build()
    run_steps(named, opt, range(2), lambda s: fm.rank_grads(s))
    sd = opt.state_dict()
    addresses = _state_addresses(opt)
    opt.reset()
    opt.states["lm_head"]["exp_avg"].zero_()
    opt.load_state_dict(sd)
    assert _state_addresses(opt) == addresses
    opt.assert_views_intact()
    assert_tree_equal(opt.state_dict(), sd)


def test_adam_grads_accumulate_over_a_non_adam_step():
    named, opt = build()
    params = dict((p.label, p) for _, p in named)
    g0, g1 = fm.rank_grads(0), fm.rank_grads(1)
    fm.accumulate(named, g0)
    opt.step(do_adam=False)
    for label, p in params.items():
        if opt.param_cfgs[label].optim == "anvil":
            assert p.grad is None, label  # ANVIL consumed its gradient
        else:
            assert torch.equal(p.grad, g0[label]), label  # Adam's is kept, untouched
    fm.accumulate(named, g1)
    opt.step(do_adam=True)
    assert all(p.grad is None for p in params.values())

    # The Adam update saw g0 + g1: the same as one Adam step fed the sum after a step with no Adam gradient.
    named2, opt2 = build(named=fm.make_params())
    fm.accumulate(named2, {k: v for k, v in g0.items() if opt.param_cfgs[k].optim == "anvil"})
    opt2.step(do_adam=False)
    adam_sum = {k: g0[k] + g1[k] if k in g1 else g0[k] for k in g0 if opt.param_cfgs[k].optim == "adam"}
    fm.accumulate(named2, {k: g1[k] for k in g1 if opt.param_cfgs[k].optim == "anvil"} | adam_sum)
    opt2.step(do_adam=True)
    assert_tree_equal(snapshot(named2), snapshot(named))


def _reference_adam_full(p: torch.Tensor, grads: list[torch.Tensor], cfg, lrs: list[float]) -> torch.Tensor:
    """Adam on the whole tensor, one adam.py update per Adam step."""
    p = p.clone()
    state = {"step": 0, "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    for g, lr in zip(grads, lrs):
        cfg.lr = lr
        reference_adam.adam_update_(p, g, state, cfg)
    return p


def test_sharded_adam_equals_per_parameter_reference_on_the_full_tensor():
    named, opt = build()
    init = snapshot(named)
    grads = lambda s: fm.mean_grads(s)
    run_steps(named, opt, range(STEPS), grads, split_at=None)
    params = snapshot(named)
    lrs = [opt.param_cfgs["lm_head"].initial_lr * lr_multiplier(s) for s in range(1, STEPS, 2)]

    def summed(label, s):
        return grads(s - 1)[label] + grads(s)[label]

    # value_embeds (39 rows: padded at world 2) sees the sum of each pair of steps.
    cfg = opt.param_cfgs["value_embeds"]
    ve_grads = [summed("value_embeds", s) for s in range(1, STEPS, 2)]
    assert torch.equal(params["value_embeds"], _reference_adam_full(init["value_embeds"], ve_grads, cfg, lrs))
    # Tied: lm_head's gradient includes embed's, transposed; embed is lm_head^T after every Adam step.
    cfg = opt.param_cfgs["lm_head"]
    head_grads = [summed("lm_head", s) + summed("embed", s).mT for s in range(1, STEPS, 2)]
    assert torch.equal(params["lm_head"], _reference_adam_full(init["lm_head"], head_grads, cfg, lrs))
    assert torch.equal(params["embed"], params["lm_head"].mT)
    assert opt.states["embed"]["step"] == 0 and not opt.states["embed"]["exp_avg"].any()


def test_split_embed_hands_lm_head_moments_to_embed_then_they_train_apart():
    named, opt = build()
    params = dict((p.label, p) for _, p in named)
    run_steps(named, opt, range(SPLIT_AT), lambda s: fm.rank_grads(s), split_at=None)
    opt.split_embed()
    head, embed = opt.states["lm_head"], opt.states["embed"]
    assert embed["step"] == head["step"] > 0
    assert torch.equal(embed["exp_avg"], head["exp_avg"].mT) and torch.equal(
        embed["exp_avg_sq"], head["exp_avg_sq"].mT
    )
    with pytest.raises(ValueError, match="already split"):
        opt.split_embed()
    run_steps(named, opt, range(SPLIT_AT, STEPS), lambda s: fm.rank_grads(s), split_at=None)
    assert not torch.equal(params["embed"], params["lm_head"].mT)
    assert embed["step"] == head["step"]


def test_split_embed_without_a_tie_is_refused():
    _, opt = build(tied=False)
    with pytest.raises(ValueError, match="no parameter .* is tied"):
        opt.split_embed()


def test_frozen_matrices_never_move():
    named, opt = build()
    init = snapshot(named)
    run_steps(named, opt, range(STEPS), lambda s: fm.rank_grads(s))
    qk = dict((p.label, p) for _, p in named)["qk_bank"]
    assert torch.equal(qk[2], init["qk_bank"][2])  # matrix_lr_mul 0.0, though its gradient is not zero
    assert not torch.equal(qk[0], init["qk_bank"][0])
    assert not opt.banks["qk_bank"].mantissa[2].any()


def test_reset_zeroes_anvil_state_keeps_adam_state_and_reties_embed():
    named, opt = build()
    run_steps(named, opt, range(STEPS), lambda s: fm.rank_grads(s))
    assert not opt.tied
    before = opt.state_dict()
    opt.reset()
    after = opt.state_dict()
    for label, entry in after["params"].items():
        if entry["optim"] == "anvil":
            assert before["params"][label]["velocity"].any()
            assert not any(entry[k].any() for k in ("velocity", "lane_energy", "mantissa")), label
        else:
            assert_tree_equal(entry, before["params"][label], label)
    assert opt.tied
    opt.assert_views_intact()


def test_rails_engage_at_the_configured_step():
    _, opt = build()
    bank = opt.banks["vo_bank"]
    opt.set_schedule(1.0, 0.9, 2)
    assert torch.equal(bank.scalars[:4], torch.tensor([0.9, bank.eff_wd.item(), 0.9, 1.0]))
    opt.set_schedule(1.0, 0.9, 3)  # rail_engage_step
    cfg = make_cfg()
    expected = torch.tensor([0.9, bank.eff_wd.item(), cfg.engaged_fast_beta, cfg.engaged_fast_weight])
    assert torch.equal(bank.scalars[:4], expected)
    # eff_wd = lr * wd_mul * weight_decay and eff_lr_j = lr * lr_mul (with the shape factor) * m_j.
    c = opt.param_cfgs["mlp_bank"]
    opt.set_schedule(0.5, 0.9, 3)
    lr = 0.5 * cfg.anvil_lr
    eff_lr = opt.banks["mlp_bank"].eff_lr.flatten()
    shape_factor = (24 / 8) ** 0.5
    expected_lr = torch.tensor([lr * shape_factor * m for m in (1, 2, 1, 2)], dtype=torch.float32)
    assert torch.equal(eff_lr, expected_lr)
    assert opt.banks["mlp_bank"].eff_wd.item() == pytest.approx(
        lr * c.wd_mul * cfg.anvil_weight_decay, rel=1e-7
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(lr_multiplier=float("nan")),
        dict(lr_multiplier=-1.0),
        dict(rail_beta=1.5),
        dict(step=-1),
        dict(step=1.0),
    ],
)
def test_set_schedule_rejects_bad_values_before_changing_anything(bad):
    _, opt = build()
    opt.set_schedule(0.7, 0.9, 1)
    lrs = {k: c.lr for k, c in opt.param_cfgs.items()}
    args = dict(lr_multiplier=1.0, rail_beta=0.9, step=1) | bad
    with pytest.raises(ValueError, match="set_schedule"):
        opt.set_schedule(**args)
    assert {k: c.lr for k, c in opt.param_cfgs.items()} == lrs


def _mutations():
    def drop(sd):
        del sd["params"]["value_embeds"]

    def extra(sd):
        sd["params"]["ghost"] = sd["params"]["scalars"]

    def shape(sd):
        sd["params"]["lm_head"]["exp_avg"] = torch.zeros(16, 41)

    def dtype(sd):
        sd["params"]["qk_bank"]["mantissa"] = sd["params"]["qk_bank"]["mantissa"].to(torch.int32)

    def kind(sd):
        sd["params"]["scalars"]["optim"] = "anvil"

    def step(sd):
        sd["params"]["scalars"]["step"] = -1

    def fmt(sd):
        sd["format"] = "something/else"

    def pending(sd):
        sd["pending_grads"]["scalars"] = torch.zeros(6)

    return {
        "missing label": (drop, "missing \\['value_embeds'\\]"),
        "unknown label": (extra, "unknown \\['ghost'\\]"),
        "wrong shape": (shape, "'lm_head'\\['exp_avg'\\]"),
        "wrong dtype": (dtype, "'qk_bank'\\['mantissa'\\]"),
        "wrong optimizer": (kind, "'scalars' was saved for optim='anvil'"),
        "bad step": (step, "'scalars': step=-1"),
        "foreign format": (fmt, "format"),
        "bad pending gradient": (pending, "pending gradient of 'scalars'"),
    }


@pytest.mark.parametrize("case", list(_mutations()))
def test_state_dict_from_another_model_is_refused_and_nothing_is_loaded(case):
    mutate, message = _mutations()[case]
    named, opt = build()
    run_steps(named, opt, range(2), lambda s: fm.rank_grads(s))
    bad = opt.state_dict()
    mutate(bad)
    # Make the valid entries differ from the current state, to see that none of them was copied.
    bad["params"]["vo_bank"]["velocity"] = bad["params"]["vo_bank"]["velocity"] + 1
    before = opt.state_dict()
    with pytest.raises(OptimizerStateError, match=message):
        opt.load_state_dict(bad)
    assert_tree_equal(opt.state_dict(), before)


def test_assert_views_intact_names_a_rebound_state_tensor():
    named, opt = build()
    opt.assert_views_intact()
    opt.states["value_embeds"]["exp_avg"] = opt.states["value_embeds"]["exp_avg"].clone()
    with pytest.raises(RuntimeError, match="'value_embeds': its exp_avg"):
        opt.assert_views_intact()


def test_assert_views_intact_names_a_rebound_parameter():
    named, opt = build()
    lm_head = dict((p.label, p) for _, p in named)["lm_head"]
    lm_head.data = lm_head.data.clone()
    with pytest.raises(RuntimeError, match="'lm_head': its param"):
        opt.assert_views_intact()


@pytest.mark.skipif(not HAS_FUSED, reason="no ReplicatedAdam")
def test_fused_and_reference_replicated_paths_give_the_same_parameters_over_many_steps():
    ref_named, ref = build("reference")
    fused_named, fused = build("fused")
    grads = lambda s: fm.rank_grads(s)
    run_steps(ref_named, ref, range(20), grads)
    run_steps(fused_named, fused, range(20), grads)
    ref_params, fused_params = snapshot(ref_named), snapshot(fused_named)
    for label in fm.REPLICATED:
        assert torch.equal(fused_params[label], ref_params[label]), label
    assert_tree_equal(fused.state_dict(), ref.state_dict())
    fused.assert_views_intact()


@pytest.mark.gpu
def test_on_cuda_fused_and_reference_paths_agree_and_a_loaded_state_continues_bitwise():
    cuda = torch.device("cuda")
    grads = lambda s: fm.rank_grads(s)
    ref_named, ref = build("reference", named=fm.make_params(device=cuda))
    fused_named, fused = build("fused", named=fm.make_params(device=cuda))
    run_steps(ref_named, ref, range(SAVE_AT), grads)
    run_steps(fused_named, fused, range(SAVE_AT), grads)
    sd, params = fused.state_dict(), snapshot(fused_named)
    run_steps(ref_named, ref, range(SAVE_AT, STEPS), grads)
    run_steps(fused_named, fused, range(SAVE_AT, STEPS), grads)
    # The fused kernel reproduces the compiled per-parameter Adam bit for bit on CUDA; the rest is shared.
    assert_tree_equal(snapshot(fused_named), snapshot(ref_named))
    assert_tree_equal(fused.state_dict(), ref.state_dict())
    # A fresh optimizer on the GPU, loaded from the mid-run state, ends on the same bits.
    named, opt = build("fused", named=fm.make_params(seed=7, device=cuda))
    load_params(named, params)
    opt.load_state_dict(sd)
    run_steps(named, opt, range(SAVE_AT, STEPS), grads)
    assert_tree_equal(snapshot(named), snapshot(fused_named))
    opt.assert_views_intact()
