"""Provenance of benchmark results: what every JSON file under perf/results/ carries besides its rows.

A figure in perf/RESULTS.md is worth something only with the command that reproduces it and the machine and
versions it ran on. Every bench script (perf/bench_*.py) therefore builds its JSON as
``{**bench_metadata(sys.argv, device), "rows": [...]}`` and writes it with :func:`write_bench_json`, which
refuses a payload without the keys in :data:`REQUIRED_KEYS`; perf/results.py renders those files into
perf/RESULTS.md and refuses them on the same terms.

Row convention, read by perf/results.py: ``rows`` is a list of flat dicts (one per measured configuration,
keys in display order); a key ``<name>_floor`` beside ``<name>`` is the floor for that figure (what the
hardware allows, e.g. the time of the step's FLOPs at the measured matmul rate) and is printed next to it.
An optional top-level ``notes`` (list of str) is printed under the table, an optional ``tables`` (title ->
list of rows, the same convention) as more tables after it, other top-level keys as facts.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REQUIRED_KEYS = ("command", "date", "device", "torch", "triton", "rows")
"""Keys perf/results.py needs in every bench JSON; a fact of the file format, not a setting."""

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout root: recorded commands are relative to it and are run from it."""


def command_line(argv: Sequence[str]) -> str:
    """The shell command that reproduces this run from the repository root: ``python3 perf/x.py --flag v``."""
    if not argv:
        raise ValueError("bench_metadata(argv): argv is empty; pass sys.argv (script path first).")
    script = Path(argv[0]).resolve()
    try:
        shown = str(script.relative_to(REPO_ROOT))
    except ValueError:  # a script outside the checkout: keep its absolute path
        shown = str(script)
    python = os.path.basename(sys.executable) or "python3"
    return shlex.join([python, shown, *argv[1:]])


def device_name(device: str | torch.device | None = None) -> str:
    """Human name of the device the figures were measured on: the GPU's product name, or the CPU's."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    # GIT_COMMIT wins: a GPU machine's copy of the tree can carry a .git whose HEAD is not the tree it runs.
    # A copy without .git simply has no commit to record.
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def bench_metadata(argv: Sequence[str], device: str | torch.device | None = None) -> dict:
    """Everything a bench JSON must carry except ``rows``: command, date, device, torch, triton (+ context).

    ``argv`` is the script's ``sys.argv``; ``device`` the device measured on (default: cuda if present).
    """
    return {
        "command": command_line(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
    }


def check_bench_payload(payload: object, source: str) -> None:
    """Raise ValueError naming ``source`` unless ``payload`` is a bench result perf/results.py can render."""
    fix = "build it as {**bench_metadata(sys.argv, device), 'rows': [...]} (perf/bench_meta.py)"
    if not isinstance(payload, dict):
        raise ValueError(
            f"{source}: a bench result must be a JSON object, got {type(payload).__name__}; {fix}."
        )
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}; {fix}.")
    rows = payload["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{source}: 'rows' must be a list of objects (one per measured configuration).")
    tables = payload.get("tables", {})
    if not isinstance(tables, dict) or not all(
        isinstance(rows, list) and all(isinstance(r, dict) for r in rows) for rows in tables.values()
    ):
        raise ValueError(f"{source}: 'tables' must map a title to a list of objects (rows).")
    notes = payload.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ValueError(f"{source}: 'notes' must be a list of strings.")


def _no_nan(value: object, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"{where} is {value}: JSON has no NaN/inf; store None for a figure that was not measured."
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _no_nan(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nan(v, f"{where}[{i}]")


def write_bench_json(path: str | os.PathLike, payload: dict) -> Path:
    """Check ``payload`` and write it as indented JSON at ``path`` (parents created; replaced atomically)."""
    path = Path(path)
    check_bench_payload(payload, str(path))
    _no_nan(payload, "payload")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path
