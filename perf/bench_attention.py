"""The attention kernel at the record's shapes: FlexAttention (model.attention_impl=flex, the CUDA path)
against FlashAttention-4 (``flash_attn.cute``, the flash-attn-4 wheel) when it imports. CUDA only.

    python perf/bench_attention.py --out perf/results/attention.json            # stage 2 of record_1gpu
    python perf/bench_attention.py --windows 1 3 --max-doc-len 896 --out /tmp/attention_stage0.json

One micro batch of ``--tokens`` tokens packed with documents (lengths drawn once from an exponential of mean
``--doc-mean``, cut at ``--max-doc-len``, fixed seed). One case per distinct attention layer shape of the
track-1 model (ModelConfig defaults): query/key width (64 on short-window layers, 128 on long ones), value
width (64 on half-V layers), paired heads (H/2 heads over a 2T stream, documents doubled) and the window the
layer's kind gets (``--windows`` short long, in blocks of 128 tokens: stage 2's 5 and 11 by default). Inputs
are bf16 [S, h, d] with q already scaled, as model/attention.py calls them.

Rows, one per (case, candidate):
- ``fwd_ms`` and ``fwd_bwd_ms``: mean over ``--steps`` after ``--warmup`` (CUDA events); the FlexAttention
  row times the whole of flex_attention_varlen (block mask and kernel) compiled once per case, as the
  trainer's compiled model runs it; flash-attn-4 needs no mask;
- ``vs_flex``: the flex row's fwd_bwd_ms over this row's;
- ``out_rel_diff``, ``dq_rel_diff``: this candidate against flex (relative norm of the difference); the
  masks are the same (same document, causal, at most ``window`` tokens back).
A candidate that does not import, or fails on a case, is a row with ``error`` (its exception) and no timings,
so the JSON says why it is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from track_1_short.model.attention import flex_attention_varlen
from track_1_short.model.config import ModelConfig, Topology

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import bench_metadata, write_bench_json  # noqa: E402
from bench_timing import time_ms  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--tokens", type=int, default=65536, help="tokens in the micro batch (record_1gpu: 65536)")
    p.add_argument("--windows", type=int, nargs=2, default=[5, 11], metavar=("SHORT", "LONG"),
                   help="windows in blocks of 128 tokens (stage 2: 5 11)")  # fmt: skip
    p.add_argument("--max-doc-len", type=int, default=3072, help="documents are cut at this many tokens")
    p.add_argument("--doc-mean", type=float, default=1000.0, help="mean document length before the cut")
    p.add_argument("--candidates", nargs="+", default=["flex", "flash_attn_4"],
                   choices=["flex", "flash_attn_4"])  # fmt: skip
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokens <= 0 or min(args.windows) < 1 or args.max_doc_len < 1 or args.doc_mean <= 0:
        p.error("--tokens, --windows, --max-doc-len and --doc-mean must be positive")
    if "flex" not in args.candidates:
        p.error("--candidates must include flex: every row is compared with it")
    return args


def doc_lengths(tokens: int, mean: float, cap: int, seed: int) -> list[int]:
    """Document lengths summing to ``tokens``: exponential of ``mean``, at least 1, cut at ``cap``."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < tokens:
        n = int(torch.empty(1).exponential_(1.0 / mean, generator=g).item()) + 1
        n = min(n, cap, tokens - total)
        lengths.append(n)
        total += n
    return lengths


def cases(windows: list[int]) -> list[dict]:
    """One entry per distinct attention layer shape of the track-1 model, with the layers that have it."""
    cfg = ModelConfig()
    out: dict[tuple, dict] = {}
    for layer, spec in sorted(Topology.of(cfg).specs.items()):
        long = layer in cfg.long_window_layers
        key = (spec.qk_dim, spec.v_dim, spec.paired, long)
        entry = out.setdefault(key, {
            "qk_dim": spec.qk_dim, "v_dim": spec.v_dim, "paired": spec.paired,
            "window_tokens": windows[1 if long else 0] * cfg.block_size,
            "heads": spec.num_heads // 2 if spec.paired else spec.num_heads, "layers": [],
        })  # fmt: skip
        entry["layers"].append(layer)
    return list(out.values())


