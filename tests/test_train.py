"""The training entry point end to end, shortened: one process, two gloo processes, resume, warmup, errors.

Each run here is the embedded default (tiny model, synthetic corpus, AnvilAndAdam with the fused replicated
path) cut to a few dozen steps over two stages, so a stage transition and both Adam and non-Adam steps occur.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.distributed_harness import run_ranks
from track_1_short import checkpoint, compile_watch, cpu_bf16_matmul, run_log, trainer
from track_1_short.schedule import StageConfig

pytestmark = pytest.mark.slow  # every test trains runs or starts the CLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
STEPS = (5, 3)  # two stages, 8 steps: a stage transition, Adam and non-Adam steps
BATCH = 512  # global tokens per step; one process runs 2 microbatches of 256, two processes one each
MICRO = f"micro_batch_tokens={BATCH // 2}"


def short_cfg(runs_root: str, *overrides: str):
    """The default run cut to 8 steps of 512 tokens and a 1,024-token validation."""
    extra = ["data.val_tokens=1024", "data.val_batch_tokens=512", "schedule.split_embed_step=6"]
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=[f"runs_root={runs_root}", "progress_bar=false", *extra, *overrides])
    first, last = (OmegaConf.to_container(cfg.schedule.stages[i]) for i in (0, -1))
    # One next-token weight throughout, so the train loss means the same thing at every step.
    common = {"batch_tokens": BATCH, "mtp_weights": [1.0], "mtp_weights_end": [], "extension": False}
    cfg.schedule.stages = [
        StageConfig(**{**first, **common, "steps": STEPS[0]}),
        StageConfig(**{**last, **common, "steps": STEPS[1]}),
    ]
    cfg.schedule.rail_warmup_steps, cfg.schedule.rail_cooldown_steps = 4, 2
    return cfg


def params_of(result) -> dict[str, torch.Tensor]:
    return checkpoint.model_state(result.trainer.model)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for label in a:
        x, y = a[label], b[label]
        bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 - compares NaN payloads and -0.0 too
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y)), label


def _worker(rank, world, runs_root, overrides):
    r = trainer.run(short_cfg(runs_root, *overrides))
    return {
        "losses": r.train_losses,
        "val": r.val_loss,
        "params": params_of(r),
        "run_dir": str(r.run_dir),
        "bf16_matmul": r.trainer.bf16_matmul,
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs1")
    # micro_batch_tokens = half the first stage's batch: 2 accumulation microbatches per step on one rank.
    return trainer.run(short_cfg(str(root), MICRO, "checkpoint.every=2"))


def test_one_process_run_finishes_and_loss_decreases(one_process):
    losses = one_process.train_losses
    assert len(losses) == sum(STEPS)
    # nats/token; step 0 sits near ln(2176) (the default experiment's compact vocabulary); 8 tiny steps take
    # off ~0.25, far more than the ~0.01 step-to-step noise of these losses.
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.15
    assert run_log.is_finished(one_process.run_dir)
    facts = one_process.corpus
    assert facts["entropy_floor"] < facts["unigram_entropy"] < math.log(2176)
    assert one_process.val_loss < math.log(2176)


def test_run_directory_follows_the_contract_and_parses_with_the_record_gate(one_process):
    sys.path.insert(0, str(ROOT))
    from tools import record_gate

    d = one_process.run_dir
    assert {"log.txt", "events.jsonl", "config.yaml", "env.json"} <= {p.name for p in d.iterdir()}
    n = sum(STEPS)
    for run in (record_gate.read_run_dir(d), record_gate.read_text_log(d / "log.txt")):
        assert run.finished and run.total_steps == n
        assert run.final_loss == pytest.approx(one_process.val_loss, abs=5e-5)  # the text line has 4 decimals
    events = run_log.read_events(d)
    assert [e["step"] for e in events if e["event"] == "train"] == list(range(1, n + 1))
    # Every train event carries the optimizer's time over the steps since the previous one: part of the
    # train time of that interval, never all of it (the forwards and backwards are outside it).
    prev_ms = 0.0
    for e in (e for e in events if e["event"] == "train"):
        assert 0 < e["optimizer_ms"] < e["train_time_ms"] - prev_ms, e
        prev_ms = e["train_time_ms"]
    assert OmegaConf.load(d / "config.yaml").schedule.stages[0].steps == STEPS[0]


def test_resumed_run_reproduces_the_uninterrupted_run_bitwise(one_process, tmp_path):
    ckpts = checkpoint.list_checkpoints(one_process.run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000004.pt", "step_000006.pt"]  # keep_last=2; none at the end
    # From step 4: crosses the stage transition (5) and the embedding split (after 6) after resuming.
    resumed = trainer.run(short_cfg(str(tmp_path), MICRO, f"resume={ckpts[0]}", "run_name=resumed"))
    assert resumed.train_losses == one_process.train_losses[4:]
    assert_bitwise_equal(params_of(resumed), params_of(one_process))
    assert resumed.val_loss == one_process.val_loss


def test_two_gloo_processes_match_one_process_with_the_same_global_batch(one_process, tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path), ())
    r0, r1 = results  # two ranks of 256 tokens: the same documents as one rank's two microbatches
    assert r0["run_dir"] == r1["run_dir"]  # rank 0 chose it and broadcast it
    # Each spawned rank took the route of the one process (trainer.run enters it in every process).
    assert r0["bf16_matmul"] == r1["bf16_matmul"] == one_process.trainer.bf16_matmul
    assert_bitwise_equal(r0["params"], r1["params"])  # replicas stay identical
    assert sorted(p.name for p in Path(r0["run_dir"]).iterdir()) == [
        "config.yaml",
        "curves.png",
        "env.json",
        "events.jsonl",
        "log.txt",
    ]
    assert r0["losses"][-1] < r0["losses"][0] - 0.15  # as in the one-process test
    # Same documents and the same averaged gradients, summed in another order (two ranks' means averaged vs
    # one rank's two microbatches): fp32 rounding differences, amplified through bf16 weights over 8 steps.
    diffs = [abs(a - b) for a, b in zip(r0["losses"], one_process.train_losses)]
    assert diffs[0] < 1e-4
    assert max(diffs) < 0.05
    assert abs(r0["val"] - one_process.val_loss) < 0.02


def test_warmup_then_in_place_restore_leaves_the_run_unchanged(one_process, tmp_path):
    warmed = trainer.run(short_cfg(str(tmp_path), MICRO, "warmup=true"))
    assert warmed.trainer.warmed_steps  # the representative steps did run (and trained) before the restore
    assert warmed.train_losses == one_process.train_losses
    assert_bitwise_equal(params_of(warmed), params_of(one_process))


def test_non_finite_loss_stops_with_the_step_and_writes_no_checkpoint(tmp_path, monkeypatch):
    real = trainer.Trainer.train_step

    def poisoned(self, step):
        loss = real(self, step)
        return loss * float("nan") if step == 3 else loss

    monkeypatch.setattr(trainer.Trainer, "train_step", poisoned)
    with pytest.raises(trainer.NonFiniteLossError, match="step 3") as info:
        trainer.run(short_cfg(str(tmp_path), "checkpoint.every=2", "run_name=poisoned"))
    assert info.value.step == 3
    d = tmp_path / "poisoned"
    # The checkpoint after 2 steps; the one after 4 never comes, so nothing written holds the NaN.
    assert [p.name for p in checkpoint.list_checkpoints(d / "checkpoints")] == ["step_000002.pt"]
    end = run_log.read_events(d)[-1]
    assert end["event"] == "end" and end["status"] == "failed"
    assert not run_log.is_finished(d)


def _cli(*args: str, full_error: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "track_1_short.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # A guard against a hang, not a speed target: one smoke_record run takes about two minutes on a
        # 2-core CPU machine (the Triton interpreter and the tiny model's eager attention).
        timeout=600,
    )


def test_unknown_key_prints_hydras_message_without_a_traceback():
    out = _cli("sedd=3")
    assert out.returncode != 0
    assert "sedd" in out.stderr and "Traceback" not in out.stderr


def test_missing_data_directory_prints_the_download_command_without_a_traceback(tmp_path):
    out = _cli("experiment=record", f"data.dir={tmp_path / 'nowhere'}", f"runs_root={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert "tools/fineweb.py" in out.stderr and "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.strip()]) <= 3  # one paragraph
    full = _cli(
        "experiment=record", f"data.dir={tmp_path / 'nowhere'}", f"runs_root={tmp_path}", full_error=True
    )
    assert full.returncode != 0 and "Traceback" in full.stderr


def test_the_per_parameter_replicated_adam_trains_bit_for_bit_like_the_fused_path(one_process, tmp_path):
    # optim.replicated_impl=reference: one all_reduce and one Adam step per parameter, over gradients
    # accumulated across both microbatches; the fused path (one_process) must end with the same bits.
    from tools.compare_checkpoints import compare

    reference = trainer.run(
        short_cfg(
            str(tmp_path),
            MICRO,
            "checkpoint.every=2",
            "optim.replicated_impl=reference",
            "checkpoint.final=true",
        )
    )
    assert reference.train_losses == one_process.train_losses
    assert reference.val_loss == one_process.val_loss
    assert_bitwise_equal(params_of(reference), params_of(one_process))
    # checkpoint.final: a checkpoint of the end state (step 8 of 8), which is the fused run's end state bit
    # for bit: parameters, buffers, the optimizer's moments and master weights, the loader's position.
    final = checkpoint.load(reference.run_dir / "checkpoints")
    assert final["step"] == sum(STEPS)
    entries, diffs = compare(final, one_process.trainer._payload())
    assert diffs == [] and entries > 2 * len(final["model"]), (entries, diffs[:5])


def test_deterministic_holds_for_the_run_and_is_restored_after_it_even_on_an_error(tmp_path, monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def built(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        raise Stop

    monkeypatch.setattr(trainer, "Trainer", built)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(Stop):
        trainer.run(short_cfg(str(tmp_path), "deterministic=true"))
    with pytest.raises(Stop):
        trainer.run(short_cfg(str(tmp_path), "deterministic=false"))
    assert seen == [True, False] and not torch.are_deterministic_algorithms_enabled()


def test_the_run_reports_the_bf16_matmul_route_it_took_next_to_compiled(one_process):
    t = one_process.trainer
    route, why = trainer.bf16_matmul_route(t.cfg, t.device)
    assert t.bf16_matmul == route and not cpu_bf16_matmul.active()  # the mode is gone after the run
    build = [line for line in (one_process.run_dir / "log.txt").read_text().splitlines() if "build:" in line]
    assert len(build) == 1 and build[0].endswith(f"compiled False, bf16 matmul {route} ({why})"), build


def _recording_route(monkeypatch, fail_at: list[int]) -> list[tuple]:
    """Patch the trainer's warmup, step and validation to record (what, the built trainer's route, whether
    the fp32 mode is in force) as they start; a step raises at ``fail_at[0]``."""
    real = {name: getattr(trainer.Trainer, name) for name in ("warmup", "train_step", "validate")}
    seen = []

    def warmup(self):
        seen.append(("warmup", self.bf16_matmul, cpu_bf16_matmul.active()))
        return real["warmup"](self)

    def train_step(self, step, marks=None):
        seen.append((f"step {step}", self.bf16_matmul, cpu_bf16_matmul.active()))
        if step == fail_at[0]:
            raise RuntimeError(f"planted failure at step {step}")
        return real["train_step"](self, step, marks)

    def validate(self, max_batches=None):
        seen.append(("validate", self.bf16_matmul, cpu_bf16_matmul.active()))
        return real["validate"](self, max_batches)

    for name, fn in (("warmup", warmup), ("train_step", train_step), ("validate", validate)):
        monkeypatch.setattr(trainer.Trainer, name, fn)
    return seen


def test_the_fp32_route_holds_from_build_to_validation_and_is_gone_after_an_error(tmp_path, monkeypatch):
    fail_at = [1]
    seen = _recording_route(monkeypatch, fail_at)
    assert not cpu_bf16_matmul.active()
    # val_every=1: step 0, its validation, then step 1 raises.
    with pytest.raises(RuntimeError, match="planted failure at step 1"):
        trainer.run(short_cfg(str(tmp_path), "cpu_bf16_matmul=fp32", "val_every=1", "run_name=fp32"))
    assert [what for what, _, _ in seen] == ["warmup", "step 0", "validate", "step 1"]
    assert all(built == "fp32" and active for _, built, active in seen), seen  # built under it too
    assert not cpu_bf16_matmul.active()
    # native: the mode is never entered.
    seen.clear()
    fail_at[0] = 0
    with pytest.raises(RuntimeError, match="planted failure at step 0"):
        trainer.run(short_cfg(str(tmp_path), "cpu_bf16_matmul=native", "run_name=native"))
    assert seen == [("warmup", "native", False), ("step 0", "native", False)]


def _first_step_grads(runs_root: str, *overrides: str) -> dict[str, torch.Tensor]:
    """The gradients step 0's optimizer step receives (captured before it consumes them)."""
    from track_1_short.config import to_object

    cfg = short_cfg(runs_root, MICRO, *overrides)
    tcfg, cpu = to_object(cfg), torch.device("cpu")
    with cpu_bf16_matmul.route(trainer.bf16_matmul_route(tcfg, cpu)[0]):  # trainer.run's matmuls
        t = trainer.Trainer(tcfg, OmegaConf.to_container(cfg, resolve=True), cpu)
        seen = {}
        t.opt.step = lambda do_adam: seen.update({k: p.grad.clone() for k, p in t.opt.params.items()})
        try:
            t.train_step(0)
        finally:
            t.loader.close()
            t.log.close()
    return seen


