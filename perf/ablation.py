"""The record's ablation on one GPU: the preset with everything on, then each component off in turn, N seeds.

    python perf/ablation.py --seeds 0 1 2 --out perf/results/ablation.json            # every arm, 3 seeds
    python perf/ablation.py --arms all ngram --seeds 0 --out /tmp/ablation.json        # a subset
    python perf/ablation.py --from-runs DIR --command "..." --out perf/results/ablation.json   # re-read runs

Each run is ``python -m track_1_short.train experiment=record_1gpu seed=S`` plus the arm's overrides (one
process per run, as a user runs it). On a machine with several GPUs the runs go side by side, one per GPU
(``--gpus``, every visible GPU by default): 3 seeds of 6 arms take three rounds on 8 GPUs instead of 18 runs
in a row. An arm turns one of the record's components off relative to the preset
(or on, where the preset leaves it off: the ``fp8`` arm then says ``on``):

- ``all``: the preset as configured;
- ``ngram``: the hashed n-gram table off;
- ``ce_stack``: the sampled softmax (full softmax at every stage) and the prefix-token loss (table and
  weights) off;
- ``fp8``: the FP8 MLP, QKV and logits GEMMs flipped;
- ``tail``: tail averaging off (every run also reports its last iterate's val loss, so the tail's val effect
  is in every row; this arm prices its time);
- ``attention``: the attention kernel flipped between FlexAttention and flash-attn-4 (model.attention_impl
  flex / fa4; the runs of this arm need the flash-attn-4 wheel).

Rows, one per arm: the overrides, the seeds that finished, overall tokens/s (the run's own ``summary`` event)
and final val loss (the one the record gate reads) as mean and sample standard deviation over the seeds, the
last iterate's val loss, tail averaging's own time on the clock (``tail_s``: its accumulators' ticks and its
ship; ``tail_pct`` of the train time), the deltas against ``all`` (tokens/s in percent, val loss in
millinats) and their two-sided Welch t-test p-values over the seeds (``p_tokens_per_s``, ``p_val``).
``upstream`` quotes upstream's ablation for the same component (record #92's README, PR #360): its wall and
val deltas on 8 H100s at the record's 1,194 steps, and the net seconds it cost to recover 3.28. The JSON is
rewritten after every run, so a call cut short still hands back what finished, and a run whose directory
under ``--runs-root`` already holds a finished run is read, not run again: a later call continues an
earlier one (arms without ``all`` give rows without deltas). ``--from-runs`` reads
finished runs ``<arm>_s<seed>`` (made by this script, possibly over several calls) instead of running them;
the card and versions are then the runs' own (their env.json), and ``--command`` names the command that made
them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from track_1_short.run_log import read_events

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import compose_train  # noqa: E402
from bench_meta import REPO_ROOT, bench_metadata, write_bench_json  # noqa: E402

PRESET = "record_1gpu"
UPSTREAM = {  # upstream's ablation rows (record #92 README / PR #360), quoted as written there
    "ngram": "n-gram table: wall +1.19 s, val +35.8 mnats, net +7.05 s",
    "ce_stack": "CE stack (sampled softmax + prefix CE + fused kernel): wall +8.80 s, val -2.4 mnats, "
    "net +8.40 s",
    "fp8": "fp8 extension (MLP + lm_head cache): wall +5.02 s, net +4.96 s",
    "tail": "tail averaging (EMA + tavg + blend): wall +0.52 s, val +20.2 mnats, net +3.82 s",
    "attention": "FlashAttention-3 instead of FlexAttention (record #29): -4.3 s",
}
ARMS = ("all", "ngram", "ce_stack", "fp8", "tail", "attention")


def gpu_slots(n: int | None) -> list[str | None]:
    """The devices that runs are pinned to, one run each at a time: ``n`` of the visible GPUs (all by
    default), as CUDA_VISIBLE_DEVICES values; [None] (no pinning) for one."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    most = max(1, len(ids))
    n = most if n is None else n
    if not 1 <= n <= most:
        raise SystemExit(f"ablation: --gpus {n}, but {len(ids)} GPU(s) are visible; give 1 to {most}.")
    return [None] if n == 1 else ids[:n]


def preset_config(overrides: list[str]):
    """The composed, typed config of the preset with ``overrides`` (what a run of it would use), refused
    as a one-GPU run would refuse it (config.check_run)."""
    from track_1_short.config import check_run, to_object

    cfg = to_object(compose_train([f"experiment={PRESET}", *overrides]))
    check_run(cfg, world_size=1)
    return cfg


