"""The trainer's own training step at the record's stage shapes: time, throughput, memory, MFU.

    python perf/bench_train_step.py --out perf/results/train_step.json  # CUDA, record_1gpu, stages 0 2
    python perf/bench_train_step.py --device cpu --tiny --out /tmp/ts.json  # CPU smoke, smoke_record
    python perf/bench_train_step.py optim.replicated_impl=reference --stages 2  # Hydra overrides
    python perf/bench_train_step.py --stages 2 --arm ref="optim.replicated_impl=reference"  # a lever

What is timed is ``Trainer.train_step`` (track_1_short/trainer.py), the very function the training loop
calls: the schedule, the loader's next batches, forward and backward per microbatch, the guards and
``AnvilAndAdam.step``, on the trainer's compiled model. The bench composes the same Hydra config as
``python -m track_1_short.train`` (default: ``experiment=record_1gpu``, the record's model, optimizer and
stage geometries on one GPU), so the bench and the run cannot drift apart: the preset's timed-loop tokens/s
is the bench's figure plus the run's few read-backs.

Figures per stage: ms/step is the Adam cycle's mean of the per-kind medians (one Adam step and adam_every - 1
steps without), each step timed with CUDA events from its start to the next step's start, after untimed
steps at the stage's start (the first compiles); tokens/s; peak and resident memory (max_memory_allocated,
and memory_allocated before the timed steps); MFU = FLOPs per token x tokens/s / the bf16 matmul rate
measured in the same run (median of repeated 8192^3 torch.matmul on random data), so MFU compares the step
with what this GPU does, not with a datasheet; FLOPs per token are the model's ``flops_per_token`` per
document of the batches the loader gave (length and windows), token-weighted. The floor of ms/step is the
step's FLOPs at that rate (100% MFU); forward and backward floors are 1/3 and 2/3 of it.

Arms (``--arm NAME="OVERRIDES"``, repeatable): after the baseline (the positional overrides), each arm builds
its own trainer with its overrides added and measures the same stages, one after another in this process
(one GPU, one pair of rate probes around them all): each row names its ``arm``, and ``vs_baseline`` is its
tokens/s over the baseline's at the same stage. That is how a fast path is judged against the default, on
the same machine. An arm that fails becomes one row with its ``error``, and the next arm still runs (a
failing baseline stops the bench).

What stands between a figure and its floor: the forward/backward/optimizer split (the optimizer is outside
the FLOP count) and, on CUDA, one profiled Adam cycle: the share of it in which the GPU runs kernels (the rest
is launch and host overhead), how kernel time splits into GEMMs, attention and the rest, and where the device
waited (its idle stretches, grouped by the kernels on either side: a host read of a device value, or a run of
small eager launches, shows up there).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from track_1_short import schedule
from track_1_short.frozen_gc import freeze_gc, restore_gc

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import compose_train  # noqa: E402
from bench_meta import bench_metadata, write_bench_json  # noqa: E402
from kernel_profile import kernel_table_line, profile_device  # noqa: E402

DEFAULT_EXPERIMENT = "record_1gpu"  # the one-GPU record preset (CUDA)
TINY_EXPERIMENT = "smoke_record"  # --tiny: the CPU smoke preset (tiny model, compact vocabulary)
GIB = 1024**3


def batch_flops_per_token(flops_per_token, model_cfg, cu_seqlens: torch.Tensor, windows) -> float:
    """Training FLOPs per token of a packed batch: the model's per-document figure, token-weighted.

    Attention FLOPs depend on a document's length and the windows, so a per-token figure for a mix of lengths
    is the token-weighted mean of ``flops_per_token(cfg, length, windows)`` over the documents.
    """
    lengths = cu_seqlens.diff().tolist()
    total = sum(float(flops_per_token(model_cfg, n, list(windows))) * n for n in lengths if n > 0)
    return total / sum(lengths)


def matmul_tflops(
    size: int, device: torch.device, warmup: int = 10, reps: int = 20, warmup_s: float = 0.0
) -> float:
    """bf16 rate of a size^3 torch.matmul on random data, median over ``reps`` timed calls, in TFLOP/s.

    Warmup: at least ``warmup`` calls and, on CUDA, at least ``warmup_s`` seconds of them (an idle GPU takes
    a while to reach its clocks; after a 10-call warmup one run read 4.5% below the run before it on the
    same H100)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    done = 0
    while done < warmup or (device.type == "cuda" and time.perf_counter() - start < warmup_s):
        torch.matmul(a, b)
        done += 1
        if device.type == "cuda" and done % 16 == 0:
            torch.cuda.synchronize(device)  # the host clock then counts executed calls, not queued ones
    with Timer(device) as timer:
        for _ in range(reps):
            timer.mark()
            torch.matmul(a, b)
            timer.mark()
    marks = timer.elapsed_ms()
    median_ms = statistics.median(marks[2 * i + 1] - marks[2 * i] for i in range(reps))
    return 2 * size**3 / (median_ms * 1e-3) / 1e12


