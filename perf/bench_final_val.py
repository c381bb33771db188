"""The canonical mask's cost at the final validation: the mask's load or build, and the masked pass against
the unmasked one, at a preset's model, validation batch and validation tokens.

    python perf/bench_final_val.py --out perf/results/final_val.json                  # record_1gpu, CUDA
    python perf/bench_final_val.py --preset smoke_record --out /tmp/final_val.json    # a CPU check

Only the FineWeb presets run the mask (a run refuses it on the synthetic corpus, whose ids have no BPE
structure), but what it costs does not depend on which ids the batches hold. So this builds the preset's
trainer on its own corpus with the weights at init, loads the mask exactly as a run does
(endgame.load_canonical_mask: from the cache under --mask-dir, else built and written there), and times the
trainer's own ``validate()`` and ``validate(masked=True)``, the two passes the final validation makes
(endgame.final_validation), alternately, ``--repeats`` times each. Validation runs the model eagerly
(trainer.py), so no pass compiles.

Rows, one per pass: ``s`` (median seconds), ``s_min``, ``s_max``, ``tokens`` (the preset's val_tokens) and
``tokens_per_s``; the masked row's ``extra_s`` is its median minus the unmasked one's. ``mask_load_s`` and
``mask_built`` say what the mask cost before the run's clock starts (a build happens once per vocabulary and
cache directory; pass an empty --mask-dir to time one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from track_1_short import distributed, endgame
from track_1_short.config import to_object
from track_1_short.model import canonical_mask
from track_1_short.trainer import Trainer, select_device

# perf/ is not a package: its helpers are imported from its directory (also when a test loads this
# file by path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import compose_train  # noqa: E402
from bench_meta import bench_metadata, write_bench_json  # noqa: E402


def build_trainer(preset: str, runs_root: str, overrides: list[str]) -> Trainer:
    from omegaconf import OmegaConf

    cfg = compose_train([f"experiment={preset}", f"runs_root={runs_root}", "run_name=final_val", *overrides])
    tcfg = to_object(cfg)
    device = distributed.init(select_device(tcfg))
    return Trainer(tcfg, OmegaConf.to_container(cfg, resolve=True), device)


def timed(trainer: Trainer, masked: bool) -> tuple[float, float]:
    """(seconds, loss) of one validation pass: validate() returns a float, so the device is idle after it."""
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    t = time.perf_counter()
    loss = trainer.validate(masked=masked)
    return time.perf_counter() - t, loss


def run(args) -> dict:
    trainer = build_trainer(
        args.preset, args.runs_root or tempfile.mkdtemp(prefix="bench_final_val_"), args.overrides
    )
    trainer.cfg.canonical_mask_dir = args.mask_dir
    built = not canonical_mask.cache_path(args.mask_dir, trainer.model.topo.vocab_padded).is_file()
    t = time.perf_counter()
    trainer.canonical_mask = endgame.load_canonical_mask(trainer)
    mask_s = time.perf_counter() - t
    timed(trainer, False)  # the first pass pays for the loader's and the kernels' first use
    times: dict[bool, list[float]] = {False: [], True: []}
    losses = {}
    for _ in range(args.repeats):
        for masked in (False, True):
            s, losses[masked] = timed(trainer, masked)
            times[masked].append(s)
    tokens = trainer.cfg.data.val_tokens
    rows = []
    for masked in (False, True):
        s = statistics.median(times[masked])
        rows.append(
            {
                "pass": "masked" if masked else "unmasked",
                "s": s,
                "s_min": min(times[masked]),
                "s_max": max(times[masked]),
                "tokens": tokens,
                "tokens_per_s": tokens / s,
                "extra_s": s - statistics.median(times[False]) if masked else None,
                "val_loss": losses[masked],
            }
        )
    return {
        **bench_metadata(sys.argv, trainer.device),
        "title": f"Final validation with the canonical mask ({args.preset})",
        "rows": rows,
        "mask_load_s": mask_s,
        "mask_built": built,
        "notes": [
            f"{args.preset}'s model at init on its own corpus: the losses are not a model's, the times are "
            "the passes' (they do not depend on which ids the batches hold).",
            f"median of {args.repeats} passes each, alternating; a first unmasked pass untimed.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--preset", default="record_1gpu", help="configs/experiment/<preset>.yaml")
    p.add_argument("--mask-dir", default=".cache/canonical_mask", help="the mask's cache (a run's default)")
    p.add_argument(
        "--runs-root", default=None, help="where the trainer's run dir goes (default: a new temp dir)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the preset")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    payload = run(args)
    path = write_bench_json(args.out, payload)
    for r in payload["rows"]:
        print(f"{r['pass']:>9}: {r['s']:.3f} s ({r['tokens_per_s']:,.0f} tokens/s)")
    how = "built" if payload["mask_built"] else "loaded"
    print(f"mask: {payload['mask_load_s']:.2f} s ({how}); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
