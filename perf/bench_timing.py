"""Timing helpers the GPU benchmarks share (perf/bench_optimizer.py, perf/bench_cascade_products.py): a mean
over timed calls (CUDA events on the GPU, perf_counter on the CPU), the device's measured bf16 matmul and copy
rates that the floors are stated at, and a call captured in a CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], None], device: torch.device, steps: int, warmup: int) -> float:
    """Mean milliseconds of ``fn`` over ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def matmul_tflops(device: torch.device, n: int, repeats: int = 5) -> float:
    """bf16 matmul rate: median over ``repeats`` of an n^3 product (2 n^3 FLOPs), in TFLOP/s."""
    a = torch.randn(n, n, device=device).bfloat16()
    b = torch.randn(n, n, device=device).bfloat16()
    times = [time_ms(lambda: torch.mm(a, b), device, steps=3, warmup=1) for _ in range(repeats)]
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def copy_gbps(device: torch.device, numel: int, repeats: int = 5) -> float:
    """Device copy rate in GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(numel, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = [time_ms(lambda: dst.copy_(src), device, steps=5, warmup=1) for _ in range(repeats)]
    return 2 * src.numel() * src.element_size() / (statistics.median(times) * 1e-3) / 1e9


def graph_replay(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after one warm-up call on the capture stream); returns its replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay
