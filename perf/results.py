"""Regenerate perf/RESULTS.md from the bench JSON files in perf/results/; RESULTS.md is never edited by hand.

    python perf/results.py             # read perf/results/*.json, write perf/RESULTS.md
    python perf/results.py --check     # exit 1 if perf/RESULTS.md differs from what the JSON files give
    python perf/results.py --archive --out /tmp/ALL.md   # also every superseded run of perf/results/archive/

perf/results/*.json are the current figures; superseded runs live in perf/results/archive/ (its INDEX.md
says what each measured and why it was superseded) and are rendered only with ``--archive``. One section per
benchmark (the script in the file's command, in SECTIONS' order), one subsection per file (sorted by name),
each with the date, device, torch and triton versions and the exact command that produced it (run from the
repository root), then one table of the file's rows and one more under its title for each entry of an
optional ``tables`` (perf/scaling.py: its runs, peak memory per rank; a kernel profile's top kernels), each
cut at TABLE_ROWS rows with a line that says how many more the JSON holds. A row key ``<name>_floor`` is the
floor of ``<name>`` (what the hardware allows) and is printed in the column beside it. The lines of
perf/results/superseded.md (one per deleted fast path, with its last figure) close the page.
The file format is defined by perf/bench_meta.py; a file without its keys is refused, naming the
file, before anything is written. The output depends only on the JSON files, so it is reproducible.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import check_bench_payload  # noqa: E402

PERF_DIR = Path(__file__).resolve().parent
REGENERATE = "python perf/results.py"
FLOOR_SUFFIX = "_floor"
# Top-level keys rendered in a section's header lines rather than as "other" facts.
HEADER_KEYS = ("title", "command", "date", "device", "torch", "triton", "cuda", "python", "git_commit")
# benchmark (the script a command runs) -> its section, in page order; docstrings and configs cite them.
SECTIONS = {
    "track_1_short.train": "Record preset",
    "bench_train_step": "Train step",
    "bench_optimizer": "Optimizer step",
    "bench_cascade_products": "Cascade products",
    "bench_loss": "Training loss",
    "bench_mlp": "MLP",
    "bench_final_val": "Final validation",
    "bench_attention": "Attention kernel",
    "bench_replicated_adam": "Replicated Adam",
    "scaling": "Scaling",
    "ablation": "Record ablation",
}
SUPERSEDED = "superseded.md"
TABLE_ROWS = 12  # rows of an extra table shown on the page; the JSON keeps them all


def benchmark(payload: dict) -> str:
    """The script a result's command ran: ``perf/bench_loss.py`` -> bench_loss, ``-m track_1_short.train``
    -> track_1_short.train; the command's first word otherwise."""
    words = payload["command"].split()
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            return words[i + 1]
        if word.endswith(".py"):
            return Path(word).stem
    return words[0] if words else ""


def section_of(payload: dict) -> str:
    name = benchmark(payload)
    return SECTIONS.get(name, name)


def _display_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(PERF_DIR.parent).as_posix()
    except ValueError:  # results kept outside the checkout
        return path.name


def load_results(results_dir: Path) -> list[tuple[str, dict]]:
    """(file, payload) for every ``*.json`` under ``results_dir``, sorted by file name; each one checked."""
    if not results_dir.is_dir():
        raise ValueError(
            f"results directory {results_dir} does not exist; run a bench script with --out first."
        )
    loaded = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); rerun the bench script that wrote it.") from None
        check_bench_payload(payload, str(path))
        loaded.append((_display_path(path), payload))
    return loaded


def format_value(value: object) -> str:
    """A table cell: floats to a precision that suits their size, None as a dash, pipes escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1 or magnitude == 0:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, list):
        return ", ".join(format_value(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(key, header) in first-seen key order, each ``<name>_floor`` moved right after ``<name>``."""
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    floors = {k for k in keys if k.endswith(FLOOR_SUFFIX) and k[: -len(FLOOR_SUFFIX)] in keys}
    columns = []
    for k in keys:
        if k in floors:
            continue
        columns.append((k, k))
        if k + FLOOR_SUFFIX in floors:
            columns.append((k + FLOOR_SUFFIX, f"{k} (floor)"))
    return columns


