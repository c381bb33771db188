"""The end of a run: its summary (printed, and kept in log.txt and events.jsonl) and its ``curves.png``.

Rank 0 appends to the run directory after training closed its logs: a ``summary`` event (final val loss,
steps, train time, tokens/s and the reference losses of curves.py) and the same lines as text in log.txt,
so the figures a terminal showed are in the directory too; then it draws ``curves.png``.
"""

from __future__ import annotations

from pathlib import Path

from track_1_short import checkpoint, curves, distributed, resume
from track_1_short.run_log import RunLog


class RunStop:
    """Where a run that stopped early stands (Ctrl-C, a crash, a NaN stop) and how to continue it."""

    def __init__(self, trainer=None) -> None:
        self.run_dir = getattr(trainer, "run_dir", None)
        self.step = getattr(trainer, "step", None)
        self.total_steps = getattr(trainer, "total_steps", None)
        self.world = getattr(trainer, "world", 1)
        self.ckpt_dir = getattr(trainer, "ckpt_dir", None)
        found = (
            checkpoint.list_checkpoints(self.ckpt_dir)
            if self.ckpt_dir is not None and self.ckpt_dir.is_dir()
            else []
        )
        self.checkpoint = found[-1] if found else None

    def continue_line(self) -> str | None:
        """ "The last checkpoint is ...; continue the run ... with: <command>", or None without one."""
        if self.run_dir is None or self.checkpoint is None:
            return None
        step = int(self.checkpoint.stem.split("_")[1])
        cmd = resume.command(resume.target(self.run_dir, self.ckpt_dir), self.world)
        return (
            f"The last checkpoint is {self.checkpoint} (step {step}); continue the run in its directory "
            f"(with the settings of its config.yaml) with: {cmd}"
        )


class RunInterrupted(Exception):
    """Ctrl-C during a run; :meth:`paragraph` says where it stopped and how to continue."""

    def __init__(self, trainer=None) -> None:
        super().__init__("interrupted")
        self.stop = RunStop(trainer)

    def paragraph(self) -> str:
        s = self.stop
        if s.run_dir is None:
            return "interrupted before the run started; nothing was trained."
        where = f"interrupted at step {s.step} of {s.total_steps}; the run directory is {s.run_dir}."
        line = s.continue_line()
        if line is None:
            return (
                f"{where} No checkpoint was written (checkpoint.every=0, or none was due yet), so this run "
                "cannot be continued: start it again, with checkpoint.every=N to be able to resume."
            )
        return f"{where} {line}"


def summary_lines(result, tokens_per_s: float, plot: Path | None) -> list[str]:
    facts = result.corpus
    line = f"final val loss {result.val_loss:.4f} nats/token after {result.steps} steps"
    if "unigram_entropy" in facts and "entropy_floor" in facts:
        line += (
            f" | corpus unigram entropy {facts['unigram_entropy']:.4f},"
            f" entropy floor {facts['entropy_floor']:.4f}"
            " (a model without context scores the first at best, a perfect one the second)"
        )
    where = f"; run directory {result.run_dir}" + (f", curves {plot}" if plot is not None else "")
    return [line, f"train time {result.train_time_ms / 1e3:.1f} s, {tokens_per_s:,.0f} tokens/s{where}"]


def finish(trainer, result) -> list[str]:
    """Write the summary and curves.png (rank 0); returns the summary lines (empty on other ranks)."""
    if not distributed.is_main():
        return []
    cfg = trainer.cfg
    refs = curves.reference_lines(result.corpus, cfg.data.kind, cfg.smoke_target)
    seconds = result.train_time_ms / 1e3
    tokens_per_s = trainer.tokens_seen / seconds if seconds > 0 else 0.0
    plot = result.run_dir / "curves.png"
    lines = summary_lines(result, tokens_per_s, plot)
    log = RunLog(result.run_dir)
    for line in lines:
        log.text(line)
    log.event(
        "summary",
        val_loss=result.val_loss,
        steps=result.steps,
        train_time_ms=result.train_time_ms,
        tokens_seen=trainer.tokens_seen,
        tokens_per_s=tokens_per_s,
        references=refs,
    )
    log.close()
    curves.plot([curves.read_curves(result.run_dir)], refs, plot, title=f"{result.run_dir.name}")
    return lines
