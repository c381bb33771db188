"""Compare two checkpoints entry by entry: bitwise, or by how far apart where they are not.

    python tools/compare_checkpoints.py A B [--atol X] [--json out.json]

A and B are checkpoint files or directories (a run directory, its ``checkpoints/``, or any directory whose
``latest`` names one; ``checkpoint.final=true`` makes a run write one after its last step). Compared: the
step, every model parameter by label, the model's buffers (rotary state, the embedding-split flag), the
optimizer's state_dict (moments, master weights, step counts) and the loader's position. Not compared:
``meta`` (it holds the config, which two runs being compared differ in) and the generator states. Tensors
are compared as bits (so -0.0 vs 0.0 and NaN payloads count as differences); with ``--atol`` a floating
tensor also passes when no element differs by more than X.

Exit status: 0 when every compared entry matches, 1 when one does not (each listed with its largest
absolute and relative difference), 2 for bad input (a missing or unreadable checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from track_1_short import checkpoint

COMPARED = ("step", "model", "buffers", "optimizer", "loader")
SHOWN = 20  # differing entries listed in full; the rest are counted


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every non-container value of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from leaves(tree[k], f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare_leaf(a: Any, b: Any, atol: float) -> dict | None:
    """None when ``a`` matches ``b``; else what differs."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return {"why": f"a {type(a).__name__} against a {type(b).__name__}"}
    if not isinstance(a, torch.Tensor):
        return None if a == b else {"why": f"{a!r} != {b!r}"}
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"why": f"{a.dtype} {list(a.shape)} against {b.dtype} {list(b.shape)}"}
    if a.numel() == 0 or torch.equal(_bits(a), _bits(b)):
        return None
    # Per element: do its bytes differ (-0.0 vs 0.0 does, though the values compare equal).
    differing = (_bits(a) != _bits(b)).reshape(a.numel(), -1).any(dim=1)
    why = f"{int(differing.sum())} of {a.numel()} elements differ"
    if not a.is_floating_point():
        return {"why": why}
    diff = (a.double() - b.double()).abs()
    worst = float(diff.nan_to_num(nan=float("inf")).max())
    scale = float(b.double().abs().max())
    if atol > 0 and worst <= atol:
        return None
    return {
        "why": why,
        "max_abs": worst,
        "max_rel": worst / scale if scale > 0 else 0.0 if worst == 0 else float("inf"),
    }


def compare(a: dict, b: dict, atol: float = 0.0) -> tuple[int, list[dict]]:
    """(entries compared, the differing ones) over the COMPARED parts of two checkpoint payloads."""
    flat_a = {p: v for key in COMPARED for p, v in leaves(a.get(key), key)}
    flat_b = {p: v for key in COMPARED for p, v in leaves(b.get(key), key)}
    diffs = [{"entry": p, "why": "only in A"} for p in flat_a.keys() - flat_b.keys()]
    diffs += [{"entry": p, "why": "only in B"} for p in flat_b.keys() - flat_a.keys()]
    for p in sorted(flat_a.keys() & flat_b.keys()):
        d = compare_leaf(flat_a[p], flat_b[p], atol)
        if d is not None:
            diffs.append({"entry": p, **d})
    return len(flat_a.keys() | flat_b.keys()), sorted(diffs, key=lambda d: d["entry"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="a checkpoint file or directory")
    p.add_argument("b", help="the checkpoint to compare it with")
    p.add_argument("--atol", type=float, default=0.0, help="largest absolute difference let pass (0 = bits)")
    p.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = p.parse_args(argv)
    if args.atol < 0:
        p.error(f"--atol {args.atol}: a tolerance is >= 0.")
    try:
        files = [checkpoint.resolve(args.a), checkpoint.resolve(args.b)]
        payloads = [checkpoint.load(f) for f in files]
    except checkpoint.CheckpointError as e:
        print(f"compare_checkpoints: {e}", file=sys.stderr)
        return 2
    n, diffs = compare(*payloads, atol=args.atol)
    how = "bitwise" if args.atol == 0 else f"within {args.atol:g}"
    print(f"A: {files[0]}\nB: {files[1]}")
    for d in diffs[:SHOWN]:
        extra = f" (max abs {d['max_abs']:.3e}, max rel {d['max_rel']:.3e})" if "max_abs" in d else ""
        print(f"  differs: {d['entry']}: {d['why']}{extra}")
    if len(diffs) > SHOWN:
        print(f"  ... and {len(diffs) - SHOWN} more")
    verdict = f"{n} entries compared: " + (
        f"all equal {how}" if not diffs else f"{len(diffs)} differ (compared {how})"
    )
    print(verdict)
    if args.json is not None:
        record = {"a": str(files[0]), "b": str(files[1]), "atol": args.atol, "entries": n, "differ": diffs}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
