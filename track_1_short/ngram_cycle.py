"""The trainer's side of the n-gram table: optimizer cycles, validation pulls, warmup restore, checkpoints.

A cycle is the run of steps up to and including one table update (optim/ngram_adam.py ``ngram_cadence``). At
the previous cycle's update step, after its last backward (for the run's first cycle: at its first step), the
trainer's batches for every step of the cycle are read ahead (the loader's position after each step is kept)
and hashed, and the pull's unique rows are found; at the cycle's first step its rows are pulled once
(model/ngram.py ``NgramTable.plan`` and ``fill``), and the steps then take their batches from here. After
each micro batch's backward its row gradient is folded into the cycle's per-row sums (fp32); at the update
step they go back to their owners and the row-sparse Adam updates the rows.

Checkpoints: every rank writes its shard, its Adam rows and the cycle's gradient so far into a file of its
own beside the main checkpoint (``step_NNNNNN.ngram-RRR-of-WWW.pt``, atomic like it), before rank 0 writes
the main file and moves ``latest``: a kill at any moment leaves ``latest`` naming a checkpoint whose files are
all whole. The main checkpoint's loader entry is the position after the last step run, not the read-ahead.
A resume reads every saved shard file that overlaps this rank's rows, so a different world size re-shards the
table and its Adam rows exactly; a cycle's gradient so far is per rank, so only a checkpoint taken at a cycle
boundary (none pending) can be resumed on another world size.

What guards the table: it is sharded, not replicated, so the replica checksum cannot cover it. At each
update step the cycle's merged row gradients are checked for NaN/inf before the guards run, and the guards
read that flag with the model's (guards.py: one all-reduce and one host read for both): with
guards.nan_policy "skip" the step and the table's update are dropped on every rank, "stop" raises naming the
table; a checkpoint refuses a non-finite shard or Adam row (checkpoint.assert_finite).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import Tensor

from track_1_short import checkpoint, schedule
from track_1_short.config import accumulation_steps
from track_1_short.model.ngram import NgramTable, PullPlan, ngram_indices_of
from track_1_short.optim.ngram_adam import NgramAdam, ngram_cadence, row_mean_sq
from track_1_short.optimizer_time import OptimizerTime

SHARD_FORMAT = 1


class NgramCycle:
    def __init__(self, trainer) -> None:
        cfg = trainer.cfg
        self.cfg, self.trainer = cfg, trainer
        self.ncfg = cfg.model.ngram
        self.table = NgramTable(self.ncfg, rank=trainer.rank, world=trainer.world, device=trainer.device)
        self.opt = NgramAdam(self.table, self.ncfg, cfg.optim)
        trainer.model.attach_ngram(self.table)
        # step -> its micro batches, read ahead for the cycle, each with its n-gram (row ids, sign rows)
        self.queue: dict[int, list] = {}
        self.loader_after: dict[int, dict] = {}  # step -> the loader's position after its batches
        # The pulls' and the table updates' hold on the step, bracketed as the optimizer's is (device time on
        # CUDA, read at log steps only): the train events' ngram_pull_ms and ngram_update_ms.
        self.pull_time = OptimizerTime(trainer.device)
        self.update_time = OptimizerTime(trainer.device)
        # The folds of the micro batches' row gradients into the cycle's sums (ngram_fold_ms): the table's
        # cost after each backward, which neither bracket above holds.
        self.fold_time = OptimizerTime(trainer.device)
        # The rows they moved (host counts: a pull's size is known on the host once its ids are unique), so
        # that a report can set each against the bytes it had to move (perf/run_summary.py).
        self.pull_rows = self.update_rows = 0
        self.skipped_updates: list[int] = []
        self._closing: tuple[Tensor, Tensor, Tensor] | None = None  # the update's (rows, grads, mean_sq)
        self._plan: PullPlan | None = None  # the read-ahead cycle's pull, planned, not yet filled
        cuda = self.table.device.type == "cuda"
        self.index_stream = torch.cuda.Stream(self.table.device) if cuda else None

    # -- the cycle --

    def cycle_end(self, step: int) -> int:
        """The update step that closes the cycle holding ``step`` (the run's last step if none comes)."""
        last = self.trainer.total_steps - 1
        s = step
        while s < last and not ngram_cadence(self.cfg.optim, s, self.ncfg)[0]:
            s += 1
        return s

    def batches(self, step: int) -> list:
        """The micro batches of ``step``, each as (batch, its n-gram row ids and sign rows). At a cycle's
        first step the cycle's rows are pulled: its batches were read ahead and its pull planned at the
        previous cycle's update step (:meth:`close_cycle`), or are now (the run's first cycle, a resume, or a
        step out of sequence: the warmup's)."""
        if step not in self.queue:
            self._read_cycle(step)
        if self._plan is not None:
            plan, self._plan = self._plan, None
            self.pull_time.start()
            self.table.fill(plan)
            self.pull_time.stop()
            self.pull_rows += self.table.want.numel()
        return self.queue.pop(step)

    def _read_cycle(self, first: int) -> None:
        """Read the batches of the cycle that starts at ``first`` ahead, hash them all at once and plan their
        pull (NgramTable.plan: the unique rows, read to the host); :meth:`batches` fills the cache.

        On CUDA this runs on a stream of its own: the plan's read to the host then waits for this hashing
        only, not for the step queued on the main stream, so the host reads, hashes and plans while the
        device runs the step (on one stream the read drained the queue, and the device idled meanwhile)."""
        if self.table.per_slot is not None:  # a jump (warmup): the unfinished cycle is abandoned
            self.table.reset_cache()
        # the position after the step before this cycle stays: a checkpoint there names it
        kept = {first - 1: self.loader_after[first - 1]} if first - 1 in self.loader_after else {}
        self.loader_after = kept
        steps = range(first, self.cycle_end(first) + 1)
        # a carried gradient (after a resume) was made on the main stream: plan beside it, on it
        side = self.index_stream if self.table.carry is None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            read = self._read_ahead(steps)
            cycle = [b for s in steps for b in read[s]]
            given = [(b.inputs, b.cu_seqlens) for b in cycle]
            ids = iter(ngram_indices_of(given, self.ncfg, self.cfg.model.cross_document_lookback))
            self.queue = {s: [(b, next(ids)) for b in read[s]] for s in steps}
            self._plan = self.table.plan([rows for s in steps for _, (rows, _) in self.queue[s]])
        if side is not None:
            main = torch.cuda.current_stream(self.table.device)
            main.wait_stream(side)
            # made on the side stream, read on the main one: their memory is not reused before then
            for s in steps:
                for b, (rows, signs) in self.queue[s]:
                    for t in (*b, rows, signs):
                        t.record_stream(main)
            self._plan.want.record_stream(main)

    def _read_ahead(self, steps: range) -> dict[int, list]:
        """The batches of ``steps`` from the trainer's loader (its position after each kept)."""
        loader, read = self.trainer.loader, {}
        for s in steps:
            plan = schedule.plan(self.cfg.schedule, s, self.cfg.optim.adam_every)
            accum = accumulation_steps(plan.batch_tokens, self.trainer.world, self.cfg.micro_batch_tokens)
            micro = plan.batch_tokens // self.trainer.world // accum
            read[s] = [loader.next_batch(micro, plan.max_doc_len) for _ in range(accum)]
            self.loader_after[s] = loader.state_dict()
        return read

    def after_backward(self) -> None:
        """Fold a micro batch's row gradient into the cycle's sums as soon as it exists, so that one micro
        batch's sink (2T x dim) is alive at a time, not a whole step's."""
        self.fold_time.start()
        self.table.fold_sinks()
        self.fold_time.stop()

    def close_cycle(self, step: int) -> Tensor | None:
        """Collective. At an update step, after its last backward and before the guards: end the cycle (its
        row gradients summed on their owners), read the next cycle ahead and plan its pull, and return the
        row gradients' non-finite flag [1] (1.0: NaN or inf) for the guards to read with the step's own
        check (guards.Guards.grads_ok's ``extra``); None at other steps.

        The table is sharded, so the replica checksum cannot cover it: this flag is what guards it. Read in
        the guards' one host read of the step, it costs no sync of its own (a read here drained the step's
        optimizer, and the device idled while the host read the next cycle ahead). The next cycle is read
        here because the host is ahead of the device here: it runs the step's last backward meanwhile."""
        if not self.opt.due(step):
            return None
        self.update_time.start()
        rows, grads = self.table.row_grads()
        # The row mean squares are non-finite exactly where a row's gradient holds NaN or inf (or squares
        # past fp32's range, where the update would be lost anyway): checked on those [N] values, not on the
        # [N, dim] gradient, and computed once for the update too.
        mean_sq = row_mean_sq(grads)
        self.update_time.stop()
        self._closing = (rows, grads, mean_sq)
        if step + 1 < self.trainer.total_steps and self.table.carry is None:
            self._read_cycle(step + 1)
        return (~torch.isfinite(mean_sq).all()).float().reshape(1)

    def after_step(self, step: int, lr_multiplier: float, applied: bool) -> None:
        """After the step's optimizer update (``applied``: the guards let it through, the table's flag
        included); at the cycle's update step, update the table. A skipped step drops the table's gradient
        so far: at an update step the update is skipped (no event, no row moves), at another the cycle's
        sums restart from zero."""
        closing, self._closing = self._closing, None
        if closing is None:
            if self.opt.due(step):
                raise RuntimeError(
                    f"NgramCycle.after_step: step {step} updates the table, but close_cycle() was not "
                    "called after its backward (the guards read its flag)."
                )
            self.table.fold_sinks()
            if not applied:
                self.table.per_slot.zero_()
            return
        if not applied:
            self.skipped_updates.append(step)
            return
        rows, grads, mean_sq = closing
        _, beta2, wd_mul = ngram_cadence(self.cfg.optim, step, self.ncfg)
        self.update_time.start()
        self.opt.update(
            rows,
            grads,
            lr=self.cfg.optim.adam_lr * lr_multiplier,
            beta2=beta2,
            wd_mul=wd_mul,
            mean_sq=mean_sq,
        )
        self.update_time.stop()
        self.update_rows += rows.numel()

    def take_ms(self) -> dict[str, float]:
        """The pulls', the updates' and the folds' time (ms), and the rows pulled and updated, since the last
        call, for a train event; after a sync."""
        out = {
            "ngram_pull_ms": self.pull_time.take_ms(),
            "ngram_update_ms": self.update_time.take_ms(),
            "ngram_fold_ms": self.fold_time.take_ms(),
            "ngram_pull_rows": self.pull_rows,
            "ngram_update_rows": self.update_rows,
        }
        self.pull_rows = self.update_rows = 0
        return out

    def reset_times(self) -> None:
        """Forget the warmup's pulls, updates and folds: they are not the timed loop's."""
        self.pull_time.reset()
        self.update_time.reset()
        self.fold_time.reset()
        self.pull_rows = self.update_rows = 0

    # -- validation --

    def begin_eval(self) -> None:
        self.table.begin_eval()

    def eval_batch(self, inputs, cu) -> None:
        """Collective: pull one validation batch's rows (the training cycle's cache stays aside; not timed:
        validation is not the train time)."""
        self.table.pull([self.trainer.model.ngram_indices(inputs, cu)[0]])

    def end_eval(self) -> None:
        self.table.end_eval()

    # -- state: warmup restore, checkpoints --

    def loader_state(self, step: int) -> dict:
        """The loader's position after step ``step - 1`` ran (the read-ahead excluded)."""
        return self.loader_after.get(step - 1, self.trainer.loader.state_dict())

    def state(self) -> dict:
        """This rank's table state (CPU copies): its real rows, their Adam state, the cycle's gradient."""
        t, o = self.table, self.opt
        real = max(0, min(t.per_rank, self.ncfg.rows - t.first_row))
        rows, grads = t.pending()
        return {
            "format": SHARD_FORMAT,
            "rows": self.ncfg.rows,
            "world_size": t.world,
            "first_row": t.first_row,
            "shard": t.shard[:real].detach().to("cpu", copy=True),
            "exp_avg_sq": o.exp_avg_sq[:real].to("cpu", copy=True),
            "last_event": o.last_event[:real].to("cpu", copy=True),
            "beta2_history": o.beta2_history[: o.events + 1].to("cpu", copy=True),
            "events": o.events,
            "pending_rows": rows.cpu(),
            "pending_grads": grads.cpu(),
        }

    def snapshot(self) -> dict:
        """What the warmup restores: a marker while the table is untouched (zero table, no update: restored
        in place, never copied), else :meth:`state`."""
        fresh = self.opt.events == 0 and self.table.carry is None and self.table.per_slot is None
        return {"fresh": True} if fresh else self.state()

    def restore(self, snap: dict) -> None:
        self.queue.clear()
        self.loader_after.clear()
        self._plan = None
        self.table.reset_cache()
        if snap.get("fresh"):
            self.table.zero_()
            self.opt.reset()
        else:
            self.load_states([snap], own=True)

    @torch.no_grad()
    def load_states(self, states: list[dict], own: bool = False) -> None:
        """This rank's rows from saved shard states covering the table (any world size they were saved at);
        ``own``: one state, this rank's own (the warmup's snapshot), so no other rank's rows are needed."""
        t, o = self.table, self.opt
        for st in states:
            if st.get("format") != SHARD_FORMAT or st.get("rows") != self.ncfg.rows:
                raise checkpoint.CheckpointError(
                    f"an n-gram shard file has format {st.get('format')!r} and {st.get('rows')!r} rows; this "
                    f"run reads format {SHARD_FORMAT} with model.ngram.rows={self.ncfg.rows}. Resume with "
                    "the model config the checkpoint was written with."
                )
        covered = sorted((int(st["first_row"]), int(st["first_row"]) + st["shard"].shape[0]) for st in states)
        end = 0
        for a, b in covered:
            if a != end:
                break
            end = b
        if end != self.ncfg.rows and not own:
            raise checkpoint.CheckpointError(
                f"the n-gram shard files cover rows up to {end} of {self.ncfg.rows} without a gap: a shard "
                "file is missing; resume from a checkpoint whose files are all present."
            )
        events = {int(st["events"]) for st in states}
        pending = [st for st in states if st["pending_rows"].numel()]
        if pending and len(states) != t.world and not own:
            raise checkpoint.CheckpointError(
                f"the checkpoint was taken inside an n-gram update cycle on {len(states)} ranks; it resumes "
                f"only on {len(states)} ranks (this run has {t.world}). Resume from a checkpoint at an "
                "update step."
            )
        if len(events) != 1:
            raise checkpoint.CheckpointError(f"the n-gram shard files disagree on the update count {events}.")
        lo, hi = t.first_row, min(t.first_row + t.per_rank, self.ncfg.rows)
        t.shard.zero_()
        for st in states:
            a, b = int(st["first_row"]), int(st["first_row"]) + st["shard"].shape[0]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                t.shard[s - lo : e - lo] = st["shard"][s - a : e - a].to(t.shard.device)
                o.exp_avg_sq[s - lo : e - lo] = st["exp_avg_sq"][s - a : e - a].to(o.exp_avg_sq.device)
                o.last_event[s - lo : e - lo] = st["last_event"][s - a : e - a].to(o.last_event.device)
        history = states[0]["beta2_history"]
        o.events = int(states[0]["events"])
        if o.beta2_history.numel() <= history.numel():  # grown as the update grows it; else loaded in place
            o.beta2_history = torch.zeros(2 * history.numel(), device=o.beta2_history.device)
        o.beta2_history.zero_()
        o.beta2_history[: history.numel()] = history.to(o.beta2_history.device)
        mine = (
            states
            if own
            else [st for st in states if int(st["first_row"]) == t.first_row and len(states) == t.world]
        )
        t.carry = None
        if mine and mine[0]["pending_rows"].numel():
            t.carry_gradient(mine[0]["pending_rows"], mine[0]["pending_grads"])

    def shard_file(
        self, ckpt_dir: Path, step: int, rank: int | None = None, world: int | None = None
    ) -> Path:
        rank = self.table.rank if rank is None else rank
        world = self.table.world if world is None else world
        return Path(ckpt_dir) / f"{checkpoint.checkpoint_name(step)[:-3]}.ngram-{rank:03d}-of-{world:03d}.pt"

    def save(self, ckpt_dir: Path, step: int) -> None:
        """Every rank: write this rank's shard file (atomically); the caller then writes the main file."""
        state = self.state()
        for key in ("shard", "exp_avg_sq", "pending_grads"):
            checkpoint.assert_finite(state[key], f"n-gram table {key}")
        checkpoint.save_side_file(self.shard_file(ckpt_dir, step), {"step": step, **state})

    def load(self, main_file: Path) -> None:
        """Read every shard file beside ``main_file`` (written at whatever world size) and take this rank's
        rows."""
        stem = main_file.name[:-3]
        files = sorted(main_file.parent.glob(f"{stem}.ngram-*-of-*.pt"))
        if not files:
            raise checkpoint.CheckpointError(
                f"{main_file} has no n-gram shard files beside it ({stem}.ngram-*.pt) but "
                "model.ngram.enabled is true: it was written without the table; resume with "
                "model.ngram.enabled=false."
            )
        worlds = {f.name.rsplit("-of-", 1)[1][:-3] for f in files}
        if len(worlds) != 1 or len(files) != int(next(iter(worlds))):
            raise checkpoint.CheckpointError(
                f"the n-gram shard files beside {main_file} are {[f.name for f in files]}: not one whole set "
                "(ngram-000-of-W .. ngram-(W-1)-of-W); resume from a checkpoint whose files are all present."
            )
        self.queue.clear()
        self.loader_after.clear()
        self._plan = None
        self.table.reset_cache()
        self.load_states([checkpoint.load_side_file(f) for f in files])
