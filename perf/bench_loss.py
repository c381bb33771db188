"""The training loss at the record's micro-batch: ms per forward + backward for each ``model.loss_impl``.

    python perf/bench_loss.py --out perf/results/loss.json                      # CUDA, the record's shapes
    python perf/bench_loss.py --device cpu --tokens 512 --vocab 2176 --out /tmp/loss.json   # CPU, small
    python perf/bench_loss.py --candidates 0 13696 19200 32768 --prefix-weight 0.25 --out /tmp/loss.json

Times ``softcapped_cross_entropy_sum`` (model/layers.py, the trainer's own loss) on hidden states x [T, D]
and the lm_head [D, V] in bf16, with the record's three MTP weights, for each implementation: its forward
(which computes the gradients, chunk by chunk) and the backward that scales them. Rows, one per impl:

- ``ms``: median over ``--steps`` after ``--warmup`` (CUDA events on the GPU, perf_counter on the CPU), with
  ``ms_min`` and ``ms_max``; ``vs_reference``: the reference row's ``ms`` over this row's;
- ``ms_floor``: the three GEMMs (logits, grad_x, grad_w: 6 T D V FLOPs) at the bf16 matmul rate measured in
  the same run, plus the fused kernel's least traffic (read the bf16 logits twice, write the gradient once:
  6 bytes per logit) at the device-to-device copy rate measured in the same run;
- ``loss_rel_diff``, ``grad_x_rel_diff``, ``grad_w_rel_diff``: this impl against the reference (relative
  norm of the difference), the agreement tests/perf/test_softcapped_ce.py bounds.

``--candidates``: one set of rows per sampled-softmax count P (0: the full softmax), the time including the
candidate set's build (model/sampled_softmax.py), ``ms_floor`` the GEMMs and kernel traffic at width P, and
``vs_full`` the same impl's full-softmax ``ms`` over this row's; the rel diffs compare with the reference at
the same P. The targets are drawn uniformly from ``--distinct`` ids (every P must hold them); the cost
depends on P, not on which ids. ``--prefix-weight``: the prefix-token term too, with a prefix target drawn
per row (-1 for a quarter of them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from track_1_short.model.config import ModelConfig
from track_1_short.model.layers import LOSS_IMPLS, softcapped_cross_entropy_sum
from track_1_short.model.sampled_softmax import candidate_set

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import bench_metadata, write_bench_json  # noqa: E402

RECORD_MTP = [1.0, 0.5, 0.25]  # the record's stage-0 MTP weights (schedule track1)
_CFG = ModelConfig()  # the softcap of the track-1 model: logit_cap, logit_shift, logit_temperature
SOFTCAP = (_CFG.logit_cap, _CFG.logit_shift, _CFG.logit_temperature)


def _timer(device: torch.device):
    """A function that runs fn once and returns its time in ms (device time through events on CUDA)."""

    def cuda_time(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_time(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cuda_time if device.type == "cuda" else cpu_time


def matmul_tflops(device: torch.device, n: int, timer, reps: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = [timer(lambda: a @ b) for _ in range(reps + 1)][1:]
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def copy_bytes_per_s(device: torch.device, numel: int, timer, reps: int = 5) -> float:
    src = torch.empty(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(reps + 1)][1:]
    return 2 * src.nbytes / (statistics.median(times) * 1e-3)  # read + written


def run(args) -> dict:
    device = torch.device(args.device)
    timer = _timer(device)
    g = torch.Generator().manual_seed(0)
    t, d, v = args.tokens, args.dim, args.vocab
    x = torch.randn(t, d, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(d, v, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    pool = torch.randperm(v, generator=g)[: min(args.distinct, v)]
    targets = pool[torch.randint(0, pool.numel(), (t,), generator=g)].to(device)
    prefix = None
    if args.prefix_weight is not None:
        prefix = torch.randint(0, v, (t,), generator=g)
        prefix[torch.rand(t, generator=g) < 0.25] = -1
        prefix = prefix.to(device)
    mtp = torch.tensor(RECORD_MTP, device=device)
    on_gpu = device.type == "cuda"
    tflops = matmul_tflops(device, 8192 if on_gpu else 512, timer)
    copy_rate = copy_bytes_per_s(device, 1 << 28 if on_gpu else 1 << 22, timer)

    def floor_ms(width: int) -> float:
        return (6 * t * d * width / (tflops * 1e12) + 6 * t * width / copy_rate) * 1e3

    arms = [(impl, p) for p in args.candidates for impl in args.impls]
    results = {}
    for impl, p in arms:
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss_args = (*SOFTCAP, args.chunk_rows, impl)

        def loss_fn(xx=xx, ww=ww, loss_args=loss_args, p=p):
            kw = {}
            if p:  # the set's build is part of the sampled loss's cost
                kw["candidates"] = candidate_set(targets, v, p, 0)
            if prefix is not None:
                kw.update(prefix_targets=prefix, prefix_weight=args.prefix_weight)
            return softcapped_cross_entropy_sum(xx, ww, targets, mtp, *loss_args, **kw)

        def step(xx=xx, ww=ww, loss_fn=loss_fn):
            xx.grad = ww.grad = None
            loss_fn().backward()

        for _ in range(args.warmup):
            step()
        times = [timer(step) for _ in range(args.steps)]
        loss = loss_fn()
        # The gradients of the last timed step: the loss above ran without a backward.
        results[(impl, p)] = (times, loss.detach().float(), xx.grad.float(), ww.grad.float())

    rows = []
    for (impl, p), (times, loss, gx, gw) in results.items():
        ref = results.get(("reference", p))
        full = results.get((impl, 0))
        row = {
            "impl": impl,
            "candidates": p,
            "tokens": t,
            "vocab": v,
            "ms": statistics.median(times),
            "ms_floor": floor_ms(p or v),
            "ms_min": min(times),
            "ms_max": max(times),
        }
        if ref is not None:
            row["vs_reference"] = statistics.median(ref[0]) / row["ms"]
            for name, a, b in (("loss", loss, ref[1]), ("grad_x", gx, ref[2]), ("grad_w", gw, ref[3])):
                row[f"{name}_rel_diff"] = ((a - b).norm() / b.norm()).item()
        if full is not None:
            row["vs_full"] = statistics.median(full[0]) / row["ms"]
        rows.append(row)
    return {
        **bench_metadata(sys.argv, device),
        "title": "Training loss (softcapped MTP cross-entropy), forward + backward",
        "matmul_tflops_measured": tflops,
        "copy_gb_per_s_measured": copy_rate / 1e9,
        "chunk_rows": args.chunk_rows,
        "distinct_targets": int(pool.numel()),
        "prefix_weight": args.prefix_weight,
        "rows": rows,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=65536, help="rows T (the record preset's micro-batch)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="V (GPT-2's, padded to 128)")
    p.add_argument("--chunk-rows", type=int, default=65536, help="model.loss_chunk_rows (the preset's)")
    p.add_argument("--impls", nargs="+", default=["reference", "fused"], choices=[i for i in LOSS_IMPLS])
    p.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=[0],
        help="sampled-softmax counts P, one set of rows each; 0: the full softmax",
    )
    p.add_argument(
        "--distinct",
        type=int,
        default=8000,
        help="targets drawn from this many ids (every P must hold them; ~11k at upstream's 49,152 tokens)",
    )
    p.add_argument(
        "--prefix-weight", type=float, default=None, help="add the prefix-token term at this weight"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if min(args.candidates) < 0 or any(0 < c < min(args.distinct, args.vocab) for c in args.candidates):
        p.error("--candidates: 0 (full) or counts >= --distinct, which every candidate set must hold")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    payload = run(args)
    write_bench_json(args.out, payload)
    for row in payload["rows"]:
        print({k: (round(val, 4) if isinstance(val, float) else val) for k, val in row.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
