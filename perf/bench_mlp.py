"""The ReLU^2 MLP at the record's micro-batch: ms per forward + backward for each ``model.mlp_impl`` and
``model.fp8.mlp_impl``.

    python perf/bench_mlp.py --out perf/results/mlp.json                                  # CUDA, the record's
    python perf/bench_mlp.py --device cpu --tokens 304 --dim 144 --hidden 528 --out /tmp/mlp.json   # CPU

Times the model's MLP on x [T, D] and one bank slot's c_fc, c_proj [hidden, D] in bf16, compiled as the
trainer compiles the model (``torch.compile``, dynamic=False; on the CPU eager, where the Triton kernels run
interpreted): ``reference`` is model/layers.py relu2_mlp, whose activation and its gradient Inductor runs as
pointwise kernels between cuBLAS GEMMs; ``triton`` is model/mlp.py's custom ops on
track_1_short/perf/kernels/relu2_mlp.py; ``fp8_scaled_mm`` and ``fp8_triton`` are model/fp8.py's FP8 MLP
with ``model.fp8.mlp_impl`` set so (training only: their rows are ``train``; on the CPU emulated). Rows,
one per impl and pass:

- ``pass``: ``train`` (forward + backward, the trainer's micro batch), ``forward`` (the evaluation forward,
  no gradient), ``up`` (the up-projection alone: the epilogue GEMM against cuBLAS's ``x @ c_fc.T``) and
  ``up_grad`` (the backward's epilogue GEMM against cuBLAS's ``g @ c_proj.T``): where the GEMM's own rate
  shows, without the rest of the MLP;
- ``ms``: mean over ``--steps`` calls after ``--warmup`` (CUDA events on the GPU, perf_counter on the CPU);
  ``ms_floor``: the pass's GEMM FLOPs (train: 12 T D hidden; forward: 4; up, up_grad: 2) at the bf16 matmul
  rate measured in the same run; ``vs_reference``: the reference row's ``ms`` over this row's;
- ``out_rel_diff``, ``grad_x_rel_diff``, ``grad_c_fc_rel_diff``, ``grad_c_proj_rel_diff`` (train rows): the
  relative norm of the difference from the reference, what tests/perf/test_relu2_mlp.py bounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from track_1_short.model.config import FP8Config
from track_1_short.model.fp8 import FP8State
from track_1_short.model.layers import relu2_mlp
from track_1_short.model.mlp import fused_relu2_mlp

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this file by
# path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import bench_metadata, write_bench_json  # noqa: E402
from bench_timing import matmul_tflops, time_ms  # noqa: E402

MLP = {"reference": relu2_mlp, "triton": fused_relu2_mlp}
FP8_IMPLS = {"fp8_scaled_mm": "scaled_mm", "fp8_triton": "triton"}  # -> model.fp8.mlp_impl
IMPLS = [*MLP, *FP8_IMPLS]
GEMM_FLOPS = {"train": 12, "forward": 4, "up": 2, "up_grad": 2}  # times T D hidden


def _up_passes(impl: str, x, w1, w2, grad):
    """The up-projection's two GEMMs alone: the fused kernels, or cuBLAS's products they replace."""
    if impl == "triton":
        from track_1_short.perf.kernels.relu2_mlp import relu2_up, relu2_up_grad

        pre = relu2_up(x, w1)[0]
        return {"up": lambda: relu2_up(x, w1), "up_grad": lambda: relu2_up_grad(grad, w2, pre)}
    return {"up": lambda: x @ w1.T, "up_grad": lambda: grad @ w2.T}


def run(args) -> dict:
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    t, d, h = args.tokens, args.dim, args.hidden

    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    x, grad = bf16(t, d), bf16(t, d)
    w1, w2 = bf16(h, d, scale=d**-0.5), bf16(h, d, scale=0.02)
    on_gpu = device.type == "cuda"
    tflops = matmul_tflops(device, 8192 if on_gpu else 512)
    timed = {}
    for impl in args.impls:
        if impl in FP8_IMPLS:
            st = FP8State(FP8Config(mlp=True, mlp_impl=FP8_IMPLS[impl]))
            st.refresh(torch.stack((w1, w2))[None], None, None)
            mlp = lambda x, w1, w2, st=st: st.mlp_forward(x, 0, w1, w2)  # noqa: E731
        else:
            mlp = MLP[impl]
        fn = torch.compile(mlp, dynamic=False) if on_gpu else mlp
        leaves = [v.clone().requires_grad_() for v in (x, w1, w2)]

        def train(fn=fn, leaves=leaves):
            for v in leaves:
                v.grad = None
            fn(*leaves).backward(grad)

        def forward(fn=fn):
            with torch.no_grad():
                fn(x, w1, w2)

        passes = {"train": train}
        if impl in MLP:
            passes.update(forward=forward, **_up_passes(impl, x, w1, w2, grad))
        for name, call in passes.items():
            timed[(impl, name)] = time_ms(call, device, args.steps, args.warmup)
        train()  # the gradients the rel diffs compare
        out = fn(*(v.detach() for v in leaves))
        timed[(impl, "result")] = [out.detach().float(), *(v.grad.float() for v in leaves)]
        torch._dynamo.reset()

    rows = []
    for impl in args.impls:
        for name in GEMM_FLOPS:
            if (impl, name) not in timed:
                continue
            ms = timed[(impl, name)]
            row = {
                "impl": impl,
                "pass": name,
                "tokens": t,
                "ms": ms,
                "ms_floor": GEMM_FLOPS[name] * t * d * h / (tflops * 1e12) * 1e3,
            }
            if ("reference", name) in timed:
                row["vs_reference"] = timed[("reference", name)] / ms
            if name == "train" and ("reference", "result") in timed:
                names = ("out", "grad_x", "grad_c_fc", "grad_c_proj")
                for key, a, b in zip(names, timed[(impl, "result")], timed[("reference", "result")]):
                    row[f"{key}_rel_diff"] = ((a - b).norm() / b.norm()).item()
            rows.append(row)
    return {
        **bench_metadata(sys.argv, device),
        "title": "ReLU² MLP, forward + backward, per model.mlp_impl",
        "matmul_tflops_measured": tflops,
        "dim": d,
        "hidden": h,
        "rows": rows,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=65536, help="rows T (the record preset's micro-batch)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2816, help="model.mlp_hidden")
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    payload = run(args)
    write_bench_json(args.out, payload)
    for row in payload["rows"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
