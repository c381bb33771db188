"""A picture of a run: its train loss per step and its val losses, against the lines that give them meaning.

:func:`read_curves` reads a run directory's ``events.jsonl`` (a resumed run's superseded steps dropped, as
run_log.py describes); :func:`plot` draws one or more runs on one figure (``curves.png`` at the end of every
run, tools/compare_runs.py for several). The reference lines are the run's own: for the synthetic corpus its
exact entropy floor (what a perfect model scores) and its unigram entropy (what a model without context
scores), from the corpus sidecar; for FineWeb the record target. They are recorded in the run's ``summary``
event, so a plot of old runs needs no data files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FINEWEB_TARGET = 3.28  # the track-1 record's mean val loss target on FineWeb (upstream rules)
FIGSIZE_IN, DPI = (8.0, 4.5), 100  # curves.png is 800 x 450 pixels


@dataclass
class Curves:
    name: str
    train: list[tuple[int, float]] = field(default_factory=list)  # (steps done, train loss of that step)
    val: list[tuple[int, float]] = field(default_factory=list)  # (steps done, val loss)
    total_steps: int | None = None
    summary: dict = field(default_factory=dict)  # the run's summary event, if it finished
    status: str = "unfinished"  # finished | failed | unfinished (from the last end event)


def _number(value) -> float:
    return float(value)  # run_log writes a non-finite float as the string "nan" or "inf"


def read_curves(run_dir: str | Path) -> Curves:
    run_dir = Path(run_dir)
    out = Curves(run_dir.name)
    path = run_dir / "events.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no events.jsonl: it is not a run directory of this program."
        )
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
        kind = e.get("event")
        if kind == "start":
            out.total_steps = e.get("total_steps")
        elif kind == "resume":
            k = int(e["step"])
            out.train = [p for p in out.train if p[0] <= k]
            out.val = [p for p in out.val if p[0] <= k]
            out.status, out.summary = "unfinished", {}
        elif kind == "train":
            out.train.append((int(e["step"]), _number(e["loss"])))
        elif kind == "val":
            out.val.append((int(e["step"]), _number(e["val_loss"])))
        elif kind == "end":
            out.status = e.get("status", "unfinished")
        elif kind == "summary":
            out.summary = e
    return out


def reference_lines(corpus: dict, data_kind: str, smoke_target: float | None) -> dict[str, float]:
    """Label -> loss of the horizontal lines a run's curves are read against."""
    lines: dict[str, float] = {}
    if "entropy_floor" in corpus and "unigram_entropy" in corpus:
        lines["corpus unigram entropy (no context)"] = float(corpus["unigram_entropy"])
        lines["corpus entropy floor (perfect model)"] = float(corpus["entropy_floor"])
    elif data_kind == "shards":
        lines["record target"] = FINEWEB_TARGET
    if smoke_target is not None and smoke_target != FINEWEB_TARGET:
        lines["smoke target"] = float(smoke_target)
    return lines


def plot(runs: list[Curves], references: dict[str, float], out: str | Path, title: str = "") -> Path:
    """Train loss per step (thin) and val losses (markers) of every run, with the reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        name = f"{run.name} " if len(runs) > 1 else ""
        if run.train:
            ax.plot(*zip(*run.train), color=color, linewidth=0.9, alpha=0.7, label=f"{name}train")
        if run.val:
            ax.plot(*zip(*run.val), color=color, marker="o", linestyle="--", linewidth=1, label=f"{name}val")
    styles = ("dotted", "dashdot", "dashed")
    for j, (label, value) in enumerate(references.items()):
        ax.axhline(value, color="tab:red" if "target" in label else "black", linestyle=styles[j % 3],
                   linewidth=1, label=f"{label}: {value:.3f}")  # fmt: skip
    ax.set_xlabel("step (steps done)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or ", ".join(r.name for r in runs))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: never over a curve
    out = Path(out)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
