"""ReplicatedAdam(impl="device"): same bits as the other paths, device table, gathered gradients, guards.

On the CPU the mode runs eagerly (Triton interpreter, gloo); the CUDA-graph tests are marked gpu.
"""

import collections

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
    unpack,
    wrong_inside_the_capture,
)
from track_1_short import distributed
from track_1_short.optim.adam import first_moment_correction, second_moment_correction
from track_1_short.perf import replicated_adam_device as dev
from track_1_short.perf.host_step import HOSTS, InstrumentedHostStep
from track_1_short.perf.kernels import replicated_adam as kernels
from track_1_short.perf.replicated_adam import (
    ReplicatedAdam,
    ReplicatedAdamError,
    adam_scalar_table,
)


class Trainer:
    """A parameter set with a loss whose gradient is a chosen weight per parameter, and one Adam path."""

    def __init__(self, params, cfgs, states, impl):
        self.params, self.cfgs, self.states = params, cfgs, states
        # "device_python": impl="device" with the Python reference of its host step (perf/host_step.py).
        host = "python" if impl == "device_python" else "native"
        impl = "device" if impl == "device_python" else impl
        self.opt = (
            None if impl == "reference" else ReplicatedAdam(params, cfgs, states, "cpu", impl=impl, host=host)
        )

    def backward(self, weights, missing=frozenset()):
        loss = sum(
            (p.float() * w).sum() for i, (p, w) in enumerate(zip(self.params, weights)) if i not in missing
        )
        loss.backward()

    def train_step(self, weights, missing, do_adam):
        self.backward(weights, missing)
        if not do_adam:
            return
        if self.opt is None:
            per_parameter_step(self.params, self.cfgs, self.states)
        else:
            self.opt.launch_reduce()
            self.opt.update()
            self.opt.zero_grad()


def _weights(params, gen, scale=1.0):
    return [torch.randn(p.shape, generator=gen) * scale for p in params]


def _assert_same(a: Trainer, b: Trainer):
    for i in range(len(a.params)):
        label = a.params[i].label
        assert_bitwise(a.params[i], b.params[i], f"{label} param")
        assert_bitwise(a.states[i]["exp_avg"], b.states[i]["exp_avg"], f"{label} exp_avg")
        assert_bitwise(a.states[i]["exp_avg_sq"], b.states[i]["exp_avg_sq"], f"{label} exp_avg_sq")
        assert a.states[i]["step"] == b.states[i]["step"], f"{label} step"


def _trainers(seed, impls=("reference", "fused", "device")):
    params, cfgs, states = make_inventory(seed=seed, wd_boost=100.0)
    out = []
    for impl in impls:
        p, c, s = clone_inventory(params, cfgs, states)
        out.append(Trainer(p, c, s, impl))
    return out


def _missing(step, n):
    # Every third step one parameter has no gradient; parameter 4 none for a whole Adam window (steps 8, 9).
    missing = {step % n} if step % 3 == 0 else set()
    return missing | ({4} if step in (8, 9) else set())


# ---- same results as the other paths ----------------------------------------------------------------------


def test_device_mode_equals_the_reference_and_fused_paths_with_accumulation_and_missing_gradients():
    trainers = _trainers(seed=0, impls=("reference", "fused", "device", "device_python"))
    gen = torch.Generator().manual_seed(1)
    for step in range(24):
        weights = _weights(trainers[0].params, gen)
        lr = 0.008 * (1.0 - step / 30)
        for t in trainers:
            for cfg in t.cfgs:
                cfg.lr = lr
            t.train_step(weights, _missing(step, len(weights)), do_adam=step % 2 == 1)
    reference, fused, device, device_python = trainers
    _assert_same(device, reference)
    _assert_same(device_python, reference)
    _assert_same(fused, reference)
    steps = [s["step"] for s in device.states]
    assert steps[4] == 11 and max(steps) == 12  # parameter 4 skipped the window without gradients


