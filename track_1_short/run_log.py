"""The run log: one directory per run, written by rank 0 only.

    <run_dir>/log.txt       human log; progress lines in the upstream format that existing tools parse:
                            ``step:N/M val_loss:X.XXXX train_time:Yms step_avg:Z.ZZms`` (train-only lines
                            omit the val_loss field)
    <run_dir>/events.jsonl  one JSON object a line, key "event" in start | train | val | end | resume |
                            summary (run_report.py, after the end of a finished run)
    <run_dir>/curves.png    train and val loss against the reference losses (curves.py), at the end
    <run_dir>/config.yaml   the resolved config, written before step 0
    <run_dir>/env.json      versions and devices

A resumed run appends to its own directory: a ``resume`` event and a log.txt line ``resumed at step:K/M
from <checkpoint>`` mark where it continues, and whatever the directory logged for steps after K before the
resumption (the steps a killed run made past its last checkpoint) is superseded by what follows, so the
directory still holds one run (tools/record_gate.py reads it so).

Step numbers in progress lines count completed steps (upstream): the line after the last training step, and
the final validation, read ``step:M/M``. A run is finished when it has a val event at step == total_steps.
Files are block-buffered and flushed by :meth:`RunLog.flush`, which the training loop calls while the clock is
stopped, so disk writes do not land on the timed path.
"""

from __future__ import annotations

import json
import math
import platform
import re
import sys
from pathlib import Path
from typing import IO, Any

EVENTS = ("start", "train", "val", "end", "phase", "resume", "summary")
RESUMED = re.compile(r"^resumed at step:(?P<step>\d+)/(?P<total>\d+)")  # the log.txt marker

_PROGRESS = re.compile(
    r"^step:(?P<step>\d+)/(?P<total>\d+)"
    r"(?: val_loss:(?P<val_loss>[-+0-9.eEnaif]+))?"
    r" train_time:(?P<train_time_ms>\d+)ms step_avg:(?P<step_avg_ms>[-+0-9.eEnaif]+)ms$"
)


def format_progress(
    step: int, total_steps: int, train_time_ms: float, step_avg_ms: float, val_loss: float | None = None
) -> str:
    """One progress line in the upstream format (train time in whole ms, step average to 0.01 ms)."""
    val = f" val_loss:{val_loss:.4f}" if val_loss is not None else ""
    return f"step:{step}/{total_steps}{val} train_time:{train_time_ms:.0f}ms step_avg:{step_avg_ms:.2f}ms"