def render_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    columns = table_columns(rows)
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(k)) for k, _ in columns) + " |")
    return lines


def render_section(file: str, payload: dict) -> list[str]:
    versions = f"torch {payload['torch']}, triton {format_value(payload['triton'])}"
    if payload.get("cuda"):
        versions += f", CUDA {payload['cuda']}"
    if payload.get("python"):
        versions += f", Python {payload['python']}"
    lines = [f"### {payload.get('title') or Path(file).stem}", ""]
    lines.append(f"- File: `{file}`")
    lines.append(f"- Date: {payload['date']}")
    lines.append(f"- Device: {payload['device']}")
    lines.append(f"- Versions: {versions}")
    if payload.get("git_commit"):
        lines.append(f"- Commit: {payload['git_commit']}")
    lines.append(f"- Command: `{payload['command']}`")
    for key, value in payload.items():
        if key in HEADER_KEYS or key in ("rows", "notes", "tables"):
            continue
        lines.append(f"- {key}: {format_value(value)}")
    lines.append("")
    lines.extend(render_table(payload["rows"]))
    for title, rows in payload.get("tables", {}).items():
        lines += ["", f"{title}:", ""]
        lines.extend(render_table(rows[:TABLE_ROWS]))
        if len(rows) > TABLE_ROWS:  # kernel profiles: the head is the figure, the tail stays in the JSON
            lines += ["", f"({len(rows) - TABLE_ROWS} more rows in `{file}`)"]
    notes = payload.get("notes", [])
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    lines.append("")
    return lines


def render_sections(results: list[tuple[str, dict]]) -> list[str]:
    """One ``##`` section per benchmark (SECTIONS' order, then others by name), its files' subsections."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for file, payload in results:
        groups.setdefault(section_of(payload), []).append((file, payload))
    order = [name for name in SECTIONS.values() if name in groups]
    order += sorted(name for name in groups if name not in order)
    lines = []
    for name in order:
        lines += [f"## {name}", ""]
        for file, payload in groups[name]:
            lines.extend(render_section(file, payload))
    return lines


def render(
    results: list[tuple[str, dict]],
    superseded: str = "",
    archive: list[tuple[str, dict]] | None = None,
) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `{REGENERATE}` from the JSON files in perf/results/; do not edit by hand.",
        "Each section holds a benchmark's current figures and names the machine and the command that",
        "produced them (run from the repository root). Superseded runs: perf/results/archive/ (INDEX.md).",
        'A "(floor)" column is what the hardware allows for the figure to its left.',
        "",
    ]
    if not results:
        lines += [
            "No results yet: run `bash perf/run_gpu.sh` on a GPU machine, then commit perf/results/.",
            "",
        ]
    lines += render_sections(results)
    if superseded.strip():
        lines += ["## Superseded", "", superseded.strip(), ""]
    if archive:
        lines += ["# Archive", ""]
        lines += [line.replace("## ", "## Archive: ", 1) if line.startswith("## ") else line
                  for line in render_sections(archive)]  # fmt: skip
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results-dir", type=Path, default=PERF_DIR / "results", help="where the JSON files are"
    )
    parser.add_argument(
        "--out", type=Path, default=PERF_DIR / "RESULTS.md", help="the markdown file to write"
    )
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    parser.add_argument(
        "--archive", action="store_true", help="also render the superseded runs of <results-dir>/archive/"
    )
    args = parser.parse_args(argv)
    superseded = args.results_dir / SUPERSEDED
    archive_dir = args.results_dir / "archive"
    text = render(
        load_results(args.results_dir),
        superseded.read_text() if superseded.exists() else "",
        load_results(archive_dir) if args.archive and archive_dir.is_dir() else None,
    )
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date with {args.results_dir}; run `{REGENERATE}`.", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} from {sum(1 for _ in args.results_dir.glob('*.json'))} result file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
