"""Replicated Adam per Adam step: the per-parameter path, the fused paths and torch.optim.Adam, in one run.

    python perf/bench_replicated_adam.py --out perf/results/replicated_adam.json             # CUDA
    python perf/bench_replicated_adam.py --device cpu --out /tmp/replicated_adam.json         # CPU smoke
    torchrun --nproc_per_node=2 perf/bench_replicated_adam.py --out /tmp/ra2.json         # with all_reduces

Sets: ``record``, the record's 13 replicated tensors (shapes, dtypes, betas and multipliers of upstream's
param table, about 212k elements, 69 of them fp32); ``synthetic``, 100 tensors of 17 shapes (1 to 2,048
elements, bf16 and fp32, three beta pairs). Paths, each from the same initial values and gradients:

- ``per_param``: per parameter one async all_reduce(AVG) and one ``adam_update_`` (compiled on CUDA);
- ``fused``: ``ReplicatedAdam(impl="fused")``: host table, one foreach copy, all_reduce and kernel per dtype;
- ``device``: ``ReplicatedAdam(impl="device")``: device table, gradients accumulated in place and reduced from
  their hooks, one kernel for every dtype, CUDA graphs on CUDA;
- ``torch_adam``: ``torch.optim.Adam`` (fused=True on CUDA), one group per tensor, after per-parameter
  all_reduces; its arithmetic differs (no cautious decay), so it is timed, not compared.

Each timed step is one backward straight into the parameters (precomputed gradients, a new scale each step)
followed by the path's Adam step; "backward only" is measured in the same run and subtracted. Columns:

- ``host_us``: host wall time per step (median over steps, no device sync inside the loop), backward excluded;
- ``device_us``: GPU busy time per step (kernels and copies, from the profiler), backward excluded (None on
  CPU);
- ``launches``: per step, host calls that launch GPU work (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch,
  cudaMemcpyAsync, ...), backward excluded. On the CPU: dispatched aten ops plus Triton launches, the calls
  that would be launches on a GPU;
- ``kernels``: GPU kernels and copies executed per step, those inside CUDA graphs included (None on CPU);
- ``speedup``, ``vs_fused``: per_param's (fused's) host_us over this path's;
- ``bitwise``: after the run, parameters and moments equal the per_param path's bit for bit.

At world size 1 the project's collectives are no-ops, so a one-process run measures everything but the
all_reduces; run it under torchrun for those (rank 0 prints and writes). On the CPU the Triton kernels run in
the interpreter (slow: the CPU run is a smoke of the whole benchmark, its figures say little).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

# label, shape, dtype, betas, lr_mul, wd_mul: the record's replicated Adam tensors (upstream-optim notes 5).
RECORD = [
    ("scalars", (24,), torch.float32, (0.9, 0.99), 5.0, 0.0),
    ("smear_gate", (1, 12), torch.bfloat16, (0.9, 0.99), 0.01, 0.0),
    ("ve_gate_bank", (3, 6, 12), torch.bfloat16, (0.9, 0.99), 1.0, 1.0),
    ("post_lambdas", (11, 2), torch.float32, (0.9, 0.95), 1.0, 0.0),
    ("resid_lambdas", (11, 2), torch.float32, (0.9, 0.95), 5.0, 0.0),
    ("mudd_w1", (2, 64, 768), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_w2", (2, 14, 64), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_w2g", (14, 12, 64), torch.bfloat16, (0.9, 0.99), 0.25, 1.0),
    ("mudd_b2", (2, 14), torch.bfloat16, (0.9, 0.99), 0.25, 0.0),
    ("mudd_gate_w1", (2, 64, 768), torch.bfloat16, (0.9, 0.99), 0.1, 1.0),
    ("mudd_gate_w2", (2, 23, 64), torch.bfloat16, (0.9, 0.99), 0.1, 1.0),
    ("mudd_gate_b2", (2, 23), torch.bfloat16, (0.9, 0.99), 0.1, 0.0),
    ("_mudd_gate_scale", (), torch.float32, (0.9, 0.99), 0.1, 0.0),
]
ADAM_LR, ADAM_EPS, ADAM_WD = 0.008, 1e-10, 0.005  # the record's Adam settings
PATHS = ("per_param", "fused", "device", "torch_adam")
SETS = ("record", "synthetic")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
# aten ops that only allocate or re-describe memory: no kernel on a GPU, not counted as launches on the CPU.
NO_KERNEL_OPS = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::view", "aten::_reshape_alias", "aten::reshape", "aten::as_strided", "aten::alias", "aten::detach",
    "aten::t", "aten::expand", "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view",
}  # fmt: skip


def synthetic_set() -> list[tuple]:
    """100 tensors of 17 shapes (so the compiled per-parameter path needs 17 graphs), sizes 1..2048."""
    shapes = [(1,), (3,), (8,), (12,), (24,), (2, 14), (11, 2), (64,), (3, 6, 12), (2, 64), (256,), (4, 96),
              (2, 23, 8), (512,), (1000,), (32, 48), (2048,)]  # fmt: skip
    betas = [(0.9, 0.99), (0.9, 0.95), (0.5, 0.95)]
    out = []
    for k in range(100):
        j = (k * 7) % len(shapes)  # spreads the 17 shapes over the 100 tensors
        dtype = torch.bfloat16 if j % 2 else torch.float32
        out.append((f"t{k}", shapes[j], dtype, betas[j % 3], (0.25, 1.0, 5.0)[k % 3], float(k % 2)))
    return out


class Cfg:
    """The attributes an Adam step reads (a stand-in for optim/anvil.py's ParamConfig)."""

    def __init__(self, betas, lr_mul, wd_mul):
        self.adam_betas, self.lr, self.lr_mul = list(betas), ADAM_LR, lr_mul
        self.eps, self.weight_decay, self.wd_mul = ADAM_EPS, ADAM_WD, wd_mul


def build(spec: list[tuple], device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params, cfgs, states = [], [], []
    for label, shape, dtype, betas, lr_mul, wd_mul in spec:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype).to(device))
        p.label = label
        params.append(p)
        cfgs.append(Cfg(betas, lr_mul, wd_mul))
        states.append(
            {
                "step": 0,
                "exp_avg": torch.zeros(shape, dtype=torch.float32, device=device),
                "exp_avg_sq": torch.zeros(shape, dtype=torch.float32, device=device),
            }
        )
    return params, cfgs, states


