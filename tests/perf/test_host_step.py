"""perf/host_step.py: the device mode's C++ host step against its Python reference, on the same inputs."""

import copy
import gc
import weakref
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from track_1_short.perf import host_step as hs
from track_1_short.perf.kernels.replicated_adam import STEP_INPUTS

N = 7


@dataclass
class Cfg:
    lr: float
    lr_mul: float
    weight_decay: float
    wd_mul: float
    adam_betas: tuple
    eps: float


def _inventory(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3,), (4, 5), (2,), (6, 2), (1,), (8,), (3, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    cfgs = [
        Cfg(
            0.01 * (i + 1),
            [1.0, 5.0, 0.25][i % 3],
            [0.0, 0.005][i % 2],
            [0.0, 1.0, 150.0][i % 3],
            (0.9, [0.95, 0.99][i % 2]),
            1e-10,
        )
        for i in range(N)
    ]
    states = [{"step": 3 * i} for i in range(N)]
    return params, cfgs, states


def _pair(seed):
    """The native and the Python host step, each over its own copy of one inventory."""
    out = []
    for host in hs.HOSTS:
        params, cfgs, states = _inventory(seed)
        out.append((hs.host_step(params, cfgs, states, host), params, cfgs, states))
    return out


def _read_all(host_name, seed):
    """A host step over a fresh inventory, every parameter's gradient present and read."""
    params, cfgs, states = _inventory(seed)
    host = hs.host_step(params, cfgs, states, host_name)
    _set_grads(params, torch.Generator().manual_seed(seed + 1), present=set(range(N)))
    assert host.read_gradients() == -1
    return host, params, cfgs, states


def _rows():
    return torch.full((len(STEP_INPUTS), N), -7.0, dtype=torch.float64)


def _set_grads(params, gen, present, strided=frozenset()):
    for i, p in enumerate(params):
        if i not in present:
            p.grad = None
        elif i in strided:
            p.grad = torch.randn(tuple(reversed(p.shape)), generator=gen).t() if p.dim() == 2 else None
        else:
            p.grad = torch.randn(p.shape, generator=gen)


def test_native_and_python_write_the_same_rows_steps_and_answers_over_random_steps():
    """Even steps take update()'s one call with one process (stage_update), odd ones the separate calls of
    several processes; steps end alternately with release() and with drop_gradients() (zero_grad)."""
    pair = _pair(seed=0)
    choices = np.random.default_rng(1)
    seen = {"refused": 0, "in_place": 0, "staged_in_place": 0, "static": 0, "staged_static": 0}
    for step in range(48):
        present = {i for i in range(N) if choices.random() < 0.75}
        strided = {i for i in present if choices.random() < 0.1}
        new_beta = choices.random() < 0.15
        staged = step % 2 == 0
        results = []
        for host, params, cfgs, states in pair:
            gen = torch.Generator().manual_seed(step)
            _set_grads(params, gen, present, strided)
            if new_beta:
                cfgs[step % N].adam_betas = (0.5 + step / 100, 0.999)
            for i, cfg in enumerate(cfgs):
                cfg.lr = 0.008 * (1 - step / 50) * (i + 1)
            bad = host.read_gradients()
            if bad >= 0:
                results.append(("refused", bad, [s["step"] for s in states]))
                continue
            expected = [0 if p.grad is None else p.grad.data_ptr() for p in params]
            assert host.addresses() == expected
            held = [p.grad for p in params if p.grad is not None]
            if step % 3 == 1 and held:
                held[0].add_(1.0)  # in place after the read
            addresses = torch.full((N,), -5, dtype=torch.int64)
            rows = _rows()
            steps_before = [s["step"] for s in states]
            if staged:
                answer = host.stage_update(addresses, rows)
                changed_in_place = max(answer, -1)
                static_changed = answer == hs.STATIC_CHANGED
                if answer >= 0:  # refused: nothing written
                    assert (rows == -7.0).all() and (addresses == -5).all()
                    assert [s["step"] for s in states] == steps_before
                else:
                    assert answer in (hs.STATIC_SAME, hs.STATIC_CHANGED)
                    assert addresses.tolist() == expected
            else:
                host.write_addresses(addresses)
                assert addresses.tolist() == expected
                changed_in_place = host.changed_in_place()
                static_changed = host.write_inputs(rows)
            if static_changed:
                host.set_static([(c.adam_betas[0], c.adam_betas[1], c.eps) for c in cfgs])
            results.append(
                (
                    host.arrived(),
                    changed_in_place,
                    static_changed,
                    rows.numpy().tobytes(),
                    [s["step"] for s in states],
                )
            )
            if step % 4 < 2:
                host.release()
            else:
                host.drop_gradients()
                assert all(p.grad is None for p in params)
            assert host.arrived() == [False] * N
        native, python = results
        assert native == python, f"step {step}"
        if native[0] != "refused":
            seen["in_place" if not staged else "staged_in_place"] += native[1] >= 0
            seen["static" if not staged else "staged_static"] += native[2]
        else:
            seen["refused"] += 1
    assert all(seen.values()), seen  # the seeded run went through every branch


def test_the_native_module_answers_with_the_reference_codes():
    module = hs.native_module()
    assert (module.STATIC_SAME, module.STATIC_CHANGED) == (hs.STATIC_SAME, hs.STATIC_CHANGED)
    assert len({hs.STATIC_SAME, hs.STATIC_CHANGED}) == 2 and max(hs.STATIC_SAME, hs.STATIC_CHANGED) < 0


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_rows_hold_each_config_value_the_step_counter_and_the_arrivals(host_name):
    params, cfgs, states = _inventory(seed=2)
    host = hs.host_step(params, cfgs, states, host_name)
    _set_grads(params, torch.Generator().manual_seed(3), present={0, 2, 3, 6})
    assert host.read_gradients() == -1
    rows = _rows()
    host.set_static([(c.adam_betas[0], c.adam_betas[1], c.eps) for c in cfgs])
    assert host.write_inputs(rows) is False
    got = rows.numpy()
    for i, cfg in enumerate(cfgs):
        assert got[:4, i].tolist() == [cfg.lr, cfg.lr_mul, cfg.weight_decay, cfg.wd_mul]
        active = i in {0, 2, 3, 6}
        assert states[i]["step"] == 3 * i + active
        assert got[4, i] == states[i]["step"] and got[5, i] == float(active)
    cfgs[4].eps = 1e-8
    assert host.write_inputs(_rows()) is True


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_an_instrumented_host_step_sends_only_the_per_step_calls_through_the_wrap_with_the_hosts_answers(
    host_name,
):
    params, cfgs, states = _inventory(seed=31)
    host = hs.host_step(params, cfgs, states, host_name)
    seen = []

    def wrap(name, call):
        def traced(*args):
            seen.append(name)
            return call(*args)

        return traced

    instrumented = hs.InstrumentedHostStep(host, wrap)
    _set_grads(params, torch.Generator().manual_seed(32), present={1, 4})
    assert instrumented.read_gradients() == -1
    instrumented.set_static([(c.adam_betas[0], c.adam_betas[1], c.eps) for c in cfgs])  # not per step
    rows = _rows()
    assert instrumented.write_inputs(rows) is False
    assert rows[5].tolist() == [float(i in {1, 4}) for i in range(N)]  # the host's own rows
    assert instrumented.arrived() == [i in {1, 4} for i in range(N)]  # forwarded, not wrapped
    instrumented.drop_gradients()
    assert all(p.grad is None for p in params) and host.arrived() == [False] * N
    assert seen == ["read_gradients", "write_inputs", "drop_gradients"]


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_a_non_contiguous_gradient_is_named_and_nothing_is_noted(host_name):
    host, params, cfgs, states = _read_all(host_name, seed=4)
    before = host.addresses()
    _set_grads(params, torch.Generator().manual_seed(6), present=set(range(N)), strided={3})
    assert host.read_gradients() == 3
    assert host.addresses() == before


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_an_unreadable_config_raises_before_any_row_or_step_is_written(host_name):
    host, params, cfgs, states = _read_all(host_name, seed=7)
    cfgs[5].lr = "fast"
    rows = _rows()
    with pytest.raises((TypeError, ValueError)):
        host.write_inputs(rows)
    assert (rows == -7.0).all()
    assert [s["step"] for s in states] == [3 * i for i in range(N)]
    cfgs[5].lr = 0.01
    cfgs[2].adam_betas = (0.9,)
    with pytest.raises(ValueError, match="parameter 2: adam_betas must hold two numbers"):
        host.write_inputs(rows)
    assert [s["step"] for s in states] == [3 * i for i in range(N)]


@pytest.mark.parametrize("host_name", hs.HOSTS)
@pytest.mark.parametrize("end", ["release", "drop_gradients", "next_read"])
def test_held_gradients_stay_alive_until_released_dropped_or_replaced(host_name, end):
    params, cfgs, states = _inventory(seed=9)
    host = hs.host_step(params, cfgs, states, host_name)
    _set_grads(params, torch.Generator().manual_seed(10), present=set(range(N)))
    ref = weakref.ref(params[1].grad)
    assert host.read_gradients() == -1
    host.stage_update(torch.zeros(N, dtype=torch.int64), _rows())
    for p in params:
        p.grad = None
    gc.collect()
    assert ref() is not None
    if end == "next_read":
        assert host.read_gradients() == -1
        assert host.arrived() == [False] * N
    else:
        getattr(host, end)()
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_drop_gradients_clears_every_grad_as_zero_grad_does(host_name):
    host, params, cfgs, states = _read_all(host_name, seed=15)
    host.drop_gradients()
    assert all(p.grad is None for p in params)
    assert host.arrived() == [False] * N
    _set_grads(params, torch.Generator().manual_seed(16), present={2})
    assert host.read_gradients() == -1
    assert host.arrived() == [i == 2 for i in range(N)]


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_buffers_of_the_wrong_kind_are_refused_naming_the_expectation(host_name):
    params, cfgs, states = _inventory(seed=11)
    host = hs.host_step(params, cfgs, states, host_name)
    with pytest.raises(
        ValueError, match=r"write_inputs: expected a contiguous CPU tensor of Double, shape \[6, 7\]"
    ):
        host.write_inputs(torch.zeros((6, N), dtype=torch.float32))
    with pytest.raises(ValueError, match=r"write_addresses: expected .* Long, shape \[7\]"):
        host.write_addresses(torch.zeros(N + 1, dtype=torch.int64))
    # stage_update checks both buffers before it writes either or counts a step.
    rows = _rows()
    with pytest.raises(ValueError, match=r"stage_update: expected .* Long, shape \[7\]"):
        host.stage_update(torch.zeros(N, dtype=torch.int32), rows)
    with pytest.raises(ValueError, match=r"stage_update: expected .* Double, shape \[6, 7\]"):
        host.stage_update(torch.zeros(N, dtype=torch.int64), rows[:5])
    assert (rows == -7.0).all() and [s["step"] for s in states] == [3 * i for i in range(N)]
    if host_name == "native":
        with pytest.raises(ValueError, match="one entry per parameter"):
            hs.host_step(params, cfgs[:-1], states, "native")


def test_a_failed_build_names_the_python_host_as_the_way_out(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(hs, "_module", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(hs.NativeBuildError, match=r"optim\.replicated_host=python"):
        hs.host_step(*_inventory(seed=12), "native")
    with pytest.raises(ValueError, match="host must be one of"):
        hs.host_step(*_inventory(seed=12), "rust")


def test_native_copies_nothing_it_should_not_share():
    """The native host reads the caller's configs and state dicts themselves, as the reference does."""
    params, cfgs, states = _inventory(seed=13)
    host = hs.host_step(params, cfgs, states, "native")
    shadow = copy.deepcopy(states)
    _set_grads(params, torch.Generator().manual_seed(14), present={1})
    host.read_gradients()
    cfgs[1].lr = 0.5
    rows = _rows()
    host.write_inputs(rows)
    assert rows[0, 1].item() == 0.5
    assert states[1]["step"] == shadow[1]["step"] + 1


def _libcuda_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_stage_and_replay_refuses_a_missing_graph_or_driver_before_anything_is_written(host_name):
    host, params, cfgs, states = _read_all(host_name, seed=17)
    rows, addresses = _rows(), torch.full((N,), -5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"graph_exec is 0; pass CUDAGraph\.raw_cuda_graph_exec\(\)"):
        host.stage_and_replay(addresses, rows, 0, 0)
    # On a machine without the CUDA driver (CPU CI): the driver is named, nothing written.
    if not _libcuda_loads():
        with pytest.raises(RuntimeError, match=r"libcuda\.so\.1"):
            host.stage_and_replay(addresses, rows, 12345, 0)
    assert (rows == -7.0).all() and (addresses == -5).all()
    assert [s["step"] for s in states] == [3 * i for i in range(N)]


@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_replay_refuses_a_missing_graph_or_driver_and_touches_no_gradient(host_name):
    host, params, _, _ = _read_all(host_name, seed=21)
    addresses = host.addresses()
    with pytest.raises(ValueError, match=r"replay: graph_exec is 0; pass CUDAGraph\.raw_cuda_graph_exec\(\)"):
        host.replay(0, 0)
    if not _libcuda_loads():
        with pytest.raises(RuntimeError, match=r"libcuda\.so\.1"):
            host.replay(12345, 0)
    assert host.addresses() == addresses == [p.grad.data_ptr() for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_replay_launches_the_graph_once_per_call_on_the_current_stream(host_name):
    params, cfgs, states = _inventory(seed=22)
    host = hs.host_step(params, cfgs, states, host_name)
    launches = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches.add_(1)
    torch.cuda.synchronize()
    base = launches.item()
    torch.cuda._sleep(100_000_000)  # the default stream stays busy: a launch queued behind it has not run
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            host.replay(graph.raw_cuda_graph_exec(), torch.cuda.current_device())
        stream.synchronize()
        seen = launches.to("cpu").item()  # copied on the side stream: no wait for the default one
    assert seen == base + 3
    torch.cuda.synchronize()
    assert launches.item() == base + 3


@pytest.mark.gpu
@pytest.mark.parametrize("host_name", hs.HOSTS)
def test_stage_and_replay_launches_the_graph_only_when_the_rows_were_written_with_the_same_statics(host_name):
    """One launch per STATIC_SAME answer; none after a refusal (gradient changed in place) or a change of
    betas, where the caller rebuilds the graph first. The graph counts its launches on the device."""
    params, cfgs, states = _inventory(seed=18)
    host = hs.host_step(params, cfgs, states, host_name)
    host.set_static([(c.adam_betas[0], c.adam_betas[1], c.eps) for c in cfgs])
    launches = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches.add_(1)
    graph_exec = graph.raw_cuda_graph_exec()
    torch.cuda.synchronize()
    base = launches.item()
    rows, addresses = _rows(), torch.zeros(N, dtype=torch.int64)
    gen = torch.Generator().manual_seed(19)

    _set_grads(params, gen, present=set(range(N)))
    assert host.read_gradients() == -1
    assert host.stage_and_replay(addresses, rows, graph_exec, 0) == hs.STATIC_SAME
    torch.cuda.synchronize()
    assert launches.item() == base + 1
    assert addresses.tolist() == [p.grad.data_ptr() for p in params]

    _set_grads(params, gen, present=set(range(N)))
    assert host.read_gradients() == -1
    params[3].grad.mul_(2.0)  # changed in place after the read
    steps = [s["step"] for s in states]
    assert host.stage_and_replay(addresses, rows, graph_exec, 0) == 3
    assert [s["step"] for s in states] == steps

    _set_grads(params, gen, present=set(range(N)))
    assert host.read_gradients() == -1
    cfgs[4].adam_betas = (0.8, 0.99)
    assert host.stage_and_replay(addresses, rows, graph_exec, 0) == hs.STATIC_CHANGED
    torch.cuda.synchronize()
    assert launches.item() == base + 1
    assert [s["step"] for s in states] == [s + 1 for s in steps]  # the rows were written: steps counted
