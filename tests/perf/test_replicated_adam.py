"""ReplicatedAdam (optim.replicated_impl=fused): its invariants, agreement with the reference, errors."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.distributed_harness import run_ranks
from tests.perf.replicated_adam_cases import (
    AdamCfg,
    assert_bitwise,
    clone_inventory,
    make_inventory,
    pack,
    per_parameter_step,
    random_grads,
    unpack,
    wrong_inside_the_capture,
)
from track_1_short.perf.replicated_adam import (
    SCALAR_TABLE_SLOTS,
    CurrentStream,
    FlatViewError,
    HostScalarTable,
    ReplicatedAdam,
    ReplicatedAdamError,
    UploadRing,
    adam_scalar_table,
    flatten_replicated,
)


def _randomise_moments(states, seed):
    gen = torch.Generator().manual_seed(seed)
    for s in states:
        s["exp_avg"].copy_(torch.randn(s["exp_avg"].shape, generator=gen) * 0.01)
        s["exp_avg_sq"].copy_(torch.rand(s["exp_avg_sq"].shape, generator=gen) * 1e-3)


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _step_both(opt, ref, grads):
    _set_grads(opt.params, grads)
    _set_grads(ref[0], grads)
    opt.launch_reduce()
    opt.update()
    opt.zero_grad()
    per_parameter_step(*ref)


def _assert_same_state(params, states, ref_params, ref_states):
    for i, (p, s, rp, rs) in enumerate(zip(params, states, ref_params, ref_states)):
        label = getattr(p, "label", i)
        assert_bitwise(p, rp, f"{label} param")
        assert_bitwise(s["exp_avg"], rs["exp_avg"], f"{label} exp_avg")
        assert_bitwise(s["exp_avg_sq"], rs["exp_avg_sq"], f"{label} exp_avg_sq")
        assert s["step"] == rs["step"], f"{label} step"


# ---- invariants --------------------------------------------------------------------------------------------


def test_construction_makes_data_and_moments_bitwise_equal_views_of_the_flat_buffers():
    params, cfgs, states = make_inventory(seed=0)
    _randomise_moments(states, seed=1)
    before = [
        (p.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for p, s in zip(params, states)
    ]
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    for group in opt.groups:
        for k, i in enumerate(group.indices):
            span, p, s = group.span(k), params[i], states[i]
            for view, flat in (
                (p.data, group.param),
                (s["exp_avg"], group.exp_avg),
                (s["exp_avg_sq"], group.exp_avg_sq),
            ):
                assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                assert view.data_ptr() == flat[span].data_ptr() and view.numel() == span.stop - span.start
            assert_bitwise(p, before[i][0], "param")
            assert_bitwise(s["exp_avg"], before[i][1], "exp_avg")
            assert_bitwise(s["exp_avg_sq"], before[i][2], "exp_avg_sq")
            assert p.shape == before[i][0].shape


def test_gradient_views_tile_each_flat_gradient_buffer_exactly():
    params, cfgs, states = make_inventory(seed=0)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    for group in opt.groups:
        cursor = group.grad.data_ptr()
        for k, view in enumerate(group.grad_views):
            assert view.data_ptr() == cursor, f"view {k} does not start where view {k - 1} ends"
            assert view.shape == params[group.indices[k]].shape and view.is_contiguous()
            cursor += view.numel() * view.element_size()
        assert cursor == group.grad.data_ptr() + group.grad.numel() * group.grad.element_size()


@pytest.mark.parametrize("first_dtype", [torch.float32, torch.bfloat16])
def test_segment_ids_are_parameter_indices_grouped_by_first_seen_dtype(first_dtype):
    params, cfgs, states = make_inventory(seed=0)
    order = sorted(range(len(params)), key=lambda i: params[i].dtype != first_dtype)  # stable
    params, states = [params[i] for i in order], [states[i] for i in order]
    groups = flatten_replicated(params, states, "cpu")
    assert [g.dtype for g in groups][0] == first_dtype
    assert sorted(i for g in groups for i in g.indices) == list(range(len(params)))
    for group in groups:
        assert group.indices == sorted(group.indices)
        assert all(params[i].dtype == group.dtype for i in group.indices)
        expected = torch.cat([torch.full((params[i].numel(),), i, dtype=torch.int32) for i in group.indices])
        assert torch.equal(group.segment, expected)


def test_a_parameter_without_gradient_is_skipped_whole():
    params, cfgs, states = make_inventory(seed=2, wd_boost=100.0)
    _randomise_moments(states, seed=3)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    gen = torch.Generator().manual_seed(4)
    skipped = 6  # mudd_w2 (bf16)
    before = [
        (p.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone(), s["step"])
        for p, s in zip(params, states)
    ]
    _set_grads(params, random_grads(params, gen, missing={skipped}))
    opt.launch_reduce()
    opt.update()
    for i, (p, s) in enumerate(zip(params, states)):
        moved = not torch.equal(p.detach(), before[i][0])
        if i == skipped:
            assert not moved and s["step"] == before[i][3]
            assert torch.equal(s["exp_avg"], before[i][1]) and torch.equal(s["exp_avg_sq"], before[i][2])
        else:
            assert s["step"] == before[i][3] + 1
            assert not torch.equal(s["exp_avg_sq"], before[i][2])


def test_on_the_cpu_the_table_reaches_the_device_by_a_plain_copy_of_the_host_table():
    params, cfgs, states = make_inventory(seed=5)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    assert opt._ring._events is None and len(opt._ring._slots) == 1 and not opt._ring._slots[0].is_pinned()
    shadow = [{"step": s["step"]} for s in states]
    missing = {0, 9}
    _set_grads(params, random_grads(params, torch.Generator().manual_seed(6), missing=missing))
    opt.launch_reduce()
    opt.update()
    active = [i not in missing for i in range(len(params))]
    expected = adam_scalar_table(params, cfgs, shadow, active)
    assert np.array_equal(opt.table.numpy().view(np.int32), expected.view(np.int32))
    assert [s["step"] for s in shadow] == [s["step"] for s in states]


def test_the_hot_path_table_is_adam_scalar_tables_bit_for_bit_across_slots_and_config_changes():
    params, cfgs, states = make_inventory(seed=15)
    shadow = [{"step": s["step"]} for s in states]
    slots = 3  # fewer than the steps between changes: every slot is reused after each change
    writer = HostScalarTable(cfgs, states, slots)
    host = [np.full((len(params), 8), np.nan, dtype=np.float32) for _ in range(slots)]
    gen = np.random.default_rng(16)
    for step in range(20):
        if step == 7:
            cfgs[2].adam_betas = [0.5, 0.9]  # a beta changes mid-run: every slot must pick it up
        if step == 13:
            cfgs[4].eps = 1e-6
        cfgs[1].lr = 0.008 * (1.0 - step / 30)  # the schedule moves lr every step
        active = [bool(a) for a in gen.random(len(params)) > 0.2]
        slot = step % slots
        writer.write(host[slot], slot, active)
        expected = adam_scalar_table(params, cfgs, shadow, active)
        assert np.array_equal(host[slot].view(np.int32), expected.view(np.int32)), f"step {step}"
        assert [s["step"] for s in states] == [s["step"] for s in shadow], f"step {step}"
    assert len({s["step"] for s in states}) > 1  # some parameters did miss steps


class _FakeEvent:
    """Stands in for torch.cuda.Event on the CPU and logs the ring's protocol."""

    def __init__(self, log, index):
        self.log, self.index = log, index

    def record(self):
        self.log.append(("record", self.index))

    def synchronize(self):
        self.log.append(("wait", self.index))