def test_changing_betas_or_eps_midway_keeps_the_device_mode_bitwise():
    trainers = _trainers(seed=2, impls=("reference", "device"))
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        if step == 6:
            for t in trainers:
                t.cfgs[1].adam_betas = [0.5, 0.9]
                t.cfgs[3].eps = 1e-6
        weights = _weights(trainers[0].params, gen)
        for t in trainers:
            t.train_step(weights, set(), do_adam=step % 2 == 1)
    _assert_same(trainers[1], trainers[0])


CHANGES = {
    "beta1": lambda c: setattr(c, "adam_betas", [0.5, c.adam_betas[1]]),
    "beta2": lambda c: setattr(c, "adam_betas", [c.adam_betas[0], 0.9]),
    "eps": lambda c: setattr(c, "eps", 1e-2),  # above sqrt(v) here, so it moves the step
    "lr": lambda c: setattr(c, "lr", 0.02),
    "lr_mul": lambda c: setattr(c, "lr_mul", 3.0 * c.lr_mul),
    "weight_decay": lambda c: setattr(c, "weight_decay", 50.0),
    "wd_mul": lambda c: setattr(c, "wd_mul", 100.0 * c.wd_mul),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_device_mode_follows_a_change_of_each_hyperparameter_alone(name):
    # The table's static part (betas, eps) is rebuilt only when a change is noticed and the per-step part
    # (lr, multipliers, decay) is uploaded every step: one hyperparameter changes (on every parameter),
    # nothing else, so a refresh that misses it leaves the device mode on the old value. The third run, on
    # the reference path without the change, shows that the change is visible in the bits at all.
    changed_ref, changed_dev, unchanged = _trainers(seed=4, impls=("reference", "device", "reference"))
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        if step == 2:
            for t in (changed_ref, changed_dev):
                for cfg in t.cfgs:
                    CHANGES[name](cfg)
        weights = _weights(changed_ref.params, gen, scale=0.03)
        for t in (changed_ref, changed_dev, unchanged):
            t.train_step(weights, set(), do_adam=step % 2 == 1)
    _assert_same(changed_dev, changed_ref)
    assert any(not torch.equal(a, b) for a, b in zip(changed_ref.params, unchanged.params)), name


def test_checkpoint_round_trip_resumes_bit_for_bit_with_state_loaded_in_place():
    reference, device = _trainers(seed=4, impls=("reference", "device"))
    gen = torch.Generator().manual_seed(5)
    schedule = [(_weights(reference.params, gen), step % 2 == 1) for step in range(12)]
    for weights, do_adam in schedule[:6]:
        reference.train_step(weights, set(), do_adam)
        device.train_step(weights, set(), do_adam)
    saved_params = [p.detach().clone() for p in device.params]
    saved_state = device.opt.state_dict()

    # A fresh model and optimizer (new flat buffers), values loaded in place as a checkpoint load does.
    params, cfgs, states = make_inventory(seed=99, wd_boost=100.0)
    resumed = Trainer(params, device.cfgs, states, "device")
    with torch.no_grad():
        for p, value in zip(params, saved_params):
            p.copy_(value)
    addresses = [p.data_ptr() for p in params]
    resumed.opt.load_state_dict(saved_state)
    resumed.opt.assert_views_intact()
    assert [p.data_ptr() for p in params] == addresses
    for weights, do_adam in schedule[6:]:
        reference.train_step(weights, set(), do_adam)
        resumed.train_step(weights, set(), do_adam)
    _assert_same(resumed, reference)


def _device_rank_worker(rank, world_size, steps):
    params, cfgs, states = make_inventory(seed=6, wd_boost=100.0)
    trainer = Trainer(params, cfgs, states, "device")
    for step in range(steps):
        trainer.train_step(_rank_weights(params, rank, step), set(), do_adam=step % 2 == 1)
    return [pack(p) for p in params] + [pack(s[k]) for s in states for k in ("exp_avg", "exp_avg_sq")]


def _rank_weights(params, rank, step):
    # Multiples of 1/64 below 1 in magnitude: two steps accumulated on two ranks sum exactly even in bf16,
    # so the average does not depend on how the backend orders or rounds its reduction.
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(-63, 64, p.shape, generator=gen) / 64 for p in params]