RATE_REPS, RATE_WARMUP_S = 50, 0.5  # the rate probes of a run (CUDA): timed calls, and seconds of warmup


def at_rate(row: dict, rate: float) -> dict:
    """``row`` with its MFU and floors restated at matmul rate ``rate`` (TFLOP/s) instead of its own."""
    ratio = row["matmul_tflops"] / rate
    out = dict(row)
    for key in ("mfu_pct", "ms_per_step_floor", "forward_ms_floor", "backward_ms_floor"):
        out[key] = row[key] * ratio
    out["matmul_tflops"] = rate
    return out


class Timer:
    """Labelled time marks on the device's stream (CUDA events), or on the host clock on the CPU (ops are
    synchronous there).

    ``mark(label)`` records a point; after the ``with`` block, ``elapsed_ms()`` gives each mark in ms from
    the first and ``labels`` their labels.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.labels: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        return False

    def mark(self, label: str = "") -> None:
        self.labels.append(label)
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.events.append(time.perf_counter())

    def elapsed_ms(self) -> list[float]:
        if not self.events:
            return []
        if self.cuda:
            return [self.events[0].elapsed_time(e) for e in self.events]
        return [(t - self.events[0]) * 1e3 for t in self.events]


def profile_cycle(run_step, first_step: int, n_steps: int, top: int = 0) -> dict:
    """Kernel breakdown of ``n_steps`` consecutive steps under torch.profiler (device activity only); with
    ``top``, also the ``top`` costliest kernels and the ``top`` largest groups of the device's idle
    stretches, under the keys "top_kernels" and "idle_gaps"."""
    steps = iter(range(first_step, first_step + n_steps))
    return profile_device(lambda: run_step(next(steps), None), n_steps, top, idle=True)


def step_times(labels: list[str], marks: list[float], steps: int) -> list[tuple[float, float, float]]:
    """(forward, backward, optimizer) ms per step from labelled marks.

    Each step is a "start" mark, then "forward" and "backward" after each microbatch's forward and backward,
    and the marks end with a closing "start". A step runs from its start mark to the next step's, so host
    gaps between steps count (the optimizer phase ends where the next step starts); with several microbatches
    their forwards and their backwards add up.
    """
    starts = [i for i, label in enumerate(labels) if label == "start"]
    if (
        len(labels) != len(marks)
        or len(starts) != steps + 1
        or starts[0] != 0
        or starts[-1] != len(marks) - 1
    ):
        raise ValueError(f"expected {steps} steps of labelled marks closed by a start mark, got {labels}.")
    out = []
    for lo, hi in zip(starts, starts[1:]):
        fwd = bwd = 0.0
        for i in range(lo + 1, hi):
            if labels[i] == "forward":
                fwd += marks[i] - marks[i - 1]
            elif labels[i] == "backward":
                bwd += marks[i] - marks[i - 1]
            else:
                raise ValueError(f"unknown mark {labels[i]!r} inside a step.")
        if labels[hi - 1] != "backward":
            raise ValueError("a step's marks must end with its last backward.")
        out.append((fwd, bwd, marks[hi] - marks[hi - 1]))
    return out


def cycle_mean(per_step: list[float], adam: list[bool], adam_every: int) -> float:
    """Mean cost of a step over the Adam cadence: (median Adam step + (adam_every - 1) x median other) / n."""
    with_adam = [t for t, a in zip(per_step, adam) if a]
    without = [t for t, a in zip(per_step, adam) if not a]
    if not with_adam or (adam_every > 1 and not without):
        raise ValueError(
            f"the timed steps must hold both kinds of step (adam_every={adam_every}); time more."
        )
    rest = statistics.median(without) if adam_every > 1 else 0.0
    return (statistics.median(with_adam) + (adam_every - 1) * rest) / adam_every


def recording_boundaries(next_batch, seen: list[torch.Tensor]):
    """``next_batch`` that also appends each batch's ``cu_seqlens`` to ``seen`` (read after the timing)."""

    def recording_next_batch(*a, **k):
        batch = next_batch(*a, **k)
        seen.append(batch.cu_seqlens)
        return batch

    return recording_next_batch