def _fake_ring(slots):
    """An UploadRing over a CPU target whose events log ("wait"/"record", slot): (ring, target, log, made)."""
    log, made = [], []

    def factory():
        made.append(_FakeEvent(log, len(made)))
        return made[-1]

    target = torch.zeros(4)
    return UploadRing(target, slots=slots, event_factory=factory), target, log, made


def test_upload_ring_rewrites_a_slot_only_after_waiting_on_its_previous_upload():
    ring, target, log, made = _fake_ring(3)
    for step in range(7):
        buffer = ring.host_buffer()
        log.append(("write", ring.slot_index))
        buffer[:] = step
        ring.upload()
        assert torch.equal(target, torch.full((4,), float(step)))
    expected = []
    for step in range(7):
        slot = step % 3
        expected += [("wait", slot), ("write", slot), ("record", slot)]
    assert log == expected
    assert len(made) == 3


def test_host_tensor_waits_like_host_buffer_and_is_the_slot_the_next_upload_reads():
    ring, target, log, _ = _fake_ring(2)
    for step in range(4):
        slot = ring.slot_index
        tensor = ring.host_tensor()
        assert log[-1] == ("wait", slot)
        assert tensor.data_ptr() == ring.host_buffer().ctypes.data == ring.slot_tensor(slot).data_ptr()
        tensor.fill_(step)
        ring.upload()
        assert torch.equal(target, torch.full((4,), float(step)))


