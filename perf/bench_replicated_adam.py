"""Replicated Adam per Adam step: the per-parameter reference against the fused path, interleaved.

    python perf/bench_replicated_adam.py --out perf/results/replicated_adam.json       # CUDA
    python perf/bench_replicated_adam.py --device cpu --reps 4 --out /tmp/ra.json      # CPU smoke

The tensor set is the record model's replicated parameters, read from its param table
(``track_1_short.model.gpt.param_inventory`` of configs/model/track1.yaml): labels, shapes, dtypes, betas and
multipliers. Adam's base lr, eps and decay are OptimConfig's defaults. Both paths start from the same values
and see the same gradients; only public names are used:

- ``per_param``: per parameter one async all_reduce(AVG) and one ``optim.adam.adam_update_`` (compiled on
  CUDA): what ``optim.replicated_impl=reference`` runs;
- ``fused``: ``ReplicatedAdam`` (``launch_reduce()`` then ``update()``, CUDA graphs as in training): what
  ``optim.replicated_impl=fused`` runs.

Method: every round sets fresh gradients on both paths (outside the clock), then runs each path's step once,
in a seeded random order, so drift and cache effects fall on both. ``host_us`` is the step's host time
(perf_counter around it); ``device_us`` the GPU time between CUDA events around it (None on the CPU), the
queue drained after every step. Each figure is the median over rounds with a bootstrap 95% interval of that
median (``*_ci``); ``speedup`` is per_param's median host time over the path's. ``bitwise``: after the run
the path's parameters and moments equal per_param's bit for bit.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import REPO_ROOT, bench_metadata, write_bench_json  # noqa: E402

PATHS = ("per_param", "fused")
CONFIDENCE = 0.95
BOOTSTRAP = 2000


@dataclass
class AdamCfg:
    """The attributes an Adam step reads (``optim.hyper.AdamParamConfig``)."""

    adam_betas: list
    lr: float
    lr_mul: float
    eps: float
    weight_decay: float
    wd_mul: float


def record_set() -> list[tuple[str, tuple[int, ...], torch.dtype, dict]]:
    """(label, shape, dtype, param-table entry) of every replicated parameter of the record model."""
    from omegaconf import OmegaConf

    from track_1_short.model.config import ModelConfig
    from track_1_short.model.gpt import param_inventory

    node = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(REPO_ROOT / "configs/model/track1.yaml")
    )
    inventory = param_inventory(OmegaConf.to_object(node))
    return [
        (label, shape, dtype, e)
        for label, (e, shape, dtype) in inventory.items()
        if e["comms"] == "replicated"
    ]


def build(spec, device: torch.device, seed: int = 0):
    """(params, cfgs, states) of ``spec``: random values, zero moments; the same for the same seed."""
    from track_1_short.optim.anvil import OptimConfig

    optim = OptimConfig()
    gen = torch.Generator().manual_seed(seed)
    params, cfgs, states = [], [], []
    for label, shape, dtype, entry in spec:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype).to(device))
        p.label = label
        params.append(p)
        cfgs.append(
            AdamCfg(
                list(entry["adam_betas"]),
                optim.adam_lr,
                entry["lr_mul"],
                optim.adam_eps,
                optim.adam_weight_decay,
                entry["wd_mul"],
            )
        )
        moments = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(2)]
        states.append({"step": 0, "exp_avg": moments[0], "exp_avg_sq": moments[1]})
    return params, cfgs, states


class PerParam:
    def __init__(self, params, cfgs, states, device):
        from track_1_short.optim.adam import new_scalar_buffers

        self.params, self.cfgs, self.states = params, cfgs, states
        self.scalars = new_scalar_buffers()

    def step(self) -> None:
        from track_1_short import distributed
        from track_1_short.optim.adam import adam_update_

        pending = [(p, distributed.all_reduce_avg(p.grad, async_op=True)) for p in self.params]
        for (p, handle), cfg, state in zip(pending, self.cfgs, self.states):
            handle.wait()
            adam_update_(p.data, p.grad, state, cfg, self.scalars)


class Fused:
    def __init__(self, params, cfgs, states, device):
        from track_1_short.perf.replicated_adam import ReplicatedAdam

        self.params, self.states = params, states
        # Under Triton's interpreter a program costs the same at any size: few large ones (same bits).
        block = 1024 if device.type == "cuda" else 65536
        self.opt = ReplicatedAdam(params, cfgs, states, device, block=block)

    def step(self) -> None:
        self.opt.launch_reduce()
        self.opt.update()


PATH_CLASSES = {"per_param": PerParam, "fused": Fused}


def median_ci(samples: list[float], rng: np.random.Generator) -> tuple[float, list[float]]:
    """(median, bootstrap CONFIDENCE interval of the median)."""
    x = np.asarray(samples, dtype=np.float64)
    medians = np.median(rng.choice(x, size=(BOOTSTRAP, x.size), replace=True), axis=1)
    tail = (1.0 - CONFIDENCE) / 2
    return float(np.median(x)), [float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail))]


def measure(spec, device: torch.device, reps: int, warmup: int, seed: int) -> list[dict]:
    from track_1_short.perf.graph_check import same_bits

    cuda = device.type == "cuda"
    runs = {name: PATH_CLASSES[name](*build(spec, device), device) for name in PATHS}
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [
        [
            (torch.randn(shape, generator=gen) * (1.0 + 0.25 * v)).to(dtype).to(device)
            for _, shape, dtype, _ in spec
        ]
        for v in range(4)
    ]
    order_rng = random.Random(seed)
    host: dict[str, list[float]] = {name: [] for name in PATHS}
    dev: dict[str, list[float]] = {name: [] for name in PATHS}
    for r in range(warmup + reps):
        order = list(PATHS)
        order_rng.shuffle(order)
        for name in order:
            run = runs[name]
            for p, g in zip(run.params, grads[r % len(grads)]):
                p.grad = g.clone()
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            run.step()
            t1 = time.perf_counter()
            if cuda:
                end.record()
                torch.cuda.synchronize(device)
            if r >= warmup:
                host[name].append((t1 - t0) * 1e6)
                if cuda:
                    dev[name].append(start.elapsed_time(end) * 1e3)
    rng = np.random.default_rng(seed)
    reference = runs["per_param"]
    base_host = statistics.median(host["per_param"])
    rows = []
    for name in PATHS:
        run = runs[name]
        host_us, host_ci = median_ci(host[name], rng)
        device_us, device_ci = median_ci(dev[name], rng) if cuda else (None, None)
        bitwise = all(
            same_bits(p.detach(), q.detach())
            and same_bits(s["exp_avg"], t["exp_avg"])
            and same_bits(s["exp_avg_sq"], t["exp_avg_sq"])
            for p, q, s, t in zip(run.params, reference.params, run.states, reference.states)
        )
        rows.append(
            {
                "path": name,
                "tensors": len(spec),
                "elements": sum(int(np.prod(shape)) for _, shape, _, _ in spec),
                "host_us": round(host_us, 1),
                "host_us_ci": [round(v, 1) for v in host_ci],
                "device_us": None if device_us is None else round(device_us, 1),
                "device_us_ci": None if device_ci is None else [round(v, 1) for v in device_ci],
                "speedup": round(base_host / host_us, 2),
                "bitwise": bitwise,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed rounds (default: 300 on CUDA, 10 on CPU)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (default: 10 CUDA, 1 CPU)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the values, the round order and the bootstrap"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error(f"--reps {args.reps}: a median and its interval need at least 2 rounds")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Triton's interpreter is chosen when a kernel is decorated: before the kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cuda = device.type == "cuda"
    reps = args.reps or (300 if cuda else 10)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    rows = measure(record_set(), device, reps, warmup, args.seed)
    print(f"{device}: {reps} interleaved rounds after {warmup} warmup rounds")
    for r in rows:
        dev = "" if r["device_us"] is None else f"  device {r['device_us']:8.1f} us"
        print(
            f"  {r['path']:<10} host {r['host_us']:9.1f} us {r['host_us_ci']}{dev}  x{r['speedup']}"
            f"  bitwise {r['bitwise']}"
        )
    if args.out:
        payload = {
            **bench_metadata(sys.argv if argv is None else ["perf/bench_replicated_adam.py", *argv], device),
            "title": "Replicated Adam per Adam step",
            "rounds": reps,
            "rows": rows,
            "notes": [
                "host_us, device_us: median over interleaved rounds of one Adam step; *_ci: bootstrap "
                f"{CONFIDENCE:.0%} interval of that median; speedup: per_param's median host_us over the "
                "row's.",
                "bitwise: parameters and moments after every round equal the per_param path's bit for bit.",
            ],
        }
        write_bench_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
