"""Each product of one ANVIL cascade round at the track-1 bank shapes, per implementation: microseconds
against the floor at this run's measured rates.

    python perf/bench_cascade_products.py --out perf/results/cascade_products.json      # CUDA
    python perf/bench_cascade_products.py --device cpu --out /tmp/p.json                # small, torch only

perf/bench_optimizer.py times the whole cascade of a bank; this splits a round (track_1_short/optim/
polar_express.py) into the products the routes compute, each through the function the route itself calls:

- ``gram``, A = X^T X (tall) or X X^T: ``bmm`` (every route);
- ``poly``, b A + c A A: ``baddbmm`` (route bmm, and every route's last round), ``square`` (route squared:
  the shifted Gram times itself with its two diagonal adds);
- ``apply``, the application to X: ``baddbmm`` (a X + X B: route bmm and every route's last round), ``bmm``
  (X F: the folded rounds of squared);
- ``normalise``, the Gram divided by one fp32 number per matrix and rounded to bf16: ``torch.div``, and on
  CUDA ``bf16_div`` (track_1_short/perf/kernels/bf16_div.py, what scaled_to_bf16 takes there);
- ``cascade``, the whole ``orthogonalize`` through each route (``polar_express.GRAMS``), whatever
  ``route_for`` would give the bank: the measurement behind ``route_for`` (the Gram-space route pays only on
  large, long matrices). Its floor counts the route's own matmuls (``cascade_flops``).

Columns: ``us`` the mean per call (on CUDA, ``--calls`` calls captured in one CUDA graph and replayed
``--steps`` times after ``--warmup``; on the CPU perf_counter), ``us_floor`` the product's matmul FLOPs as
plain matmuls at the measured bf16 rate (for ``normalise``: its bytes at the measured copy rate),
``tflops`` those FLOPs over ``us``, ``vs_first`` the first implementation's ``us`` over this row's (same
bank and product), ``bitwise_first`` whether this row's output has the first implementation's bits (none for
``square``, which makes the squared route's rescaled factor, another matrix). The ``square`` row shifts a
scratch copy of the Gram in place on every call, as the route shifts its fresh Gram (the values drift over
the timed calls; the kernels and their cost do not).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from track_1_short.optim import polar_express as pe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_meta import bench_metadata, write_bench_json  # noqa: E402
from bench_optimizer import SMALL_BANKS, TRACK1_BANKS  # noqa: E402 - the sibling script's bank shapes
from bench_timing import copy_gbps, graph_replay, matmul_tflops, time_ms  # noqa: E402

ROUND = 1  # the round whose coefficients the products use (any folded round: the cost does not depend on it)


def bank_inputs(shape: list[int], device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """bf16 X [B, rows, cols] with singular values below 1 (as after the normalisation), its Gram, tall."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = (x / (1.1 * x.norm(dim=(-2, -1), keepdim=True))).bfloat16().to(device)
    tall = x.size(-2) > x.size(-1)
    return x, pe._gram(x, tall), tall


def implementations(
    x: torch.Tensor,
    big_a: torch.Tensor,
    tall: bool,
) -> dict[str, list[tuple[str, Callable[[], torch.Tensor]]]]:
    """product -> [(implementation, call)], the first of each the reference its bits are compared with."""
    a, b, c = pe.ANVIL_MAPS[ROUND]
    delta, gamma = pe._SQUARED_ROUNDS[ROUND]
    scratch = big_a.clone()
    factor = pe._poly(big_a, b, c)
    factor.diagonal(dim1=-2, dim2=-1).add_(a)
    divisor = big_a.float().diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1) + 1.0
    out = {
        "gram": [("bmm", lambda: pe._gram(x, tall))],
        "poly": [
            ("baddbmm", lambda: pe._poly(big_a, b, c)),
            ("square", lambda: pe._squared_poly(scratch, delta, gamma)),
        ],
        "apply": [
            ("baddbmm", lambda: pe._apply_linear(x, factor, a, tall)),
            ("bmm", lambda: pe._apply(x, factor, tall)),
        ],
        "normalise": [("torch.div", lambda: torch.div(big_a, divisor, out=torch.empty_like(big_a)))],
        "cascade": [(g, lambda g=g: pe.orthogonalize(x, gram=g)) for g in pe.GRAMS],
    }
    if big_a.is_cuda:
        from track_1_short.perf.kernels import bf16_div

        out["normalise"].append(("bf16_div", lambda: bf16_div.div_(big_a, divisor, torch.empty_like(big_a))))
    return out


