"""The training command line, stopped on cue: ``python -m tests.stop_runs MODE STEP [train overrides...]``.

It runs ``python -m track_1_short.train`` (its ``cli()``, in this process) and stops it at the start of
training step STEP (STEP steps are complete) the way MODE names:

    crash      an exception the trainer does not expect (RuntimeError)
    interrupt  KeyboardInterrupt, as Ctrl-C raises it in the main thread
    kill       SIGKILL, which no handler intercepts: nothing is printed, the next start must find it

A NaN stop needs no cue: ``fault_injection.nan_grad_step`` is a setting of the run itself.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> None:
    mode, step, *overrides = argv
    step = int(step)
    from track_1_short import train, trainer

    real_step = trainer.Trainer.train_step

    def train_step(self, s, marks=None):
        if s == step:
            if mode == "crash":
                raise RuntimeError(f"a crash planted at step {s}")
            if mode == "interrupt":
                raise KeyboardInterrupt
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise SystemExit(f"unknown mode {mode!r}; one of crash, interrupt, kill")
        return real_step(self, s, marks)

    trainer.Trainer.train_step = train_step
    sys.argv = ["track_1_short.train", *overrides]
    train.cli()


if __name__ == "__main__":
    main(sys.argv[1:])