class Gradients:
    """Precomputed gradients, a few distinct sets cycled, fed straight into the parameters by backward()."""

    def __init__(self, params, seed: int = 1, variants: int = 4):
        gen = torch.Generator().manual_seed(seed)
        base = [torch.randn(p.shape, generator=gen) for p in params]
        self.sets = [
            [(b * (1.0 + 0.25 * v)).to(p.dtype).to(p.device) for b, p in zip(base, params)]
            for v in range(variants)
        ]

    def backward(self, params, step: int) -> None:
        torch.autograd.backward(params, grad_tensors=self.sets[step % len(self.sets)])


# ---- the paths ---------------------------------------------------------------------------------------------


class PerParam:
    def __init__(self, params, cfgs, states, device, block):
        from track_1_short.optim.adam import new_scalar_buffers

        self.params, self.cfgs, self.states = params, cfgs, states
        self.scalars = new_scalar_buffers()

    def before_backward(self) -> None:
        pass

    def step(self) -> None:
        from track_1_short import distributed
        from track_1_short.optim.adam import adam_update_

        pending = [
            (i, distributed.all_reduce_avg(p.grad, async_op=True))
            for i, p in enumerate(self.params)
            if p.grad is not None
        ]
        for i, handle in pending:
            handle.wait()
            p = self.params[i]
            adam_update_(p.data, p.grad, self.states[i], self.cfgs[i], self.scalars)
        for p in self.params:
            p.grad = None


class Fused:
    impl = "fused"

    def __init__(self, params, cfgs, states, device, block):
        from track_1_short.perf.replicated_adam import ReplicatedAdam

        self.opt = ReplicatedAdam(params, cfgs, states, device, impl=self.impl, block=block)

    def before_backward(self) -> None:
        self.opt.arm_reduce()

    def step(self) -> None:
        self.opt.launch_reduce()
        self.opt.update()
        self.opt.zero_grad()


class Device(Fused):
    impl = "device"


