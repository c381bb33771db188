"""One compiled training step of the track1 model trains (GPU), and perf/bench_train_step.py runs end to end.

The GPU test builds the step from its parts (configs/model/track1.yaml, configs/optim/anvil_adam.yaml, stage
0's windows and MTP weights from configs/schedule/track1.yaml, 16384 tokens), compiled with torch.compile; the
trainer's own compiled steps are tested in tests/test_gpu_trainer.py.
The CPU test runs the benchmark's own command at tiny size and checks that its JSON is what
perf/results.py renders.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from perf.bench_meta import REPO_ROOT, REQUIRED_KEYS
from tests.perf_scripts import load_perf_script
from track_1_short import schedule


def load_bench():
    return load_perf_script("bench_train_step")


def load_structured(dataclass_type, path):
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(dataclass_type), node))


@pytest.mark.gpu
def test_one_compiled_track1_step_is_finite_moves_every_trained_parameter_and_lowers_the_loss():
    from track_1_short.data import GPT2_BOS_ID
    from track_1_short.model.config import ModelConfig
    from track_1_short.model.gpt import GPT
    from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig

    configs = REPO_ROOT / "configs"
    model_cfg = load_structured(ModelConfig, configs / "model" / "track1.yaml")
    optim_cfg = load_structured(OptimConfig, configs / "optim" / "anvil_adam.yaml")
    sched = load_structured(schedule.ScheduleConfig, configs / "schedule" / "track1.yaml")
    # Stage 0's per-rank microbatch of the record (131,072 tokens / 8 ranks) in whole documents of 512 tokens,
    # tokens from 64 ids only: one step can then lower the loss on its own batch by a wide margin (the unigram
    # alone is worth ln(50257 / 64) = 6.7 nats), so "lower" cannot pass or fail by noise.
    tokens = 16384
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 64, (tokens + 1,), generator=g)
    cu = torch.arange(0, tokens + 1, 512, dtype=torch.int32)
    buf[cu[:-1].long()] = GPT2_BOS_ID
    inputs, targets = buf[:-1].int().cuda(), buf[1:].cuda()
    plan0 = schedule.plan(sched, 0, optim_cfg.adam_every)
    step = 2 * optim_cfg.adam_every - 1  # an Adam step, so every optimiser path runs
    plan = schedule.plan(sched, step, optim_cfg.adam_every)
    assert plan.do_adam

    torch.manual_seed(0)
    model = GPT(model_cfg).cuda()
    table = model.param_table()
    opt = AnvilAndAdam(
        list(model.named_parameters()), table, model.scatter_order(), model.work_order(), optim_cfg
    )
    forward = torch.compile(model, dynamic=False)
    mtp = torch.tensor(plan0.mtp_weights, device="cuda")
    args = (inputs, targets, cu.cuda(), plan0.windows, mtp)
    before = {p.label: p.detach().clone() for p in model.parameters()}

    opt.set_schedule(plan.lr_multiplier, plan.rail_beta, step)
    loss = forward(*args)
    (loss / tokens).backward()
    had_grad = {p.label for p in model.parameters() if p.grad is not None and bool(p.grad.ne(0).any())}
    opt.step(plan.do_adam)
    loss_after = forward(*args)  # the same compiled graph (grad mode unchanged), no recompile
    torch.cuda.synchronize()

    assert math.isfinite(loss.item()) and math.isfinite(loss_after.item())
    assert loss_after.item() < loss.item(), (loss.item(), loss_after.item())
    for p in model.parameters():
        assert bool(torch.isfinite(p).all()), f"{p.label} is not finite after one step"
    banks = {label for label, row in table.items() if row["optim"] == "anvil"}
    assert banks <= had_grad

    def first_adam_step(row) -> float:
        # Adam's first step moves an element by about its lr: m / sqrt(v) is sign(g).
        return optim_cfg.adam_lr * row["lr_mul"] * plan.lr_multiplier

    # A smaller step than 1e-3 may round away in bf16 storage (half an ulp at |p| = 0.3 is 2^-10), so only the
    # parameters whose first step is at least that must have moved; the banks always must.
    must_move = {label for label in had_grad if label in banks or first_adam_step(table[label]) >= 1e-3}
    moved = {p.label for p in model.parameters() if not torch.equal(p.detach(), before[p.label])}
    assert must_move <= moved, f"trained but unchanged: {sorted(must_move - moved)}"


@pytest.mark.slow
def test_bench_runs_tiny_on_cpu_and_writes_what_results_renders(tmp_path):
    out = tmp_path / "train_step.json"
    # One stage, one step of each kind after the warm-up: the smallest run that fills every field. The
    # smoke preset's stage 0 runs 1,024 tokens a step.
    flags = ["--device", "cpu", "--tiny", "--stages", "0", "--warmup", "2", "--steps", "2", "--out", str(out)]
    command = [sys.executable, "perf/bench_train_step.py", *flags]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert set(REQUIRED_KEYS) <= set(payload)
    assert payload["command"].endswith("perf/bench_train_step.py " + " ".join(flags))
    assert [row["stage"] for row in payload["rows"]] == [0]
    probes = payload["matmul_tflops_probes"]  # before and after the stages; the rows use the higher
    assert len(probes) == 2 and all(row["matmul_tflops"] == max(probes) for row in payload["rows"])
    for row in payload["rows"]:
        assert row["tokens"] == 1024  # the smoke preset's stage 0 batch, at world size 1
        assert row["compiled"] is False
        for key in (
            "ms_per_step",
            "ms_per_step_floor",
            "tokens_per_s",
            "mfu_pct",
            "forward_ms",
            "backward_ms",
        ):
            assert row[key] > 0 and math.isfinite(row[key]), key
        # The phases tile the step. With one timed step of each kind every median is that step's value and
        # the cycle mean is linear, so the phase figures add up to the step's up to float rounding.
        phases = row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]
        assert phases == pytest.approx(row["ms_per_step"], rel=1e-9)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["ms_per_step"] * 1e3)
        assert row["peak_memory_gib"] is None  # not measured on the CPU, and said so
        assert 0 < row["attention_flops_pct"] < 100
    rendered = subprocess.run(
        [sys.executable, "perf/results.py", "--results-dir", str(tmp_path), "--out", str(tmp_path / "R.md")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "| ms_per_step | ms_per_step (floor) |" in (tmp_path / "R.md").read_text()