def joined_boundaries(seen: list[torch.Tensor]) -> torch.Tensor:
    """The boundaries of several packed batches as those of one batch holding them all, on the CPU: the
    documents of every batch in order, each with its own length."""
    lengths = torch.cat([c.cpu().long().diff() for c in seen])
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def measure_stage(
    trainer, stage: int, warmup: int, steps: int, matmul_rate: float, profile: bool, top: int = 0
) -> dict:
    """Untimed steps from the stage's first step (the first compiles), then ``steps`` timed ones; the row."""
    from track_1_short.config import accumulation_steps
    from track_1_short.model.gpt import flops_per_token

    cfg, device = trainer.cfg, trainer.device
    cuda = device.type == "cuda"
    sched, adam_every = cfg.schedule, cfg.optim.adam_every
    first = schedule.stage_starts(sched)[stage]
    plan = schedule.plan(sched, first, adam_every)
    if first + warmup + steps > schedule.stage_starts(sched)[stage] + sched.stages[stage].steps:
        raise ValueError(
            f"stage {stage} has {sched.stages[stage].steps} steps; --warmup {warmup} + --steps {steps} "
            "must fit in it (the shapes change at the next stage)."
        )
    accum = accumulation_steps(plan.batch_tokens, trainer.world, cfg.micro_batch_tokens)
    tokens = plan.batch_tokens // trainer.world  # one rank's tokens per step

    # The boundaries of every batch read, read after the timing (no sync). Batches are read in step order,
    # though not always within their step (the n-gram table reads a cycle's batches ahead, at the previous
    # cycle's last step), so the timed steps' batches are found by position.
    seen: list[torch.Tensor] = []
    next_batch = trainer.loader.next_batch
    trainer.loader.next_batch = recording_boundaries(next_batch, seen)

    def run_step(step: int, timer: Timer | None) -> torch.Tensor:
        if timer is None:
            return trainer.train_step(step)
        timer.mark("start")
        loss = trainer.train_step(step, marks=timer.mark)
        return loss

    try:
        t0 = time.perf_counter()
        loss = run_step(first, None)  # compiles on the first call of a new geometry
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"stage {stage}: the first step's loss is {loss.item()}; the model is broken.")
        first_step_s = time.perf_counter() - t0
        for step in range(first + 1, first + warmup):
            run_step(step, None)
        timed_first = first + warmup
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() if cuda else None
        gc_state = freeze_gc() if cfg.gc_freeze else None  # as the trainer's timed loop runs (gc_freeze)
        wall0 = time.perf_counter()
        try:
            with Timer(device) as timer:
                for step in range(timed_first, timed_first + steps):
                    loss = run_step(step, timer)
                timer.mark("start")
        finally:
            restore_gc(gc_state)
    finally:
        trainer.loader.next_batch = next_batch
    wall_ms = (time.perf_counter() - wall0) * 1e3  # the Timer synchronised on exit
    peak = torch.cuda.max_memory_allocated() if cuda else None
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"stage {stage}: the loss became {loss.item()} while timing.")

    phases = step_times(timer.labels, timer.elapsed_ms(), steps)
    adam = [schedule.do_adam(s, adam_every) for s in range(timed_first, timed_first + steps)]
    if len(seen) < (warmup + steps) * accum:
        raise RuntimeError(f"stage {stage}: {len(seen)} batches read for {warmup + steps} steps of {accum}.")
    timed_batches = joined_boundaries(seen[warmup * accum : (warmup + steps) * accum])
    fpt = batch_flops_per_token(flops_per_token, cfg.model, timed_batches, plan.windows)
    # At length 1 a query sees only itself: what is left is the FLOPs outside attention (to 1e-4).
    attention_pct = 100 * (1 - float(flops_per_token(cfg.model, 1, list(plan.windows))) / fpt)
    ms_per_step = cycle_mean([sum(p) for p in phases], adam, adam_every)
    floor_ms = fpt * tokens / (matmul_rate * 1e12) * 1e3
    tokens_per_s = tokens / (ms_per_step * 1e-3)
    row = {
        "stage": stage,
        "tokens": tokens,
        "micro_batches": accum,
        "docs_per_step": (timed_batches.numel() - 1) / steps,
        "windows": list(plan.windows),
        "compiled": trainer.compiled,
        "ms_per_step": ms_per_step,
        "ms_per_step_floor": floor_ms,
        "tokens_per_s": tokens_per_s,
        "mfu_pct": 100.0 * fpt * tokens_per_s / (matmul_rate * 1e12),
        "forward_ms": cycle_mean([p[0] for p in phases], adam, adam_every),
        "forward_ms_floor": floor_ms / 3,
        "backward_ms": cycle_mean([p[1] for p in phases], adam, adam_every),
        "backward_ms_floor": 2 * floor_ms / 3,
        "optimizer_ms": cycle_mean([p[2] for p in phases], adam, adam_every),
        "optimizer_adam_step_ms": statistics.median(p[2] for p, a in zip(phases, adam) if a),
        "wall_ms_per_step": wall_ms / steps,
        "peak_memory_gib": peak / GIB if cuda else None,
        "resident_memory_gib": resident / GIB if cuda else None,
        "matmul_tflops": matmul_rate,
        "flops_per_token": fpt,
        "attention_flops_pct": attention_pct,
        "first_step_s": first_step_s,
    }
    if cuda and profile:
        try:
            row.update(profile_cycle(run_step, timed_first + steps, adam_every, top))
        except Exception as e:  # a diagnostic (e.g. no profiler permission here): keep the timings, say why
            print(f"stage {stage}: the kernel breakdown failed: {e}", file=sys.stderr)
            row["profile_error"] = str(e)
    return row


