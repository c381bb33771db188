"""A picture of a run: its train loss per step and its val losses, against the lines that give them meaning.

:func:`read_curves` reads a run directory's ``events.jsonl`` (a resumed run's superseded steps dropped, as
run_log.py describes); :func:`plot` draws one or more runs on one figure (``curves.png`` at the end of every
run, tools/compare_runs.py for several). The reference lines are the run's own: for the synthetic corpus its
exact entropy floor (what a perfect model scores) and its unigram entropy (what a model without context
scores), from the corpus sidecar; for FineWeb the record target. They are recorded in the run's ``summary``
event, so a plot of old runs needs no data files.

The train loss of a step whose schedule adds multi-token-prediction targets is the MTP-weighted sum over the
targets (next token, the one after, ...), not next-token loss: at the start of the default run it is about
1.5 x ln 2176 = 11.5, above the no-context line. Those steps are drawn apart (dashed, labelled as the sum);
only next-token steps (weight sum 1) and the val losses compare with the reference lines. The y-axis is scaled
to those losses after the first steps and to the reference lines, so the learning, not the first step, fills
the plot.
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
    mtp: dict[int, float] = field(default_factory=dict)  # steps done -> MTP weight sum, where logged
    config: dict = field(default_factory=dict)  # the run directory's config.yaml, if any
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
            if "mtp_weight_sum" in e:
                out.mtp[int(e["step"])] = float(e["mtp_weight_sum"])
        elif kind == "val":
            out.val.append((int(e["step"]), _number(e["val_loss"])))
        elif kind == "end":
            out.status = e.get("status", "unfinished")
        elif kind == "summary":
            out.summary = e
    config = run_dir / "config.yaml"
    if config.is_file():
        import yaml

        out.config = yaml.safe_load(config.read_text()) or {}
    return out


BOOKKEEPING = ("run_name", "runs_root", "resume")  # where a run lives, not what it computes


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_difference(runs: list[Curves]) -> dict[str, list]:
    """Dotted key -> each run's value, for the keys whose values differ between the runs' configs."""
    flats = [flat(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    out = {}
    for key in keys:
        if key.split(".")[0] in BOOKKEEPING:
            continue
        values = [f.get(key) for f in flats]
        if len({repr(v) for v in values}) > 1:
            out[key] = values
    return out


def _summed(run: Curves, step: int) -> bool:
    return run.mtp.get(step, 1.0) > 1.0 + 1e-9


def split_train(run: Curves) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(next-token steps, MTP-weighted steps) of the run's train loss; runs that did not log the weights
    count as next-token throughout."""
    return [p for p in run.train if not _summed(run, p[0])], [p for p in run.train if _summed(run, p[0])]


def y_range(runs: list[Curves], references: dict[str, float]) -> tuple[float, float] | None:
    """Loss limits that hold every val loss, the next-token train losses after the first 5% of steps, and the
    reference lines: the first steps (near ln V) and the MTP-weighted sums (above it) would squash the rest,
    so they may run off the top."""
    values = list(references.values())
    for run in runs:
        total = run.total_steps or (run.train[-1][0] if run.train else 0)
        values += [v for s, v in split_train(run)[0] if s > 0.05 * total]
        values += [v for _, v in run.val]
    values = [v for v in values if v == v and abs(v) != float("inf")]
    if not values:
        return None
    low, high = min(values), max(values)
    pad = 0.05 * (high - low or 1.0)
    return low - pad, high + pad


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
        nexttoken, summed = split_train(run)
        if summed:
            ax.plot(*zip(*summed), color=color, linewidth=0.9, alpha=0.5, linestyle="--",
                    label=f"{name}train, MTP-weighted sum over targets (not next-token)")  # fmt: skip
        if nexttoken:
            label = "train (next-token)" if run.mtp else "train"
            ax.plot(*zip(*nexttoken), color=color, linewidth=0.9, alpha=0.7, label=f"{name}{label}")
        if run.val:
            ax.plot(*zip(*run.val), color=color, marker="o", linestyle="--", linewidth=1, label=f"{name}val")
    styles = ("dotted", "dashdot", "dashed")
    for j, (label, value) in enumerate(references.items()):
        ax.axhline(value, color="tab:red" if "target" in label else "black", linestyle=styles[j % 3],
                   linewidth=1, label=f"{label}: {value:.3f}")  # fmt: skip
    limits = y_range(runs, references)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_xlabel("step (steps done)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or ", ".join(r.name for r in runs))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: never over a curve
    out = Path(out)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
