"""perf/bench_replicated_adam.py on the CPU: the paired interleaved method, the paths, launches, agreement."""

import gc
import json
import time

import numpy as np
import pytest
import torch

from tests.perf_scripts import load_perf_script

bench = load_perf_script("bench_replicated_adam")
CPU = bench.torch.device("cpu")


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "replicated_adam.json"
    paths = ",".join(bench.PATHS)
    argv = ["--device", "cpu", "--sets", "synthetic", "--paths", paths, "--reps", "3", "--warmup", "1"]
    assert bench.main([*argv, "--profile-steps", "1", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_writes_the_baseline_row_then_one_row_per_path_with_provenance(bench_result):
    payload = bench_result
    for key in ("command", "date", "device", "torch", "triton", "rows"):
        assert key in payload
    assert [r["path"] for r in payload["rows"]] == [bench.BASELINE, *bench.PATHS]
    assert all(r["set"] == "synthetic" and r["tensors"] == 100 for r in payload["rows"])


def test_every_step_cost_is_a_positive_number_or_below_noise_and_cpu_has_no_device_time(bench_result):
    for row in bench_result["rows"][1:]:
        cost = row["host_us"]
        assert cost == bench.BELOW_NOISE or (isinstance(cost, float) and cost > 0), row
        low, high = row["host_us_ci"]
        assert low <= high
        assert row["device_us"] is None and row["device_us_ci"] is None and row["total_device_us"] is None
        assert row["total_host_us"] > 0


def test_fused_paths_are_bitwise_equal_to_the_per_parameter_path(bench_result):
    rows = {r["path"]: r for r in bench_result["rows"]}
    assert rows["per_param"]["bitwise"] is True
    compared = [name for name in rows if name not in ("per_param", "torch_adam", bench.BASELINE)]
    assert compared == ["fused", "device"]
    assert all(rows[name]["bitwise"] is True for name in compared)
    assert rows["torch_adam"]["bitwise"] is None


def test_fused_launches_are_counted_and_far_fewer_than_per_parameter(bench_result):
    rows = {r["path"]: r for r in bench_result["rows"]}
    # Counted from the profiler (aten ops) plus the Triton launches: a hundred tensors cost the per-parameter
    # path hundreds of ops; the fused path a copy, a table upload and a kernel per dtype.
    assert rows["per_param"]["launches"] >= 100 * 5
    assert 2 <= rows["fused"]["launches"] <= 4 * 2
    # The device mode without CUDA graphs, whatever the number of tensors: two uploads (gradient addresses,
    # step inputs) and one kernel (gather, table and Adam for every dtype); nothing in the backward (autograd
    # keeps each fresh gradient as .grad, as in the baseline).
    assert rows["device"]["launches"] == 3


# ---- the method, on runners whose cost is known -----------------------------------------------------------


class FakeClock:
    """A clock that moves only when a runner says how long it took: exact, noise-free repetitions."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def takes(self, seconds: float):
        def run() -> None:
            self.now += seconds

        return run


def test_rounds_run_every_runner_once_each_in_a_varying_order():
    log = []
    runners = {name: (lambda name=name: log.append(name)) for name in ("backward_only", "a", "b")}
    samples = bench.interleaved_samples(runners, 20, CPU)
    rounds = [tuple(log[i : i + 3]) for i in range(0, len(log), 3)]
    assert len(rounds) == 20 and all(sorted(r) == ["a", "b", "backward_only"] for r in rounds)
    assert len(set(rounds)) > 1  # the order is shuffled per round, so no path always runs first
    assert all(s.host.shape == (20,) and s.device is None for s in samples.values())


def test_identical_repetitions_cost_below_noise_not_zero():
    clock = FakeClock()
    runners = {"backward_only": clock.takes(100e-6), "same": clock.takes(100e-6)}
    samples = bench.interleaved_samples(runners, 30, CPU, clock=clock)
    cost = bench.paired_cost(samples["same"].host, samples["backward_only"].host)
    assert cost.median == 0.0
    assert cost.figure == bench.BELOW_NOISE


def test_a_difference_inside_its_noise_is_below_noise_and_the_same_difference_outside_it_a_number():
    rng = np.random.default_rng(3)
    base = 100.0 + rng.normal(0.0, 1.0, 200)
    noisy = base + 5.0 + rng.normal(0.0, 50.0, 200)
    assert bench.paired_cost(noisy, base).figure == bench.BELOW_NOISE
    quiet = base + 5.0 + rng.normal(0.0, 0.5, 200)
    figure = bench.paired_cost(quiet, base).figure
    # 200 rounds with 0.5 of noise: the median sits within a few tenths of the planted 5.
    assert isinstance(figure, float) and figure == pytest.approx(5.0, abs=0.3)


def test_pairing_by_round_cancels_drift_that_both_share():
    # Both drift by 200 over the run (a clock ramp, a warming GPU); the path costs 3 more in every round.
    drift = np.linspace(0.0, 200.0, 300)
    base = 100.0 + drift
    path = base + 3.0 + np.random.default_rng(4).normal(0.0, 0.2, 300)
    cost = bench.paired_cost(path, base)
    assert isinstance(cost.figure, float) and 2.9 < cost.low <= cost.high < 3.1  # noise 0.2, 300 rounds


def test_paired_cost_refuses_unequal_or_too_short_samples():
    with pytest.raises(ValueError, match="equal-length"):
        bench.paired_cost(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="--reps"):
        bench.paired_cost(np.ones(1), np.ones(1))


def test_ratios_are_made_only_from_figures_above_noise():
    assert bench.ratio(10.0, 4.0) == 2.5
    assert bench.ratio(10.0, bench.BELOW_NOISE) == bench.BELOW_NOISE
    assert bench.ratio(bench.BELOW_NOISE, 4.0) == bench.BELOW_NOISE
    assert bench.ratio(None, 4.0) is None


def _sleeps(seconds: float):
    class Sleeping(bench.BackwardOnly):
        def step(self) -> None:
            super().step()
            time.sleep(seconds)

    return Sleeping


@pytest.fixture(scope="module")
def planted_rows():
    # The baseline sleeps 1 ms after its backward; "per_param" (a stand-in with the same backward) 5 ms, so it
    # costs 4 ms more; "quick" is the bare backward: cheaper than the baseline, so no cost to report.
    classes = {"backward_only": _sleeps(1e-3), "per_param": _sleeps(5e-3), "quick": bench.BackwardOnly}
    rows = bench.measure_set("record", bench.RECORD, ["per_param", "quick"], CPU, 15, 1, 1, 65536, classes)
    return {r["path"]: r for r in rows}


def test_a_planted_sleep_is_measured_above_noise(planted_rows):
    row = planted_rows["per_param"]
    # time.sleep waits at least its time, so the planted gap is 4 ms give or take oversleep; only the baseline
    # oversleeping by 2 ms in most of the 15 rounds (a loaded CPU's worst) would halve the median.
    assert isinstance(row["host_us"], float) and row["host_us"] > 2000.0
    assert row["host_us_ci"][0] > 0
    assert row["speedup"] == 1.0


def test_a_path_no_slower_than_the_baseline_is_below_noise_never_negative(planted_rows):
    row = planted_rows["quick"]
    assert row["host_us"] == bench.BELOW_NOISE
    assert row["host_us_ci"][1] < 0  # it is in fact about 1 ms cheaper: still no negative figure
    assert row["speedup"] == bench.BELOW_NOISE  # per_param's 4 ms over a cost below noise: no ratio


def test_results_md_shows_below_noise_verbatim(planted_rows):
    results = load_perf_script("results")
    lines = results.render_table(list(planted_rows.values()))
    quick = next(line for line in lines if "| quick |" in line)
    assert "| below noise |" in quick


def test_record_flag_measures_the_record_set_and_prints_a_short_table_last(tmp_path, capsys):
    out = tmp_path / "ra.json"
    argv = ["--device", "cpu", "--record", "--paths", "per_param,device", "--reps", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["set"] for r in rows} == {"record"} and rows[1]["tensors"] == 13
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert lines[-4].startswith("Adam step over backward only, record set")
    assert lines[-3].split()[:2] == ["path", "host"]
    assert [line.split()[0] for line in lines[-2:]] == ["per_param", "device"]


def test_phase_times_charge_a_planted_sleep_to_its_phase():
    class Phased(bench.BackwardOnly):
        def step_phases(self):
            return [("quick", lambda: None), ("slow", lambda: time.sleep(3e-3))]

    params, cfgs, states = bench.build(bench.RECORD, CPU)
    runner = bench.Runner(Phased(params, cfgs, states, CPU, 65536), params, bench.Gradients(params))
    rows = {r["phase"]: r["host_us"] for r in bench.phase_times(runner, 5, CPU)}
    assert list(rows) == ["backward", "quick", "slow"]
    assert rows["slow"] >= 3000.0  # time.sleep waits at least its time
    assert rows["quick"] < 1000.0
    assert runner.step == 5  # each repetition consumed its gradient set, as a timed one does
    plain = bench.Runner(
        bench.BackwardOnly(params, cfgs, states, CPU, 65536), params, bench.Gradients(params)
    )
    assert [r["phase"] for r in bench.phase_times(plain, 2, CPU)] == ["backward", "step"]


def test_repetitions_run_with_the_collector_off_and_it_is_restored_after():
    seen = []

    class Watching(bench.BackwardOnly):
        def step(self) -> None:
            super().step()
            seen.append(gc.isenabled())

    params, cfgs, states = bench.build(bench.RECORD, CPU)
    runner = bench.Runner(Watching(params, cfgs, states, CPU, 65536), params, bench.Gradients(params))
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            bench.phase_times(runner, 2, CPU)
            bench.interleaved_samples({"w": runner}, 2, CPU)
            assert gc.isenabled() == enabled  # as it was before, whichever it was
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] * 8


def test_phases_flag_adds_a_table_of_each_paths_public_calls(tmp_path):
    out = tmp_path / "ra.json"
    argv = ["--device", "cpu", "--record", "--paths", "per_param,device", "--reps", "2", "--phases"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    ((title, table),) = json.loads(out.read_text())["tables"].items()
    assert title.startswith("record set: host us per phase")
    device = [r["phase"] for r in table if r["path"] == "device"]
    assert device == ["backward", "launch_reduce", "update", "zero_grad"]
    assert [r["phase"] for r in table if r["path"] == "per_param"] == ["backward", "step"]
    assert all(r["host_us"] > 0 for r in table)


def test_record_flag_with_another_set_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--record", "--sets", "synthetic"])
    assert "--record measures the record set only" in capsys.readouterr().err


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's events, spin kernel and sync over a FakeClock: the CUDA branch's bookkeeping on a CPU."""
    clock = FakeClock()

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock.now

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report

    def spin(cycles):
        clock.now += cycles / 2e9  # a 2 GHz clock

    torch = bench.torch
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", spin)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return clock


def test_cuda_repetitions_get_event_device_times_in_seconds_and_count_starved_spins(fake_cuda):
    clock = fake_cuda
    runners = {"backward_only": clock.takes(100e-6), "slow": clock.takes(2e-3)}
    cuda = bench.torch.device("cuda")
    leads = bench.spin_lengths(runners, cuda, clock)
    assert leads == pytest.approx({"backward_only": 3 * 100e-6 + 200e-6, "slow": 3 * 2e-3 + 200e-6})
    samples = bench.interleaved_samples(
        runners, 8, cuda, lead_s={"backward_only": 1e-3, "slow": 1e-3}, clock=clock
    )
    assert samples["slow"].device == pytest.approx(np.full(8, 2e-3))
    assert samples["slow"].starved == 8 and samples["backward_only"].starved == 0
    with pytest.raises(ValueError, match="lead_s"):
        bench.interleaved_samples(runners, 2, cuda, clock=clock)


def test_the_backward_hands_over_fresh_gradients_that_autograd_keeps_without_a_copy():
    params, cfgs, states = bench.build(bench.RECORD, CPU)
    grads = bench.Gradients(params)
    runner = bench.Runner(bench.BackwardOnly(params, cfgs, states, CPU, 65536), params, grads)
    runner.prepare()  # the forward, outside what is profiled (as outside the clock)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.backward()
    copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_", "aten::add_")]
    assert copies == []  # as from a model's backward: .grad is the multiply's own output
    assert all(bench.same_bits(p.grad, g) for p, g in zip(params, grads.sets[0]))  # 1 * g is g


def test_on_cuda_the_event_that_closes_a_repetition_is_inside_its_host_time(fake_cuda, monkeypatch):
    # The first CUDA call after a backward pays for the hand-over, wherever it lands: with the closing event
    # timed, the baseline pays it too (a runner without CUDA calls of its own would otherwise look cheap).
    clock = fake_cuda
    event_cost = 7e-6
    recorded = bench.torch.cuda.Event.record

    def costly_record(self):
        clock.now += event_cost
        recorded(self)

    monkeypatch.setattr(bench.torch.cuda.Event, "record", costly_record)
    runners = {"backward_only": clock.takes(100e-6)}
    cuda = bench.torch.device("cuda")
    samples = bench.interleaved_samples(runners, 4, cuda, lead_s={"backward_only": 1e-3}, clock=clock)
    assert samples["backward_only"].host == pytest.approx(np.full(4, 100e-6 + event_cost))


def _rows_beside_per_param(tmp_path, path: str) -> dict:
    """The bench's rows (by path) for ``path`` run beside per_param on the CPU, two repetitions."""
    out = tmp_path / f"{path}.json"
    argv = ["--device", "cpu", "--record", "--paths", f"per_param,{path}", "--reps", "2"]
    assert bench.main([*argv, "--warmup", "1", "--profile-steps", "1", "--out", str(out)]) == 0
    return {r["path"]: r for r in json.loads(out.read_text())["rows"]}


def test_device_split_is_selectable_gathers_in_launch_reduce_and_ends_bitwise_equal(tmp_path):
    params, cfgs, states = bench.build(bench.RECORD, CPU)
    split = bench.PATH_CLASSES["device_split"](params, cfgs, states, CPU, 65536)
    assert split.opt._device_mode.gather_in_update is False  # one process would gather in update()
    rows = _rows_beside_per_param(tmp_path, "device_split")
    assert rows["device_split"]["bitwise"] is True


def test_device_python_is_selectable_runs_the_python_host_step_and_ends_bitwise_equal(tmp_path):
    from track_1_short.perf.host_step import PythonHostStep

    params, cfgs, states = bench.build(bench.RECORD, CPU)
    path = bench.PATH_CLASSES["device_python"](params, cfgs, states, CPU, 65536)
    assert isinstance(path.opt._device_mode.host, PythonHostStep)
    native = bench.PATH_CLASSES["device"](*bench.build(bench.RECORD, CPU), CPU, 65536)
    assert not isinstance(native.opt._device_mode.host, PythonHostStep)
    rows = _rows_beside_per_param(tmp_path, "device_python")
    assert rows["device_python"]["bitwise"] is True


def test_device_torch_replay_is_selectable_stages_without_launching_from_the_host_step_and_ends_bitwise(
    tmp_path,
):
    params, cfgs, states = bench.build(bench.RECORD, CPU)
    path = bench.PATH_CLASSES["device_torch_replay"](params, cfgs, states, CPU, 65536)
    assert path.opt._device_mode.replay_in_host_step is False
    native = bench.PATH_CLASSES["device"](*bench.build(bench.RECORD, CPU), CPU, 65536)
    assert native.opt._device_mode.replay_in_host_step is True
    rows = _rows_beside_per_param(tmp_path, "device_torch_replay")
    assert rows["device_torch_replay"]["bitwise"] is True


def test_device_rows_in_place_is_selectable_and_ends_bitwise(tmp_path):
    params, cfgs, states = bench.build(bench.RECORD, CPU)
    path = bench.PATH_CLASSES["device_rows_in_place"](params, cfgs, states, CPU, 65536)
    assert path.opt._device_mode.rows_in_place is True
    native = bench.PATH_CLASSES["device"](*bench.build(bench.RECORD, CPU), CPU, 65536)
    assert native.opt._device_mode.rows_in_place is False
    rows = _rows_beside_per_param(tmp_path, "device_rows_in_place")
    assert rows["device_rows_in_place"]["bitwise"] is True


class _Answers:
    """A host step whose stage_and_replay answers from a script (a launch only on STATIC_SAME)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def stage_and_replay(self, *args):
        return self.answers.pop(0)

    def __getattr__(self, name):  # the other per-step calls: not made here
        return lambda *args: None


@pytest.mark.parametrize("traced", [False, True])
def test_cuda_launches_count_the_host_steps_driver_launches_once_whether_or_not_the_profiler_traces_them(
    fake_cuda, monkeypatch, traced
):
    from types import SimpleNamespace

    from track_1_short.perf.host_step import STATIC_CHANGED, STATIC_SAME

    # Three steps: a launch, a beta change (no launch: the caller captures again), a launch.
    host = _Answers([STATIC_SAME, STATIC_CHANGED, STATIC_SAME])
    mode = SimpleNamespace(host=host)
    path = SimpleNamespace(opt=SimpleNamespace(_device_mode=mode))
    launched = []

    def runner():
        answer = mode.host.stage_and_replay()
        if traced and answer == STATIC_SAME:
            launched.append("cuGraphLaunch")
        launched.append("cudaLaunchKernel")  # one traced launch of the path's own per step

    runner.path = path

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [SimpleNamespace(name=n, device_type=None) for n in launched]

    monkeypatch.setattr(bench.torch.profiler, "profile", Profile)
    counts = bench.profile_counts(runner, 3, bench.torch.device("cuda"))
    assert counts["launches"] == pytest.approx((3 + 2) / 3)  # 3 traced kernels, 2 graph launches
    assert mode.host is host  # the counting wrapper is taken out again


def _runner(name, device):
    params, cfgs, states = bench.build(bench.RECORD, device)
    path = bench.PATH_CLASSES[name](params, cfgs, states, device, 65536 if device.type == "cpu" else 1024)
    return bench.Runner(path, params, bench.Gradients(params)), params, states


def test_device_floor_takes_the_gradients_makes_one_call_drops_them_and_is_never_compared(tmp_path):
    runner, params, _ = _runner("device_floor", CPU)
    before = [p.detach().clone() for p in params]
    runner.backward()
    grads = [p.grad for p in params]
    runner.path.launch_reduce()
    assert runner.path.host.addresses() == [g.data_ptr() for g in grads]
    runner.path.update()
    runner.path.zero_grad()
    assert all(p.grad is None for p in params)
    assert runner.path.count.item() == 1  # off CUDA: one op where a GPU makes its one launch
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # it updates nothing

    rows = _rows_beside_per_param(tmp_path, "device_floor")
    assert rows["device_floor"]["bitwise"] is None and rows["per_param"]["bitwise"] is True
    assert rows["device_floor"]["launches"] == 1


def test_device_fence_graph_runs_as_device_without_graphs_and_is_never_compared(tmp_path):
    runner, params, _ = _runner("device_fence_graph", CPU)
    reference, ref_params, _ = _runner("device", CPU)
    for _ in range(2):
        runner()
        reference()
    assert runner.path.swapped_graph is None  # no CUDA graphs on the CPU: nothing to swap
    assert all(bench.same_bits(p, q) for p, q in zip(params, ref_params))
    rows = _rows_beside_per_param(tmp_path, "device_fence_graph")
    assert rows["device_fence_graph"]["bitwise"] is None


@pytest.mark.gpu
def test_device_fence_graph_swaps_in_the_fence_signal_once_trusted_then_moves_nothing_and_keeps_the_fence():
    cuda = torch.device("cuda")
    runner, params, states = _runner("device_fence_graph", cuda)
    mode = runner.path.opt._device_mode
    runner()
    assert mode.graphs_trusted and runner.path.swapped_graph is None  # swapped at the next launch_reduce
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params] + [s["exp_avg"].clone() for s in states]
    for _ in range(4):
        runner()
    torch.cuda.synchronize()
    assert runner.path.swapped_graph is not None
    after = [p.detach() for p in params] + [s["exp_avg"] for s in states]
    assert all(bench.same_bits(a, b) for a, b in zip(after, before))
    assert mode._fence.arrived == mode._fence.enqueued  # each launch of the swapped graph signalled


@pytest.mark.gpu
def test_device_floor_launches_its_one_kernel_graph_once_per_step_and_counts_it():
    cuda = torch.device("cuda")
    runner, params, _ = _runner("device_floor", cuda)
    for _ in range(4):
        runner()
    torch.cuda.synchronize()
    assert runner.path.count.item() == 4 and runner.path.launched == 4
    assert all(p.grad is None for p in params)
    params_b, cfgs_b, states_b = bench.build(bench.RECORD, cuda)
    baseline = bench.Runner(
        bench.BackwardOnly(params_b, cfgs_b, states_b, cuda, 1024), params_b, bench.Gradients(params_b)
    )
    counts = bench.profile_counts(runner, 3, cuda)
    base_counts = bench.profile_counts(baseline, 3, cuda)
    # One driver launch per step over the backward's own (untraced by the profiler: the path counts it).
    assert counts["launches"] - base_counts["launches"] == pytest.approx(1.0)
    assert runner.path.count.item() == 7


def test_hand_over_runs_after_the_backward_and_before_the_step_and_gets_its_own_phase():
    params, cfgs, states = bench.build(bench.RECORD, CPU)
    order = []

    class Recording(bench.BackwardOnly):
        def step(self):
            order.append("step")
            super().step()

    def hand_over():
        assert all(p.grad is not None for p in params)  # the backward has delivered every gradient
        order.append("hand_over")
        time.sleep(0.02)

    runner = bench.Runner(
        Recording(params, cfgs, states, CPU, 65536), params, bench.Gradients(params), hand_over
    )
    runner()
    assert order == ["hand_over", "step"]
    rows = {r["phase"]: r["host_us"] for r in bench.phase_times(runner, 3, CPU)}
    assert list(rows) == ["backward", "hand_over", "step"]
    assert rows["hand_over"] >= 20_000 > rows["step"]


@pytest.mark.parametrize("hand_over", [False, True])
def test_hand_over_flag_gives_every_runner_the_baseline_too_the_same_call(tmp_path, monkeypatch, hand_over):
    calls = []
    monkeypatch.setattr(bench, "hand_over_call", lambda device: lambda: calls.append(device))
    out = tmp_path / "hand_over.json"
    argv = ["--device", "cpu", "--record", "--paths", "device", "--reps", "2", "--warmup", "1"]
    argv += ["--profile-steps", "1", "--out", str(out)] + (["--hand-over"] if hand_over else [])
    assert bench.main(argv) == 0
    # Two runners (backward_only, device), each: 1 warmup + 2 timed + 1 profiled repetitions.
    assert calls == ([CPU] * 8 if hand_over else [])
    payload = json.loads(out.read_text())
    assert payload["hand_over"] is hand_over
    assert any("--hand-over" in note for note in payload["notes"]) is hand_over