def test_a_slot_copied_by_someone_else_is_marked_uploaded_and_waited_on_before_its_next_write():
    # The fused path's CUDA graphs copy the slot themselves; mark_uploaded() then records the slot's event.
    ring, target, log, _ = _fake_ring(2)
    for step in range(5):
        slot = ring.slot_index
        ring.host_buffer()[:] = step
        target.copy_(ring.slot_tensor(slot))  # what a graph's copy node does
        ring.mark_uploaded()
        assert ring.slot_index == (slot + 1) % 2 and torch.equal(target, torch.full((4,), float(step)))
    assert log == [(kind, step % 2) for step in range(5) for kind in ("wait", "record")]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_table_goes_through_pinned_slots_each_waited_on_before_its_next_write(graphs):
    # With CUDA graphs or without, a slot's mark is a CUDA event recorded after its upload.
    params, cfgs, states = make_inventory(seed=7, device="cuda")
    opt = ReplicatedAdam(params, cfgs, states, "cuda", use_cuda_graphs=graphs)
    ring = opt._ring
    assert len(ring._slots) == SCALAR_TABLE_SLOTS and all(s.is_pinned() for s in ring._slots)
    assert len(ring._events) == SCALAR_TABLE_SLOTS
    assert all(isinstance(e, torch.cuda.Event) for e in ring._events)
    gen = torch.Generator().manual_seed(8)
    for step in range(SCALAR_TABLE_SLOTS + 3):
        assert ring.slot_index == step % SCALAR_TABLE_SLOTS
        _set_grads(params, [g.cuda() for g in random_grads(params, gen)])
        opt.launch_reduce()
        opt.update()
        torch.cuda.synchronize()
        slot = ring._slots[step % SCALAR_TABLE_SLOTS]
        assert torch.equal(opt.table.cpu(), slot)
        assert ring._events[step % SCALAR_TABLE_SLOTS].query()


def test_a_flat_snapshot_loads_back_bit_for_bit_and_names_what_differs():
    # What the CUDA-graph check rewinds with, and how they name a buffer a graph got wrong.
    params, cfgs, states = make_inventory(seed=44)
    _randomise_moments(states, seed=45)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    opt.table.copy_(torch.randn(opt.table.shape, generator=torch.Generator().manual_seed(46)))
    before = opt._flat_snapshot()
    grads = [torch.full_like(g.grad, 3.0) for g in opt.groups]
    for t in [opt.table] + [
        getattr(g, n) for g in opt.groups for n in ("param", "grad", "exp_avg", "exp_avg_sq")
    ]:
        t.add_(1.0)
    changed = opt._flat_snapshot()
    assert opt._flat_snapshot_differences(before, changed) == ["table"] + [
        f"{g.dtype} {n}" for g in opt.groups for n in ("param", "grad", "exp_avg", "exp_avg_sq")
    ]
    opt._load_flat_snapshot(before, grads)
    after = opt._flat_snapshot()
    assert opt._flat_snapshot_differences(before, after) == [f"{g.dtype} grad" for g in opt.groups]
    for group, grad in zip(opt.groups, grads):
        assert_bitwise(group.grad, grad, "gradients given to the load")
    opt._load_flat_snapshot(before)
    assert opt._flat_snapshot_differences(before, opt._flat_snapshot()) == []


