"""One training step of the track1 model at the record's per-rank batch shapes: time, throughput, memory, MFU.

    python perf/bench_train_step.py --out perf/results/train_step.json      # CUDA, compiled, stages 0 and 2
    python perf/bench_train_step.py --device cpu --tiny --out /tmp/ts.json    # CPU smoke test, tiny model

One step is what the training loop (track_1_short/trainer.py) does at world size 1: ``set_schedule``, the
forward (the weighted CE summed over tokens), backward of the per-token mean, ``AnvilAndAdam.step`` with the
schedule's Adam cadence; the model is compiled (torch.compile, dynamic=False) on CUDA. The shapes come from
configs/schedule/track1.yaml: the record trains on 8 GPUs, so a rank's microbatch is a stage's global batch
/ 8 (stage 0: 16384 tokens, windows (1, 3), MTP weights [1, 0.5, 0.25]; stage 2: 49152 tokens, windows
(5, 11)). Tokens are random, packed into whole documents (BOS first) whose lengths follow a log-normal with
median 400 tokens (mean 660 before the cap at the stage's max_doc_len), a web-text-like spread: lengths shape
the attention mask and the per-document work, not the dense matmuls. Batches live on the device, so loading
is not timed.

Figures per stage: ms/step is the Adam cycle's mean of the per-kind medians (one Adam step and adam_every - 1
steps without), each step timed with CUDA events from its start to the next step's start after a warm-up;
tokens/s; peak and resident memory (max_memory_allocated, and memory_allocated before the timed steps);
MFU = FLOPs per token x tokens/s / the bf16 matmul rate measured in the same run (median of repeated 8192^3
torch.matmul on random data), so MFU compares the step with what this GPU does, not with a datasheet; FLOPs
per token are the model's ``flops_per_token`` per document (length and windows), token-weighted. The
floor of ms/step is the step's FLOPs at that rate (100% MFU); forward and backward floors are 1/3 and 2/3 of
it (the backward of a matmul is two matmuls).

What stands between a figure and its floor: the forward/backward/optimizer split (the optimizer is outside
the FLOP count) and, on CUDA, one profiled Adam cycle: the share of it in which the GPU runs kernels (the rest
is launch and host overhead) and how kernel time splits into GEMMs, attention and the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from track_1_short import schedule
from track_1_short.perf.bench_meta import REPO_ROOT, bench_metadata, write_bench_json

RECORD_WORLD_SIZE = 8  # the record's GPU count: a rank's microbatch is a stage's global batch / 8
DOC_LEN_MEDIAN = 400.0  # tokens; document lengths are log-normal, median 400, mean 660 (sigma 1)
DOC_LEN_SIGMA = 1.0
BATCHES_PER_STAGE = 4  # token batches cycled through; one boundary set, so one compiled graph per stage
TINY_TOKENS = 512  # --tiny: tokens per step
TINY_MAX_DOC_LEN = 160  # --tiny: document cap, in tokens
GIB = 1024**3


@dataclass
class StageShape:
    """One benchmarked configuration: a schedule stage's per-rank microbatch, as at the stage's first step."""

    stage: int
    first_step: int  # the warm-up starts here and timing follows it: set_schedule sees the stage's own steps
    tokens: int  # tokens per step on one rank
    max_doc_len: int  # tokens
    windows: tuple[int, int]  # (short, long), in attention blocks
    mtp_weights: list[float]  # held at the stage's first value: one compiled graph per stage


@dataclass
class Batch:
    inputs: torch.Tensor  # int32 [T]
    targets: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1], 0 ... T


CONFIG_GROUPS = ("model", "optim", "schedule")  # the groups --set can reach


def load_structured(dataclass_type, path: Path, overrides: list[str] | None = None):
    """A config dataclass from one Hydra group YAML (+ ``key=value`` overrides), through OmegaConf."""
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; run from a full checkout.")
    node = OmegaConf.load(path)
    if "defaults" in node:  # a group file's own defaults list is Hydra's business, not the dataclass's
        node.pop("defaults")
    merged = OmegaConf.merge(
        OmegaConf.structured(dataclass_type), node, OmegaConf.from_dotlist(overrides or [])
    )
    return OmegaConf.to_object(merged)


def group_overrides(assignments: list[str]) -> dict[str, list[str]]:
    """``--set model.check_inputs=false`` -> {"model": ["check_inputs=false"]}; a bad item is refused."""
    out: dict[str, list[str]] = {g: [] for g in CONFIG_GROUPS}
    for item in assignments:
        group, _, rest = item.partition(".")
        if group not in out or "=" not in rest:
            raise ValueError(
                f"--set {item}: write GROUP.KEY=VALUE with GROUP one of {', '.join(CONFIG_GROUPS)}."
            )
        out[group].append(rest)
    return out


def stage_shapes(cfg: schedule.ScheduleConfig, stages: list[int], tiny: bool) -> list[StageShape]:
    starts = schedule.stage_starts(cfg)
    shapes = []
    for i in stages:
        if not 0 <= i < len(cfg.stages):
            raise ValueError(
                f"--stages: stage {i} does not exist; the schedule has {len(cfg.stages)} stages."
            )
        plan = schedule.plan(cfg, starts[i], adam_every=1)
        shapes.append(
            StageShape(
                stage=i,
                first_step=starts[i],
                tokens=TINY_TOKENS if tiny else plan.batch_tokens // RECORD_WORLD_SIZE,
                max_doc_len=min(plan.max_doc_len, TINY_MAX_DOC_LEN) if tiny else plan.max_doc_len,
                windows=plan.windows,
                mtp_weights=list(plan.mtp_weights),
            )
        )
    return shapes


def document_lengths(tokens: int, max_doc_len: int, generator: torch.Generator) -> list[int]:
    """Lengths of whole documents (each capped at ``max_doc_len``) that fill exactly ``tokens`` tokens."""
    lengths, left = [], tokens
    while left > 0:
        z = torch.randn((), generator=generator).item()
        n = min(max(1, round(DOC_LEN_MEDIAN * math.exp(DOC_LEN_SIGMA * z))), max_doc_len, left)
        lengths.append(n)
        left -= n
    return lengths


def synthetic_batches(shape: StageShape, vocab_size: int, bos_id: int, device, seed: int) -> list[Batch]:
    """``BATCHES_PER_STAGE`` batches of random tokens; every document starts with BOS, as the loader's do."""
    g = torch.Generator().manual_seed(seed)
    lengths = document_lengths(shape.tokens, shape.max_doc_len, g)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    batches = []
    for _ in range(BATCHES_PER_STAGE):
        buf = torch.randint(0, vocab_size, (shape.tokens + 1,), generator=g)  # inputs, then targets shifted
        buf[cu[:-1].long()] = bos_id
        batches.append(
            Batch(
                inputs=buf[:-1].to(device=device, dtype=torch.int32),
                targets=buf[1:].to(device=device, dtype=torch.int64),
                cu_seqlens=cu.to(device),
            )
        )
    return batches


