"""Overlay the loss curves of two or more runs and print their final figures side by side.

    python tools/compare_runs.py RUN_DIR RUN_DIR [...] [--out compare.png] [--force]

Each RUN_DIR is a run directory of this program (its events.jsonl). The plot is curves.png's (train loss per
step, val losses) for every run on one set of axes, with the reference losses of the first run that recorded
them (corpus entropy floor and unigram entropy, or the FineWeb target). Each run is labelled by its name and
the settings in which its config.yaml differs from the others', and those differences are printed. An existing
plot is not overwritten without --force. Exit status: 0, or 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from track_1_short import curves

ROWS = ("status", "steps", "final train loss", "final val loss", "train time (s)", "tokens/s")


def figures(run: curves.Curves) -> dict[str, str]:
    s = run.summary
    return {
        "status": run.status,
        "steps": f"{run.train[-1][0] if run.train else 0}/{run.total_steps}",
        "final train loss": f"{run.train[-1][1]:.4f}" if run.train else "-",
        "final val loss": f"{run.val[-1][1]:.4f}" if run.val else "-",
        "train time (s)": f"{s['train_time_ms'] / 1e3:.1f}" if "train_time_ms" in s else "-",
        "tokens/s": f"{s['tokens_per_s']:,.0f}" if "tokens_per_s" in s else "-",
    }


def table(runs: list[curves.Curves]) -> str:
    """One column per run, one row per figure."""
    cols = [[run.name] + [figures(run)[r] for r in ROWS] for run in runs]
    head = [""] + list(ROWS)
    widths = [max(map(len, head))] + [max(map(len, c)) for c in cols]
    lines = []
    for i, label in enumerate(head):
        cells = [label.ljust(widths[0])] + [c[i].rjust(w) for c, w in zip(cols, widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


LABEL_KEYS = 3  # settings named in a run's plot label; the printed difference has them all


def label(run: curves.Curves, i: int, differ: dict[str, list]) -> str:
    """The run's name and the settings in which it differs from the others (seed first)."""
    keys = sorted(differ, key=lambda k: (k != "seed", k))
    shown = [f"{k}={differ[k][i]}" for k in keys[:LABEL_KEYS]]
    more = " ..." if len(keys) > LABEL_KEYS else ""
    return f"{run.name} ({', '.join(shown)}{more})" if shown else run.name


def difference_lines(runs: list[curves.Curves], differ: dict[str, list]) -> str:
    if not any(r.config for r in runs):
        return "config difference: none recorded (no config.yaml in the run directories)"
    if not differ:
        return "config difference: none (the runs share every setting but where they live)"
    lines = ["config difference:"]
    for key, values in differ.items():
        lines.append(f"  {key}: " + ", ".join(f"{r.name}={v}" for r, v in zip(runs, values)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_runs", description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="run directories (two or more)")
    p.add_argument("--out", type=Path, default=Path("compare.png"), help="the PNG to write (%(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        print("compare_runs: give two or more run directories.", file=sys.stderr)
        return 2
    if args.out.exists() and not args.force:
        print(f"compare_runs: {args.out} exists; pass --force to overwrite it, or --out another path.",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        runs = [curves.read_curves(d) for d in args.runs]
    except FileNotFoundError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # runs of different roots with one name: label them by path
        for r, d in zip(runs, args.runs):
            r.name = str(d)
    refs = next((r.summary["references"] for r in runs if r.summary.get("references")), {})
    differ = curves.config_difference(runs)
    print(table(runs))
    print(difference_lines(runs, differ))
    for r in runs:
        r.name = label(r, runs.index(r), differ)
    curves.plot(runs, refs, args.out, title="compare: " + ", ".join(r.name for r in runs))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
