"""Atomic, label-keyed checkpoints.

A checkpoint is one file ``<dir>/step_NNNNNN.pt`` (NNNNNN = steps completed) holding a dict:

    format     CHECKPOINT_FORMAT
    step       steps completed; the resumed run starts at this step
    model      {label: tensor}  every parameter by its label (never by name or id())
    optimizer  the optimizer's label-keyed state_dict
    loader     the training loader's position
    rng        torch / cuda / python / numpy generator states
    tail       (with tail averaging on) {"<accumulator>/<label>": {buf, seeded}}, each buffer gathered whole,
               so it reshards to any world size (optim/tail_average.py)
    meta       anything the writer wants checked at load (model config, total steps, world size)

Writes are atomic: the file is written as ``.tmp``, fsynced, then renamed over its final name; only then is
``<dir>/latest`` (a one-line text file naming the checkpoint) replaced the same way. A process killed at any
moment leaves the previous checkpoint and a ``latest`` that names a complete file. Nothing non-finite is ever
written: :func:`save` checks every floating tensor first and names the offending entry.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_FORMAT = 1  # bump when the payload layout changes; load refuses other formats
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{6,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, foreign or mismatched."""


class NonFiniteError(FloatingPointError):
    """A tensor about to be saved (or a loss) holds NaN or inf."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


# -- model state by label --
def _labelled(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    out: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters():
        label = getattr(p, "label", None)
        if label is None:
            raise CheckpointError(f"parameter {name!r} has no .label; every parameter must carry one.")
        out[label] = p
    return out


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{label: a CPU copy of the parameter}."""
    return {label: p.detach().to("cpu", copy=True) for label, p in _labelled(model).items()}


def check_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the first label or shape of ``state`` that does not fit ``model``;
    changes nothing (so a resume can check every part of a checkpoint before loading any)."""
    params = _labelled(model)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint 'model' entry is a {type(state).__name__}, not a label-keyed dict."
        )
    missing = sorted(set(params) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise CheckpointError(
            f"checkpoint labels do not match the model: missing {missing}, unknown {unknown}. "
            "The checkpoint comes from another model config; resume with the config it was written with."
        )
    for label, p in params.items():
        if not isinstance(state[label], torch.Tensor) or tuple(state[label].shape) != tuple(p.shape):
            got = tuple(state[label].shape) if isinstance(state[label], torch.Tensor) else state[label]
            raise CheckpointError(
                f"checkpoint tensor {label!r} has shape {got}, the model expects "
                f"{tuple(p.shape)}: the checkpoint comes from another model config."
            )


def check_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError unless each saved buffer is one of the model's, shaped alike; changes nothing."""
    own = dict(model.named_buffers())
    if not isinstance(buffers, dict):
        raise CheckpointError(f"checkpoint 'buffers' entry is a {type(buffers).__name__}, not a dict.")
    for name, t in buffers.items():
        if name not in own or not isinstance(t, torch.Tensor) or t.shape != own[name].shape:
            expected = tuple(own[name].shape) if name in own else "no such buffer"
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(
                f"checkpoint buffer {name!r} is {got}, the model has {expected}: the checkpoint comes from "
                "another model config."
            )


