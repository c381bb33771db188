"""The training run in named phases: build, warmup, timed loop, validate.

:func:`run` is what ``python -m track_1_short.train`` calls once Hydra has composed the config; tests call it
directly (in one process, or in every rank of a gloo group). One step:

    plan = schedule.plan(step)             stage geometry, lr multiplier, rail beta, Adam or not, split,
                                           prefix weight, sampled-softmax P (scaled to the micro batch)
    accum x: loader.next_batch -> model -> (loss_sum / rank tokens).backward()
    opt.step(do_adam)                      reductions across ranks average the per-rank means

Every rank composes the same config and seeds the same generators, so replicas start equal (and are broadcast
from rank 0 to be sure). Rank 0 alone chooses the run directory (broadcast to the others) and writes it.

Time accounting follows the record harness: on CUDA the model is compiled and warmed up on the schedule's
representative steps off the clock, the initial model, optimizer, loader and RNG state are restored in place,
and only then does the clock start. It stops only around validation forwards (and checkpoint writes, which
record runs do not make).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from track_1_short import (
    checkpoint,
    compile_watch,
    cpu_bf16_matmul,
    distributed,
    endgame,
    preflight,
    progress,
    resume,
    run_log,
    run_report,
    schedule,
)
from track_1_short.checkpoint import CheckpointError, NonFiniteError
from track_1_short.config import ConfigError, TrainConfig, accumulation_steps, check_run, to_object
from track_1_short.data import fixed_boundaries
from track_1_short.frozen_gc import freeze_gc, restore_gc
from track_1_short.guards import Guards
from track_1_short.model import sampled_softmax
from track_1_short.model.config import saved_model_config
from track_1_short.optim.tail_average import TailAverages
from track_1_short.optimizer_time import OptimizerTime
from track_1_short.run_log import RunLog, environment


class NonFiniteLossError(NonFiniteError):
    """The training loss became NaN or inf; the run stops at that step."""

    def __init__(self, step: int, value: float) -> None:
        self.step = step
        super().__init__(
            f"the training loss became {value} at step {step}; the run stops there. No checkpoint holds it: "
            "resume from the last one (a resume may lower optim.adam_lr; the seed stays the run's)."
        )


@dataclass
class RunResult:
    run_dir: Path
    val_loss: float
    train_time_ms: float
    steps: int
    train_losses: list[float] = field(default_factory=list)  # one per read-back step, all-rank mean per token
    corpus: dict[str, Any] = field(default_factory=dict)  # the synthetic corpus sidecar, if any
    summary: list[str] = field(default_factory=list)  # the end-of-run lines (rank 0; also in log.txt)
    trainer: Trainer | None = None  # the built objects, for callers that inspect the final state (tests)


def select_device(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu (or auto).")
    return cfg.device


def _data_paths(data_cfg) -> dict:
    """Rank 0 finds (or builds) the data files first, so ranks never build the corpus concurrently; its
    outcome, paths or the user error, is broadcast so every rank raises the same error instead of hanging."""
    from track_1_short import corpus, data

    outcome: tuple = ("ok", None)
    if distributed.is_main():
        try:
            outcome = ("ok", corpus.run_paths(data_cfg))
        except data.USER_ERRORS as e:
            outcome = ("error", e)
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1] if distributed.is_main() else corpus.run_paths(data_cfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Phases:
    """Says what the run is doing and how long each phase took: stderr on rank 0 (tqdm-safe), and, once
    the run directory exists, log.txt and a ``phase`` event in events.jsonl."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.log: RunLog | None = None
        self.done: dict[str, float] = {}

    def say(self, line: str) -> None:
        if self.enabled:
            tqdm.write(line, file=sys.stderr)
        if self.log is not None:
            self.log.text(line)

    def finished(self, name: str, seconds: float, **fields: Any) -> None:
        self.done[name] = seconds
        extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in fields.items())
        self.say(f"{name}: {seconds:.1f} s{extra}")
        if self.log is not None:
            self.log.event("phase", name=name, seconds=seconds, **fields)


