"""A training run's figures as a bench JSON for perf/RESULTS.md: per-stage throughput, MFU, compile, losses.

    python perf/run_summary.py RUN_DIR --out perf/results/record_1gpu.json --command "python -m ..."

Reads the run directory the trainer wrote (events.jsonl, config.yaml, env.json). Per stage of the schedule:
the timed loop's tokens/s and ms per step, from the progress events whose steps lie inside the stage (the
first logged interval that crosses a stage boundary is left out: it mixes two geometries), and MFU =
FLOPs per token x tokens/s / the bf16 matmul rate given by --matmul-tflops (the run does not measure it).
FLOPs per token come from the model's ``flops_per_token`` at the stage's document cap and windows: an upper
bound, since shorter documents have less attention to do (attention is 1-3% of the FLOPs at these windows).
``optimizer_pct`` is rank 0's optimizer time over the same intervals (``optimizer_ms`` of the train events,
see track_1_short/optimizer_time.py), as a share of the train time; ``ngram_pull_pct`` and
``ngram_update_pct`` the same for the n-gram table's pulls and row updates (``ngram_pull_ms``,
``ngram_update_ms``, track_1_short/ngram_cycle.py; ``ngram_pull_ms_per_step`` and
``ngram_update_ms_per_step`` beside their floors: the rows they moved, ``ngram_pull_rows`` and
``ngram_update_rows``, at NGRAM_BYTES_PER_ROW_DIM bytes per row and table channel over --hbm-gbps),
``ngram_fold_pct`` for the folds of the micro batches' row gradients into the cycle's sums
(``ngram_fold_ms``), and ``tail_pct`` for tail averaging's accumulators (``tail_ms``); None for a run
logged without them.
``tail_ship_s`` is the ship's time (on the clock, after the last step).
The run's phases (data, build, warmup), graph counts, peak memory, the loss curve and the final val loss
against the corpus floor go into the header and notes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from track_1_short import schedule
from track_1_short.model.config import ModelConfig
from track_1_short.model.gpt import flops_per_token
from track_1_short.run_log import read_events

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import write_bench_json  # noqa: E402

# A train event's timed part -> its share of the stage's train time in a row.
TIMED_PARTS = {
    "optimizer_ms": "optimizer_pct",
    "ngram_pull_ms": "ngram_pull_pct",
    "ngram_update_ms": "ngram_update_pct",
    "ngram_fold_ms": "ngram_fold_pct",
    "tail_ms": "tail_pct",
}


# Bytes an n-gram row costs in device memory traffic, per table width: a pull reads the bf16 row, writes it to
# the cycle's cache and zeroes its fp32 gradient slot (2 + 2 + 4); an update reads the bf16 row and its fp32
# gradient and writes the row back (2 + 4 + 2). The ids' sort and the exchange between ranks come on top.
NGRAM_BYTES_PER_ROW_DIM = {"ngram_pull": 8, "ngram_update": 8}


def stage_rows(
    events: list[dict], sched, model_cfg, matmul_tflops: float, hbm_gbps: float = 3350.0
) -> list[dict]:
    starts = schedule.stage_starts(sched) + [schedule.total_steps(sched)]
    train = [e for e in events if e["event"] == "train"]
    rows = []
    for i, stage in enumerate(sched.stages):
        lo, hi = starts[i], starts[i + 1]
        prev = None
        tokens = ms = 0.0
        # Each timed part's ms over the stage's intervals; None where an interval lacks it (a run logged
        # before the trainer timed it, or without the n-gram table).
        counted = (*TIMED_PARTS, "ngram_pull_rows", "ngram_update_rows")
        parts: dict[str, float | None] = dict.fromkeys(counted, 0.0)
        for e in train:
            if prev is not None and lo <= prev["step"] and e["step"] <= hi:
                tokens += e["tokens_seen"] - prev["tokens_seen"]
                ms += e["train_time_ms"] - prev["train_time_ms"]
                # each part's ms (and rows) cover the steps since the previous train event: the same interval
                for field, so_far in parts.items():
                    parts[field] = None if so_far is None or field not in e else so_far + e[field]
            prev = e
        if ms <= 0:
            continue
        steps = tokens / stage.batch_tokens
        ngram = {}
        for kind, per_dim in NGRAM_BYTES_PER_ROW_DIM.items():
            if parts[f"{kind}_ms"] is not None and parts[f"{kind}_rows"] is not None:
                ngram[f"{kind}_ms_per_step"] = parts[f"{kind}_ms"] / steps
                nbytes = parts[f"{kind}_rows"] * per_dim * model_cfg.ngram.dim
                ngram[f"{kind}_ms_per_step_floor"] = nbytes / (hbm_gbps * 1e9) * 1e3 / steps
        windows = [stage.window_short, stage.window_long]
        fpt = float(flops_per_token(model_cfg, stage.max_doc_len, windows))
        tokens_per_s = tokens / (ms * 1e-3)
        rows.append(
            {
                "stage": i,
                "steps": f"{lo}-{hi - 1}",
                "batch_tokens": stage.batch_tokens,
                "windows": windows,
                "timed_steps": round(steps),
                "ms_per_step": ms / steps,
                "tokens_per_s": tokens_per_s,
                "mfu_pct": 100 * fpt * tokens_per_s / (matmul_tflops * 1e12),
                "flops_per_token": fpt,
                **{
                    share: None if parts[f] is None else 100 * parts[f] / ms
                    for f, share in TIMED_PARTS.items()
                },
                **ngram,
            }
        )
    return rows


def summarize(
    run_dir: Path,
    command: str,
    date: str,
    matmul_tflops: float,
    corpus: dict | None,
    hbm_gbps: float = 3350.0,
) -> dict:
    events = read_events(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    env = json.loads((run_dir / "env.json").read_text())
    sched = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schedule.ScheduleConfig), cfg.schedule))
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))
    end = next(e for e in reversed(events) if e["event"] == "end")
    phases = {e["name"]: e for e in events if e["event"] == "phase"}
    train = [e for e in events if e["event"] == "train"]
    devices = env.get("devices") or [{"name": "cpu"}]
    payload = {
        "command": command,
        "date": date,
        "device": devices[0]["name"],
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "cuda": env.get("cuda"),
        "title": f"Training run {run_dir.name}: {schedule.total_steps(sched)} steps, world size "
        f"{env.get('world_size', 1)}",
        "status": end["status"],
        "val_loss": end.get("val_loss"),
        "train_time_s": end["train_time_ms"] / 1e3,
        "data_s": phases.get("data", {}).get("seconds"),
        "build_s": phases.get("build", {}).get("seconds"),
        "warmup_and_compile_s": phases.get("warmup", {}).get("seconds"),
        "tail_ship_s": phases.get("tail_ship", {}).get("seconds"),
        "graphs": end.get("graphs"),
        "timed_loop_graphs": end.get("timed_loop_graphs"),
        "peak_memory_mib": end.get("peak_memory_mib"),
        "matmul_tflops_assumed": matmul_tflops,
        "hbm_gbps_assumed": hbm_gbps,
        "rows": stage_rows(events, sched, model_cfg, matmul_tflops, hbm_gbps),
        "notes": [
            "train loss (per token, MTP-weighted) at logged steps: "
            + ", ".join(f"{e['step']}: {e['loss']:.3f}" for e in train),
        ],
    }
    summary = next((e for e in reversed(events) if e["event"] == "summary"), None)
    if summary is not None:  # the run's own summary: its reference lines (corpus floor, targets)
        refs = summary.get("references") or {}
        payload["tokens_per_s_overall"] = summary.get("tokens_per_s")
        payload["notes"].append(
            f"final val loss {end.get('val_loss'):.4f} against "
            + ", ".join(f"{label} {value:.4f}" for label, value in refs.items())
        )
    elif corpus:
        facts = corpus
        payload["notes"].append(
            f"final val loss {end.get('val_loss'):.4f} against the corpus's entropy floor "
            f"{facts['entropy_floor']:.4f} and unigram entropy {facts['unigram_entropy']:.4f} (nats)"
        )
    return payload


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--command", required=True, help="the exact command that made the run")
    p.add_argument("--matmul-tflops", type=float, default=790.0, help="bf16 matmul rate for MFU (H200: 790)")
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=3350.0,
        help="memory bandwidth for the n-gram floors (H100 SXM: 3350)",
    )
    p.add_argument("--date", required=True, help="when the run was made (ISO 8601)")
    p.add_argument("--commit", default=None, help="the commit the run was made at")
    p.add_argument("--entropy-floor", type=float, default=None, help="the synthetic corpus's floor (nats)")
    p.add_argument("--unigram-entropy", type=float, default=None, help="its unigram entropy (nats)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.run_dir / "events.jsonl").is_file():
        p.error(f"{args.run_dir} holds no events.jsonl: pass a run directory the trainer wrote.")
    corpus = None
    if args.entropy_floor is not None and args.unigram_entropy is not None:
        corpus = {"entropy_floor": args.entropy_floor, "unigram_entropy": args.unigram_entropy}
    payload = summarize(args.run_dir, args.command, args.date, args.matmul_tflops, corpus, args.hbm_gbps)
    if args.commit:
        payload["git_commit"] = args.commit
    write_bench_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