def arm_overrides(arm: str, cfg) -> list[str]:
    """The Hydra overrides that turn ``arm``'s component off (or, for fp8 where the preset has it off, on;
    for attention, the other kernel)."""
    if arm == "all":
        return []
    if arm == "ngram":
        return ["model.ngram.enabled=false"]
    if arm == "ce_stack":
        stages = range(len(cfg.schedule.stages))
        return [
            *(f"schedule.stages.{i}.sampled_candidates=[0]" for i in stages),
            *(f"schedule.stages.{i}.prefix_weights=[0.0]" for i in stages),
            "model.prefix_targets=false",
        ]
    if arm == "fp8":
        on = "false" if cfg.model.fp8.any else "true"
        return [f"model.fp8.{path}={on}" for path in ("mlp", "qkv", "lm_head")]
    if arm == "tail":
        return ["tail.enabled=false"]
    if arm == "attention":
        return ["model.attention_impl=" + ("flex" if cfg.model.attention_impl == "fa4" else "fa4")]
    raise ValueError(f"unknown arm {arm!r}: choose from {list(ARMS)}")


def run_figures(run_dir: Path) -> dict | None:
    """A finished run's overall tokens/s, final val loss (the gate's) and last-iterate val loss; None if the
    run did not finish."""
    if not (run_dir / "events.jsonl").is_file():
        return None
    events = read_events(run_dir)
    end = next((e for e in reversed(events) if e["event"] == "end"), None)
    summary = next((e for e in reversed(events) if e["event"] == "summary"), None)
    final = next((e for e in reversed(events) if e["event"] == "val" and e["step"] == e["total_steps"]), None)
    if end is None or summary is None or final is None or end.get("status") != "finished":
        return None
    ship = next((e for e in events if e["event"] == "phase" and e["name"] == "tail_ship"), None)
    ticks_ms = [e["tail_ms"] for e in events if e["event"] == "train" and "tail_ms" in e]
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "val_loss": final["val_loss"],
        "val_loss_last_iterate": final.get("val_loss_last_iterate", final["val_loss"]),
        "train_time_s": end["train_time_ms"] / 1e3,
        "timed_loop_graphs": end.get("timed_loop_graphs"),
        # tail averaging's own time on the clock (its accumulators' ticks and the ship); None without it
        "tail_s": None if ship is None else sum(ticks_ms) / 1e3 + ship["seconds"],
    }


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def shown(overrides: list[str]) -> str:
    """The overrides as a table cell: the per-stage ones of the ce_stack arm as one phrase."""
    stages = [o for o in overrides if o.startswith("schedule.stages.")]
    rest = [o for o in overrides if o not in stages]
    values = {}  # schedule.stages.<i>.<field>=<value>: field -> value
    for o in stages:
        key, value = o.split("=", 1)
        values[key.split(".")[3]] = value
    return " ".join(rest + [f"schedule.stages.*.{f}={v}" for f, v in sorted(values.items())])