def batch_flops_per_token(flops_per_token, model_cfg, cu_seqlens: torch.Tensor, windows) -> float:
    """Training FLOPs per token of a packed batch: the model's per-document figure, token-weighted.

    Attention FLOPs depend on a document's length and the windows, so a per-token figure for a mix of lengths
    is the token-weighted mean of ``flops_per_token(cfg, length, windows)`` over the documents.
    """
    lengths = cu_seqlens.diff().tolist()
    total = sum(float(flops_per_token(model_cfg, n, list(windows))) * n for n in lengths if n > 0)
    return total / sum(lengths)


def matmul_tflops(size: int, device: torch.device, warmup: int = 10, reps: int = 20) -> float:
    """bf16 rate of a size^3 torch.matmul on random data, median over ``reps`` timed calls, in TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b)
    with Timer(device) as timer:
        for _ in range(reps):
            timer.mark()
            torch.matmul(a, b)
            timer.mark()
    marks = timer.elapsed_ms()
    median_ms = statistics.median(marks[2 * i + 1] - marks[2 * i] for i in range(reps))
    return 2 * size**3 / (median_ms * 1e-3) / 1e12


class Timer:
    """Time marks on the device's stream (CUDA events), or on the host clock on the CPU (ops are synchronous).

    ``mark()`` records a point; after the ``with`` block, ``elapsed_ms()`` gives each mark in ms from the
    first.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        return False

    def mark(self) -> None:
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


