"""ANVIL's optimizer step for the track-1 banks at world size 1: ms per step, split into cascade and rest.

    python perf/bench_optimizer.py --out perf/results/optimizer.json                 # CUDA, track-1 banks
    python perf/bench_optimizer.py --device cpu --out /tmp/optimizer.json            # CPU: small banks
    python perf/bench_optimizer.py --bank-update eager triton --out /tmp/optimizer.json    # Triton kernels
    python perf/bench_optimizer.py --cascade-gram bmm squared gram_space --out /tmp/o.json  # cascade routes
    python perf/bench_optimizer.py --bank-update triton --bank-graphs off on --out /tmp/o.json  # CUDA graphs
    python perf/bench_optimizer.py --bank-update triton --bank-streams off on --out /tmp/o.json  # streams

The banks are the record's (reshape views): qk [48, 256, 768] (wide), vo [16, 768, 768] (square), mlp
[24, 2816, 768] (tall, c_proj x2, two frozen matrices), bf16, random weights and gradients. ``--shapes small``
(the CPU default) divides every matrix dimension by 8 and keeps a quarter (qk, vo) or half (mlp) of the
matrices. At world size 1 a step is, per bank, the local reduce_scatter/all_gather copies plus
``AnvilBank.update()``: twin rails, cascade, lane equaliser, master update.

Rows, one per bank and one for the whole ``AnvilAndAdam.step(do_adam=False)``, for each ``--bank-update``
arm (``optim.bank_update``: ``eager``, ``triton``; default eager and triton on CUDA, eager on the CPU).
Each arm builds the optimizer with that setting and times its own ``update()`` and ``step()``, so the triton
arm times the kernels of track_1_short/perf/kernels/anvil_bank.py (the cascade stays torch there, so its
``cascade_ms`` is the eager cascade's):

``--top-kernels N`` (CUDA) profiles each bank's update: the GPU's busy share between its kernels, kernel time
by class and the N costliest kernels (perf/kernel_profile.py, as perf/bench_train_step.py).

Arms are crossed with ``--bank-graphs`` (``optim.bank_graphs``: ``off``, ``on``; default off): ``on``
replays each bank's update from a CUDA graph (track_1_short/perf/bank_graphs.py), one launch a bank, and with
``--bank-streams`` (``optim.bank_streams``: ``off``, ``on``; default off): ``on`` runs each bank's update in
the optimizer step on its own CUDA stream (track_1_short/perf/bank_streams.py). Arms are
also crossed with ``--cascade-gram`` (``optim.cascade_gram``: ``bmm``, ``squared``, ``gram_space``; default
bmm): the cascade's route (track_1_short/optim/polar_express.py; ``gram_space`` runs as ``squared`` on the
banks ``route_for`` keeps off it, and ``cascade_ms`` and its floor time and count what each bank runs). Its
arms time the same update through each route; ``cascade_ms`` shows their effect on the cascade alone,
perf/bench_cascade_products.py product by product.

- ``bank_update``: the arm; ``cascade_gram``: the arm's Gram route; ``compile_s``: the triton arm's first
  ``update()`` of the bank (Triton's JIT of the kernels), wall seconds, untimed otherwise; ``vs_eager``: the
  eager arm's ``step_ms`` over this row's (same cascade_gram); ``vs_bmm``: the bmm arm's ``step_ms`` over this
  row's (same bank_update);
- ``step_ms``: the bank's ``update()`` (the total row: the whole optimizer step), mean over ``--steps`` after
  ``--warmup``, CUDA events on the GPU, perf_counter on the CPU;
- ``cascade_ms``: ``orthogonalize`` alone on the bank's chunk;
  ``rest_ms = step_ms - cascade_ms``;
- ``cascade_ms_floor``: the cascade's matmul FLOPs (``cascade_flops``, plain matmuls, also in the triton
  arm) at the bf16 matmul rate measured in the same run (median of repeated n^3 matmuls, n = 8192 on CUDA,
  512 on the CPU);
- ``rest_ms_floor``: the bytes the elementwise part must move at least, 28 per bank element (read the bf16
  gradient 2, read and write both fp32 rails 16, the bf16 weight 4 and the uint16 mantissa 4, read the cascade
  output 2), at the device-to-device copy rate measured in the same run (bytes read + written per second).

The eager update runs each elementwise phase as separate kernels and the cascade as plain bmm/baddbmm; the gap
between ``rest_ms`` and its floor is the cost of not fusing them (upstream compiles them and captures each
bank update in a CUDA graph), the gap on the cascade the cost of not using symmetric Gram kernels and of bf16
GEMM efficiency at these sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from track_1_short.optim.anvil import BANK_UPDATES, CASCADE_GRAMS, AnvilAndAdam, OptimConfig
from track_1_short.optim.polar_express import cascade_flops, orthogonalize

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import bench_metadata, write_bench_json  # noqa: E402
from bench_timing import copy_gbps, graph_replay, matmul_tflops, sync, time_ms  # noqa: E402
from kernel_profile import kernel_table_line, profile_device  # noqa: E402

# label: (parameter shape, reshape, matrix_lr_mul), the record's banks (upstream-optim notes 3.1 and 3.5): mlp
# matrices alternate c_fc (x1) and c_proj (x2); 14 and 15 (a deleted layer's MLP) are frozen.
MLP_MULTS = [0.0 if j in (14, 15) else (2.0 if j % 2 else 1.0) for j in range(24)]
TRACK1_BANKS = {
    "qk_bank": ([48, 256, 768], [48, 256, 768], None),
    "vo_bank": ([16, 768, 768], [16, 768, 768], None),
    "mlp_bank": ([12, 2, 2816, 768], [24, 2816, 768], MLP_MULTS),
}
# --shapes small: every matrix dimension / 8, a quarter (qk, vo) or half (mlp) of the matrices.
SMALL_BANKS = {
    "qk_bank": ([12, 32, 96], [12, 32, 96], None),
    "vo_bank": ([4, 96, 96], [4, 96, 96], None),
    "mlp_bank": ([6, 2, 352, 96], [12, 352, 96], MLP_MULTS[:12]),
}
PROFILED_UPDATES = 5  # bank updates under the profiler per row with --top-kernels
BYTES_PER_ELEMENT_FLOOR = (
    28  # the elementwise part's least traffic per bank element, see the module docstring
)


def build(
    banks: dict,
    device: torch.device,
    bank_update: str = "eager",
    cascade_gram: str = "bmm",
    bank_graphs: bool = False,
    bank_streams: bool = False,
):
    gen = torch.Generator(device=device).manual_seed(0)
    named, table, grads = [], {}, {}
    for label, (shape, reshape, mults) in banks.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device).mul_(0.02).bfloat16())
        p.label = label
        named.append((label, p))
        table[label] = {
            "optim": "anvil",
            "comms": "sharded",
            "adam_betas": None,
            "lr_mul": 1.0,
            "wd_mul": 1.0,
            "reshape": reshape,
            "matrix_lr_mul": mults,
        }
        grads[label] = torch.randn(shape, generator=gen, device=device).bfloat16()
    order = list(banks)
    cfg = OptimConfig(
        bank_update=bank_update, cascade_gram=cascade_gram, bank_graphs=bank_graphs, bank_streams=bank_streams
    )
    opt = AnvilAndAdam(named, table, order, order, cfg)
    opt.set_schedule(1.0, 0.93, 100)
    return named, opt, grads


def measure(
    banks: dict,
    device: torch.device,
    steps: int,
    warmup: int,
    tflops: float,
    gbps: float,
    bank_update: str = "eager",
    cascade_gram: str = "bmm",
    bank_graphs: bool = False,
    top: int = 0,
    bank_streams: bool = False,
) -> list[dict]:
    named, opt, grads = build(banks, device, bank_update, cascade_gram, bank_graphs, bank_streams)
    cascade = orthogonalize
    rows = []
    for label, _ in named:
        bank = opt.banks[label]
        bank.grad.copy_(grads[label].view(bank.grad.shape))
        chunk, r, c = bank.grad.shape
        x = bank.grad.clone()
        extra = {}
        # The first call compiles (and captures the graph): timed on its own, never in step_ms.
        if bank_update == "triton" or bank_graphs:
            sync(device)
            t0 = time.perf_counter()
            bank.update()
            sync(device)
            extra["compile_s"] = time.perf_counter() - t0
        step_ms = time_ms(bank.update, device, steps, warmup)
        route = bank.constants["gram"]  # what the bank runs: route_for's choice (gram_space where it pays)
        run_cascade = lambda x=x, route=route: cascade(x, opt.cfg.frobenius_margin, route)  # noqa: E731
        if bank_graphs:  # the cascade alone as the arm runs it: replayed from a graph
            run_cascade = graph_replay(run_cascade, device)
        cascade_ms = time_ms(run_cascade, device, steps, warmup)
        if top:  # where the update's device time goes, and how busy the GPU is between its kernels
            extra.update(profile_device(bank.update, PROFILED_UPDATES, top))
        flops = cascade_flops(chunk, r, c, route)
        rows.append(
            {
                "bank": label,
                "bank_update": bank_update,
                "matrices": f"{chunk} x {r} x {c}",
                "cascade_gram": cascade_gram,
                "bank_graphs": bank_graphs,
                "bank_streams": bank_streams,
                **extra,
                "step_ms": step_ms,
                "cascade_ms": cascade_ms,
                "cascade_ms_floor": flops / (tflops * 1e12) * 1e3,
                "rest_ms": step_ms - cascade_ms,
                "rest_ms_floor": BYTES_PER_ELEMENT_FLOOR * bank.grad.numel() / (gbps * 1e9) * 1e3,
                "cascade_gflop": flops / 1e9,
            }
        )

    def full_step() -> None:
        for label, p in named:
            p.grad = grads[label]
        opt.step(do_adam=False)

    total_ms = time_ms(full_step, device, steps, warmup)
    total = {
        k: sum(r[k] for r in rows)
        for k in ("cascade_ms", "cascade_ms_floor", "rest_ms_floor", "cascade_gflop")
    }
    rows.append(
        {
            "bank": "optimizer step (all banks)",
            "bank_update": bank_update,
            "matrices": "",
            "cascade_gram": cascade_gram,
            "bank_graphs": bank_graphs,
            "bank_streams": bank_streams,
            "step_ms": total_ms,
            "cascade_ms": total["cascade_ms"],
            "cascade_ms_floor": total["cascade_ms_floor"],
            "rest_ms": total_ms - total["cascade_ms"],
            "rest_ms_floor": total["rest_ms_floor"],
            "cascade_gflop": total["cascade_gflop"],
        }
    )
    return rows


def add_vs_eager(rows: list[dict]) -> None:
    """Give every row ``vs_eager`` (eager step_ms / its step_ms, same cascade_gram and bank_graphs) when the
    eager arm was measured, ``vs_bmm`` (bmm step_ms / its step_ms, same bank_update and bank_graphs) when both
    Gram routes were, and ``vs_ungraphed`` (the ungraphed arm's step_ms / its step_ms, same bank_update and
    cascade_gram) when both bank_graphs settings were."""

    def same(r: dict, *keys: str) -> tuple:
        return (r["bank"], *(r[k] for k in keys))

    for r in rows:
        r.setdefault("bank_streams", False)
    eager = {
        same(r, "cascade_gram", "bank_graphs", "bank_streams"): r["step_ms"]
        for r in rows
        if r["bank_update"] == "eager"
    }
    bmm = {
        same(r, "bank_update", "bank_graphs", "bank_streams"): r["step_ms"]
        for r in rows
        if r["cascade_gram"] == "bmm"
    }
    plain = {
        same(r, "bank_update", "cascade_gram", "bank_streams"): r["step_ms"]
        for r in rows
        if not r["bank_graphs"]
    }
    serial = {
        same(r, "bank_update", "cascade_gram", "bank_graphs"): r["step_ms"]
        for r in rows
        if not r["bank_streams"]
    }
    both_grams = len({r["cascade_gram"] for r in rows}) > 1
    both_graphs = len({r["bank_graphs"] for r in rows}) > 1
    both_streams = len({r["bank_streams"] for r in rows}) > 1
    for r in rows:
        if same(r, "cascade_gram", "bank_graphs", "bank_streams") in eager:
            r["vs_eager"] = eager[same(r, "cascade_gram", "bank_graphs", "bank_streams")] / r["step_ms"]
        if both_grams and same(r, "bank_update", "bank_graphs", "bank_streams") in bmm:
            r["vs_bmm"] = bmm[same(r, "bank_update", "bank_graphs", "bank_streams")] / r["step_ms"]
        if both_graphs and same(r, "bank_update", "cascade_gram", "bank_streams") in plain:
            r["vs_ungraphed"] = plain[same(r, "bank_update", "cascade_gram", "bank_streams")] / r["step_ms"]
        if both_streams and same(r, "bank_update", "cascade_gram", "bank_graphs") in serial:
            r["vs_serial"] = serial[same(r, "bank_update", "cascade_gram", "bank_graphs")] / r["step_ms"]


def print_table(rows: list[dict]) -> None:
    print(
        f"{'bank':<28}{'arm':>9}{'gram':>7}{'graphs':>7}{'streams':>8}{'matrices':>18}{'step ms':>10}"
        f"{'cascade':>10}{'floor':>9}{'rest':>10}{'floor':>9}"
    )
    for r in rows:
        print(
            f"{r['bank']:<28}{r['bank_update']:>9}{r['cascade_gram']:>7}"
            f"{'on' if r['bank_graphs'] else 'off':>7}{'on' if r['bank_streams'] else 'off':>8}"
            f"{r['matrices']:>18}"
            f"{r['step_ms']:>10.3f}{r['cascade_ms']:>10.3f}{r['cascade_ms_floor']:>9.3f}{r['rest_ms']:>10.3f}"
            f"{r['rest_ms_floor']:>9.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--shapes", choices=("track1", "small"), default=None, help="default: track1 on cuda")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 on cuda, 3 on cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 / 1)")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 rate matmul (8192 / 512)")
    parser.add_argument(
        "--bank-update",
        nargs="+",
        choices=BANK_UPDATES,
        default=None,
        help="optim.bank_update arms, measured in this order in one run (default: eager triton on cuda, "
        "eager on cpu)",
    )
    parser.add_argument(
        "--cascade-gram",
        nargs="+",
        choices=CASCADE_GRAMS,
        default=None,
        help="optim.cascade_gram arms, crossed with the bank_update arms (default: bmm)",
    )
    for switch, what in (
        ("bank_graphs", "each bank update replayed from a CUDA graph"),
        ("bank_streams", "each bank update on its own CUDA stream"),
    ):
        parser.add_argument(
            "--" + switch.replace("_", "-"),
            nargs="+",
            choices=("off", "on"),
            default=None,
            help=f"optim.{switch} arms (on: {what}; CUDA only), crossed with the others (default: off)",
        )
    parser.add_argument(
        "--top-kernels",
        type=int,
        default=0,
        help="CUDA: profile each bank's update and list its N costliest kernels (0: no profile)",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch; use --device cpu.")
    if not cuda:
        # The triton arms' kernels run on the CPU only in Triton's interpreter, chosen when a kernel module is
        # imported (the first triton arm imports them).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = args.shapes or ("track1" if cuda else "small")
    steps = args.steps if args.steps is not None else (20 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if steps < 1 or warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0.")
    graph_arms = [arm == "on" for arm in (args.bank_graphs or ["off"])]
    stream_arms = [arm == "on" for arm in (args.bank_streams or ["off"])]
    for option, arms, what in (
        ("--bank-graphs", graph_arms, "graphs"),
        ("--bank-streams", stream_arms, "streams"),
    ):
        if any(arms) and not cuda:
            parser.error(f"{option} on needs CUDA (CUDA {what}); use {option} off on the CPU.")
    if args.top_kernels and not cuda:
        parser.error("--top-kernels profiles CUDA kernels; leave it out on the CPU.")
    n = args.matmul_size or (8192 if cuda else 512)
    banks = TRACK1_BANKS if shapes == "track1" else SMALL_BANKS

    tflops = matmul_tflops(device, n)
    gbps = copy_gbps(device, 1 << (28 if cuda else 22))
    arms = args.bank_update or (["eager", "triton"] if cuda else ["eager"])
    grams = args.cascade_gram or ["bmm"]
    rows = [
        r
        for arm in arms
        for gram in grams
        for graphs in graph_arms
        for streams in stream_arms
        for r in measure(
            banks, device, steps, warmup, tflops, gbps, arm, gram, graphs, args.top_kernels, streams
        )
    ]
    add_vs_eager(rows)
    tables = {
        f"{r['bank']}, {r['bank_update']}, {r['cascade_gram']}, graphs {'on' if r['bank_graphs'] else 'off'}"
        f"{', streams on' if r['bank_streams'] else ''}: top kernels per update": r.pop("top_kernels")
        for r in rows
        if r.get("top_kernels")
    }
    rates = f"bf16 matmul {tflops:.2f} TFLOP/s, copy {gbps:.0f} GB/s"
    print(f"{device}, {shapes} banks, {steps} timed steps; {rates}")
    print_table(rows)
    for title, table in tables.items():
        print(title)
        for k in table:
            print(kernel_table_line(k))
    if args.out:
        payload = {
            **bench_metadata(sys.argv if argv is None else ["perf/bench_optimizer.py", *argv], device),
            "title": "ANVIL optimizer step, track-1 banks, world size 1",
            "banks": shapes,
            "bank_update": arms,
            "cascade_gram": grams,
            "bank_graphs": graph_arms,
            "bank_streams": stream_arms,
            "timed_steps": steps,
            "matmul_tflops": tflops,
            "matmul_n": n,
            "copy_gbps": gbps,
            "rows": rows,
            **({"tables": tables} if tables else {}),
            "notes": [
                "cascade floor: the cascade's matmul FLOPs (plain matmuls) at this run's bf16 matmul rate",
                f"rest floor: {BYTES_PER_ELEMENT_FLOOR} bytes per bank element at the copy rate of this run",
                "rest_ms = step_ms - cascade_ms: rails, equaliser, master update (the total row adds the "
                "step's gradient and gather copies)",
                "bank_update: optim.bank_update of the arm (triton: the Triton kernels outside the cascade, "
                "compile_s their first call); vs_eager: the eager arm's step_ms over the row's",
                "cascade_gram: optim.cascade_gram of the arm; vs_bmm: the bmm arm's step_ms over the row's",
                "bank_graphs: optim.bank_graphs of the arm (each bank update replayed from a CUDA graph; "
                "compile_s then includes the capture, and cascade_ms times the cascade replayed from a graph "
                "too); vs_ungraphed: the ungraphed arm's step_ms over the row's",
                "bank_streams: optim.bank_streams of the arm (each bank update on its own CUDA stream inside "
                "the optimizer step; a bank row times its update alone, as without streams, so only the "
                "all-banks row can differ); vs_serial: the arm without streams' step_ms over the row's",
                "with --top-kernels: gpu_busy_pct, the share of the profiled span the GPU was busy over "
                f"{PROFILED_UPDATES} updates of the bank (idle gaps: the host launching), gemm_pct and "
                "other_kernel_pct its kernel time by class, and a table of its costliest kernels",
            ],
        }
        write_bench_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
