"""Plain progress lines for a run whose stderr is not a terminal: their cadence and their figures."""

from __future__ import annotations

import io
import re

from track_1_short.progress import PlainProgress, duration

LINE = re.compile(r"^progress: step (\d+)/(\d+) loss (\S+) tokens/s ([\d,]+) eta (\S+)$")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _progress(clock: Clock, **kw) -> tuple[PlainProgress, io.StringIO]:
    out = io.StringIO()
    args = dict(
        total_steps=100, start_step=0, start_tokens=0, every_steps=10, every_seconds=30.0, enabled=True
    )
    return PlainProgress(**{**args, **kw}, stream=out, clock=clock), out


def test_a_line_every_n_steps_when_steps_are_fast():
    clock = Clock()
    p, out = _progress(clock)
    for step in range(1, 101):
        clock.t += 0.5  # 10 steps = 5 s: the step count comes first
        p.update(step, 3.0, step * 1000)
    steps = [int(LINE.match(line)[1]) for line in out.getvalue().splitlines()]
    assert steps == list(range(10, 101, 10))


def test_a_line_every_30_seconds_when_steps_are_slow_and_one_at_the_last_step():
    clock = Clock()
    p, out = _progress(clock, total_steps=25)
    for step in range(1, 26):
        clock.t += 7.0  # 30 s pass after 5 steps, before the 10 of every_steps
        p.update(step, 3.0, step * 1000)
    steps = [int(LINE.match(line)[1]) for line in out.getvalue().splitlines()]
    assert steps == [5, 10, 15, 20, 25]


def test_the_line_gives_the_loss_the_rate_and_the_eta_of_this_process():
    clock = Clock()
    # A resumed run: 40 steps and 40,000 tokens were done before this process started.
    p, out = _progress(clock, start_step=40, start_tokens=40_000)
    clock.t += 20.0
    line = p.update(50, 2.34567, 50_000)
    step, total, loss, rate, eta = LINE.match(line).groups()
    assert (step, total, loss) == ("50", "100", "2.3457")
    assert rate == "500"  # 10,000 tokens in 20 s
    assert eta == "1m40s"  # 50 steps left at 2 s a step
    assert out.getvalue() == line + "\n"


def test_disabled_writes_nothing():
    clock = Clock()
    p, out = _progress(clock, enabled=False)
    clock.t += 100
    assert p.update(100, 1.0, 1) is None and out.getvalue() == ""


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0, 59.4, 61, 3600 + 125)] == ["0s", "59s", "1m01s", "1h02m"]