def _graphs_and_eager(seed):
    params, cfgs, states = make_inventory(seed=seed, wd_boost=100.0, device="cuda")
    _randomise_moments(states, seed=seed + 1)
    twin = clone_inventory(params, cfgs, states)
    graphed = ReplicatedAdam(params, cfgs, states, "cuda")
    eager = ReplicatedAdam(*twin, "cuda", use_cuda_graphs=False)
    assert graphed._graphs is not None and eager._graphs is None
    return graphed, eager


def _graphs_schedule(step, params):
    """Missing gradients on some steps, every bf16 parameter's on one (a dtype with no active parameter)."""
    if step == 5:
        return {i for i, p in enumerate(params) if p.dtype == torch.bfloat16}
    return {step % len(params)} if step % 3 == 0 else set()


@pytest.mark.gpu
def test_the_fused_update_as_cuda_graphs_gives_the_eager_bits_through_every_slot():
    graphed, eager = _graphs_and_eager(seed=40)
    gen = torch.Generator().manual_seed(41)
    for step in range(3 * SCALAR_TABLE_SLOTS):
        grads = random_grads(graphed.params, gen, _graphs_schedule(step, graphed.params))
        if step == 2 * SCALAR_TABLE_SLOTS:  # betas and eps reach the kernels as table data: no recapture
            for opt in (graphed, eager):
                opt.param_cfgs[1].adam_betas = [0.8, 0.95]
                opt.param_cfgs[1].eps = 1e-8
        for opt in (graphed, eager):
            for cfg in opt.param_cfgs:
                cfg.lr = 0.008 * (1.0 - step / 40)
            _set_grads(opt.params, [None if g is None else g.cuda() for g in grads])
            opt.launch_reduce()
            opt.update()
            opt.zero_grad()
    torch.cuda.synchronize()
    assert graphed._graphs.enabled and all(g is not None for g in graphed._graphs.graphs)
    _assert_same_state(graphed.params, graphed.param_states, eager.params, eager.param_states)


@pytest.mark.gpu
def test_a_fused_update_graph_that_disagrees_is_dropped_with_a_warning_and_the_step_stays_right(monkeypatch):
    graphed, eager = _graphs_and_eager(seed=42)
    graphs = graphed._graphs
    wrong_inside_the_capture(monkeypatch, graphs, "_eager", lambda: graphed.groups[0].exp_avg.add_(1.0))
    gen = torch.Generator().manual_seed(43)
    for step in range(4):
        grads = random_grads(graphed.params, gen)
        for opt in (graphed, eager):
            _set_grads(opt.params, [g.cuda() for g in grads])
            opt.launch_reduce()
            if opt is graphed and step == 0:
                warning = r"fused replicated Adam update disagrees .* in torch\.float32 exp_avg;"
                with pytest.warns(UserWarning, match=warning):
                    opt.update()
            else:
                opt.update()
            opt.zero_grad()
    torch.cuda.synchronize()
    assert not graphs.enabled and all(g is None for g in graphs.graphs)
    # Refused, the eager launches still signal the fence the ring's tickets wait on: one per step, plus the
    # refused graph's check replay.
    assert graphs.fence.enqueued == 4 + 1 == graphs.fence.arrived
    _assert_same_state(graphed.params, graphed.param_states, eager.params, eager.param_states)


@pytest.mark.gpu
def test_the_cached_current_stream_follows_a_switch_to_another_stream_and_back():
    current = CurrentStream(torch.device("cuda"))
    assert current() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side
    assert current() == torch.cuda.current_stream()


# ---- agreement with the per-parameter path -----------------------------------------------------------------


def test_fifty_steps_match_the_per_parameter_path_bitwise_with_missing_gradients():
    params, cfgs, states = make_inventory(seed=9, wd_boost=100.0)
    _randomise_moments(states, seed=10)
    ref = clone_inventory(params, cfgs, states)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    gen = torch.Generator().manual_seed(11)
    for step in range(50):
        missing = {step % len(params), (3 * step) % len(params)} if step % 3 == 0 else set()
        cfgs[0].lr = ref[1][0].lr = 0.008 * (1.0 - step / 60)  # the schedule moves lr; both paths see it
        _step_both(opt, ref, random_grads(params, gen, missing))
    _assert_same_state(params, states, ref[0], ref[2])
    assert len({s["step"] for s in states}) > 1  # some parameters did miss steps