def test_the_graph_counts_are_this_runs_not_the_processes(tmp_path, monkeypatch):
    # Dynamo's counter is the process's: a run started after others (a sweep, a test session) must not report
    # their graphs as its own, nor call them recompiles.
    from track_1_short.config import to_object

    made = [40]  # graphs an earlier run in this process made
    monkeypatch.setattr(compile_watch, "graphs_made", lambda: made[0])
    cfg = short_cfg(str(tmp_path), MICRO, "warmup=true")
    tcfg, cpu = to_object(cfg), torch.device("cpu")
    with cpu_bf16_matmul.route(trainer.bf16_matmul_route(tcfg, cpu)[0]):
        t = trainer.Trainer(tcfg, OmegaConf.to_container(cfg, resolve=True), cpu)
        try:
            t.compiled = True  # the counts are reported for compiled runs (CUDA); the CPU steps run eagerly
            step = t.train_step

            def compiling_step(s):  # each warmup step makes one graph
                made[0] += 1
                return step(s)

            t.train_step = compiling_step
            steps = t.warmup()
            assert steps and t.graphs_after_warmup == len(steps)
            made[0] += 2  # two graphs in the timed loop
            assert t._compile_stats() == {"graphs": len(steps) + 2, "timed_loop_graphs": 2}
        finally:
            t.loader.close()
            t.log.close()


