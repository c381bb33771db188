"""OptimizerTime: the bracketed time, summed between reads, forgotten on reset, on the CPU and on CUDA."""

import time

import pytest
import torch

from track_1_short.optimizer_time import OptimizerTime


def test_cpu_brackets_sum_between_reads_and_leave_out_the_time_outside_them():
    t = OptimizerTime(torch.device("cpu"))
    for _ in range(2):
        t.start()
        time.sleep(0.02)
        t.stop()
        time.sleep(0.05)  # outside the brackets: not counted
    took = t.take_ms()
    assert 40 <= took < 90, took  # 2 x 20 ms inside; the 2 x 50 ms outside would push it past 100
    assert t.take_ms() == 0.0  # read and forgotten


def test_reset_forgets_the_warmup_and_a_stop_without_start_is_refused():
    t = OptimizerTime(torch.device("cpu"))
    t.start()
    time.sleep(0.01)
    t.stop()
    t.reset()
    assert t.take_ms() == 0.0
    with pytest.raises(RuntimeError, match="stop\\(\\) without start\\(\\)"):
        t.stop()


@pytest.mark.gpu
def test_cuda_events_time_the_stream_inside_the_brackets_without_a_sync():
    t = OptimizerTime(torch.device("cuda"))
    torch.cuda.synchronize()
    t.start()
    torch.cuda._sleep(50_000_000)  # tens of ms of GPU time at ~1-2 GHz, enqueued and not waited for
    t.stop()
    torch.cuda._sleep(50_000_000)  # after the bracket: not counted
    torch.cuda.synchronize()
    took = t.take_ms()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    one_sleep = start.elapsed_time(end)
    # The same sleep kernel timed alone: the bracket holds one sleep, not the one after it.
    assert 0.7 * one_sleep <= took <= 1.3 * one_sleep, (took, one_sleep)
