"""The forward's input checks: every argument of a GPT forward named when it cannot work, before any compute
(``model.check_inputs``; the record presets leave them off and validate their data on load)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from track_1_short.model.config import ModelConfigError

if TYPE_CHECKING:
    from track_1_short.model.gpt import GPT


@torch.compiler.disable
def check_inputs(
    model: GPT, inputs: Tensor, targets: Tensor | None, cu_seqlens: Tensor, windows, mtp_weights
) -> None:
    """Raise ModelConfigError naming the bad argument, before any compute.

    Shapes, dtypes, windows and weights are checked on the host; the value checks (token ids, cu_seqlens)
    read their numbers back in one device-to-host copy, the one sync this costs per forward.
    """
    cfg = model.cfg

    def fail(msg: str) -> None:
        raise ModelConfigError(msg)

    if not isinstance(inputs, Tensor) or inputs.dim() != 1 or inputs.dtype not in (torch.int32, torch.int64):
        fail("inputs must be a 1-D int32/int64 tensor [T] (one packed sequence, batch 1).")
    t = inputs.numel()
    if t == 0:
        fail("inputs is empty: pass at least one token.")
    if t > cfg.max_seq_len:
        fail(
            f"inputs has {t} tokens, more than max_seq_len={cfg.max_seq_len}: split the batch or raise "
            "model.max_seq_len."
        )
    if targets is not None and (
        not isinstance(targets, Tensor) or targets.shape != inputs.shape or targets.dtype != torch.int64
    ):
        fail(f"targets must be an int64 tensor shaped like inputs [{t}].")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        fail("cu_seqlens must be a 1-D int32 tensor [n_docs + 1] of document start offsets ending at T.")
    tensors = [inputs, cu_seqlens] + ([targets] if targets is not None else [])
    if any(x.device != inputs.device for x in tensors):
        devices = [str(x.device) for x in tensors]
        fail(f"inputs, targets and cu_seqlens must be on one device, got {devices}.")
    window_tensor = isinstance(windows, Tensor)
    if window_tensor:
        if windows.shape != (2,) or windows.dtype not in (torch.int32, torch.int64):
            fail(
                "windows as a tensor must be int32/int64 [2] (short, long) in blocks of "
                f"{cfg.block_size} tokens, got {windows.dtype} {tuple(windows.shape)}."
            )
        if windows.device != inputs.device:
            fail(f"windows is on {windows.device}, inputs on {inputs.device}: put them on one device.")
    elif not hasattr(windows, "__len__") or len(windows) != 2:
        fail(f"windows must be (short, long) in blocks of {cfg.block_size} tokens, got {windows!r}.")
    elif any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in windows):
        fail(f"windows must be two ints >= 1 (blocks of {cfg.block_size} tokens), got {windows!r}.")
    if len(mtp_weights) == 0 or any(not math.isfinite(w) or w < 0 for w in mtp_weights):
        fail(f"mtp_weights must be a non-empty list of finite weights >= 0, got {mtp_weights!r}.")

    ranges = [inputs.min(), inputs.max()]
    if targets is not None:
        ranges += [targets.min(), targets.max()]
    if window_tensor:
        ranges += list(windows.long().unbind())
    values = torch.cat([torch.stack(ranges).long(), cu_seqlens.long()]).tolist()  # the one sync
    ranges, cu = values[: len(ranges)], values[len(ranges) :]
    if window_tensor:
        blocks, ranges = ranges[-2:], ranges[:-2]
        if min(blocks) < 1:
            fail(f"windows must be >= 1 block of {cfg.block_size} tokens, got {blocks}.")
        fitted = [w // cfg.block_size for w in model._rope_windows]
        if model.training and torch.is_grad_enabled() and fitted != blocks:
            fail(
                f"windows {blocks} (a tensor) differ from the windows the rotary state is fitted to "
                f"({fitted}; -1 = none yet): a training forward does not read a tensor's values on the "
                "host, so call model.follow_windows(windows) with the ints first."
            )
    if ranges[0] < 0 or ranges[1] >= cfg.vocab_size:
        fail(
            f"inputs holds token ids in [{ranges[0]}, {ranges[1]}], outside the vocabulary "
            f"[0, {cfg.vocab_size}): the data was tokenised for another vocabulary; use matching data or "
            "model.vocab_size."
        )
    if targets is not None and (ranges[2] < 0 or ranges[3] >= cfg.vocab_size):
        fail(
            f"targets holds token ids in [{ranges[2]}, {ranges[3]}], outside the vocabulary "
            f"[0, {cfg.vocab_size})."
        )
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != t or any(b < a for a, b in zip(cu, cu[1:])):
        fail(f"cu_seqlens must start at 0, never decrease and end at T={t}; got {cu[:4]}...{cu[-2:]}.")