class TorchAdam:
    def __init__(self, params, cfgs, states, device, block):
        self.params, self.cfgs = params, cfgs
        groups = [
            {
                "params": [p],
                "lr": c.lr * c.lr_mul,
                "betas": tuple(c.adam_betas),
                "eps": c.eps,
                "weight_decay": 0.0,
            }
            for p, c in zip(params, cfgs)
        ]
        cuda = device.type == "cuda"
        self.opt = torch.optim.Adam(groups, fused=True if cuda else None, foreach=None if cuda else False)

    def before_backward(self) -> None:
        pass

    def step(self) -> None:
        from track_1_short import distributed

        pending = [
            distributed.all_reduce_avg(p.grad, async_op=True) for p in self.params if p.grad is not None
        ]
        for handle in pending:
            handle.wait()
        for group, cfg in zip(self.opt.param_groups, self.cfgs):
            group["lr"] = cfg.lr * cfg.lr_mul  # what a schedule does every step
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class BackwardOnly:
    """The baseline: the same backward, gradients dropped."""

    def __init__(self, params, cfgs, states, device, block):
        self.params = params

    def before_backward(self) -> None:
        pass

    def step(self) -> None:
        for p in self.params:
            p.grad = None


PATH_CLASSES = {"per_param": PerParam, "fused": Fused, "device": Device, "torch_adam": TorchAdam}


# ---- measuring ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(
    path, params, grads: Gradients, first: int, count: int, device, timed: bool = False
) -> list[float]:
    """``count`` steps from step index ``first``; per-step host seconds when ``timed``."""
    times = []
    for step in range(first, first + count):
        start = time.perf_counter()
        path.before_backward()
        grads.backward(params, step)
        path.step()
        if timed:
            times.append(time.perf_counter() - start)
    sync(device)
    return times


def _count_triton_launches(counter: list[int]) -> Callable[[], None]:
    """Wrap the kernel module's launch functions (called by attribute) to count and mark CPU launches."""
    from track_1_short.perf.kernels import replicated_adam as kernels

    originals = {}
    for name in ("launch_fused_adam", "launch_fused_adam_groups", "device_scalar_table_"):
        original = getattr(kernels, name)
        originals[name] = original

        def counted(*args, _original=original, **kwargs):
            counter[0] += 1
            with torch.profiler.record_function("triton_launch"):
                return _original(*args, **kwargs)

        setattr(kernels, name, counted)

    def restore() -> None:
        for name, original in originals.items():
            setattr(kernels, name, original)

    return restore


def _outermost(evt, names=("triton_launch",)) -> bool:
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") or parent.name in names:
            return False
        parent = parent.cpu_parent
    return True