class Trainer:
    """Owns the built objects of one run and its phases."""

    def __init__(self, cfg: TrainConfig, resolved: dict, device: torch.device) -> None:
        from track_1_short import data
        from track_1_short.model.gpt import GPT
        from track_1_short.optim.anvil import AnvilAndAdam

        self.graphs_made = compile_watch.RunGraphs()  # this run's graphs, whatever ran in the process before
        self.cfg = cfg
        self.device = device
        self.rank, self.world = distributed.rank(), distributed.world_size()
        check_run(cfg, self.world)
        self.total_steps = schedule.total_steps(cfg.schedule)
        self.phases = Phases(distributed.is_main())

        # Data first: a missing corpus is the most likely user error; report it before any heavy work.
        # For the synthetic corpus this builds it on first use (once; later runs reuse it).
        t = time.perf_counter()
        self.phases.say(f"data: {cfg.data.kind} ({cfg.data.dir})")
        self.paths = _data_paths(cfg.data)
        data_s = time.perf_counter() - t
        # Every file the run reads, the checkpoint and the run directory, before anything is built or written.
        self.plan = preflight.prepare(cfg, self.paths, self.total_steps)
        self.phases.say(f"run directory: {self.plan.run_dir}")

        t = time.perf_counter()
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model, device=device)
        with torch.no_grad():
            for p in self.model.parameters():
                distributed.broadcast_(p.data, src=0)
        self.opt = AnvilAndAdam(
            list(self.model.named_parameters()),
            self.model.param_table(),
            self.model.scatter_order(),
            self.model.work_order(),
            cfg.optim,
        )
        self.model.refresh_fp8()  # the FP8 weight copies (model.fp8) of the built weights
        self.forward = self.model
        self._window_tensors: dict[tuple[int, int], torch.Tensor] = {}
        self.mtp_width = max(len(st.mtp_weights) for st in cfg.schedule.stages)
        # The prefix term is in every training graph when the model has its table (weight 0 adds exact zeros).
        self.prefix_on = cfg.model.prefix_targets
        self.compiled = device.type == "cuda" and cfg.compile
        if self.compiled:
            self.forward = torch.compile(self.model, dynamic=False)
        # Validation runs the model uncompiled (FlexAttention still compiled on its own): Inductor (torch
        # 2.11) fails to lower FlexAttention in a no-grad graph whose mask reads document ids computed in that
        # graph ("convert FlexibleLayout to FixedLayout first", seen on an H200 for the paired layers), and a
        # few validation forwards a run do not pay for a compile anyway.
        self.val_forward = self.model
        model_s = time.perf_counter() - t
        self.loader = data.TrainLoader(
            self.paths["train"],
            self.rank,
            self.world,
            device,
            bos_id=cfg.data.bos_id,
            vocab_size=cfg.data.vocab_size,
            attn_segment_cap=cfg.data.attn_segment_cap,
        )
        self.ngram = None  # the n-gram table's cycles, pulls and checkpoints (model.ngram.enabled)
        if cfg.model.ngram.enabled:
            from track_1_short.ngram_cycle import NgramCycle

            distributed.broadcast_(self.model.ngram_sign_pool, src=0)
            self.ngram = NgramCycle(self)
        self.step = 0
        self.train_time_ms = 0.0
        self.tokens_seen = 0
        self.run_dir = self.plan.run_dir
        self.log = RunLog(self.run_dir, enabled=distributed.is_main())
        if not self.plan.continuing:  # a continued run keeps the config.yaml it started with
            self.log.write_config(OmegaConf.to_yaml(resolved))
            self.log.write_env({**environment(), "world_size": self.world, "device": str(device)})
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.resolved = resolved
        self.phases.log = self.log
        self.phases.finished("data", data_s, source=cfg.data.kind)
        n_params = sum(p.numel() for p in self.model.parameters())
        # What is in force, not what was asked for: a caller that builds the trainer outside run() and
        # forgets the route shows up here. The reason is the switch's when the two agree.
        self.bf16_matmul = "fp32" if cpu_bf16_matmul.active() else "native"
        route, why = bf16_matmul_route(cfg, device)
        self.phases.finished(
            "build",
            model_s,
            parameters=f"{n_params:,}",
            compiled=self.compiled,
            bf16_matmul=f"{self.bf16_matmul} ({why})" if route == self.bf16_matmul else self.bf16_matmul,
        )
        self.tail = TailAverages(cfg.tail, self.opt, self.total_steps) if cfg.tail.enabled else None
        # The final validation's mask, loaded (or built) before the clock: it depends on the vocabulary only.
        self.canonical_mask = endgame.load_canonical_mask(self) if cfg.canonical_mask else None
        self.graphs_after_warmup: int | None = None
        self.opt_time = OptimizerTime(device)  # the optimizer's share of the timed loop (train events)
        self.tail_time = OptimizerTime(device)  # the tail accumulators' share, bracketed the same way
        self.guards = Guards(
            cfg.guards,
            cfg.fault_injection,
            self.opt.params,
            self.opt.states,
            self.opt.replicated_labels,
            log=self.log.text,
            drop_grads=self.opt.zero_grad,
        )

    # -- state snapshots (warmup restore, checkpoints) --
    def _payload(self) -> dict:
        return {
            "step": self.step,
            "model": checkpoint.model_state(self.model),
            # Buffers that training changes (rotary state after window changes, the embedding-split flag).
            "buffers": {k: v.detach().to("cpu", copy=True) for k, v in self.model.named_buffers()},
            "optimizer": self.opt.state_dict(),
            # with the n-gram table, the position after the last step run, not the cycle's read-ahead
            "loader": self.ngram.loader_state(self.step) if self.ngram else self.loader.state_dict(),
            "rng": checkpoint.capture_rng(),
            **({"tail": self.tail.state_dict()} if self.tail is not None else {}),
            "meta": {
                "model": OmegaConf.to_container(OmegaConf.structured(self.cfg.model)),
                "total_steps": self.total_steps,
                "world_size": self.world,
                "train_time_ms": self.train_time_ms,
                "tokens_seen": self.tokens_seen,
                # What a resume may not change (preflight.check_checkpoint), and where the run lives.
                "seed": self.cfg.seed,
                "schedule": OmegaConf.to_container(OmegaConf.structured(self.cfg.schedule)),
                "run_dir": str(self.run_dir),
            },
        }

    def _restore_(self, payload: dict) -> None:
        """Load a snapshot in place: parameters, optimizer moments and flat buffers keep their storage.
        Every part is checked before any is loaded: a bad snapshot raises and leaves the run as it was."""
        checkpoint.check_model_state(self.model, payload["model"])
        checkpoint.check_buffers(self.model, payload.get("buffers"))
        if self.tail is not None:
            try:
                self.tail.check_state_dict(payload.get("tail"))
            except ValueError as e:
                raise CheckpointError(str(e)) from e
        loader_before = self.loader.state_dict()
        self.loader.load_state_dict(payload["loader"])  # checks, then moves the cursor
        try:
            self.opt.load_state_dict(payload["optimizer"])  # checks everything, then copies
        except BaseException:
            self.loader.load_state_dict(loader_before)
            raise
        checkpoint.load_model_state_(self.model, payload["model"])
        # load_state_dict copies in place and runs the model's hooks that refresh its host-side mirrors.
        self.model.load_state_dict(payload["buffers"], strict=False)
        checkpoint.restore_rng(payload["rng"])
        self.model.rearm_fp8()  # FP8 copies of the loaded weights, delayed scales from their start
        if self.tail is not None:
            self.tail.load_state_dict(payload["tail"])
        # Adam's accumulated gradients are part of the optimizer's state and were just loaded with it; clear
        # only the others (ANVIL's are cleared every step, so this is a guard, not a reset of saved state).
        for label, p in self.opt.params.items():
            if p.grad is not None and self.opt.param_cfgs[label].optim != "adam":
                p.grad.zero_()
        self.opt.assert_views_intact()
        self.step = int(payload["step"])

    def resume(self, path: str) -> None:
        payload = checkpoint.load(path)
        meta, needed = payload.get("meta"), {"model", "total_steps", "train_time_ms", "tokens_seen"}
        if not isinstance(meta, dict) or not needed <= meta.keys():
            raise CheckpointError(f"resume={path}: the checkpoint's 'meta' entry is missing or incomplete.")
        saved = saved_model_config(payload["meta"]["model"])
        current = OmegaConf.to_container(OmegaConf.structured(self.cfg.model))
        if saved != current:
            diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
            raise CheckpointError(
                f"resume={path}: the checkpoint was written for another model config (fields {diff} differ). "
                "Resume with the model config it was written with."
            )
        if payload["meta"]["total_steps"] != self.total_steps:
            raise CheckpointError(
                f"resume={path}: the checkpoint's schedule has {payload['meta']['total_steps']} steps, this "
                f"one {self.total_steps}; resume with the schedule it was written with."
            )
        self._restore_(payload)
        if self.ngram is not None:
            self.ngram.load(checkpoint.resolve(path))
        self.train_time_ms = float(payload["meta"]["train_time_ms"])
        self.tokens_seen = int(payload["meta"]["tokens_seen"])
        run_log.mark_resumption(self.log, checkpoint.resolve(path), self.step, self.total_steps)
        self.phases.say(f"resumed at step {self.step} of {self.total_steps} from {checkpoint.resolve(path)}")

    # -- one step --
    def train_step(self, step: int, marks=None) -> torch.Tensor:
        """Run step ``step``; returns this rank's loss per token (a 0-d tensor, not synced).

        The one step the trainer runs and perf/bench_train_step.py times. ``marks``: called with "forward"
        and "backward" after each microbatch's forward and backward (the bench's timer), or None.
        """
        plan = schedule.plan(self.cfg.schedule, step, self.cfg.optim.adam_every)
        if plan.split_embed:
            self.model.split_embed()
            self.opt.split_embed()
        self.opt.set_schedule(plan.lr_multiplier, plan.rail_beta, step)
        accum = accumulation_steps(plan.batch_tokens, self.world, self.cfg.micro_batch_tokens)
        micro = plan.batch_tokens // self.world // accum
        # Outside the compiled forward, so that its graph never holds a rotary update or a constant that
        # changes: the rotary state follows the windows here (a no-op within a stage), and the windows and
        # the MTP weights (which ramp every step) enter as tensors, so every stage of one micro-batch shape
        # runs the same graph.
        self.model.follow_windows(plan.windows)
        windows = self._window_tensor(plan.windows)
        # Zero-padded to the schedule's widest stage: a stage with fewer MTP targets is the same graph, and a
        # zero weight leaves the gradient bitwise unchanged (tests/model/test_layers.py).
        padded = list(plan.mtp_weights) + [0.0] * (self.mtp_width - len(plan.mtp_weights))
        mtp = torch.tensor(padded, dtype=torch.float32).to(self.device, non_blocking=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        # Per-token mean over this rank's step, or (loss_sum_ranks N) the sum over batch/N tokens; the
        # optimizer's reductions average the ranks.
        scale = self.cfg.loss_sum_ranks / self.world if self.cfg.loss_sum_ranks else micro * accum
        if self.model._fp8 is not None:
            self.model._fp8.set_loss_divisor(scale)  # FP8 gradient scales follow the loss's size
        ngram_batches = (
            self.ngram.batches(step) if self.ngram is not None else None
        )  # the cycle's, read ahead
        extra, p = self._loss_fields(plan, micro)
        for m in range(accum):
            if ngram_batches:
                b, ngram_ids = ngram_batches[m]
            else:
                b = self.loader.next_batch(micro, plan.max_doc_len)
            cu = fixed_boundaries(b.cu_seqlens, micro)
            if p:
                offset = self._sweep_offset(step, m, accum, p)
                extra["candidates"] = self.model.candidate_sets.build(b.targets, p, offset)
            # The n-gram rows are looked up here and enter as tensors: the compiled forward calls their
            # embedding's custom op, with no graph break on the lookup (the table-off graph count).
            ngram = {"ngram": self.model.ngram_rows(*ngram_ids)} if self.ngram is not None else {}
            loss = self.forward(b.inputs, b.targets, cu, windows, mtp, **extra, **ngram)
            if marks is not None:
                marks("forward")
            (loss / scale).backward()
            if self.ngram is not None:
                self.ngram.after_backward()
            if marks is not None:
                marks("backward")
            loss_sum += loss.detach().float()
        # the table's cycle ends at its update step (the next one is read ahead): its row gradients' flag
        # joins the guards' one read
        flag = self.ngram.close_cycle(step) if self.ngram is not None else None
        extra = {"ngram_table": flag} if flag is not None else None
        applied = self.guards.grads_ok(step, extra)  # NaN/inf gradient: stop, or skip the step on every rank
        if applied:
            self.opt_time.start()
            self.opt.step(plan.do_adam)
            self.model.refresh_fp8()  # the banks change only here: one requantise per optimizer update
            self.opt_time.stop()
            self.guards.after_update(step)  # replicas compared every guards.checksum_every steps
        if self.ngram is not None:
            self.ngram.after_step(step, plan.lr_multiplier, applied)
        self.tokens_seen += plan.batch_tokens
        return loss_sum / (micro * accum)

    def _loss_fields(self, plan, micro: int) -> tuple[dict, int]:
        """The step's prefix weight (a device tensor: no new graph when it changes), and the sampled softmax's
        P for this micro-batch size (0: the full softmax), whose candidate sets enter the forward as tensors
        of dynamic length (model/sampled_softmax.CandidateSets): one graph for every P."""
        extra: dict = {}
        if self.prefix_on:
            weight = torch.tensor([plan.prefix_weight], dtype=torch.float32)
            extra["prefix_weight"] = weight.to(self.device, non_blocking=True)
        p = sampled_softmax.candidates_for(
            plan.sampled_candidates,
            micro,
            self.cfg.schedule.sampled_candidates_tokens,
            self.model.topo.vocab_padded,
        )
        return extra, p

    def _sweep_offset(self, step: int, micro_index: int, accum: int, p: int) -> torch.Tensor:
        """Where this micro batch's negatives start: staggered over every rank's micro batches of the step."""
        g, n = self.rank * accum + micro_index, self.world * accum
        offset = sampled_softmax.sweep_offset(step, g, n, p, self.model.topo.vocab_padded)
        return torch.tensor(offset, dtype=torch.int64).to(self.device, non_blocking=True)

    def _window_tensor(self, windows) -> torch.Tensor | tuple[int, int]:
        """The (short, long) windows as a device tensor, one per distinct pair (uploaded once); with
        model.attention_impl=fa4 as host ints, which flash-attn-4 takes (a graph per pair, each made in the
        warmup, which runs every stage's first steps)."""
        key = tuple(int(w) for w in windows)
        if self.cfg.model.attention_impl == "fa4":
            return key
        if key not in self._window_tensors:
            self._window_tensors[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return self._window_tensors[key]

    # -- phases --
    def warmup(self) -> list[int]:
        """Run the representative steps off the clock, then restore the initial state in place."""
        warm = self.cfg.warmup if self.cfg.warmup is not None else self.device.type == "cuda"
        self.warmed_steps: list[int] = []
        if not warm:
            return []
        initial = copy.deepcopy(self._payload())
        initial_ngram = self.ngram.snapshot() if self.ngram is not None else None
        tokens_seen = self.tokens_seen
        # The split steps are included: restoring the model's buffers re-ties it (embed_is_split), and the
        # optimizer's state_dict carries its own tied flag.
        steps = schedule.warmup_steps(self.cfg.schedule, self.cfg.optim.adam_every)
        t = time.perf_counter()
        self.phases.say(
            f"warmup: {len(steps)} representative steps off the clock"
            + (" (the first of each geometry compiles)" if self.compiled else "")
        )
        for k, s in enumerate(steps):
            t_step = time.perf_counter()
            self.train_step(s)
            _sync(self.device)
            self.model.candidate_sets.check()  # a too-small P stops the run here, before the clock starts
            self.phases.say(
                f"  warmup step {k + 1}/{len(steps)} (schedule step {s}): "
                f"{time.perf_counter() - t_step:.1f} s, graphs so far {self.graphs_made()}"
            )
        # One validation forward, so that its graph (no grad, validation windows) is made here too.
        t_val = time.perf_counter()
        self.validate(max_batches=1)
        self.phases.say(f"  warmup validation forward: {time.perf_counter() - t_val:.1f} s")
        _sync(self.device)
        self._restore_(initial)
        if self.ngram is not None:
            self.ngram.restore(initial_ngram)
        self.tokens_seen = tokens_seen
        self.warmed_steps = steps
        self.graphs_after_warmup = self.graphs_made()
        self.phases.finished(
            "warmup", time.perf_counter() - t, steps=len(steps), graphs=self.graphs_after_warmup
        )
        return steps

    def validate(self, max_batches: int | None = None, masked: bool = False) -> float:
        """Mean next-token CE over the validation tokens, summed over ranks (no MTP, val windows);
        ``max_batches``: stop after that many batches (the warmup's one forward); ``masked``: with the
        canonical mask (the final validation only, endgame.py)."""
        from track_1_short import data

        if masked:
            self.model.canonical_mask = self.canonical_mask
            try:
                return self.validate(max_batches)
            finally:
                self.model.canonical_mask = None
        windows = schedule.val_windows(self.cfg.schedule)
        tokens_per_rank = self.cfg.data.val_batch_tokens // self.world
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            d = self.cfg.data
            batches = data.ValLoader(
                self.paths["val"],
                d.val_tokens,
                tokens_per_rank,
                self.rank,
                self.world,
                self.device,
                bos_id=d.bos_id,
                vocab_size=d.vocab_size,
            )
            if self.ngram is not None:
                self.ngram.begin_eval()  # each batch pulls its rows; the training cycle's cache stays aside
            for i, b in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                cu = fixed_boundaries(b.cu_seqlens, b.inputs.numel())
                if self.ngram is not None:
                    self.ngram.eval_batch(b.inputs, cu)
                totals[0] += self.val_forward(b.inputs, b.targets, cu, windows, None).double()
                totals[1] += b.targets.numel()
            if self.ngram is not None:
                self.ngram.end_eval()
        distributed.all_reduce_sum(totals)
        return float(totals[0] / totals[1])

    def _check_losses(self, pending: list[tuple[int, torch.Tensor]]) -> list[tuple[int, float]]:
        """Read back the losses of ``pending`` steps (one collective), stop at the first non-finite one."""
        if not pending:
            return []
        values = torch.stack([v for _, v in pending]).float()
        distributed.all_reduce_avg(values)
        out = []
        for (step, _), v in zip(pending, values.tolist()):
            if not math.isfinite(v) and step not in self.guards.skipped_steps:
                raise NonFiniteLossError(step, v)
            out.append((step, v))
        return out

    def train(self) -> RunResult:
        cfg, n = self.cfg, self.total_steps
        check_every = cfg.check_every or (1 if self.device.type == "cpu" else cfg.log_every)
        # The process and the checkpoint directory let a later start tell a killed run from a live one.
        self.log.start(
            n,
            cfg.seed,
            self.resolved,
            world_size=self.world,
            start_step=self.step,
            checkpoint_dir=str(self.ckpt_dir),
            **resume.process_tag(),
        )
        self.log.text(f"run {self.run_dir} world_size {self.world} device {self.device} steps {n}")
        bar = tqdm(
            total=n,
            initial=self.step,
            # Off when stderr is not a terminal: a redirected bar is kilobytes of carriage returns (the
            # progress is in log.txt).
            disable=not (cfg.progress_bar and distributed.is_main() and sys.stderr.isatty()),
            unit="step",
            dynamic_ncols=True,
        )
        plain = progress.PlainProgress(
            n,
            self.step,
            self.tokens_seen,
            cfg.log_every,
            cfg.progress_seconds,
            enabled=bar.disable and cfg.progress_bar and distributed.is_main() and not sys.stderr.isatty(),
        )
        losses: list[float] = []
        val_loss = float("nan")
        pending: list[tuple[int, torch.Tensor]] = []
        t_start = time.perf_counter()
        last_tokens = self.tokens_seen
        gc_state = None
        try:
            if cfg.gc_freeze:  # before the clock: the collection is not timed, no collector pause is
                gc_state = freeze_gc()
            _sync(self.device)
            self.opt_time.reset()  # the warmup's steps are not the timed loop's
            self.tail_time.reset()
            if self.ngram is not None:
                self.ngram.reset_times()
            t0 = time.perf_counter()
            while self.step < n:
                pending.append((self.step, self.train_step(self.step)))
                if self.tail is not None:
                    self.tail_time.start()
                    self.tail.tick(self.step)
                    self.tail_time.stop()
                self.step += 1
                done, last = self.step, self.step == n
                want_val = last or (cfg.val_every > 0 and done % cfg.val_every == 0)
                every = cfg.checkpoint.every
                want_ckpt = (cfg.checkpoint.final and last) or (every > 0 and done % every == 0 and not last)
                if done % check_every == 0 or want_val or want_ckpt or done % cfg.log_every == 0:
                    checked = self._check_losses(pending)  # a device sync: the time below is real
                    self.model.candidate_sets.check()
                    now = time.perf_counter()
                    pending = []
                    elapsed = self.train_time_ms + 1e3 * (now - t0)
                    losses.extend(v for _, v in checked)
                    step_loss = checked[-1][1]
                    self.log.train(
                        done,
                        n,
                        loss=step_loss,
                        lr_multiplier=schedule.lr_multiplier(cfg.schedule, done - 1),
                        # Above 1 the loss is the MTP-weighted sum over targets, not next-token loss.
                        mtp_weight_sum=sum(schedule.mtp_weights(cfg.schedule, done - 1)),
                        tokens_seen=self.tokens_seen,
                        train_time_ms=elapsed,
                        step_avg_ms=elapsed / done,
                        progress_line=done % cfg.log_every == 0 or done >= n - 1,
                        optimizer_ms=self.opt_time.take_ms(),  # after the read-back's sync: no wait
                        **(self.ngram.take_ms() if self.ngram is not None else {}),
                        **({"tail_ms": self.tail_time.take_ms()} if self.tail is not None else {}),
                        **self._memory(),
                    )
                    if self.model._fp8 is not None and distributed.is_main():
                        for line in self.model._fp8.clip_report():  # the device is idle here: no wait
                            self.log.text(line)
                    wall = now - t_start
                    bar.set_postfix(
                        loss=f"{step_loss:.4f}",
                        tok_s=f"{(self.tokens_seen - last_tokens) / max(wall, 1e-9):,.0f}",
                    )
                    bar.update(done - bar.n)
                    plain.update(done, step_loss, self.tokens_seen)
                if want_val or want_ckpt:
                    _sync(self.device)
                    self.train_time_ms += 1e3 * (time.perf_counter() - t0)
                    if want_ckpt:
                        self.save_checkpoint()
                    if want_val and last:
                        shipped = endgame.ship_tail(self) if self.tail is not None else None
                        val_loss = endgame.final_validation(self, done, n, shipped)
                        self.log.flush()
                    elif want_val:
                        val_loss = self.validate()
                        self.log.val(done, n, val_loss, self.train_time_ms, self.train_time_ms / done)
                        self.log.flush()
                    t0 = time.perf_counter()
        except BaseException as e:
            why = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            self.log.text(f"stopped at step:{self.step}/{n}: {why}")
            self.log.end(
                self.step,
                n,
                "failed",
                val_loss=None,
                train_time_ms=self.train_time_ms,
                error=f"{type(e).__name__}: {e}",
            )
            raise
        else:
            self.log.end(
                n,
                n,
                "finished",
                val_loss=val_loss,
                train_time_ms=self.train_time_ms,
                **self._compile_stats(),
                **self._memory(),
                **self._memory_per_rank(),
            )
            stats = self._compile_stats()
            if stats:
                self.phases.say(
                    f"compile: {stats['graphs']} graphs, {stats['timed_loop_graphs']} made in the timed loop"
                )
        finally:
            restore_gc(gc_state)
            bar.close()
            self.loader.close()
            self.log.close()
        return RunResult(self.run_dir, val_loss, self.train_time_ms, n, losses)

    def save_checkpoint(self) -> Path | None:
        self.guards.assert_replicas_agree(self.step)  # never record a split model
        payload = self._payload()  # on every rank: the optimizer's state_dict may gather shards
        checkpoint.assert_finite(payload["model"], "model")
        checkpoint.assert_finite(payload["optimizer"], "optimizer state")
        if "tail" in payload:
            checkpoint.assert_finite(payload["tail"], "tail accumulators")
        path = None
        if self.ngram is not None:  # every rank's shard file first: latest moves only once all are whole
            self.ngram.save(self.ckpt_dir, self.step)
            distributed.barrier()
        if distributed.is_main():
            path = checkpoint.save(self.ckpt_dir, payload, keep_last=self.cfg.checkpoint.keep_last)
            self.log.text(f"checkpoint {path}")
            self.log.flush()  # off the clock: a kill after this leaves the logs as far as the checkpoint
        distributed.barrier()
        return path

    def _compile_stats(self) -> dict:
        """Graphs made in all, and after the warmup (each one a recompile the warmup missed)."""
        if not self.compiled or self.graphs_after_warmup is None:
            return {}
        made = self.graphs_made()
        return {"graphs": made, "timed_loop_graphs": made - self.graphs_after_warmup}

    def _memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        return {"peak_memory_mib": torch.cuda.max_memory_allocated(self.device) // (1 << 20)}

    def _memory_per_rank(self) -> dict:
        """Every rank's peak, gathered once at the end of a finished run (rank 0 alone writes the log, and
        ranks differ: the sharded optimizer's padding and the loader's buffers are not the same on each)."""
        if self.device.type != "cuda":
            return {}
        peaks = distributed.all_gather_object(self._memory()["peak_memory_mib"])
        return {"peak_memory_mib_per_rank": [int(m) for m in peaks]}


def corpus_facts(paths: dict) -> dict:
    """The synthetic corpus's sidecar (entropy floor, unigram entropy), or {} for other data."""
    sidecar = paths.get("sidecar")
    if not sidecar or not Path(sidecar).is_file():
        return {}
    return json.loads(Path(sidecar).read_text())


def run(cfg: DictConfig | TrainConfig) -> RunResult:
    """Build, warm up, train, validate. Works in one process, under torchrun, or in a test's gloo ranks.

    All four run under the route :func:`bf16_matmul_route` picks for the bf16 matmuls (on a CPU without native
    bf16 GEMM: fp32 GEMMs, track_1_short/cpu_bf16_matmul.py), entered here in every process that trains
    and left on the way out, also on an error."""
    resolved = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    resolved_dict = OmegaConf.to_container(resolved, resolve=True)
    tcfg = to_object(cfg)
    device = distributed.init(select_device(tcfg))
    apply_cpu_threads(tcfg, device)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if tcfg.deterministic:
        # cuBLAS is deterministic only with a fixed workspace configuration; torch refuses matmuls otherwise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    trainer = None
    try:
        # Build, warmup, training and validation: every matmul of the run takes the same route.
        with cpu_bf16_matmul.route(bf16_matmul_route(tcfg, device)[0]):
            trainer = Trainer(tcfg, resolved_dict, device)
            if tcfg.resume:
                trainer.resume(tcfg.resume)
            trainer.warmup()
            result = trainer.train()
    except KeyboardInterrupt as e:
        raise run_report.RunInterrupted(trainer) from e
    except Exception as e:
        e.run_stop = run_report.RunStop(trainer)  # the entry point names the resume command
        raise
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    result.corpus = corpus_facts(trainer.paths)
    result.trainer = trainer
    result.summary = run_report.finish(trainer, result)
    return result


def bf16_matmul_route(cfg: TrainConfig, device: torch.device) -> tuple[str, str]:
    """("fp32" | "native", why) for this run's bf16 matmuls (``cpu_bf16_matmul``). A run compiles when its
    model is compiled (CUDA only)."""
    compiles = device.type == "cuda" and cfg.compile
    return cpu_bf16_matmul.resolve(cfg.cpu_bf16_matmul, device.type, compiles)


def apply_cpu_threads(cfg: TrainConfig, device: torch.device) -> None:
    """torch's intra-op threads on the CPU from ``cpu_threads`` (0 leaves torch's default)."""
    if device.type == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
