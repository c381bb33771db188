"""Overlay the loss curves of two or more runs and print their final figures side by side.

    python tools/compare_runs.py RUN_DIR RUN_DIR [...] [--out compare.png]

Each RUN_DIR is a run directory of this program (its events.jsonl). The plot is curves.png's (train loss per
step, val losses) for every run on one set of axes, with the reference losses of the first run that recorded
them (corpus entropy floor and unigram entropy, or the FineWeb target). Exit status: 0, or 2 for bad input.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_runs", description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="run directories (two or more)")
    p.add_argument("--out", type=Path, default=Path("compare.png"), help="the PNG to write (%(default)s)")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        print("compare_runs: give two or more run directories.", file=sys.stderr)
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
    print(table(runs))
    curves.plot(runs, refs, args.out, title="compare: " + ", ".join(r.name for r in runs))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