def profile_counts(path, params, grads, first: int, count: int, device) -> dict:
    """Per-step launches, device kernels and device busy microseconds of ``count`` steps (profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    triton = [0]
    restore = _count_triton_launches(triton) if device.type == "cpu" else None
    try:
        with torch.profiler.profile(activities=activities) as prof:
            run_steps(path, params, grads, first, count, device)
    finally:
        if restore is not None:
            restore()
    events = prof.events()
    if device.type == "cuda":
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(1 for e in events if e.name.startswith(LAUNCH_CALLS))
        kernels = len(gpu)
        busy = sum(e.time_range.elapsed_us() for e in gpu)
        return {"launches": launches / count, "kernels": kernels / count, "device_us": busy / count}
    aten = sum(
        1 for e in events if e.name.startswith("aten::") and e.name not in NO_KERNEL_OPS and _outermost(e)
    )
    return {"launches": (aten + triton[0]) / count, "kernels": None, "device_us": None}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.element_size() == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def measure_set(name, spec, paths, device, steps, warmup, profile_steps, block) -> list[dict]:
    results, finals = {}, {}
    for path_name in ("backward_only", *paths):
        cls = BackwardOnly if path_name == "backward_only" else PATH_CLASSES[path_name]
        params, cfgs, states = build(spec, device)
        grads = Gradients(params)
        path = cls(params, cfgs, states, device, block)
        run_steps(path, params, grads, 0, warmup, device)
        times = run_steps(path, params, grads, warmup, steps, device, timed=True)
        counts = profile_counts(path, params, grads, warmup + steps, profile_steps, device)
        results[path_name] = {"host_us": statistics.median(times) * 1e6, **counts}
        finals[path_name] = (params, states)

    base = results["backward_only"]
    rows = []
    n_elements = sum(torch.Size(s[1]).numel() for s in spec)
    for path_name in paths:
        r = results[path_name]
        row = {
            "set": name,
            "tensors": len(spec),
            "elements": n_elements,
            "dtypes": len({s[2] for s in spec}),
            "path": path_name,
            "host_us": r["host_us"] - base["host_us"],
            "device_us": None if r["device_us"] is None else r["device_us"] - base["device_us"],
            "launches": r["launches"] - base["launches"],
            "kernels": None if r["kernels"] is None else r["kernels"] - base["kernels"],
        }
        rows.append(row)
    for row in rows:
        for column, against in (("speedup", "per_param"), ("vs_fused", "fused")):
            other = results.get(against)
            ratio_ok = other is not None and row["host_us"] > 0
            row[column] = (other["host_us"] - base["host_us"]) / row["host_us"] if ratio_ok else None
        if row["path"] == "torch_adam" or "per_param" not in finals:
            row["bitwise"] = None
            continue
        ref_params, ref_states = finals["per_param"]
        params, states = finals[row["path"]]
        row["bitwise"] = all(
            same_bits(p, q)
            and same_bits(s["exp_avg"], t["exp_avg"])
            and same_bits(s["exp_avg_sq"], t["exp_avg_sq"])
            for p, q, s, t in zip(params, ref_params, states, ref_states)
        )
    return rows


def print_table(rows: list[dict]) -> None:
    def fmt(value, spec):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return f"{'-':>{width}}" if value is None else format(value, spec)

    print(
        f"{'set':<10}{'path':<12}{'host us':>11}{'device us':>11}{'launches':>10}{'kernels':>9}"
        f"{'speedup':>9}{'vs fused':>9}  bitwise"
    )
    for r in rows:
        print(
            f"{r['set']:<10}{r['path']:<12}{fmt(r['host_us'], '11.1f')}{fmt(r['device_us'], '11.1f')}"
            f"{fmt(r['launches'], '10.1f')}{fmt(r['kernels'], '9.1f')}{fmt(r['speedup'], '9.2f')}"
            f"{fmt(r['vs_fused'], '9.2f')}  "
            f"{'-' if r['bitwise'] is None else r['bitwise']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {SETS}")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {PATHS}")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed Adam steps (default: 100 on cuda, 3 on cpu)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default: 5 on cuda, 1 on cpu)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=None, help="steps under the profiler (default 5 / 1)"
    )
    parser.add_argument(
        "--block", type=int, default=None, help="kernel block (default: 1024 cuda, 65536 cpu)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Triton's interpreter is chosen when a kernel is decorated: before the kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from track_1_short import distributed
    from track_1_short.perf.bench_meta import bench_metadata, write_bench_json

    device = (
        distributed.init(device.type)
        if device.type == "cuda" or distributed.launched_by_torchrun()
        else device
    )
    cuda = device.type == "cuda"
    sets = [s for s in args.sets.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    for s in sets:
        if s not in SETS:
            parser.error(f"--sets: unknown set {s!r}; choose from {SETS}")
    for p in paths:
        if p not in PATHS:
            parser.error(f"--paths: unknown path {p!r}; choose from {PATHS}")
    steps = args.steps or (100 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    profile_steps = args.profile_steps or (5 if cuda else 1)
    block = args.block or (1024 if cuda else 65536)

    rows = []
    for name in sets:
        spec = RECORD if name == "record" else synthetic_set()
        rows += measure_set(name, spec, paths, device, steps, warmup, profile_steps, block)
    if distributed.is_main():
        print(
            f"{device}, world size {distributed.world_size()}, {steps} timed steps after {warmup}; "
            f"block {block}"
        )
        print_table(rows)
        if args.out:
            payload = {
                **bench_metadata(
                    sys.argv if argv is None else ["perf/bench_replicated_adam.py", *argv], device
                ),
                "title": "Replicated Adam per Adam step",
                "world_size": distributed.world_size(),
                "steps": steps,
                "rows": rows,
                "notes": [
                    "host_us, device_us, launches, kernels: per Adam step, the backward excluded "
                    "(measured alone in the same run and subtracted).",
                    "At world size 1 the collectives are no-ops; torchrun with several processes includes "
                    "them.",
                    "bitwise: parameters and moments after warmup + timed + profiled steps equal the "
                    "per_param path's bit for bit.",
                ],
            }
            write_bench_json(args.out, payload)
            print(f"wrote {args.out}")
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