def _two_rank_worker(rank, world_size, steps):
    params, cfgs, states = make_inventory(seed=12, wd_boost=100.0)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    for step in range(steps):
        _set_grads(params, _rank_grads(params, rank, step))
        opt.launch_reduce()
        opt.update()
        opt.zero_grad()
    return {
        "params": [pack(p) for p in params],
        "states": [
            {"step": s["step"], "exp_avg": pack(s["exp_avg"]), "exp_avg_sq": pack(s["exp_avg_sq"])}
            for s in states
        ],
        "segments": [pack(g.segment) for g in opt.groups],
    }


def _unpack_result(result):
    return {
        "params": [unpack(p) for p in result["params"]],
        "states": [
            {"step": s["step"], "exp_avg": unpack(s["exp_avg"]), "exp_avg_sq": unpack(s["exp_avg_sq"])}
            for s in result["states"]
        ],
        "segments": [unpack(s) for s in result["segments"]],
    }


def _rank_grads(params, rank, step):
    # Multiples of 1/64 below 2 in magnitude: the sum of two is exact even in bf16, so the average does not
    # depend on how the backend orders or rounds its reduction.
    gen = torch.Generator().manual_seed(1000 * step + rank)
    missing = {4} if step == 2 else set()
    return [
        None if i in missing else (torch.randint(-127, 128, p.shape, generator=gen) / 64).to(p.dtype)
        for i, p in enumerate(params)
    ]


@pytest.mark.slow
def test_two_gloo_ranks_hold_identical_bits_equal_to_one_process_fed_the_averaged_gradients():
    steps = 4
    r0, r1 = (_unpack_result(r) for r in run_ranks(_two_rank_worker, 2, steps))
    for a, b in zip(r0["segments"], r1["segments"]):
        assert torch.equal(a, b)
    for i in range(len(r0["params"])):
        assert_bitwise(r0["params"][i], r1["params"][i], f"param {i} across ranks")
        assert_bitwise(r0["states"][i]["exp_avg"], r1["states"][i]["exp_avg"], f"exp_avg {i} across ranks")

    params, cfgs, states = make_inventory(seed=12, wd_boost=100.0)
    for step in range(steps):
        g0, g1 = _rank_grads(params, 0, step), _rank_grads(params, 1, step)
        _set_grads(
            params,
            [None if a is None else (a.float() + b.float()).div(2).to(a.dtype) for a, b in zip(g0, g1)],
        )
        per_parameter_step(params, cfgs, states)
    _assert_same_state(r0["params"], r0["states"], [p.detach() for p in params], states)


# ---- views stay views --------------------------------------------------------------------------------------


def test_assert_views_intact_names_the_parameter_whose_data_was_rebound():
    params, cfgs, states = make_inventory(seed=13)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    opt.assert_views_intact()
    view = params[2].data
    params[2].data = params[2].data.clone()
    with pytest.raises(FlatViewError, match=r"parameter 2 \(ve_gate_bank\): \.data"):
        opt.assert_views_intact()
    params[2].data = view
    opt.assert_views_intact()


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_assert_views_intact_names_the_parameter_whose_moment_was_rebound(key):
    params, cfgs, states = make_inventory(seed=14)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    states[12][key] = torch.zeros_like(states[12][key])
    with pytest.raises(FlatViewError, match=rf"parameter 12 \(_mudd_gate_scale\): state\['{key}'\]"):
        opt.assert_views_intact()


def test_load_state_dict_copies_in_place_and_keeps_every_view():
    params, cfgs, states = make_inventory(seed=15)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    saved = opt.state_dict()
    _randomise_moments(states, seed=16)  # in place: still views
    for d in saved:
        d["step"] = 7
        d["exp_avg"].fill_(0.25)
    opt.load_state_dict(saved)
    opt.assert_views_intact()
    assert all(s["step"] == 7 and torch.all(s["exp_avg"] == 0.25) for s in states)
    assert all(torch.all(g.exp_avg == 0.25) for g in opt.groups)