def load_model_state_(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the model's parameters in place; checks every label and shape first."""
    check_model_state(model, state)
    params = _labelled(model)
    with torch.no_grad():
        for label, p in params.items():
            p.copy_(state[label])


# -- RNG --
def capture_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- finiteness --
def assert_finite(tree: Any, where: str = "checkpoint") -> None:
    """Raise NonFiniteError naming the first floating tensor (or float) in ``tree`` with NaN or inf."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not bool(torch.isfinite(tree).all()):
            raise NonFiniteError(f"{where} holds NaN or inf; refusing to write it.")
    elif isinstance(tree, float):
        if tree != tree or tree in (float("inf"), float("-inf")):
            raise NonFiniteError(f"{where} is {tree}; refusing to write it.")
    elif isinstance(tree, dict):
        for k, v in tree.items():
            assert_finite(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            assert_finite(v, f"{where}[{i}]")


# -- files --
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(ckpt_dir: str | Path, payload: dict[str, Any], keep_last: int = 0) -> Path:
    """Write ``payload`` (which must hold ``step``) as ``step_NNNNNN.pt`` and point ``latest`` at it.

    ``keep_last`` > 0 deletes older checkpoints beyond the newest ``keep_last`` after ``latest`` moved.
    """
    for key in ("step", "model", "optimizer", "loader", "rng"):
        if key not in payload:
            raise CheckpointError(f"checkpoint payload lacks {key!r}.")
    assert_finite(payload["model"], "model")
    assert_finite(payload["optimizer"], "optimizer state")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / checkpoint_name(int(payload["step"]))
    _atomic_write(path, lambda f: torch.save({"format": CHECKPOINT_FORMAT, **payload}, f))
    _atomic_write(ckpt_dir / LATEST, lambda f: f.write((path.name + "\n").encode()))
    if keep_last > 0:
        for old in list_checkpoints(ckpt_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
            for side in side_files(old):
                side.unlink(missing_ok=True)
    return path


# -- per-rank side files (sharded state: the n-gram table) --
def side_files(main_file: Path) -> list[Path]:
    """The per-rank files written beside a checkpoint (``step_NNNNNN.<what>.pt``)."""
    return sorted(main_file.parent.glob(f"{main_file.name[:-3]}.*.pt"))


def save_side_file(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write one rank's sharded state beside its checkpoint, atomically. Every rank writes its own before
    rank 0 writes the main file and moves ``latest``, so ``latest`` never names a checkpoint with a missing
    side file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: torch.save({"format": CHECKPOINT_FORMAT, **payload}, f))
    return path


def load_side_file(path: str | Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one clear message, as load()
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}): it is truncated or damaged; resume from an older "
            "checkpoint."
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a side file of checkpoint format {CHECKPOINT_FORMAT}.")
    return payload


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest first (``.tmp`` files are never listed)."""
    ckpt_dir = Path(ckpt_dir)
    found = [(int(m[1]), p) for p in ckpt_dir.glob("step_*.pt") if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a directory whose ``latest`` names one (a run dir's ``checkpoints/`` too)."""
    path = Path(path)
    if path.is_dir():
        for d in (path, path / "checkpoints"):
            if (d / LATEST).is_file():
                name = (d / LATEST).read_text().strip()
                if not _NAME.match(name):
                    raise CheckpointError(f"{d / LATEST} names {name!r}, which is not a checkpoint file.")
                return d / name
        raise CheckpointError(
            f"{path} holds no '{LATEST}' file: pass a checkpoint file or a checkpoint directory."
        )
    if not path.is_file():
        raise CheckpointError(f"resume={path}: no such checkpoint file or directory.")
    return path


def load(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint (file or directory) into CPU memory, checking its format.

    ``mmap`` maps the tensors instead of reading them (cheap: for a check before the run starts)."""
    file = resolve(path)
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - every unreadable file gets the same clear message
        # One line: torch's message for a file that is not a weights-only pickle is paragraphs of advice about
        # weights_only=False, which would load arbitrary code and is not what a damaged file needs.
        raise CheckpointError(
            f"{file} cannot be read as a checkpoint ({type(e).__name__}): it is truncated, damaged or not a "
            "checkpoint of this program; resume from another one (an older step_*.pt beside it)."
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{file} has checkpoint format {got!r}; this version reads {CHECKPOINT_FORMAT}."
        )
    missing = [k for k in ("step", "model", "optimizer", "loader", "rng") if k not in payload]
    if missing:
        raise CheckpointError(f"{file} lacks {missing}: it is not a complete checkpoint of this program.")
    return payload