def flops(product: str, batch: int, rows: int, cols: int, impl: str) -> int:
    # 2 per multiply-add, as plain matmuls.
    if product == "cascade":
        return pe.cascade_flops(batch, rows, cols, impl)
    s, long = min(rows, cols), max(rows, cols)
    return {"gram": 2 * long * s * s, "poly": 2 * s**3, "apply": 2 * long * s * s, "normalise": 0}[
        product
    ] * batch


def timed_us(call: Callable[[], object], device: torch.device, calls: int, steps: int, warmup: int) -> float:
    """Mean microseconds of one call: ``calls`` of them in one CUDA graph on CUDA, one by one on the CPU."""
    if device.type == "cuda":

        def many() -> None:
            for _ in range(calls):
                call()

        return time_ms(graph_replay(many, device), device, steps, warmup) * 1e3 / calls
    return time_ms(call, device, steps, warmup) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--shapes", choices=("track1", "small"), default=None, help="default: track1 on cuda")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed replays (default: 20 on cuda, 3 on cpu)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed replays first")
    parser.add_argument("--calls", type=int, default=10, help="calls captured in one CUDA graph (CUDA only)")
    parser.add_argument(
        "--matmul-size", type=int, default=None, help="n of the rate probe (8192 cuda, 512 cpu)"
    )
    parser.add_argument("--out", required=True, help="JSON path for the results")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    banks = TRACK1_BANKS if (args.shapes or ("track1" if cuda else "small")) == "track1" else SMALL_BANKS
    steps = args.steps if args.steps is not None else (20 if cuda else 3)
    tflops = matmul_tflops(device, args.matmul_size or (8192 if cuda else 512))
    gbps = copy_gbps(device, 1 << (28 if cuda else 22))
    print(f"{device.type}; bf16 matmul {tflops:.2f} TFLOP/s, copy {gbps:.0f} GB/s")

    rows = []
    for seed, (label, (_shape, reshape, _mults)) in enumerate(banks.items()):
        x, big_a, tall = bank_inputs(reshape, device, seed)
        batch, r, c = reshape
        moved = 4 * big_a.numel()  # normalise: read and write a bf16 [B, s, s]
        for product, impls in implementations(x, big_a, tall).items():
            for i, (impl, call) in enumerate(impls):
                work = flops(product, batch, r, c, impl)
                bits = call().view(torch.int16)  # before timing: "square" shifts its scratch Gram per call
                us = timed_us(call, device, args.calls, steps, args.warmup)
                if i == 0:
                    first_bits, first_us = bits, us
                rows.append(
                    {
                        "bank": label,
                        "matrices": f"{batch} x {r} x {c}",
                        "product": product,
                        "impl": impl,
                        "us": us,
                        "us_floor": work / (tflops * 1e6) if work else moved / (gbps * 1e3),
                        "tflops": work / us / 1e6 if work else None,
                        "vs_first": first_us / us,
                        # square is the squared route's rescaled factor, not b A + c A A, and the routes'
                        # cascades round differently: nothing to compare bit for bit
                        "bitwise_first": None
                        if impl == "square" or (product == "cascade" and i > 0)
                        else bool(torch.equal(bits, first_bits)),
                    }
                )
                print(f"{label:10s} {product:9s} {impl:26s} {us:9.1f} us  floor {rows[-1]['us_floor']:8.1f}")
    payload = {
        **bench_metadata(sys.argv if argv is None else [sys.argv[0], *argv], device),
        "title": "ANVIL cascade round, each product per implementation, track-1 bank shapes",
        "matmul_tflops": tflops,
        "copy_gbps": gbps,
        "round": ROUND,
        "rows": rows,
        "notes": [
            "us: mean per call (CUDA: calls captured in one graph, replayed); us_floor: matmul FLOPs as"
            " plain matmuls at matmul_tflops (normalise: 4 bytes a Gram element at copy_gbps)",
            "vs_first: the product's first implementation's us over this row's; bitwise_first: this row's"
            " output has that implementation's bits",
            "cascade: the whole orthogonalize through each route at the bank's shape, whether or not"
            " route_for gives the bank that route; its floor counts the route's own matmuls",
        ],
    }
    write_bench_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