def test_load_state_dict_rejects_a_wrong_shape_before_copying_anything():
    params, cfgs, states = make_inventory(seed=17)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    saved = opt.state_dict()
    for d in saved:
        d["exp_avg"].fill_(1.0)
    saved[5]["exp_avg_sq"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"parameter 5 \(mudd_w1\): saved 'exp_avg_sq'"):
        opt.load_state_dict(saved)
    assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in states)


# ---- bad input ---------------------------------------------------------------------------------------------


def _without(cfg, name):
    fields = {k: v for k, v in vars(cfg).items() if k != name}
    return SimpleNamespace(**fields)


def _snapshot(params, states):
    return [(p.data, p.data_ptr(), s.get("exp_avg"), s.get("exp_avg_sq")) for p, s in zip(params, states)]


def _unchanged(params, states, snap):
    return all(
        p.data_ptr() == ptr and s.get("exp_avg") is m and s.get("exp_avg_sq") is v
        for p, s, (_, ptr, m, v) in zip(params, states, snap)
    )


@pytest.mark.parametrize(
    "corrupt, error, match",
    [
        (
            lambda p, c, s: s[3].__setitem__("exp_avg", s[3]["exp_avg"].double()),
            TypeError,
            r"parameter 3 \(post_lambdas\): exp_avg is torch.float64",
        ),
        (
            lambda p, c, s: s[7].__setitem__("exp_avg_sq", torch.zeros(2)),
            ValueError,
            r"parameter 7 \(mudd_w2g\): exp_avg_sq has shape",
        ),
        (
            lambda p, c, s: s[1].pop("exp_avg"),
            ValueError,
            r"parameter 1 \(smear_gate\): state has no tensor 'exp_avg'",
        ),
        (
            lambda p, c, s: p.__setitem__(4, p[2]),
            ValueError,
            r"parameter 4 \(ve_gate_bank\) appears twice \(also at index 2\)",
        ),
        (
            lambda p, c, s: p.__setitem__(0, torch.nn.Parameter(torch.zeros(24, dtype=torch.float16))),
            TypeError,
            "float16",
        ),
        (
            lambda p, c, s: c.__setitem__(8, _without(c[8], "wd_mul")),
            TypeError,
            r"parameter 8 \(mudd_b2\): its config lacks wd_mul",
        ),
        (
            lambda p, c, s: setattr(c[9], "adam_betas", [0.9, 1.0]),
            ValueError,
            r"parameter 9 \(mudd_gate_w1\): adam_betas",
        ),
        (lambda p, c, s: c.pop(), ValueError, "13 parameters but 12 configs"),
    ],
)
def test_bad_input_raises_one_clear_error_before_anything_is_modified(corrupt, error, match):
    params, cfgs, states = make_inventory(seed=18)
    cfgs = [AdamCfg(**vars(c)) for c in cfgs]
    corrupt(params, cfgs, states)
    snap = _snapshot(params, states)
    with pytest.raises(error, match=match):
        ReplicatedAdam(params, cfgs, states, "cpu")
    assert _unchanged(params, states, snap)


def test_empty_parameter_list_is_rejected():
    with pytest.raises(ValueError, match="at least one parameter"):
        ReplicatedAdam([], [], [], "cpu")


def test_update_without_launch_reduce_names_the_missing_call():
    params, cfgs, states = make_inventory(seed=20)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    _set_grads(params, random_grads(params, torch.Generator().manual_seed(0)))
    with pytest.raises(ReplicatedAdamError, match=r"update\(\) called without launch_reduce\(\)"):
        opt.update()
    assert all(s["step"] == 0 for s in states)


def test_launch_reduce_twice_is_rejected_before_copying_again():
    params, cfgs, states = make_inventory(seed=21)
    opt = ReplicatedAdam(params, cfgs, states, "cpu")
    _set_grads(params, random_grads(params, torch.Generator().manual_seed(0)))
    opt.launch_reduce()
    flat = [g.grad.clone() for g in opt.groups]
    _set_grads(params, random_grads(params, torch.Generator().manual_seed(1)))
    with pytest.raises(ReplicatedAdamError, match=r"launch_reduce\(\) called twice"):
        opt.launch_reduce()
    assert all(torch.equal(g.grad, f) for g, f in zip(opt.groups, flat))
