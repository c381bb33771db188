"""Resume that follows the run: ``resume=<run dir or checkpoint>`` alone continues a run with its settings.

A run directory keeps the resolved config it started with (``config.yaml``), so a resumed run needs no flags:
:func:`follow` takes that config as the base and checks the command line's overrides against it.

- ``resume``, ``run_name`` and ``runs_root`` are bookkeeping: they come from the command line.
- Settings that cannot change on resume (:data:`FROZEN`: the seed, the model, the schedule and the data,
  except where the data lives) restore with the checkpoint; an override of one is accepted only when it
  repeats the run's value, and refused otherwise, each one named.
- Every other override applies (a lower lr after a NaN stop, another checkpoint cadence, a progress setting).
- A group or preset named with ``resume=`` (``experiment=...``, ``model=...``) is checked the same way on the
  settings it would change that cannot change, and otherwise changes nothing: the run's config.yaml already
  holds what the preset gave it.

:func:`command` is the one way every stop path (Ctrl-C, a crash, a NaN stop, a kill found on the next start)
writes the command that continues a run, and :func:`stopped_runs` finds the runs a kill left behind.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from track_1_short import checkpoint
from track_1_short.config import ConfigError, TrainConfig
from track_1_short.run_log import checkpoint_owner

BOOKKEEPING = ("resume", "run_name", "runs_root")  # where the run is, not how it trains
FROZEN = ("seed", "model", "schedule", "data")  # restored with the checkpoint: an override would not apply
MOVABLE = ("data.dir",)  # under FROZEN, but only says where the same files are
ENTRY = "python -m track_1_short.train"


def _frozen(key: str) -> bool:
    if key in MOVABLE or any(key.startswith(m + ".") for m in MOVABLE):
        return False
    return any(key == f or key.startswith(f + ".") for f in FROZEN)


def command(target: Path | str, world_size: int = 1) -> str:
    """The command that continues the run whose checkpoints ``target`` (a run or checkpoint dir) holds."""
    launcher = (
        ENTRY
        if world_size <= 1
        else f"torchrun --standalone --nproc_per_node={world_size} -m track_1_short.train"
    )
    return f"{launcher} resume={shlex.quote(str(target))}"


def target(run_dir: Path, ckpt_dir: Path) -> Path:
    """What ``resume=`` should name: the run directory, or the checkpoint directory when it lives elsewhere
    (``checkpoint.dir``), since a run directory is searched for ``checkpoints/`` only."""
    return run_dir if Path(ckpt_dir) == Path(run_dir) / "checkpoints" else Path(ckpt_dir)


def run_config(resume: str) -> tuple[Path, Path, DictConfig] | None:
    """(checkpoint file, run dir, the run's config.yaml) for ``resume=``; None when no run directory with a
    config.yaml owns the checkpoint (a copied file: the command line is then the whole config)."""
    file = checkpoint.resolve(resume)
    meta = checkpoint.load(file, mmap=True).get("meta")
    owner = checkpoint_owner(file, meta if isinstance(meta, dict) else {})
    if owner is None or not (owner / "config.yaml").is_file():
        return None
    try:
        saved = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(owner / "config.yaml"))
    except Exception as e:  # noqa: BLE001 - any unreadable or foreign config gets the same message
        raise ConfigError(
            f"resume={resume}: {owner / 'config.yaml'} does not fit this program's config schema ({e}). "
            "Resume with the version of the program that wrote the run, or start a new run."
        ) from e
    return file, owner, saved


def _show(value) -> str:
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return json.dumps(OmegaConf.to_container(value, resolve=True))
    return repr(value)


def _diff(a, b, prefix: str) -> list[str]:
    """Dotted keys under ``prefix`` whose resolved values differ between two configs."""
    x = OmegaConf.to_container(a, resolve=True) if OmegaConf.is_config(a) else a
    y = OmegaConf.to_container(b, resolve=True) if OmegaConf.is_config(b) else b
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in sorted(set(x) | set(y)):
            out += _diff(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if x == y else [prefix]


def follow(asked: DictConfig, overrides: list[str], groups: list[str]) -> DictConfig:
    """The config a ``resume=`` command runs: the run's config.yaml with the allowed ``overrides`` applied
    (``asked`` is the command line's own composition). Raises ConfigError naming every refused override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = run_config(asked.resume)
    if found is None:
        return asked
    file, owner, saved = found
    where = f"{owner / 'config.yaml'}"
    refused: list[str] = []
    applied: list[str] = []
    parser = OverridesParser.create()
    for text in overrides:
        (override,) = parser.parse_overrides([text])
        key = override.key_or_group
        if key in BOOKKEEPING or key.startswith("hydra"):
            continue
        if override.is_delete():
            refused.append(f"{text} (a resumed run keeps every key of its config)")
            continue
        if key in groups:
            sections = FROZEN if key == "experiment" else [key] if key in FROZEN else []
            changed = [k for s in sections for k in _diff(saved[s] if s in saved else None, asked[s], s)]
            changed = [k for k in changed if _frozen(k)]
            if changed:
                refused.append(
                    f"{text} (it changes {', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''})"
                )
            continue
        value = OmegaConf.select(asked, key, throw_on_missing=False)
        if _frozen(key):
            if _diff(OmegaConf.select(saved, key), value, key):
                refused.append(f"{text} (the run has {key}={_show(OmegaConf.select(saved, key))})")
            continue
        OmegaConf.update(saved, key, value, merge=False)
        applied.append(text)
    if refused:
        raise ConfigError(
            f"resume={asked.resume} continues the run in {owner} with the settings in {where}; the seed, "
            "the model, the schedule and the data restore with its checkpoint and cannot change, and these "
            f"overrides would change them: {'; '.join(refused)}. Drop them to continue the run (resume= "
            "alone is enough), or start a new run without resume= to train with them."
        )
    for key in BOOKKEEPING:
        saved[key] = asked[key]
    if applied and os.environ.get("RANK", "0") == "0":
        # config.yaml keeps the run's start; the resumed run's start event in events.jsonl records these.
        print(f"resume: the settings of {where}, with {' '.join(applied)}", file=sys.stderr)
    return saved


# -- runs a kill left behind -------------------------------------------------------------------------------
def process_tag() -> dict:
    """What the start event records so that a later start can tell a killed run from a live one."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Stopped:
    run_dir: Path
    step: int  # the last step its events recorded
    total_steps: int
    checkpoint: Path  # the newest complete checkpoint
    resume_target: Path

    def line(self) -> str:
        k = int(self.checkpoint.stem.split("_")[1])
        return (
            f"{self.run_dir} stopped without an end (killed?) after step {self.step} of {self.total_steps} "
            f"(the last it logged); its last checkpoint is step {k}: continue it with: "
            f"{command(self.resume_target)}"
        )


def stopped_run(run_dir: Path) -> Stopped | None:
    """The run in ``run_dir`` if a kill stopped it: its last start or resume has no end after it, the
    process that wrote it (on this host) is gone, and a checkpoint is left."""
    events = Path(run_dir) / "events.jsonl"
    if not events.is_file():
        return None
    last_start, step, total, ended = None, 0, 0, False
    for line in events.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by the kill
            continue
        kind = e.get("event")
        if kind in ("start", "resume"):
            last_start = e if kind == "start" else {**(last_start or {}), **e}
            total = e.get("total_steps", total)
            ended = False
        elif kind in ("train", "val"):
            step = max(step, int(e.get("step", 0)))
        elif kind == "end":
            ended = True
    if last_start is None or ended or last_start.get("host") != socket.gethostname():
        return None
    pid = last_start.get("pid")
    if not isinstance(pid, int) or _alive(pid):
        return None
    ckpt_dir = Path(last_start.get("checkpoint_dir") or Path(run_dir) / "checkpoints")
    found = checkpoint.list_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    if not found:
        return None
    return Stopped(Path(run_dir), step, total, found[-1], target(Path(run_dir), ckpt_dir))


def stopped_runs(runs_root: str | Path) -> list[Stopped]:
    """Every run under ``runs_root`` a kill left behind with a checkpoint, oldest first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    out = [s for d in sorted(root.iterdir()) if d.is_dir() and (s := stopped_run(d)) is not None]
    return out