def parse_progress(line: str) -> dict | None:
    """Inverse of :func:`format_progress`; None for any other line."""
    m = _PROGRESS.match(line.strip())
    if m is None:
        return None
    out: dict[str, Any] = {
        "step": int(m["step"]),
        "total_steps": int(m["total"]),
        "train_time_ms": float(m["train_time_ms"]),
        "step_avg_ms": float(m["step_avg_ms"]),
    }
    if m["val_loss"] is not None:
        out["val_loss"] = float(m["val_loss"])
    return out


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/inf; a poisoned loss is logged as a string so every line stays parseable.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def environment() -> dict:
    """Versions and devices, for env.json (the upstream log records the same facts as text)."""
    import numpy
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "devices": [],
    }
    for name in ("triton", "hydra", "omegaconf"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is recorded, not fatal
            env[name] = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["devices"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory})
    else:
        env["devices"].append({"index": 0, "name": platform.processor() or "cpu", "cpus": _cpu_count()})
    return env


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class RunLog:
    """Writes the run directory. With ``enabled=False`` (ranks other than 0) every call is a no-op."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, echo: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.echo = echo
        self._text: IO[str] | None = None
        self._events: IO[str] | None = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._text = open(self.run_dir / "log.txt", "a", buffering=1 << 16)
            self._events = open(self.run_dir / "events.jsonl", "a", buffering=1 << 16)

    # -- files written once -------------------------------------------------------------------------------
    def write_config(self, resolved_yaml: str) -> None:
        if self.enabled:
            (self.run_dir / "config.yaml").write_text(resolved_yaml)

    def write_env(self, env: dict | None = None) -> None:
        if self.enabled:
            (self.run_dir / "env.json").write_text(
                json.dumps(env if env is not None else environment(), indent=2)
            )

    # -- lines ----------------------------------------------------------------------------------------------
    def text(self, line: str) -> None:
        if self._text is not None:
            self._text.write(line + "\n")
        if self.enabled and self.echo:
            print(line, flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        if kind not in EVENTS:
            raise ValueError(f"unknown run-log event {kind!r}; expected one of {EVENTS}.")
        if self._events is not None:
            self._events.write(json.dumps(_jsonable({"event": kind, **fields}), allow_nan=False) + "\n")

    def start(self, total_steps: int, seed: int, config: dict, **extra: Any) -> None:
        self.event("start", total_steps=total_steps, seed=seed, config=config, **extra)

    def train(
        self,
        step: int,
        total_steps: int,
        loss: float,
        lr_multiplier: float,
        tokens_seen: int,
        train_time_ms: float,
        step_avg_ms: float,
        progress_line: bool = False,
        **extra: Any,
    ) -> None:
        """A completed step (``step`` = steps done); ``progress_line`` also writes the upstream line."""
        self.event(
            "train",
            step=step,
            loss=loss,
            lr_multiplier=lr_multiplier,
            tokens_seen=tokens_seen,
            train_time_ms=train_time_ms,
            step_avg_ms=step_avg_ms,
            **extra,
        )
        if progress_line:
            self.text(format_progress(step, total_steps, train_time_ms, step_avg_ms))
            # Throughput on its own line: the progress line keeps the upstream format that tools parse.
            rate = tokens_seen / (train_time_ms / 1e3) if train_time_ms > 0 else 0.0
            self.text(f"  tokens_seen:{tokens_seen} tokens/s:{rate:.0f} (mean over the train time)")

    def val(
        self,
        step: int,
        total_steps: int,
        val_loss: float,
        train_time_ms: float,
        step_avg_ms: float,
        **extra: Any,
    ) -> None:
        """``val_loss`` is the one the record gate reads; ``extra``: the final validation's other losses."""
        self.event(
            "val",
            step=step,
            total_steps=total_steps,
            val_loss=val_loss,
            train_time_ms=train_time_ms,
            step_avg_ms=step_avg_ms,
            **extra,
        )
        self.text(format_progress(step, total_steps, train_time_ms, step_avg_ms, val_loss))

    def end(
        self,
        step: int,
        total_steps: int,
        status: str,
        val_loss: float | None,
        train_time_ms: float,
        **extra: Any,
    ) -> None:
        if status not in ("finished", "failed"):
            raise ValueError(f"run status {status!r} must be 'finished' or 'failed'.")
        self.event(
            "end",
            step=step,
            total_steps=total_steps,
            status=status,
            val_loss=val_loss,
            train_time_ms=train_time_ms,
            **extra,
        )
        self.flush()

    def flush(self) -> None:
        for f in (self._text, self._events):
            if f is not None:
                f.flush()

    def close(self) -> None:
        self.flush()
        for f in (self._text, self._events):
            if f is not None:
                f.close()
        self._text = self._events = None


def mark_resumption(log: RunLog, checkpoint_file: Path, step: int, total_steps: int) -> None:
    """The marked resumption a continued run appends before its first step (see the module docstring)."""
    log.text(f"resumed at step:{step}/{total_steps} from {checkpoint_file}")
    log.event("resume", step=step, total_steps=total_steps, checkpoint=str(checkpoint_file))
    log.flush()


def read_events(run_dir: str | Path) -> list[dict]:
    """Every event of a run directory, in order."""
    path = Path(run_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_finished(run_dir: str | Path) -> bool:
    """A run is finished when it has a val event at step == total_steps."""
    return any(e["event"] == "val" and e["step"] == e["total_steps"] for e in read_events(run_dir))


# -- which directory holds a run ----------------------------------------------------------------------------
RUN_FILES = (
    "events.jsonl",
    "log.txt",
    "config.yaml",
    "checkpoints",
)  # any of them: the directory holds a run


def holds_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def checkpoint_owner(file: Path, meta: dict) -> Path | None:
    """The run directory that wrote ``file``: the one holding its ``checkpoints/``, or meta's run_dir."""
    if file.parent.name == "checkpoints" and holds_run(file.parent.parent):
        return file.parent.parent
    recorded = meta.get("run_dir")
    if isinstance(recorded, str) and holds_run(Path(recorded)):
        return Path(recorded)
    return None