def _flash_attn_4():
    """flash-attn-4's varlen function, or the reason it is unavailable."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # an ImportError, or a CuTeDSL set-up failure at import
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_varlen_func, None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _inputs(case: dict, lengths: list[int], tokens: int, seed: int, device) -> dict:
    """One case's bf16 q, k, v, output gradient and document layout (a paired layer: the 2T stream)."""
    factor = 2 if case["paired"] else 1
    s, h, dq, dv = tokens * factor, case["heads"], case["qk_dim"], case["v_dim"]
    per_doc = torch.tensor(lengths) * factor
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return {
        "q": (torch.randn(s, h, dq, device=device, generator=g) * dq**-0.5).bfloat16(),
        "k": torch.randn(s, h, dq, device=device, generator=g).bfloat16(),
        "v": torch.randn(s, h, dv, device=device, generator=g).bfloat16(),
        "dout": torch.randn(s, h, dv, device=device, generator=g).bfloat16(),
        "doc_ids": torch.repeat_interleave(torch.arange(len(lengths)), per_doc).to(device, torch.int32),
        "cu": torch.cat([torch.zeros(1, dtype=torch.long), per_doc.cumsum(0)]).to(device, torch.int32),
        "max_len": int(per_doc.max()),
        "window": case["window_tokens"],
    }


def _flex(x: dict, block: int):
    """flex_attention_varlen (block mask and kernel) compiled as one graph, as the trainer's model runs it."""
    doc_ids, window = x["doc_ids"], x["window"]

    def call(q, k, v):
        return flex_attention_varlen(q, k, v, doc_ids, window, block)

    return torch.compile(call, dynamic=False)


def _fa4(x: dict, fa4):
    cu, max_len, window = x["cu"], x["max_len"], x["window"]

    def call(q, k, v):
        # window_size (left, right): keys up to ``window`` tokens back, none ahead: the model's mask
        out = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                  softmax_scale=1.0, causal=True, window_size=(window, 0))  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    return call


def _measure(fn, x: dict, device, steps: int, warmup: int) -> tuple[dict, tuple]:
    """fwd_ms and fwd_bwd_ms of ``fn``, and its (output, dq) for the comparison."""
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        fn(qg, kg, vg).backward(dout)

    out = fn(qg, kg, vg)
    out.backward(dout)
    result = (out.detach(), qg.grad.detach().clone())
    qg.grad = kg.grad = vg.grad = None
    fwd_ms = time_ms(fwd, device, steps, warmup)
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": time_ms(fwd_bwd, device, steps, warmup)}, result


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention runs on CUDA only (compiled FlexAttention, flash-attn-4).")
    device = torch.device("cuda")
    block = ModelConfig().block_size
    lengths = doc_lengths(args.tokens, args.doc_mean, args.max_doc_len, args.seed)
    fa4, fa4_error = _flash_attn_4() if "flash_attn_4" in args.candidates else (None, None)
    rows = []
    for case in cases(args.windows):
        x = _inputs(case, lengths, args.tokens, args.seed, device)
        base = {**case, "seq": x["q"].size(0), "documents": len(lengths)}
        ref = None
        for name in args.candidates:  # flex first (parse_args keeps it in), the reference of the others
            row = {**base, "candidate": name}
            if name == "flash_attn_4" and fa4 is None:
                rows.append({**row, "error": fa4_error})
                continue
            try:
                fn = _flex(x, block) if name == "flex" else _fa4(x, fa4)
                times, result = _measure(fn, x, device, args.steps, args.warmup)
            except Exception as e:  # a candidate that cannot run this case: its reason goes in the JSON
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            row.update(times)
            if name == "flex":
                ref = (result, times["fwd_bwd_ms"])
            if ref is not None:
                row["vs_flex"] = ref[1] / times["fwd_bwd_ms"]
                row["out_rel_diff"] = _rel(result[0], ref[0][0])
                row["dq_rel_diff"] = _rel(result[1], ref[0][1])
            rows.append(row)
    mean = args.tokens / len(lengths)
    notes = [f"documents: {len(lengths)} (mean {mean:.0f} tokens, cut at {args.max_doc_len})"]
    if fa4_error:
        notes.append(f"flash_attn_4 unavailable: {fa4_error}")
    title = (
        f"FlexAttention against flash-attn-4 at the record's attention shapes, windows {args.windows} blocks"
    )
    return {**bench_metadata(sys.argv, device), "title": title, "rows": rows, "notes": notes,
            "tokens": args.tokens, "windows_blocks": list(args.windows)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    payload = run(args)
    path = write_bench_json(args.out, payload)
    for r in payload["rows"]:
        what = f"{r['candidate']:>13} qk{r['qk_dim']} v{r['v_dim']} {'paired' if r['paired'] else 'single'}"
        what += f" window {r['window_tokens']}"
        if "error" in r:
            print(f"{what}: {r['error'][:200]}")
        else:
            print(f"{what}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