@pytest.mark.slow
def test_two_gloo_ranks_in_device_mode_agree_and_equal_one_process_fed_the_averaged_gradients():
    steps = 4
    r0, r1 = ([unpack(x) for x in r] for r in run_ranks(_device_rank_worker, 2, steps))
    for k, (a, b) in enumerate(zip(r0, r1)):
        assert_bitwise(a, b, f"tensor {k} across ranks")
    params, cfgs, states = make_inventory(seed=6, wd_boost=100.0)
    single = Trainer(params, cfgs, states, "reference")
    for step in range(steps):
        w0, w1 = _rank_weights(params, 0, step), _rank_weights(params, 1, step)
        single.train_step([(a + b) / 2 for a, b in zip(w0, w1)], set(), do_adam=step % 2 == 1)
    expected = [p.detach() for p in params] + [s[k] for s in states for k in ("exp_avg", "exp_avg_sq")]
    for k, (a, b) in enumerate(zip(r0, expected)):
        assert_bitwise(a, b, f"tensor {k} against one process")


# ---- the device table -----------------------------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
def test_device_table_equals_the_host_table_bitwise(host):
    n = 9
    betas = [[0.9, 0.99], [0.0, 0.9], [0.5, 0.95], [0.9, 0.999], [0.75, 0.9999], [0.9, 0.99], [0.99, 0.0]]
    cfgs = [
        AdamCfg(
            adam_betas=betas[i % len(betas)],
            lr=0.0123 * (1 + i / 7),
            lr_mul=[5.0, 0.01, 70.0, 0.25][i % 4],
            weight_decay=[0.005, 2.25, 0.0][i % 3],
            wd_mul=[0.0, 1.0, 150.0][i % 3],
            eps=1e-10,
        )
        for i in range(n)
    ]
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]
    states = [{"step": s, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} for s in range(n)]
    states[2]["step"] = 5000  # past the saturation of 0.5 and 0.95: the tables' last entry
    states[3]["step"] = 40000  # past 0.999's
    opt = ReplicatedAdam(params, cfgs, states, "cpu", impl="device", host=host)
    step = opt._device_mode
    active = [i not in (1, 6) for i in range(n)]
    for p, is_active in zip(params, active):
        p.grad = torch.ones(3) if is_active else None
    shadow = [{"step": s["step"]} for s in states]
    step._read_gradients()
    step._write_inputs()
    kernels.device_scalar_table_(opt.table, step.inputs, step.corrections, step.correction_index)
    expected = adam_scalar_table(params, cfgs, shadow, active)
    assert [s["step"] for s in states] == [s["step"] for s in shadow]
    assert np.array_equal(opt.table.numpy().view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.95, 0.99, 0.999])
def test_correction_tables_reach_exactly_one_and_stay_there(beta):
    for fn in (first_moment_correction, second_moment_correction):
        table = dev.correction_table(beta, fn)
        last = len(table) - 1
        assert table == [fn(beta, t) for t in range(last + 1)]
        assert table[-1] == 1.0
        assert all(fn(beta, t) == 1.0 for t in range(last, 3 * last + 10))
        assert len(table) <= dev.correction_length(beta)


# ---- the gather -----------------------------------------------------------------------------------------