def stage_note(row: dict) -> str:
    """One sentence on where a stage's step time goes, relative to its floors (naming its arm, if any)."""
    share = 100 * row["optimizer_ms"] / row["ms_per_step"]
    arm = f"{row['arm']}: " if "arm" in row else ""
    versus = f" ({row['vs_baseline']:.4f}x the baseline's tokens/s)" if "vs_baseline" in row else ""
    parts = [
        f"{arm}stage {row['stage']} ({row['tokens']:,} tokens){versus}: {row['ms_per_step']:.2f} ms/step, "
        f"{row['ms_per_step'] / row['ms_per_step_floor']:.2f}x its floor ({row['mfu_pct']:.1f}% MFU)",
        f"forward {row['forward_ms']:.2f} ms ({row['forward_ms'] / row['forward_ms_floor']:.2f}x its floor), "
        f"backward {row['backward_ms']:.2f} ms ({row['backward_ms'] / row['backward_ms_floor']:.2f}x), "
        f"optimizer {row['optimizer_ms']:.2f} ms ({share:.0f}% of the step, outside the FLOP count)",
    ]
    if row.get("gpu_busy_pct") is not None:
        parts.append(
            f"kernels run {row['gpu_busy_pct']:.0f}% of a profiled Adam cycle; of device time GEMMs take "
            f"{row['gemm_pct']:.0f}%, attention {row['attention_pct']:.0f}% (attention is "
            f"{row['attention_flops_pct']:.0f}% of the FLOPs), the rest {row['other_kernel_pct']:.0f}%"
        )
    return "; ".join(parts) + "."


PRINTED = ("stage", "tokens", "ms_per_step", "ms_per_step_floor", "tokens_per_s", "mfu_pct", "forward_ms",
           "backward_ms", "optimizer_ms", "peak_memory_gib")  # fmt: skip


