"""Where a run's data lives: the FineWeb shards on disk, or the embedded corpus (built on first use).

Apart from the loaders (data.py) because the embedded corpus (synthetic.py) writes its shards with them:
this module imports both, and neither imports it.
"""

from __future__ import annotations

from pathlib import Path

from track_1_short import data, synthetic


def run_paths(cfg: data.DataConfig) -> dict[str, str | Path | None]:
    """The run's data files: {"train": train glob, "val": val shard, "sidecar": synthetic JSON or None}.

    For kind "synthetic" this builds the corpus first (once; later runs reuse it). Raises MissingDataError,
    naming the download command, when the train or val shards are not there.
    """
    sidecar = None
    if cfg.kind == "synthetic":
        root = synthetic.ensure_corpus(cfg, cfg.dir)
        sidecar = root / synthetic.SIDECAR_NAME
    else:
        root = Path(cfg.dir).expanduser()
        if not root.is_dir():
            raise data.MissingDataError(
                f"the data directory {root} (data.dir) does not exist. Download FineWeb into it: "
                f"{data.download_command(root)}"
            )
    train = str(root / cfg.train_pattern)
    data.find_shards(train)
    vals = data.find_shards(root / cfg.val_pattern)
    if len(vals) != 1:
        raise data.MissingDataError(
            f"data.val_pattern={cfg.val_pattern!r} matches {len(vals)} files in {root}: it must name exactly "
            "one val shard."
        )
    return {"train": train, "val": vals[0], "sidecar": sidecar}