def welch_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided p-value of Welch's t-test that ``a`` and ``b`` have the same mean; None under 2 values each
    (no spread to test against)."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy import stats

    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def rows_of(results: dict[str, dict[int, dict]], overrides: dict[str, list[str]]) -> list[dict]:
    """One row per arm from {arm: {seed: figures}}, deltas against the ``all`` arm's means."""
    base = [results.get("all", {})[seed] for seed in sorted(results.get("all", {}))]
    base_tps_list, base_val_list = [f["tokens_per_s"] for f in base], [f["val_loss"] for f in base]
    base_tps, _ = _mean_sd(base_tps_list)
    base_val, _ = _mean_sd(base_val_list)
    rows = []
    for arm, by_seed in results.items():
        figs = [by_seed[seed] for seed in sorted(by_seed)]
        tps_list, val_list = [f["tokens_per_s"] for f in figs], [f["val_loss"] for f in figs]
        tps, tps_sd = _mean_sd(tps_list)
        val, val_sd = _mean_sd(val_list)
        last, _ = _mean_sd([f["val_loss_last_iterate"] for f in figs])
        tail_s, _ = _mean_sd([f["tail_s"] for f in figs if f.get("tail_s") is not None])
        train_s, _ = _mean_sd([f["train_time_s"] for f in figs])
        row = {
            "arm": arm,
            "overrides": shown(overrides.get(arm, [])),
            "seeds": sorted(by_seed),
            "tokens_per_s": tps,
            "tokens_per_s_sd": tps_sd,
            "val_loss": val,
            "val_loss_sd": val_sd,
            "val_loss_last_iterate": last,
            "tail_s": tail_s,
            "tail_pct": None if tail_s is None else 100 * tail_s / train_s,
            "d_tokens_per_s_pct": None if arm == "all" or not base_tps else 100 * (tps / base_tps - 1),
            "d_val_mnats": None if arm == "all" or base_val is None else 1e3 * (val - base_val),
            "p_tokens_per_s": None if arm == "all" else welch_p(tps_list, base_tps_list),
            "p_val": None if arm == "all" else welch_p(val_list, base_val_list),
            "upstream": UPSTREAM.get(arm, ""),
        }
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs-root", type=Path, default=Path("/tmp/ablation_runs"))
    p.add_argument("--from-runs", type=Path, default=None, help="read finished runs <arm>_s<seed> from here")
    p.add_argument("--command", default=None, help="with --from-runs: the command that made the runs")
    p.add_argument(
        "--note", action="append", default=[], help="a note on how the runs were made (repeatable)"
    )
    p.add_argument("--deadline-s", type=float, default=math.inf, help="start no run after this many seconds")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="stop one run after this many seconds")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="runs at once, each on a GPU of its own (default: every visible GPU; one run per GPU)",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if (args.from_runs is None) != (args.command is None):
        p.error("--command goes with --from-runs (and only there): the command that made the runs")
    cfg = preset_config(args.overrides)
    overrides = {arm: arm_overrides(arm, cfg) for arm in args.arms}
    root = args.from_runs or args.runs_root
    results: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    t0 = time.monotonic()
    payload = {**bench_metadata(sys.argv if argv is None else [__file__, *argv]), "title": "Record ablation"}
    if args.from_runs is not None:  # the runs' card and versions, not this machine's
        env = json.loads((args.from_runs / f"{args.arms[0]}_s{args.seeds[0]}" / "env.json").read_text())
        payload.update(
            command=args.command,
            device=env["devices"][0]["name"],
            **{k: env.get(k) for k in ("torch", "triton", "cuda", "python")},
        )
    notes = [
        "Deltas: arm's mean minus the all arm's mean (tokens/s in percent, val loss in millinats); "
        "sd: sample standard deviation over the seeds (None with one seed).",
        "upstream: record #92's ablation on 8 H100s (its README and PR #360), quoted as written.",
        *args.note,
    ]
    devices = gpu_slots(args.gpus)
    if len(devices) > 1 and args.from_runs is None:
        notes.append(
            f"{len(devices)} runs at once, each on a GPU of its own (CUDA_VISIBLE_DEVICES): the host's cores "
            "and memory are shared."
        )

    def record(arm: str, seed: int, figs: dict | None) -> None:
        if figs is not None:
            results[arm][seed] = figs
            print(f"ablation: {arm}_s{seed}: {figs}", flush=True)
        payload["rows"] = rows_of({a: r for a, r in results.items() if r}, overrides)
        payload["notes"] = notes
        if payload["rows"]:
            write_bench_json(args.out, payload)

    # Seeds outermost: a call cut short still has every arm at the first seeds.
    jobs = []
    for seed in args.seeds:
        for arm in args.arms:
            figs = run_figures(root / f"{arm}_s{seed}")  # --from-runs, or a run an earlier call finished
            if figs is not None and args.from_runs is None:
                print(f"ablation: {arm}_s{seed} finished in an earlier call: read, not run again", flush=True)
            if figs is not None or args.from_runs is not None:
                record(arm, seed, figs)
            else:
                jobs.append((arm, seed))
    free: queue.Queue = queue.Queue()
    for d in devices:
        free.put(d)

    def run_one(arm: str, seed: int) -> None:
        """One run, on a GPU no other run holds meanwhile."""
        name, device = f"{arm}_s{seed}", free.get()
        try:
            if time.monotonic() - t0 > args.deadline_s:
                print(f"ablation: deadline reached, {name} not started", flush=True)
                return
            cmd = [
                sys.executable, "-m", "track_1_short.train", f"experiment={PRESET}", f"seed={seed}",
                f"runs_root={root}", f"run_name={name}", "progress_bar=false",
                *overrides[arm], *args.overrides,
            ]  # fmt: skip
            env = None if device is None else {**os.environ, "CUDA_VISIBLE_DEVICES": device}
            where = "" if device is None else f" (GPU {device})"
            print(f"ablation: {name}{where}: {' '.join(cmd[2:])}", flush=True)
            try:
                subprocess.run(cmd, cwd=REPO_ROOT, timeout=args.run_timeout_s, check=False, env=env)
            except subprocess.TimeoutExpired:
                print(f"ablation: {name} ran past {args.run_timeout_s:.0f} s and was stopped", flush=True)
        finally:
            free.put(device)

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        futures = {pool.submit(run_one, arm, seed): (arm, seed) for arm, seed in jobs}
        for done in as_completed(futures):
            done.result()
            arm, seed = futures[done]
            record(arm, seed, run_figures(root / f"{arm}_s{seed}"))
    return 0 if all(results[a] for a in args.arms) else 1


if __name__ == "__main__":
    sys.exit(main())