def test_gradients_stay_where_autograd_puts_them_and_the_gather_copies_their_bits_zeros_if_missing():
    (trainer,) = _trainers(seed=7, impls=("device",))
    opt = trainer.opt
    assert all(p.grad is None for p in trainer.params)  # construction leaves .grad alone
    gen = torch.Generator().manual_seed(8)
    trainer.backward(_weights(trainer.params, gen), missing={3})
    trainer.backward(_weights(trainer.params, gen), missing={3})  # autograd accumulates, as for "fused"
    buffers = [
        (g.grad.data_ptr(), g.grad.data_ptr() + g.grad.numel() * g.grad.element_size()) for g in opt.groups
    ]
    for i, p in enumerate(trainer.params):
        if i != 3:
            assert not any(lo <= p.grad.data_ptr() < hi for lo, hi in buffers), (
                f"grad {i} is in a flat buffer"
            )
    for group in opt.groups:
        group.grad.fill_(float("nan"))  # whatever the gather does not write stays NaN
    expected = [p.grad.clone() if p.grad is not None else None for p in trainer.params]
    opt.launch_reduce()
    assert opt._device_mode.host.arrived() == [i != 3 for i in range(len(trainer.params))]
    # One process: the gather waits for update(), and the update reads the gathered values, never writes them.
    assert opt._device_mode.gather_in_update
    opt.update()
    for group in opt.groups:
        for k, i in enumerate(group.indices):
            got = group.grad[group.span(k)]
            if i == 3:
                assert_bitwise(got, torch.zeros_like(got), "missing gradient's slice")
            else:
                assert_bitwise(got, expected[i].reshape(-1), f"gathered grad {i}")
    assert [s["step"] for s in trainer.states] == [0 if i == 3 else 1 for i in range(len(trainer.params))]