def print_table(rows: list[dict]) -> None:
    def cell(v) -> str:
        if v is None:
            return "-"
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    arms = any("arm" in r for r in rows)
    keys = (["arm"] if arms else []) + list(PRINTED) + (["vs_baseline"] if arms else [])
    table = [keys] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    for line in table:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("overrides", nargs="*", help="Hydra overrides of the training config, e.g. experiment=record_1gpu")
    add("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    add("--tiny", action="store_true", help=f"experiment={TINY_EXPERIMENT} (CPU smoke test)")
    add("--stages", type=int, nargs="+", default=None, help="schedule stages to measure (0 2; --tiny 0)")
    add("--warmup", type=int, default=None, help="untimed steps per stage; the first compiles (4; cpu 2)")
    add("--steps", type=int, default=None, help="timed steps per stage (20; cpu 2)")
    add("--profile", action=argparse.BooleanOptionalAction, default=True, help="CUDA kernel breakdown")
    add("--top-kernels", type=int, default=25, help="list the N costliest kernels of the profiled cycle")
    add("--matmul-size", type=int, default=None, help="n of the n^3 bf16 matmul rate (8192; cpu 256)")
    add(
        "--arm",
        action="append",
        default=[],
        metavar='NAME="OVERRIDES"',
        help="another arm (NAME: letters, digits, _ and -): the same stages with these Hydra overrides added "
        "(space-separated), measured after the baseline in this process, with its tokens/s against the "
        "baseline's (repeatable)",
    )
    add("--out", type=Path, default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    args.arms = []
    for text in args.arm:
        name, _, overrides = text.partition("=")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not overrides.split():
            p.error(
                f'--arm {text!r}: write NAME="OVERRIDES", e.g. --arm ref="optim.replicated_impl=reference".'
            )
        if name == "baseline" or name in dict(args.arms):
            p.error(f"--arm {name}: arm names must differ from each other and from 'baseline'.")
        args.arms.append((name, overrides.split()))
    cpu = args.device == "cpu"
    experiment = TINY_EXPERIMENT if args.tiny else DEFAULT_EXPERIMENT
    if not any(o.lstrip("+").startswith("experiment=") for o in args.overrides):
        args.overrides = [f"experiment={experiment}", *args.overrides]
    args.stages = args.stages if args.stages is not None else [0] if args.tiny else [0, 2]
    args.warmup = 2 if cpu and args.warmup is None else 4 if args.warmup is None else args.warmup
    args.steps = 2 if cpu and args.steps is None else 20 if args.steps is None else args.steps
    args.matmul_size = args.matmul_size or (256 if cpu else 8192)
    if not cpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu --tiny for the smoke test.")
    if args.warmup < 1 or args.steps < 2 or args.matmul_size < 1:
        p.error(
            "--warmup >= 1 (its first step compiles), --steps >= 2 (both kinds of step), --matmul-size >= 1."
        )
    return args


def compose(overrides: list[str], device: str, runs_root: str):
    """The training config exactly as ``python -m track_1_short.train OVERRIDES`` composes it."""
    return compose_train([*overrides, f"device={device}", f"runs_root={runs_root}", "progress_bar=false"])


def check_stages(args: argparse.Namespace, tcfg, arm: str) -> None:
    """Refuse stages the arm's schedule lacks and a warmup shorter than its Adam cycle."""
    n_stages = len(tcfg.schedule.stages)
    where = "" if arm == "baseline" else f" (arm {arm})"
    for i in args.stages:
        if not 0 <= i < n_stages:
            raise ValueError(
                f"--stages: stage {i} does not exist; the schedule has {n_stages} stages{where}."
            )
    if args.warmup < tcfg.optim.adam_every:
        raise ValueError(
            f"--warmup {args.warmup} must cover an Adam cycle "
            f"(optim.adam_every={tcfg.optim.adam_every}{where}): both kinds of step compile or load kernels "
            "on their first call."
        )


def measure_arm(trainer, args: argparse.Namespace, rate: float, arm: str | None) -> list[dict]:
    """The rows of ``args.stages`` on ``trainer`` (named ``arm`` when there are several), then the trainer
    closed and its memory and compiled graphs let go, so that the next arm starts as this one did."""
    rows = []
    try:
        for stage in args.stages:
            row = measure_stage(trainer, stage, args.warmup, args.steps, rate, args.profile, args.top_kernels)
            row = row if arm is None else {"arm": arm, **row}
            rows.append(row)
            print(stage_note(row), flush=True)
    finally:
        trainer.loader.close()
        trainer.log.close()
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def table_title(row: dict, idle: bool = False) -> str:
    """The title of a row's kernel table, or with ``idle`` of its idle-stretch table (its arm first, if
    any)."""
    arm = f"{row['arm']}, " if "arm" in row else ""
    what = "where the device idled in" if idle else "the costliest kernels of"
    return f"{arm}stage {row['stage']}: {what} a profiled Adam cycle, per step"


def measured(rows: list[dict]) -> list[dict]:
    """The rows with figures (an arm that failed has one row with its ``error`` instead)."""
    return [r for r in rows if "error" not in r]


def add_vs_baseline(rows: list[dict]) -> None:
    """Each arm's row gets its tokens/s over the baseline's at the same stage."""
    base = {r["stage"]: r["tokens_per_s"] for r in rows if r["arm"] == "baseline"}
    for row in measured(rows):
        if row["arm"] != "baseline":
            row["vs_baseline"] = row["tokens_per_s"] / base[row["stage"]]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton kernels on CPU tensors run in Triton's interpreter, which is chosen when a kernel module is
        # imported (as in track_1_short/train.py): so set it before the imports below reach one.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from omegaconf import OmegaConf

    from track_1_short import cpu_bf16_matmul, distributed
    from track_1_short.config import to_object
    from track_1_short.trainer import Trainer, bf16_matmul_route

    meta = bench_metadata(argv, device)  # taken first: the date is when the run started
    arms = [("baseline", [])] + args.arms
    with tempfile.TemporaryDirectory() as runs_root:
        # Every arm's config first: a bad override or stage fails before any measuring.
        configs = []
        for name, extra in arms:
            cfg = compose([*args.overrides, *extra], args.device, runs_root)
            tcfg = to_object(cfg)
            check_stages(args, tcfg, name)
            configs.append((name, cfg, tcfg))
        # The route trainer.run takes for these matmuls (cpu_bf16_matmul): the rate and the step use it alike.
        with cpu_bf16_matmul.route(bf16_matmul_route(configs[0][2], device)[0]):
            rate = matmul_tflops(args.matmul_size, device, reps=RATE_REPS, warmup_s=RATE_WARMUP_S)
            print(f"bf16 matmul {args.matmul_size}^3: {rate:.4g} TFLOP/s on {meta['device']}", flush=True)
            run_device = distributed.init(args.device)
            rows = []
            for name, cfg, tcfg in configs:
                route = bf16_matmul_route(tcfg, device)[0]  # an arm may choose another
                try:
                    with cpu_bf16_matmul.route(route):
                        trainer = Trainer(tcfg, OmegaConf.to_container(cfg, resolve=True), run_device)
                        rows += measure_arm(trainer, args, rate, name if len(arms) > 1 else None)
                        del trainer  # measure_arm closed it; its memory goes before the next arm's build
                except Exception as exc:  # noqa: BLE001 - an arm's failure is its row; the others still run
                    if name == "baseline":
                        raise
                    print(f"{name}: FAILED: {exc!r}", file=sys.stderr, flush=True)
                    rows.append({"arm": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            # The rate again, after the stages: MFU and floors are stated at the higher of the two, what this
            # GPU does, so that a probe that caught it below its clocks cannot inflate MFU.
            try:
                again = matmul_tflops(args.matmul_size, device, reps=RATE_REPS, warmup_s=RATE_WARMUP_S)
            except Exception as exc:  # noqa: BLE001 - an arm that broke the device: keep what was measured
                if all("error" not in r for r in rows):
                    raise
                print(
                    f"the second rate probe failed after a failed arm ({exc!r}); using the first", flush=True
                )
                again = rate
            print(f"bf16 matmul {args.matmul_size}^3 after the stages: {again:.4g} TFLOP/s", flush=True)
            rates = [rate, again]
            if again > rate:  # the stage lines above used the first probe
                rows = [row if "error" in row else at_rate(row, again) for row in rows]
                for row in measured(rows):
                    print(f"at {again:.4g} TFLOP/s: {stage_note(row)}", flush=True)
    if len(arms) > 1:
        add_vs_baseline(rows)
    tables = {table_title(row): row.pop("top_kernels") for row in rows if row.get("top_kernels")}
    idle = {table_title(row, idle=True): row.pop("idle_gaps") for row in rows if "idle_gaps" in row}
    print_table(rows)
    for title, table in tables.items():
        print(title)
        for k in table:
            print(kernel_table_line(k))
    for title, table in idle.items():
        print(title)
        for g in table:
            idle_ms, count = g["idle_ms_per_step"], g["stretches_per_step"]
            print(f"  {idle_ms:9.3f} ms x{count:<6g} after {g['after']} before {g['before']}")
    tables.update((title, table) for title, table in idle.items() if table)

    payload = {
        **meta,
        "title": f"Trainer.train_step, {' '.join(args.overrides)}, world size 1"
        + "".join(f"; arm {name}: {' '.join(extra)}" for name, extra in args.arms),
        "overrides": args.overrides,
        **({"arms": {name: extra for name, extra in args.arms}} if args.arms else {}),
        "matmul_tflops_probes": rates,
        "rows": rows,
        **({"tables": tables} if tables else {}),
        "notes": [stage_note(r) for r in measured(rows)]
        + [f"arm {r['arm']} failed: {r['error']}" for r in rows if "error" in r]
        + [
            "ms_per_step: the Adam cycle's mean of per-kind medians. Floors: the FLOPs (flops_per_token x "
            "tokens) at the matmul rate measured in this run; forward and backward: 1/3 and 2/3 of that.",
            "matmul_tflops: the higher of two probes of the rate, before and after the stages "
            "(matmul_tflops_probes); MFU and the floors are stated at it.",
        ],
    }
    if args.out is not None:
        write_bench_json(args.out, payload)
        print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
