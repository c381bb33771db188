"""Progress for a run whose stderr is not a terminal (CI, nohup, ``| tee``): plain lines at a steady cadence.

On a terminal the tqdm bar shows progress; redirected, a bar is kilobytes of carriage returns, so it is off
and this writes one line instead every ``log_every`` steps or every ``progress_seconds`` seconds, whichever
comes first, and at the last step:

    progress: step 50/176 loss 5.1234 tokens/s 1,450 eta 1m23s

tokens/s and the ETA are wall-clock figures of this process's loop (validation and checkpoints included),
which is what a person waiting for the run wants; the train time in log.txt is the record's clock.
"""

from __future__ import annotations

import sys
import time
from typing import IO


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class PlainProgress:
    """Writes a progress line when due; :meth:`update` is called at every loss read-back."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        start_tokens: int,
        every_steps: int,
        every_seconds: float,
        enabled: bool,
        stream: IO[str] | None = None,
        clock=time.monotonic,
    ) -> None:
        self.total, self.every_steps, self.every_seconds = total_steps, every_steps, every_seconds
        self.enabled = enabled
        self.stream = stream
        self.clock = clock
        self.t0 = clock()
        self.start_step, self.start_tokens = start_step, start_tokens
        self.last_step, self.last_time = start_step, self.t0

    def update(self, step: int, loss: float, tokens_seen: int) -> str | None:
        """The line written for completed step ``step``, or None when none was due."""
        if not self.enabled:
            return None
        now = self.clock()
        due = (
            step >= self.total
            or (self.every_steps > 0 and step - self.last_step >= self.every_steps)
            or (self.every_seconds > 0 and now - self.last_time >= self.every_seconds)
        )
        if not due:
            return None
        wall = max(now - self.t0, 1e-9)
        rate = (tokens_seen - self.start_tokens) / wall
        done = step - self.start_step
        eta = (self.total - step) * wall / done if done > 0 else float("nan")
        line = (
            f"progress: step {step}/{self.total} loss {loss:.4f} tokens/s {rate:,.0f} "
            f"eta {duration(eta) if eta == eta else '?'}"
        )
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)
        self.last_step, self.last_time = step, now
        return line