def test_a_gradient_present_at_construction_is_gathered_and_counts_as_active():
    params, cfgs, states = make_inventory(seed=19)
    grads = [torch.full(p.shape, 0.5).to(p.dtype) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = ReplicatedAdam(params, cfgs, states, "cpu", impl="device")
    assert all(p.grad is g for p, g in zip(params, grads))
    opt.launch_reduce()
    opt.update()
    for group in opt.groups:
        assert torch.all(group.grad == 0.5)
    assert all(s["step"] == 1 for s in states)


def test_with_the_gather_in_launch_reduce_a_late_gradient_waits_for_the_next_step_as_in_the_fused_path():
    # Several processes gather in launch_reduce() (the reduce follows); one process refuses an in-place change
    # in between (the test below), so this runs the gather where several processes have it.
    fused, device = _trainers(seed=20, impls=("fused", "device"))
    device.opt._device_mode.gather_in_update = False
    gen = torch.Generator().manual_seed(21)
    first, late, third = (_weights(fused.params, gen) for _ in range(3))
    for t in (fused, device):
        t.backward(first)
        t.opt.launch_reduce()
        t.backward(late)  # accumulates into .grad after the gather: not part of this update
        t.opt.update()
        t.backward(third)  # the next step's gradient is late + third
        t.opt.launch_reduce()
        t.opt.update()
        t.opt.zero_grad()
    _assert_same(device, fused)


@pytest.mark.parametrize("gather_in_update", [True, False], ids=["one_graph", "gather_graph"])
def test_gradients_dropped_or_replaced_after_launch_reduce_give_the_fused_bits(gather_in_update):
    # Gathered in launch_reduce() (several processes), what happens to .grad afterwards belongs to the next
    # step, changes in place included; gathered in update() (one process), launch_reduce() holds the gradients
    # it saw, and an in-place change is refused (the test below).
    fused, device = _trainers(seed=32, impls=("fused", "device"))
    device.opt._device_mode.gather_in_update = gather_in_update
    gen = torch.Generator().manual_seed(33)
    kinds = 2 if gather_in_update else 3
    for step in range(6):
        weights, other = _weights(fused.params, gen), _weights(fused.params, gen)
        for t in (fused, device):
            t.backward(weights)
            t.opt.launch_reduce()
            for i, p in enumerate(t.params):
                kind = (i + step) % kinds
                if kind == 0:
                    p.grad = None
                elif kind == 1:
                    p.grad = other[i].to(p.dtype)
                else:
                    p.grad.mul_(2.0)
            t.opt.update()
            t.opt.zero_grad()
    _assert_same(device, fused)


@pytest.mark.parametrize("impl", ["device", "device_python"])
def test_a_gradient_changed_in_place_after_launch_reduce_is_refused_naming_it_before_anything_is_written(
    impl,
):
    (trainer,) = _trainers(seed=34, impls=(impl,))
    opt = trainer.opt
    trainer.backward(_weights(trainer.params, torch.Generator().manual_seed(35)))
    opt.launch_reduce()
    trainer.params[5].grad.mul_(2.0)  # mudd_w1
    params = [p.detach().clone() for p in trainer.params]
    moments = [s["exp_avg"].clone() for s in trainer.states]
    with pytest.raises(ReplicatedAdamError, match=r"parameter 5 \(mudd_w1\): \.grad was changed in place"):
        opt.update()
    for i, (p, s) in enumerate(zip(trainer.params, trainer.states)):
        assert_bitwise(p, params[i], f"param {i} after the refusal")
        assert_bitwise(s["exp_avg"], moments[i], f"exp_avg {i} after the refusal")
        assert s["step"] == 0, f"step {i} after the refusal"


def test_zero_grad_drops_every_gradient():
    (trainer,) = _trainers(seed=17, impls=("device",))
    trainer.backward(_weights(trainer.params, torch.Generator().manual_seed(18)))
    trainer.opt.zero_grad()
    assert all(p.grad is None for p in trainer.params)


@pytest.mark.parametrize("impl", ["device", "device_python"])
def test_a_non_contiguous_gradient_is_refused_naming_the_parameter_before_anything_is_written(impl):
    (trainer,) = _trainers(seed=15, impls=(impl,))
    opt = trainer.opt
    trainer.backward(_weights(trainer.params, torch.Generator().manual_seed(16)))
    p = trainer.params[3]  # post_lambdas, [11, 2]
    p.grad = torch.randn(2, 11).t()
    before = [g.grad.clone() for g in opt.groups]
    with pytest.raises(ValueError, match=r"parameter 3 \(post_lambdas\): \.grad is not contiguous"):
        opt.launch_reduce()
    for group, grad in zip(opt.groups, before):
        assert_bitwise(group.grad, grad, "flat gradients after the refusal")
    p.grad = p.grad.contiguous()  # the fix the message names; the step then runs
    opt.launch_reduce()
    opt.update()


# ---- call order and bad input ---------------------------------------------------------------------------


def test_call_order_errors_name_the_call():
    (trainer,) = _trainers(seed=22, impls=("device",))
    with pytest.raises(ReplicatedAdamError, match=r"update\(\) called without launch_reduce\(\)"):
        trainer.opt.update()
    trainer.opt.launch_reduce()
    with pytest.raises(ReplicatedAdamError, match=r"launch_reduce\(\) called twice"):
        trainer.opt.launch_reduce()
    with pytest.raises(ReplicatedAdamError, match=r"zero_grad\(\) called between"):
        trainer.opt.zero_grad()


def test_a_beta_too_close_to_one_for_the_correction_table_is_rejected():
    params, cfgs, states = make_inventory(seed=24)
    cfgs[7].adam_betas = [0.9, 1 - 1e-6]
    with pytest.raises(ValueError, match=r"parameter 7 \(mudd_w2g\): beta .* too close to 1"):
        ReplicatedAdam(params, cfgs, states, "cpu", impl="device")


# ---- CUDA graphs (GPU) ----------------------------------------------------------------------------------


def _cuda_pair(seed, gather_in_update=True, host="native"):
    """A fused and a device ReplicatedAdam on the same values; ``gather_in_update=False`` makes the device one
    gather in launch_reduce() through its own graph, as several processes do (one process has no reduce to
    capture, so only the gather moves)."""
    params, cfgs, states = make_inventory(seed=seed, wd_boost=100.0, device="cuda")
    fused = ReplicatedAdam(*clone_inventory(params, cfgs, states), "cuda", impl="fused")
    device = ReplicatedAdam(params, cfgs, states, "cuda", impl="device", host=host)
    device._device_mode.gather_in_update = gather_in_update
    return fused, device


def _cuda_step(opt, weights, do_adam):
    loss = sum((p.float() * w).sum() for p, w in zip(opt.params, weights))
    loss.backward()
    if do_adam:
        opt.launch_reduce()
        opt.update()
        opt.zero_grad()


@pytest.mark.gpu
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("gather_in_update", [True, False], ids=["one_graph", "gather_graph"])
@pytest.mark.parametrize("rows_in_place", [False, True], ids=["rows_uploaded", "rows_read_in_place"])
def test_cuda_graph_mode_equals_the_fused_path_bitwise_over_a_hundred_adam_steps(
    gather_in_update, host, rows_in_place
):
    fused, device = _cuda_pair(seed=25, gather_in_update=gather_in_update, host=host)
    device._device_mode.rows_in_place = rows_in_place
    gen = torch.Generator().manual_seed(26)
    for step in range(200):
        weights = [w.cuda() for w in _weights(fused.params, gen)]
        _cuda_step(fused, weights, step % 2 == 1)
        _cuda_step(device, weights, step % 2 == 1)
    mode = device._device_mode
    assert mode.graphs_trusted and mode.update_graph is not None
    assert (mode.gather_graph is None) == gather_in_update  # one replay per step, or two
    torch.cuda.synchronize()
    # 100 Adam steps: the first runs eagerly and replays once to check the capture, the others replay; each
    # of those runs signals the fence once, and every signal has landed in the pinned count.
    assert mode._fence.enqueued == 101 == mode._fence.arrived
    for i, (a, b) in enumerate(zip(device.params, fused.params)):
        assert_bitwise(a, b, f"param {i}")
        assert_bitwise(device.param_states[i]["exp_avg_sq"], fused.param_states[i]["exp_avg_sq"], f"v {i}")


def _counting(counts):
    """An InstrumentedHostStep wrap that counts each per-step call by name."""

    def wrap(name, call):
        def counted(*args, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)

        return counted

    return wrap


@pytest.mark.gpu
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("replay_in_host_step", [True, False], ids=["host_step_launches", "torch_replays"])
def test_the_trusted_update_graph_is_launched_by_the_host_step_or_by_torch_with_the_same_bits(
    monkeypatch, replay_in_host_step, host
):
    fused, device = _cuda_pair(seed=29, host=host)
    mode = device._device_mode
    mode.replay_in_host_step = replay_in_host_step
    counts = collections.Counter()
    mode.host = InstrumentedHostStep(mode.host, _counting(counts))
    replay = torch.cuda.CUDAGraph.replay

    def counted_replay(graph):
        if graph is mode.update_graph:  # not the fused path's own graphs
            counts["torch_replay"] += 1
        return replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted_replay)
    gen = torch.Generator().manual_seed(30)
    for step in range(40):
        weights = [w.cuda() for w in _weights(fused.params, gen)]
        _cuda_step(fused, weights, step % 2 == 1)
        _cuda_step(device, weights, step % 2 == 1)
    torch.cuda.synchronize()
    # 20 Adam steps: the first stages its rows, runs eagerly, captures and replays once to check; the other 19
    # launch the graph, from the host step's one call or from torch after stage_update.
    assert counts["stage_and_replay"] == (19 if replay_in_host_step else 0)
    assert counts["stage_update"] == (1 if replay_in_host_step else 20)
    assert counts["torch_replay"] == (1 if replay_in_host_step else 20)
    # The first step signals eagerly and in its check, then one signal per launch.
    assert mode._fence.enqueued == 21 == mode._fence.arrived
    for i, (a, b) in enumerate(zip(device.params, fused.params)):
        assert_bitwise(a, b, f"param {i}")
        assert_bitwise(device.param_states[i]["exp_avg"], fused.param_states[i]["exp_avg"], f"m {i}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "method, buffer, gather_in_update, match",
    [
        ("_launch_update_kernels", "exp_avg", True, "CUDA graph of the replicated Adam step disagrees"),
        (
            "_launch_update_kernels",
            "grad",
            True,
            r"CUDA graph of the replicated Adam step disagrees with the eager step in .*grad",
        ),
        ("_launch_update_kernels", "exp_avg", False, "CUDA graph of the replicated Adam step disagrees"),
        ("_gather", "grad", False, "CUDA graph of the replicated gradient gather disagrees"),
    ],
)
def test_cuda_graph_that_disagrees_with_the_eager_call_is_refused(
    monkeypatch, method, buffer, gather_in_update, match
):
    _, device = _cuda_pair(seed=27, gather_in_update=gather_in_update)
    step = device._device_mode
    wrong_inside_the_capture(monkeypatch, step, method, lambda: getattr(device.groups[0], buffer).add_(1.0))
    weights = [w.cuda() for w in _weights(device.params, torch.Generator().manual_seed(28))]
    with pytest.raises(RuntimeError, match=match):
        _cuda_step(device, weights, do_adam=True)
    assert not step.graphs_trusted and step.update_graph is None
    assert method != "_gather" or step.gather_graph is None


