"""Checks before step 0: every file the run will read, the checkpoint it resumes, the directory it writes.

A run that fails after hours on a file it could have checked at the start wastes the hours; a refused start
that leaves a directory behind litters ``runs/``. So :func:`prepare` runs in the trainer's build, after the
data paths are known and before the model, the optimizer or the run directory exist, and raises one user
error naming the file and the fix:

- shards: every train shard's and the val shard's header and size (data.read_shard: magic, version, declared
  token count against the file size; the tokens themselves are read later, when a shard is opened), and that
  the val shard holds the ``data.val_tokens`` + 1 tokens validation reads;
- the checkpoint, when resuming: it resolves and loads (memory-mapped, so this costs little), and the
  settings that cannot change on resume (``seed``, ``schedule``, ``model``) equal the ones it was written
  with; each one that differs is named;
- the run directory. A fresh run never writes into a directory that already holds a run (its log would mix
  two runs, and the record gate would read the newer one). ``resume=`` continues in the run's own directory
  (the one that holds the checkpoint's ``checkpoints/``) and appends to its logs, so the directory still holds
  one run; with a ``run_name`` of another, unused directory, the resumed run starts there instead (a branch).
  A finished run is not continued: it has nothing left to train.

Only rank 0 touches the files; its outcome (the plan, or the error) is broadcast so that every rank raises
the same error instead of waiting in a collective.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from track_1_short import checkpoint, data, distributed, resume
from track_1_short.checkpoint import CheckpointError
from track_1_short.model.config import saved_model_config
from track_1_short.run_log import checkpoint_owner, holds_run


class RunDirError(ValueError):
    """The run directory cannot be used: it holds another run, or it cannot be written."""


@dataclass
class RunPlan:
    run_dir: Path
    continuing: bool  # resume into an existing run directory: append to its logs, keep its config.yaml
    checkpoint: Path | None  # the resolved checkpoint file when resuming


def _finished(run_dir: Path) -> bool:
    events = run_dir / "events.jsonl"
    if not events.is_file():
        return False
    from track_1_short import run_log

    try:
        return run_log.is_finished(run_dir)
    except ValueError:  # a line cut off by a kill: not a finished run
        return False


# -- shards ------------------------------------------------------------------------------------------------
def check_shards(paths: dict, cfg) -> None:
    """Header and size of every train shard and of the val shard; the val shard holds enough tokens."""
    for path in data.find_shards(paths["train"]):
        data.read_shard(path)
    val = Path(paths["val"])
    tokens = data.read_shard(val)
    if tokens.size < cfg.data.val_tokens + 1:
        raise data.ShardError(
            f"{val} holds {tokens.size} tokens; validating data.val_tokens={cfg.data.val_tokens} needs "
            f"{cfg.data.val_tokens + 1} (the last target). Lower data.val_tokens or use a larger val shard."
        )


# -- the checkpoint ----------------------------------------------------------------------------------------
def _container(node) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(node))


def _differs(saved: dict, current: dict) -> list[str]:
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def check_checkpoint(cfg, total_steps: int) -> tuple[Path, dict]:
    """Resolve and load ``cfg.resume``; refuse settings that differ from the run it was written by."""
    file = checkpoint.resolve(cfg.resume)
    payload = checkpoint.load(file, mmap=True)
    meta = payload.get("meta")
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"resume={cfg.resume}: {file} has no 'meta' entry; it is not a checkpoint of a run."
        )
    differ = []
    if "seed" in meta and meta["seed"] != cfg.seed:
        differ.append(f"seed (the run has {meta['seed']}, this command {cfg.seed})")
    if "schedule" in meta:
        fields = _differs(meta["schedule"], _container(cfg.schedule))
        if fields:
            differ.append(f"schedule (fields {fields})")
    elif meta.get("total_steps") not in (None, total_steps):
        differ.append(f"schedule ({meta['total_steps']} steps in the run, {total_steps} here)")
    if "model" in meta:
        fields = _differs(saved_model_config(meta["model"]), _container(cfg.model))
        if fields:
            differ.append(f"model (fields {fields})")
    if differ:
        raise CheckpointError(
            f"resume={cfg.resume}: these settings cannot change on resume, and differ from the run that "
            f"wrote {file}: {'; '.join(differ)}. The resumed run restores the model, its generators and its "
            "step, so they would have no effect. From the command line, resume=<run dir> alone continues the "
            "run with the settings in its config.yaml; when the checkpoint has no run directory beside it, "
            "give the experiment and the overrides the run was started with, or start a new run."
        )
    return file, meta


# -- the output directory ----------------------------------------------------------------------------------
def check_writable(path: Path, what: str) -> None:
    """``path`` is a directory that can be written, or can be created under a writable parent."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} {path} exists and is not a directory; choose another path.")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(
            f"{what} {path} cannot be written ({parent} is not a writable directory); choose another "
            "runs_root or run_name, or fix the permissions."
        )


def _new_name() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def plan_run_dir(cfg, resumed: tuple[Path, dict] | None) -> RunPlan:
    root = Path(cfg.runs_root)
    if resumed is None:
        run_dir = root / (cfg.run_name or _new_name())
        if holds_run(run_dir):
            raise RunDirError(
                f"{run_dir} already holds a run (run_name={cfg.run_name}): a second one would mix into its "
                f"logs. Choose another run_name=, or continue that run with: {resume.command(run_dir)}"
            )
        check_writable(run_dir, "the run directory")
        return RunPlan(run_dir, continuing=False, checkpoint=None)
    file, meta = resumed
    owner = checkpoint_owner(file, meta)
    asked = root / cfg.run_name if cfg.run_name else None
    if asked is not None and (owner is None or asked.resolve() != owner.resolve()):
        if holds_run(asked):
            raise RunDirError(
                f"{asked} already holds a run: the run resumed from {file} cannot start there. Choose an "
                f"unused run_name=, or leave run_name out to continue in "
                f"{owner if owner is not None else 'the run that wrote the checkpoint'}."
            )
        check_writable(asked, "the run directory")
        return RunPlan(asked, continuing=False, checkpoint=file)
    if owner is None:
        raise RunDirError(
            f"resume={cfg.resume}: {file} is not inside a run directory, so there is no run to continue; "
            "give run_name= for the directory the resumed run should write."
        )
    if _finished(owner):
        raise RunDirError(
            f"resume={cfg.resume}: the run in {owner} has finished; it has nothing left to train. To train "
            "again from its checkpoint, give an unused run_name= for the new run's directory."
        )
    check_writable(owner, "the run directory")
    return RunPlan(owner, continuing=True, checkpoint=file)


def prepare(cfg, paths: dict, total_steps: int) -> RunPlan:
    """Every check before step 0 (see the module docstring); the run directory to write, on every rank."""
    outcome: tuple = ("ok", None)
    if distributed.is_main():
        try:
            check_shards(paths, cfg)
            resumed = check_checkpoint(cfg, total_steps) if cfg.resume else None
            plan = plan_run_dir(cfg, resumed)
            if (cfg.checkpoint.every > 0 or cfg.checkpoint.final) and cfg.checkpoint.dir:
                check_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
            outcome = ("ok", plan)
        except (*data.USER_ERRORS, CheckpointError, RunDirError) as e:
            outcome = ("error", e)
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]
