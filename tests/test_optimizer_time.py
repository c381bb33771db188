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
    # The sleep kernel's length follows the GPU's clock, which ramps up from idle (measured on an H200: one
    # sleep of 50M cycles took 41 ms cold and 25 ms right after). So the bracket holds one sleep of N cycles
    # and the stream after it four more: counting them would read at least 5x one sleep, counting none 0;
    # the bounds (0.4x-2.5x a sleep timed before and after) hold over a 2.5x clock swing and still split them.
    cycles = 20_000_000

    def one_sleep_ms() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    t = OptimizerTime(torch.device("cuda"))
    before = one_sleep_ms()
    t.start()
    torch.cuda._sleep(cycles)  # enqueued and not waited for
    t.stop()
    torch.cuda._sleep(4 * cycles)  # after the bracket: not counted
    torch.cuda.synchronize()
    took = t.take_ms()
    after = one_sleep_ms()
    assert 0.4 * min(before, after) <= took <= 2.5 * max(before, after), (took, before, after)