@pytest.mark.gpu
@pytest.mark.parametrize("gather_in_update", [True, False], ids=["one_graph", "gather_graph"])
def test_gradients_dropped_right_after_launch_reduce_and_their_memory_reused_give_the_fused_bits(
    gather_in_update,
):
    # The gather runs late (behind a spin kernel) while the host drops every .grad and fills new tensors of
    # the same sizes with NaN: the caching allocator may hand the freed blocks straight back. With the gather
    # in launch_reduce() stream order keeps it reading the gradients rather than the NaNs; with the gather in
    # update() the references launch_reduce() holds keep the blocks from being handed back.
    fused, device = _cuda_pair(seed=30, gather_in_update=gather_in_update)
    gen = torch.Generator().manual_seed(31)
    for _ in range(6):
        weights = [w.cuda() for w in _weights(fused.params, gen)]
        _cuda_step(fused, weights, do_adam=True)
        sum((p.float() * w).sum() for p, w in zip(device.params, weights)).backward()
        torch.cuda._sleep(20_000_000)
        device.launch_reduce()
        for p in device.params:
            p.grad = None
        junk = [torch.full_like(p, float("nan")) for p in device.params]
        device.update()
        del junk
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(device.params, fused.params)):
        assert_bitwise(a, b, f"param {i}")