def test_loss_sum_ranks_backprops_upstreams_summed_loss_of_one_of_n_ranks(tmp_path):
    mean = _first_step_grads(str(tmp_path / "a"))
    summed = _first_step_grads(str(tmp_path / "b"), "loss_sum_ranks=8")
    # Upstream differentiates the loss summed over its rank's batch / 8 tokens: 512 / 8 = 64 times the
    # per-token mean's gradient. A power of two, so the scaled gradients are exact: bitwise.
    assert mean.keys() == summed.keys() and mean
    for label in mean:
        assert torch.equal(summed[label], mean[label] * 64), label


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("+schedul.lr_floor=0.2",), "Did you mean 'schedule.lr_floor'"),  # ours, before Hydra composes
        (("seed=abc",), "seed"),  # Hydra's own composition error
        (("fault_injection.nan_grad_value=bad",), "nan_grad_value"),  # a group's __post_init__
        (("cpu_bf16_matmul=bf16",), "cpu_bf16_matmul='bf16' must be one of ['auto', 'native', 'fp32']"),
        (("optim.replicated_impl=rust",), "replicated_impl='rust' must be one of ['fused', 'reference']"),
    ],
)
def test_bad_flags_exit_2_with_one_message_and_no_traceback(args, match, tmp_path):
    out = _cli(*args, f"runs_root={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert match in out.stderr and "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_cli_run_keeps_the_summary_and_curves_and_never_writes_carriage_returns(tmp_path):
    # The smoke record cut to 4 steps: what is asserted is the output's form, at any length.
    short = (
        "schedule.stages=[{steps:4,batch_tokens:1024,max_doc_len:512,window_short:1,window_long:2}]",
        "schedule.rail_warmup_steps=1",
        "schedule.rail_cooldown_steps=1",
    )
    args = ("experiment=smoke_record", *short, "progress_bar=true", f"runs_root={tmp_path}", "run_name=cli")
    out = _cli(*args)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr  # stderr is a pipe here: no progress bar
    # ... but the run directory is named before training, and plain progress lines come instead of the bar.
    assert f"run directory: {tmp_path / 'cli'}" in out.stderr
    progress = [line for line in out.stderr.splitlines() if line.startswith("progress: ")]
    assert progress and progress[-1].startswith("progress: step 4/4 loss "), out.stderr
    assert " tokens/s " in progress[-1] and " eta " in progress[-1]
    run_dir = tmp_path / "cli"
    summary = out.stdout.strip().splitlines()
    assert summary[0].startswith("final val loss") and "tokens/s" in summary[1]
    assert (run_dir / "log.txt").read_text().splitlines()[-2:] == summary
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = (run_dir / "events.jsonl").read_bytes()
    again = _cli(*args)  # the same run_name again: refused, the run's files untouched
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert (run_dir / "events.jsonl").read_bytes() == before


def test_ctrl_c_exits_130_with_one_paragraph_naming_the_checkpoint_and_the_resume_command(tmp_path):
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    args = ["experiment=smoke_record", "checkpoint.every=2", f"runs_root={tmp_path}", "run_name=c"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "track_1_short.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored (no
        # KeyboardInterrupt): give the run the disposition of a run started from a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    ckpts = tmp_path / "c" / "checkpoints"
    start = time.monotonic()
    while not (ckpts / "latest").is_file() and time.monotonic() < start + 90 and proc.poll() is None:
        time.sleep(0.05)
    waited = time.monotonic() - start
    # A run that ends before the signal is sent tests nothing: say what the poll saw.
    assert proc.poll() is None, (
        f"the run exited ({proc.returncode}) after {waited:.1f} s before it was interrupted; checkpoints: "
        f"{sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else 'none'}; {proc.communicate()}"
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (f"after {waited:.1f} s", err)
    # The phase lines (data, build, ...) come first; the interruption is one paragraph, the last line.
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[-1].startswith("interrupted at step"), err
    assert sum("interrupted" in line for line in lines) == 1, err
    assert "step_0000" in lines[-1] and f"resume={tmp_path / 'c'}" in lines[-1]


def _recording_gc(monkeypatch, fail_at: int | None = None) -> list[tuple[bool, int]]:
    """Patch the trainer's step to record (collector enabled, objects frozen) as it starts; raise at
    ``fail_at``."""
    real, seen = trainer.Trainer.train_step, []

    def recorded(self, step, marks=None):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        if step == fail_at:
            raise RuntimeError(f"planted failure at step {step}")
        return real(self, step, marks)

    monkeypatch.setattr(trainer.Trainer, "train_step", recorded)
    return seen


def test_gc_freeze_off_trains_bitwise_like_the_frozen_default(one_process, tmp_path, monkeypatch):
    # one_process ran with the default gc_freeze=true and left the collector as it found it.
    assert gc.isenabled() and gc.get_freeze_count() == 0
    seen = _recording_gc(monkeypatch)
    plain = trainer.run(short_cfg(str(tmp_path), MICRO, "checkpoint.every=2", "gc_freeze=false"))
    assert seen == [(True, 0)] * sum(STEPS)  # the reference: the collector as Python runs it
    assert plain.train_losses == one_process.train_losses
    assert plain.val_loss == one_process.val_loss
    assert_bitwise_equal(params_of(plain), params_of(one_process))


def test_timed_loop_runs_with_gc_frozen_and_an_error_restores_it(tmp_path, monkeypatch):
    assert gc.isenabled() and gc.get_freeze_count() == 0
    seen = _recording_gc(monkeypatch, fail_at=2)
    with pytest.raises(RuntimeError, match="planted failure at step 2"):
        trainer.run(short_cfg(str(tmp_path), "run_name=fails"))
    assert len(seen) == 3 and all(not enabled and frozen > 0 for enabled, frozen in seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0
