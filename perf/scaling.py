"""Throughput over GPUs: the same training run on 1 and on N GPUs, per stage, as a bench JSON.

    python perf/scaling.py --out perf/results/scaling.json                    # K = 1 and every visible GPU
    python perf/scaling.py schedule.lr_floor=0.2 --nproc 1 2 4 8               # Hydra overrides first
    python perf/scaling.py experiment=smoke_record --device cpu --nproc 1 2    # CPU smoke test on gloo

For each K it runs ``torchrun --standalone --nproc_per_node=K -m track_1_short.train experiment=record_1gpu
<overrides>`` in a run directory of its own, one K after the other, and reads what that run wrote with
perf/run_summary.py (events.jsonl, config.yaml, env.json): per stage, the timed loop's tokens/s and ms per
step and the optimizer's share of that time (rank 0's ``optimizer_ms``, see track_1_short/optimizer_time.py).
The global batch of a stage is the same for every K (the trainer splits it over the ranks, and fewer ranks
accumulate more micro-batches: the ``micro_batches`` column), so the runs train on the same tokens and their
rates compare directly.

Scaling efficiency per stage = tokens/s(K) / ((K / K0) x tokens/s(K0)), K0 the smallest K given (1 unless
--nproc says otherwise), so 1.0 is perfect scaling; a stage without a timed interval in either run (one too
short for an interval that does not cross a stage boundary) has none. Peak memory is every rank's CUDA
allocator peak (``max_memory_allocated``), gathered by the trainer at the end of the run (the end event's
``peak_memory_mib_per_rank``); on the CPU the trainer records none, and the JSON says so in ``peak_memory``.

Bad input is refused in one message before anything runs: a K below 1 or above the visible GPU count, no
torchrun. A run that fails stops the script, naming its directory; no JSON is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

# perf/ is not a package: its sibling scripts are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_summary  # noqa: E402
from bench_meta import bench_metadata, write_bench_json  # noqa: E402

from track_1_short.config import accumulation_steps  # noqa: E402
from track_1_short.run_log import read_events  # noqa: E402

DEFAULT_EXPERIMENT = "experiment=record_1gpu"
ROW_KEYS = ("steps", "batch_tokens", "timed_steps", "ms_per_step", "tokens_per_s", "optimizer_pct")


class ScalingError(Exception):
    """Bad input or a failed run; the message names the fix."""


def find_torchrun() -> str | None:
    """The torchrun beside this interpreter (its environment's), else the first one on PATH."""
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.is_file() else shutil.which("torchrun")


def check_request(nproc: list[int], device: str, torchrun: str | None, gpus: int) -> None:
    """Raise ScalingError naming every reason the runs cannot start (``gpus``: visible CUDA devices)."""
    problems = []
    if len(set(nproc)) != len(nproc) or len(nproc) < 2:
        problems.append(f"--nproc {' '.join(map(str, nproc))}: give at least two different process counts")
    if any(k < 1 for k in nproc):
        problems.append(f"--nproc {' '.join(map(str, nproc))}: every process count must be at least 1")
    if device == "cuda" and max(nproc) > gpus:
        problems.append(
            f"--nproc {max(nproc)} needs {max(nproc)} GPUs but {gpus} are visible "
            "(torch.cuda.device_count(); check CUDA_VISIBLE_DEVICES)"
        )
    if torchrun is None or not (Path(torchrun).is_file() and os.access(torchrun, os.X_OK)):
        problems.append(
            f"no torchrun executable ({torchrun or 'none'} beside {sys.executable} or on PATH); "
            "install torch into this environment or pass --torchrun PATH"
        )
    if problems:
        raise ScalingError("perf/scaling.py: nothing was run: " + "; ".join(problems) + ".")


def run_command(torchrun: str, k: int, overrides: list[str], device: str, runs_root: Path) -> list[str]:
    """The torchrun command of the run on ``k`` processes; its run directory is ``runs_root/k<k>``."""
    return [
        torchrun,
        "--standalone",
        f"--nproc_per_node={k}",
        "-m",
        "track_1_short.train",
        *overrides,
        f"device={device}",
        f"runs_root={runs_root}",
        f"run_name=k{k}",
        "progress_bar=false",
    ]


def read_run(run_dir: Path, k: int, command: str) -> dict:
    """One run's figures: its per-stage rows (perf/run_summary.py), status, time and every rank's peak."""
    summary = run_summary.summarize(run_dir, command, "-", matmul_tflops=1.0, corpus=None)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    end = next(e for e in reversed(read_events(run_dir)) if e["event"] == "end")
    rows = []
    for r in summary["rows"]:
        micro = accumulation_steps(r["batch_tokens"], k, cfg.micro_batch_tokens)
        rows.append({"nproc": k, "stage": r["stage"], "micro_batches": micro, **{x: r[x] for x in ROW_KEYS}})
    return {
        "nproc": k,
        "run_dir": str(run_dir),
        "command": command,
        "status": summary["status"],
        "train_time_s": summary["train_time_s"],
        "tokens_per_s_overall": summary.get("tokens_per_s_overall"),
        "peak_memory_mib_per_rank": end.get("peak_memory_mib_per_rank"),
        "rows": rows,
    }


def efficiency(tokens_per_s: float, k: int, base_tokens_per_s: float, base_k: int) -> float:
    """tokens/s(K) / ((K / K0) x tokens/s(K0)): 1.0 when K processes are K / K0 times as fast as K0."""
    return tokens_per_s / (k / base_k * base_tokens_per_s)


def scaling_rows(runs: list[dict]) -> list[dict]:
    """Every run's stage rows, K ascending, each with its efficiency against the smallest K's same stage."""
    runs = sorted(runs, key=lambda r: r["nproc"])
    base = runs[0]
    base_rows = {r["stage"]: r for r in base["rows"]}
    out = []
    for run in runs:
        for row in run["rows"]:
            ref = base_rows.get(row["stage"])
            eff = None
            if ref is not None and run is not base:
                eff = efficiency(row["tokens_per_s"], run["nproc"], ref["tokens_per_s"], base["nproc"])
            out.append({**row, "efficiency": eff})
    return out


def payload(runs: list[dict], meta: dict, overrides: list[str], device: str) -> dict:
    """The bench JSON: stage rows with efficiency, a table of the runs, one of every rank's peak memory."""
    runs = sorted(runs, key=lambda r: r["nproc"])
    ks = [r["nproc"] for r in runs]
    recorded = all(r["peak_memory_mib_per_rank"] is not None for r in runs)
    if recorded:
        memory = "every rank's CUDA allocator peak (max_memory_allocated), gathered at the end of each run"
    else:
        memory = f"not recorded: the trainer records peak memory on CUDA only (device {device})"
    return {
        **meta,
        "title": f"Scaling over processes: {' '.join(overrides)}, K = {', '.join(map(str, ks))}",
        "overrides": overrides,
        "nproc": ks,
        "baseline_nproc": ks[0],
        "peak_memory": memory,
        "rows": scaling_rows(runs),
        "tables": {
            "runs": [
                {k: r[k] for k in ("nproc", "status", "train_time_s", "tokens_per_s_overall")} for r in runs
            ],
            "peak memory per rank": [
                {"nproc": r["nproc"], "rank": i, "peak_memory_mib": m}
                for r in runs
                for i, m in enumerate(r["peak_memory_mib_per_rank"] or [])
            ],
        },
        "notes": [
            f"efficiency = tokens/s(K) / ((K / {ks[0]}) x tokens/s({ks[0]})) per stage; 1.0 scales perfectly",
            "the global batch of every stage is the same for every K; micro_batches is per rank and step",
            "optimizer_pct: rank 0's optimizer step (its reduce and gather waits included) / the train time",
        ]
        + [f"K={r['nproc']}: {r['command']}" for r in runs],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("overrides", nargs="*", help=f"Hydra overrides of the training config (default {DEFAULT_EXPERIMENT})")
    add("--nproc", type=int, nargs="+", default=None, help="process counts (default: 1 and every GPU)")
    add("--out", type=Path, default=Path("perf/results/scaling.json"), help="the JSON file to write")
    add("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo ranks (a smoke test)")
    add(
        "--runs-root",
        type=Path,
        default=None,
        help="where the runs' directories go (default: a new temp dir)",
    )
    add("--torchrun", default=None, help="the torchrun executable (default: beside python, else on PATH)")
    args = p.parse_args(argv)
    if not any(o.lstrip("+").startswith("experiment=") for o in args.overrides):
        args.overrides = [DEFAULT_EXPERIMENT, *args.overrides]
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])
    gpus = torch.cuda.device_count()
    nproc = args.nproc or [1, gpus if args.device == "cuda" else 2]
    torchrun = args.torchrun or find_torchrun()
    try:
        check_request(nproc, args.device, torchrun, gpus)
    except ScalingError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    meta = bench_metadata(argv, args.device)  # before the runs: the date is when they started
    runs_root = args.runs_root or Path(tempfile.mkdtemp(prefix="scaling."))
    runs = []
    for k in sorted(nproc):
        cmd = run_command(torchrun, k, args.overrides, args.device, runs_root)
        shown = " ".join(["torchrun", *cmd[1:]])
        print(f"scaling: K={k}: {shown}", flush=True)
        rc = subprocess.run(cmd, check=False).returncode
        run_dir = runs_root / f"k{k}"
        if rc != 0:
            print(
                f"perf/scaling.py: the run on {k} process(es) failed (exit {rc}); see {run_dir}/log.txt "
                "and the output above. No JSON was written.",
                file=sys.stderr,
            )
            sys.exit(1)
        runs.append(read_run(run_dir, k, shown))
    out = payload(runs, meta, args.overrides, args.device)
    write_bench_json(args.out, out)
    print(f"scaling: wrote {args.out} (runs in {runs_root})")
    return out


if __name__ == "__main__":
    main()
