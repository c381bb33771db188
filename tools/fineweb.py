"""Download the GPT-2-tokenised FineWeb 10B shards and check them.

    python tools/fineweb.py --shards N --dir DIR

fetches ``fineweb_val_000000.bin`` and ``fineweb_train_000001.bin`` .. ``fineweb_train_<N>.bin`` (10^8 tokens,
~200 MB each) from the Hugging Face dataset repo ``kjj0/fineweb10B-gpt2`` (the files of the upstream
``data/cached_fineweb10B.py``; 103 train shards in all; the record run reads the first 4) into DIR (default
``data/fineweb10B``, as upstream). A file already in DIR that passes the shard checks is skipped without
touching the network, so rerunning after an interruption fetches only what is missing (the hub client also
resumes a partly downloaded file). Every file is checked after download (header magic and version, token count
against the file size, token ids below the GPT-2 vocabulary); a file that fails is deleted and reported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from track_1_short.data import GPT2_VOCAB_SIZE, USER_ERRORS, read_shard

REPO_ID = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS_AVAILABLE = 103  # fineweb_train_000001..000103 in the repo (10.3B tokens)
DEFAULT_DIR = "data/fineweb10B"


def shard_names(n_train: int) -> list[str]:
    """The val shard, then train shards 1..n_train."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def fetch(name: str, out_dir: Path, revision: str) -> None:
    """Download one file of the dataset repo into out_dir (the only network call)."""
    from huggingface_hub import hf_hub_download

    hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", revision=revision, local_dir=out_dir)


def shard_problem(path: Path, vocab_size: int = GPT2_VOCAB_SIZE) -> str | None:
    """Why ``path`` is not a usable shard (the reader's message), or None if it is one."""
    try:
        read_shard(path, vocab_size)
    except USER_ERRORS as e:
        return str(e)
    return None


def download(
    n_train: int,
    out_dir: str | Path,
    *,
    revision: str = "main",
    fetcher: Callable[[str, Path, str], None] | None = None,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Make ``out_dir`` hold valid copies of the val shard and train shards 1..n_train; returns their paths.

    ``fetcher(name, out_dir, revision)`` downloads one file (default: :func:`fetch`, the hub).
    Valid files already there are kept; invalid ones are deleted and fetched again. Raises RuntimeError naming
    every file that could not be fetched or failed its check after fetching (those files are deleted).
    """
    if not 0 <= n_train <= TRAIN_SHARDS_AVAILABLE:
        raise ValueError(
            f"--shards {n_train}: the repo has train shards 1..{TRAIN_SHARDS_AVAILABLE}; pick 0 to 103."
        )
    fetcher = fetcher or fetch
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, failures = [], []
    for name in shard_names(n_train):
        path = out_dir / name
        paths.append(path)
        if path.exists():
            problem = shard_problem(path)
            if problem is None:
                log(f"ok       {path} (already there)")
                continue
            log(f"refetch  {path}: {problem}")
            path.unlink()
        log(f"fetch    {name}")
        try:
            fetcher(name, out_dir, revision)
        except Exception as e:  # noqa: BLE001 - reported per file; the other files still get fetched
            failures.append(f"{name}: download failed: {type(e).__name__}: {e}")
            continue
        problem = shard_problem(path)
        if problem is not None:
            path.unlink(missing_ok=True)
            failures.append(f"{name}: fetched but invalid (deleted): {problem}")
            continue
        log(f"ok       {path}")
    if failures:
        raise RuntimeError(
            f"{len(failures)} of {len(paths)} file(s) are missing from {out_dir}:\n  "
            + "\n  ".join(failures)
            + f"\nRerun `python tools/fineweb.py --shards {n_train} --dir {out_dir}` to fetch only those."
        )
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/fineweb.py",
        description=f"Download GPT-2-tokenised FineWeb 10B shards from the dataset repo {REPO_ID} and check "
        "them.",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=9,
        help="train shards to fetch, 10^8 tokens each (default %(default)s; the "
        "record run reads 4; 0 fetches only the val shard)",
    )
    parser.add_argument(
        "--dir", default=DEFAULT_DIR, help="where the shards go (data.dir); default %(default)s"
    )
    parser.add_argument("--revision", default="main", help="dataset repo revision (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        paths = download(args.shards, args.dir, revision=args.revision)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{len(paths)} shard(s) ready in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
