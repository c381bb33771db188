"""Import a benchmark script of perf/ (not a package) as a module, for the tests of its pieces."""

import importlib.util
import json
import sys
from pathlib import Path

from perf.bench_meta import check_bench_payload

PERF_DIR = Path(__file__).resolve().parents[1] / "perf"


def load_perf_script(name: str):
    """``load_perf_script("bench_optimizer")`` imports perf/bench_optimizer.py once and returns the module."""
    module_name = f"perf_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, PERF_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_perf_script(name: str, out: Path, *args: str) -> dict:
    """Run perf/<name>.py's ``main`` with ``args`` and ``--out out``; return its JSON, read back and checked
    as perf/results.py checks it."""
    assert load_perf_script(name).main([*args, "--out", str(out)]) == 0
    payload = json.loads(Path(out).read_text())
    check_bench_payload(payload, str(out))
    return payload