def _nccl_child(rank, world_size, init_file, steps, queue):
    import os

    os.environ["LOCAL_RANK"] = str(rank)
    try:
        distributed.init("cuda", rank=rank, world_size=world_size, init_method=f"file://{init_file}")
        params, cfgs, states = make_inventory(seed=29, wd_boost=100.0, device="cuda")
        fused = ReplicatedAdam(*clone_inventory(params, cfgs, states), "cuda", impl="fused")
        device = ReplicatedAdam(params, cfgs, states, "cuda", impl="device")
        for step in range(steps):
            weights = [w.cuda() for w in _rank_weights(params, rank, step)]
            _cuda_step(fused, weights, step % 2 == 1)
            _cuda_step(device, weights, step % 2 == 1)
        torch.cuda.synchronize()
        tensors = [pack(p) for p in device.params] + [pack(p) for p in fused.params]
        queue.put((rank, "ok", (tensors, device._device_mode.reduce_graph is not None)))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        distributed.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_cuda_ranks_replay_the_captured_reduce_and_equal_the_fused_path(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_nccl_child, args=(r, 2, store, 12, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(2):
        rank, status, payload = queue.get(timeout=600)
        assert status == "ok", payload
        results[rank] = payload
    for p in procs:
        p.join(timeout=60)
    (t0, graph0), (t1, graph1) = results[0], results[1]
    assert graph0 and graph1  # the reduce runs inside the graph on both ranks
    n = len(t0) // 2
    for k in range(len(t0)):
        assert_bitwise(unpack(t0[k]), unpack(t1[k]), f"tensor {k} across ranks")
    for k in range(n):
        assert_bitwise(unpack(t0[k]), unpack(t0[n + k]), f"device vs fused param {k}")
