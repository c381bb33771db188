"""Where a CUDA workload's device time goes, from a torch.profiler trace: busy share, classes, top kernels.

Shared by the benchmarks (perf/bench_train_step.py, perf/bench_optimizer.py), so a kernel is classed and
ranked the same way in every table of perf/RESULTS.md. The functions on trace events are plain Python (tested
on the CPU with made-up traces); :func:`profile_device` runs a callable under the profiler on CUDA.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# Kernel classes by lower-cased name, attention first (a fused attention template may also contain "mm").
# cuBLAS/cuBLASLt kernels are named gemm/xmma/nvjet/cutlass; Inductor's matmul templates "triton_tem_..._mm_".
# Inductor's pointwise and reduction kernels are never GEMMs, though their names list every op fused into them
# (an FP8 quantise feeding _scaled_mm is "triton_poi_fused__scaled_mm_..."; a tiny bmm becomes a reduction).
INDUCTOR_ELEMENTWISE = ("triton_poi_", "triton_red_", "triton_per_")
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn", "flex")
GEMM_MARKERS = ("gemm", "xmma", "nvjet", "cutlass", "cublas", "wgmma", "_mm_", "_bmm_", "addmm", "matmul")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of device work


def device_events(trace_events: list[dict]) -> list[dict]:
    """The trace's device work: kernels, copies and fills (complete events)."""
    return [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in low for m in GEMM_MARKERS) and not low.startswith(INDUCTOR_ELEMENTWISE):
        return "gemm"
    return "other"


def kernel_breakdown(trace_events: list[dict]) -> dict:
    """From chrome-trace events: the device-busy share of the traced span and kernel time per class.

    Busy time is the union of device intervals (overlapping streams count once); class shares are of the
    summed device time. Percentages; None where the trace holds no device work.
    """
    device = device_events(trace_events)
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


def top_kernels(trace_events: list[dict], n: int, steps: int) -> list[dict]:
    """The ``n`` kernels (by name) with the most summed device time in the trace, per step: calls, ms, share.

    Names are cut to 90 characters (Inductor's fused-kernel names run long); the share is of all device time.
    """
    device = device_events(trace_events)
    total = sum(float(e["dur"]) for e in device)
    per_name: dict[str, list[float]] = {}
    for e in device:
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        acc = per_name.setdefault(name, [0.0, 0.0])
        acc[0] += 1
        acc[1] += float(e["dur"])
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:n]
    return [
        {
            "kernel": name[:90],
            "class": kernel_class(name),
            "calls_per_step": calls / steps,
            "ms_per_step": us / steps / 1e3,
            "pct": 100.0 * us / total if total > 0 else None,
        }
        for name, (calls, us) in ranked
    ]


def idle_gaps(trace_events: list[dict], n: int, steps: int, min_us: float = 10.0) -> list[dict]:
    """Where the device waited: its idle stretches (no kernel, copy or fill on any stream) of at least
    ``min_us``, grouped by the work on either side (the names of the last to end before and the first to
    start after, cut to 60 characters), the ``n`` groups with the most idle time, per step.

    A host that waits on the device (a read of a device value, a synchronize) or falls behind it (a run of
    small eager launches) shows here as idle time after the last kernel it enqueued; the neighbours say
    where in the step that was."""
    device = device_events(trace_events)
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"] if e["cat"] == "kernel" else e["cat"])
        for e in device
    )
    groups: dict[tuple[str, str], list[float]] = {}
    last_end, last_name = None, None
    for start, end, name in spans:
        if last_end is not None and start - last_end >= min_us:
            acc = groups.setdefault((last_name[:60], name[:60]), [0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += start - last_end
            acc[2] = max(acc[2], start - last_end)
        if last_end is None or end > last_end:
            last_end, last_name = end, name
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:n]
    return [
        {
            "after": before,
            "before": after,
            "stretches_per_step": count / steps,
            "idle_ms_per_step": us / steps / 1e3,
            "longest_ms": longest / 1e3,
        }
        for (before, after), (count, us, longest) in ranked
    ]


def kernel_table_line(kernel: dict) -> str:
    """One printed line of a :func:`top_kernels` entry: ms and share per step, calls, class, name."""
    share = f"{kernel['ms_per_step']:9.3f} ms {kernel['pct']:5.1f}% x{kernel['calls_per_step']:<6g}"
    return f"  {share} {kernel['class']:9s} {kernel['kernel']}"


def device_trace(run: Callable[[], None], n: int) -> list[dict]:
    """Chrome-trace events of ``n`` calls of ``run`` under torch.profiler, device activity only (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return trace.get("traceEvents", [])


def profile_device(run: Callable[[], None], n: int, top: int = 0, idle: bool = False) -> dict:
    """:func:`kernel_breakdown` of ``n`` calls of ``run``; with ``top``, also the ``top`` costliest kernels
    per call under the key "top_kernels", and with ``idle`` the ``top`` largest groups of idle stretches
    (:func:`idle_gaps`) under "idle_gaps"."""
    events = device_trace(run, n)
    out = kernel_breakdown(events)
    if top:
        out["top_kernels"] = top_kernels(events, top, n)
        if idle:
            out["idle_gaps"] = idle_gaps(events, top, n)
    return out