# Kernel classes by lower-cased name, attention first (a fused attention template may also contain "mm").
# cuBLAS/cuBLASLt kernels are named gemm/xmma/nvjet/cutlass; Inductor's matmul templates "triton_tem_..._mm_".
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn", "flex")
GEMM_MARKERS = ("gemm", "xmma", "nvjet", "cutlass", "cublas", "wgmma", "_mm_", "_bmm_", "addmm", "matmul")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of device work


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def kernel_breakdown(trace_events: list[dict]) -> dict:
    """From chrome-trace events: the device-busy share of the traced span and kernel time per class.

    Busy time is the union of device intervals (overlapping streams count once); class shares are of the
    summed device time. Percentages; None where the trace holds no device work.
    """
    device = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        return {"gpu_busy_pct": None, "gemm_pct": None, "attention_pct": None, "other_kernel_pct": None}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device)
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    total_span = spans[-1][1] - spans[0][0]
    per_class = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in device:
        per_class[kernel_class(e["name"]) if e["cat"] == "kernel" else "other"] += float(e["dur"])
    kernel_sum = sum(per_class.values())
    pct = lambda x, of: 100.0 * x / of if of > 0 else None
    return {
        "gpu_busy_pct": pct(busy, total_span),
        "gemm_pct": pct(per_class["gemm"], kernel_sum),
        "attention_pct": pct(per_class["attention"], kernel_sum),
        "other_kernel_pct": pct(per_class["other"], kernel_sum),
    }


def profile_cycle(run_step, first_step: int, n_steps: int) -> dict:
    """Kernel breakdown of ``n_steps`` consecutive steps under torch.profiler (device activity only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for step in range(first_step, first_step + n_steps):
            run_step(step, None)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return kernel_breakdown(trace.get("traceEvents", []))


@dataclass
class Bench:
    """What every stage's measurement shares: the built objects and the run's settings."""

    model: torch.nn.Module
    forward: torch.nn.Module  # the compiled model, or the model itself
    opt: object  # AnvilAndAdam
    schedule: schedule.ScheduleConfig
    adam_every: int
    device: torch.device
    matmul_tflops: float
    warmup: int
    steps: int
    profile: bool


def step_times(marks: list[float], steps: int) -> list[tuple[float, float, float]]:
    """(forward, backward, optimizer) ms per step from 3 marks per step plus a closing mark.

    A step runs from its start mark to the next step's, so host gaps between steps count (the optimizer phase
    ends where the next step starts).
    """
    if len(marks) != 3 * steps + 1:
        raise ValueError(f"expected {3 * steps + 1} marks for {steps} steps, got {len(marks)}.")
    return [
        (
            marks[3 * i + 1] - marks[3 * i],
            marks[3 * i + 2] - marks[3 * i + 1],
            marks[3 * i + 3] - marks[3 * i + 2],
        )
        for i in range(steps)
    ]


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


def measure_stage(
    b: Bench, shape: StageShape, batches: list[Batch], flops_per_token: float, attention_flops_pct: float
) -> dict:
    """Warm up, time ``b.steps`` steps from the stage's first step, and return the stage's row.

    ``flops_per_token``: training FLOPs per token of the batch; ``attention_flops_pct``: the attention
    (scores and values) share of them.
    """
    cuda = b.device.type == "cuda"

    def run_step(step: int, timer: Timer | None) -> torch.Tensor:
        plan = schedule.plan(b.schedule, step, b.adam_every)
        batch = batches[step % len(batches)]
        if timer:
            timer.mark()
        b.opt.set_schedule(plan.lr_multiplier, plan.rail_beta, step)
        loss = b.forward(batch.inputs, batch.targets, batch.cu_seqlens, shape.windows, shape.mtp_weights)
        if timer:
            timer.mark()
        (loss / shape.tokens).backward()  # the training loop's per-token mean
        if timer:
            timer.mark()
        b.opt.step(plan.do_adam)
        return loss

    t0 = time.perf_counter()
    loss = run_step(shape.first_step, None)  # compiles on the first call
    if not math.isfinite(loss.item()):
        raise RuntimeError(
            f"stage {shape.stage}: the first step's loss is {loss.item()}; the model is broken."
        )
    compile_s = time.perf_counter() - t0
    for step in range(shape.first_step + 1, shape.first_step + b.warmup):
        run_step(step, None)
    first = shape.first_step + b.warmup
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else None
    wall0 = time.perf_counter()
    with Timer(b.device) as timer:
        for step in range(first, first + b.steps):
            loss = run_step(step, timer)
        timer.mark()
    wall_ms = (time.perf_counter() - wall0) * 1e3  # the Timer synchronised on exit
    peak = torch.cuda.max_memory_allocated() if cuda else None
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"stage {shape.stage}: the loss became {loss.item()} while timing.")

    phases = step_times(timer.elapsed_ms(), b.steps)
    adam = [schedule.do_adam(s, b.adam_every) for s in range(first, first + b.steps)]
    ms_per_step = cycle_mean([sum(p) for p in phases], adam, b.adam_every)
    floor_ms = flops_per_token * shape.tokens / (b.matmul_tflops * 1e12) * 1e3
    tokens_per_s = shape.tokens / (ms_per_step * 1e-3)
    row = {
        "stage": shape.stage,
        "tokens": shape.tokens,
        "docs": int(batches[0].cu_seqlens.numel() - 1),
        "windows": list(shape.windows),
        "compiled": b.forward is not b.model,
        "ms_per_step": ms_per_step,
        "ms_per_step_floor": floor_ms,
        "tokens_per_s": tokens_per_s,
        "mfu_pct": 100.0 * flops_per_token * tokens_per_s / (b.matmul_tflops * 1e12),
        "forward_ms": cycle_mean([p[0] for p in phases], adam, b.adam_every),
        "forward_ms_floor": floor_ms / 3,
        "backward_ms": cycle_mean([p[1] for p in phases], adam, b.adam_every),
        "backward_ms_floor": 2 * floor_ms / 3,
        "optimizer_ms": cycle_mean([p[2] for p in phases], adam, b.adam_every),
        "optimizer_adam_step_ms": statistics.median(p[2] for p, a in zip(phases, adam) if a),
        "wall_ms_per_step": wall_ms / b.steps,
        "peak_memory_gib": peak / GIB if cuda else None,
        "resident_memory_gib": resident / GIB if cuda else None,
        "matmul_tflops": b.matmul_tflops,
        "flops_per_token": flops_per_token,
        "attention_flops_pct": attention_flops_pct,
        "first_step_s": compile_s,
    }
    if cuda and b.profile:
        try:
            row.update(profile_cycle(run_step, first + b.steps, b.adam_every))
        except Exception as e:  # a diagnostic (e.g. no profiler permission here): keep the timings, say why
            print(f"stage {shape.stage}: the kernel breakdown failed: {e}", file=sys.stderr)
            row["profile_error"] = str(e)
    return row


def stage_note(row: dict) -> str:
    """One sentence on where a stage's step time goes, relative to its floors."""
    share = 100 * row["optimizer_ms"] / row["ms_per_step"]
    parts = [
        f"stage {row['stage']} ({row['tokens']:,} tokens): {row['ms_per_step']:.2f} ms/step, "
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

    table = [list(PRINTED)] + [[cell(r.get(k)) for k in PRINTED] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(PRINTED))]
    for line in table:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    add("--tiny", action="store_true", help=f"the tiny model, {TINY_TOKENS} tokens per step (smoke test)")
    add("--model", default=None, help="configs/model/<name>.yaml (default track1; tiny with --tiny)")
    add("--optim", default="anvil_adam", help="configs/optim/<name>.yaml (default anvil_adam)")
    add("--schedule", default="track1", help="configs/schedule/<name>.yaml, where the shapes come from")
    add("--stages", type=int, nargs="+", default=[0, 2], help="schedule stages to measure (default 0 2)")
    add("--warmup", type=int, default=None, help="untimed steps per stage; the first compiles (4; cpu 2)")
    add("--steps", type=int, default=None, help="timed steps per stage (20; cpu 2)")
    add("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile (CUDA default)")
    add("--profile", action=argparse.BooleanOptionalAction, default=True, help="CUDA kernel breakdown")
    add("--matmul-size", type=int, default=None, help="n of the n^3 bf16 matmul rate (8192; cpu 256)")
    add("--set", nargs="+", default=[], metavar="GROUP.KEY=VALUE", help="config overrides, e.g. model.x=1")
    add("--seed", type=int, default=0, help="seed of the model init and the synthetic batches")
    add("--out", type=Path, default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if args.tiny else "track1")
    args.warmup = 2 if cpu and args.warmup is None else 4 if args.warmup is None else args.warmup
    args.steps = 2 if cpu and args.steps is None else 20 if args.steps is None else args.steps
    args.compile = not cpu if args.compile is None else args.compile
    args.matmul_size = args.matmul_size or (256 if cpu else 8192)
    if not cpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu --tiny for the smoke test.")
    if args.warmup < 1 or args.steps < 2 or args.matmul_size < 1:
        p.error(
            "--warmup >= 1 (its first step compiles), --steps >= 2 (both kinds of step), --matmul-size >= 1."
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton kernels on CPU tensors run in Triton's interpreter, which is chosen when a kernel module is
        # imported (as in track_1_short/train.py): so set it before the imports below reach one.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from track_1_short.data import GPT2_BOS_ID
    from track_1_short.model.gpt import GPT, ModelConfig, flops_per_token
    from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig

    meta = bench_metadata(argv, device)  # taken first: the date is when the run started
    configs, sets = REPO_ROOT / "configs", group_overrides(args.set)
    model_cfg = load_structured(ModelConfig, configs / "model" / f"{args.model}.yaml", sets["model"])
    optim_cfg = load_structured(OptimConfig, configs / "optim" / f"{args.optim}.yaml", sets["optim"])
    sched = load_structured(
        schedule.ScheduleConfig, configs / "schedule" / f"{args.schedule}.yaml", sets["schedule"]
    )
    shapes = stage_shapes(sched, args.stages, args.tiny)
    if args.warmup < optim_cfg.adam_every:
        raise ValueError(
            f"--warmup {args.warmup} must cover an Adam cycle (optim.adam_every={optim_cfg.adam_every}): "
            "both kinds of step compile or load kernels on their first call."
        )

    rate = matmul_tflops(args.matmul_size, device)
    print(f"bf16 matmul {args.matmul_size}^3: {rate:.4g} TFLOP/s on {meta['device']}", flush=True)

    torch.manual_seed(args.seed)
    model = GPT(model_cfg).to(device)
    model.train()
    table = model.param_table()
    opt = AnvilAndAdam(
        list(model.named_parameters()), table, model.scatter_order(), model.work_order(), optim_cfg
    )
    forward = torch.compile(model, dynamic=False) if args.compile else model
    b = Bench(
        model, forward, opt, sched, optim_cfg.adam_every, device, rate, args.warmup, args.steps, args.profile
    )

    rows = []
    for shape in shapes:
        batches = synthetic_batches(shape, model_cfg.vocab_size, GPT2_BOS_ID, device, args.seed + shape.stage)
        fpt = batch_flops_per_token(flops_per_token, model_cfg, batches[0].cu_seqlens.cpu(), shape.windows)
        # At length 1 a query sees only itself: what is left is the FLOPs outside attention (to 1e-4).
        attention_pct = 100 * (1 - float(flops_per_token(model_cfg, 1, list(shape.windows))) / fpt)
        row = measure_stage(b, shape, batches, fpt, attention_pct)
        rows.append(row)
        print(stage_note(row), flush=True)
    print_table(rows)

    payload = {
        **meta,
        "title": f"Training step of the {args.model} model, world size 1",
        "rows": rows,
        "notes": [stage_note(r) for r in rows]
        + [
            "ms_per_step: the Adam cycle's mean of per-kind medians. Floors: the FLOPs (flops_per_token x "
            "tokens) at the matmul rate measured in this run; forward and backward: 1/3 and 2/3 of that.",
            "Target (issue 7): at least 40% MFU in bf16 on one H200.",
        ],
    }
    if args.out is not None:
        write_bench_json(args.out, payload)
        print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
