"""The optimizer's share of the timed loop, measured without adding a sync to it.

The trainer brackets each ``opt.step`` with :meth:`OptimizerTime.start` and :meth:`OptimizerTime.stop` and
reads the sum with :meth:`OptimizerTime.take_ms` only where the loop has just synced anyway (the loss
read-back before each ``train`` event), so the measurement adds no wait to the timed path. On CUDA the marks
are timing events recorded on the current stream (microseconds to enqueue, nothing waited for); on the CPU,
where an op has finished when it returns, they are ``time.perf_counter`` readings.

What it measures on CUDA is the stream's time from the end of the step's last backward to the end of the
update, waits for the reduce-scatter and all-gather included: how long the optimizer holds the step, not its
kernels alone (perf/bench_optimizer.py times those). The figure is this rank's. The n-gram table's pulls
and row updates are bracketed the same way (ngram_cycle.py).
"""

from __future__ import annotations

import time

import torch


class OptimizerTime:
    """Sum of the bracketed intervals since the last :meth:`take_ms`, in milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | float | None = None
        self._cpu_ms = 0.0

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("OptimizerTime.stop() without start(): the bracket around opt.step is broken.")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
        else:
            self._cpu_ms += 1e3 * (time.perf_counter() - self._open)
        self._open = None

    def take_ms(self) -> float:
        """The bracketed time since the last call, then start again from zero. Call it after a sync: the
        events' wait below is then already over."""
        total = self._cpu_ms
        for begin, end in self._events:
            end.synchronize()
            total += begin.elapsed_time(end)
        self.reset()
        return total

    def reset(self) -> None:
        """Forget what was measured (the warmup's steps, before the clock starts)."""
        self._events.clear()
        self._open = None
        self._cpu_ms = 0.0
