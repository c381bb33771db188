"""The n-gram table in the trainer: cycles, checkpoints, kills and world sizes.

The runs are tests/faults_runs.py's short config (6 steps of 512 tokens, checkpoints every 2) with a small
table. ``optim.value_embed_period4_start=0`` makes every cycle 4 steps long (one update, at step 3), so the
checkpoint after step 2 is taken inside a cycle, with its gradient so far pending.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed_harness import run_ranks
from tests.faults_runs import build, final_state, run_route, short_cfg
from tests.test_faults import CKPT, assert_tree_bitwise_equal, die
from track_1_short import checkpoint, trainer
from track_1_short.checkpoint import CheckpointError
from track_1_short.guards import FaultInjectionConfig, GuardConfig, Guards, NonFiniteGradError
from track_1_short.model.config import NgramConfig
from track_1_short.model.ngram import ngram_embed
from track_1_short.ngram_cycle import NgramCycle
from track_1_short.optim.anvil import OptimConfig
from track_1_short.run_log import read_events

NG = (
    "model.mudd_gate_lanes=10",
    "model.ngram.enabled=true",
    "model.ngram.rows=4096",
    "model.ngram.dim=64",
    "model.ngram.sign_pool_rows=64",
    "model.ngram.inject_layers=[0,1,3,6]",
    "optim.replicated_impl=reference",
)
LONG_CYCLES = ("optim.value_embed_period4_start=0",)


def table_state(t: trainer.Trainer) -> dict:
    state = t.ngram.state()
    return {k: state[k] for k in ("shard", "exp_avg_sq", "last_event", "beta2_history", "events")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram_ref")
    r = trainer.run(short_cfg(str(root), *CKPT, *NG, *LONG_CYCLES, "run_name=ref"))
    return {
        "ckpts": r.run_dir / "checkpoints",
        "table": table_state(r.trainer),
        "events": read_events(r.run_dir),
        "last_pull_rows": r.trainer.ngram.table.want.numel(),  # the run ends inside the cycle of step 4
        **final_state(r.trainer),
    }


def test_train_events_time_the_pulls_updates_and_folds_in_the_intervals_that_hold_them(uninterrupted):
    # Every train event covers one step here (check_every 1 on the CPU). Cycles of 4 steps: pulls at steps 0
    # and 4 (each cycle's first step fills its cache; step 4's was read ahead at step 3), the update at step
    # 3 (the next would be at 7: the run's 6 steps end inside that cycle), folds after every backward.
    train = {e["step"]: e for e in uninterrupted["events"] if e["event"] == "train"}
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    pulled = {s - 1 for s, e in train.items() if e["ngram_pull_ms"] > 0}
    updated = {s - 1 for s, e in train.items() if e["ngram_update_ms"] > 0}
    folded = {s - 1 for s, e in train.items() if e["ngram_fold_ms"] > 0}
    assert pulled == {0, 4} and updated == {3} and folded == set(range(6)), (pulled, updated, folded)
    # The rows they moved: the update at step 3 moves exactly the rows the cycle's pull at step 0 fetched
    # (world size 1), the pull at step 4 the rows its cycle's cache still holds; other intervals none.
    pull_rows = {s - 1: e["ngram_pull_rows"] for s, e in train.items() if e["ngram_pull_rows"]}
    update_rows = {s - 1: e["ngram_update_rows"] for s, e in train.items() if e["ngram_update_rows"]}
    assert pull_rows == {0: pull_rows[0], 4: uninterrupted["last_pull_rows"]} and pull_rows[0] > 0
    assert update_rows == {3: pull_rows[0]}, (pull_rows, update_rows)


def test_the_next_cycle_is_read_ahead_and_planned_at_the_update_step_before_the_guards_read(tmp_path):
    """The host reads, hashes and plans the next cycle while the device still runs the update step's last
    backward (before the guards' one host read), and its rows are pulled at that cycle's first step."""
    cfg = short_cfg(str(tmp_path), *NG, *LONG_CYCLES)
    with run_route(cfg):
        t = build(cfg)
        seen = {}
        real = t.guards.grads_ok

        def grads_ok(step, extra=None):
            seen[step] = (sorted(t.ngram.queue), t.ngram._plan is not None, extra is not None)
            return real(step, extra)

        t.guards.grads_ok = grads_ok
        for step in range(5):
            t.train_step(step)
            if step == 3:
                planned = t.ngram._plan.want.clone()
        # steps 0-2: the cycle's later steps queued, nothing planned; step 3 (its update): the next cycle's
        # steps 4 and 5 (the run's end) read ahead and planned, the table's flag handed to the guards
        assert seen == {
            0: ([1, 2, 3], False, False),
            1: ([2, 3], False, False),
            2: ([3], False, False),
            3: ([4, 5], True, True),
            4: ([5], False, False),
        }, seen
        assert torch.equal(t.ngram.table.want, planned)  # step 4 pulled what step 3 planned


@pytest.mark.slow
@pytest.mark.parametrize("step, warmup", [(2, False), (4, False), (2, True)])
def test_resume_is_bitwise_inside_and_at_the_end_of_a_cycle(uninterrupted, step, warmup, tmp_path):
    """``warmup``: the resumed run warms up first (as on CUDA), then restores the loaded table in place."""
    ckpt = uninterrupted["ckpts"] / checkpoint.checkpoint_name(step)
    pending = checkpoint.load_side_file(checkpoint.side_files(ckpt)[0])["pending_rows"]
    assert (pending.numel() > 0) == (step == 2)  # after step 2 the cycle's gradient is pending
    resume = (f"resume={ckpt}", "run_name=resumed", f"warmup={str(warmup).lower()}")
    r = trainer.run(short_cfg(str(tmp_path), *CKPT, *NG, *LONG_CYCLES, *resume))
    assert uninterrupted["table"]["events"] == 1
    assert uninterrupted["table"]["shard"].float().abs().sum() > 0  # the update moved rows
    assert_tree_bitwise_equal(table_state(r.trainer), uninterrupted["table"], "table")
    assert_tree_bitwise_equal(final_state(r.trainer)["params"], uninterrupted["params"], "params")


@pytest.mark.slow
def test_kill_while_writing_a_shard_file_leaves_the_previous_checkpoint_whole(uninterrupted, tmp_path):
    die(tmp_path, "bytes", 4, *NG, *LONG_CYCLES)  # the first file of step 4 written is this rank's shard file
    ckpts = tmp_path / "killed" / "checkpoints"
    assert (ckpts / "step_000004.ngram-000-of-001.pt.tmp").is_file()
    assert (
        not (ckpts / "step_000004.pt").exists() and not (ckpts / "step_000004.ngram-000-of-001.pt").exists()
    )
    assert checkpoint.resolve(ckpts).name == "step_000002.pt"
    resumed = trainer.run(short_cfg(str(tmp_path), *CKPT, *NG, *LONG_CYCLES, f"resume={ckpts}", "run_name=r"))
    assert_tree_bitwise_equal(table_state(resumed.trainer), uninterrupted["table"], "table")
    assert_tree_bitwise_equal(final_state(resumed.trainer)["params"], uninterrupted["params"], "params")


def _cycle(rank: int, world: int, cfg: NgramConfig, nan_policy: str = "stop") -> NgramCycle:
    """A table and its optimizer as the trainer builds them, without a model or data."""
    fake = SimpleNamespace(
        cfg=SimpleNamespace(
            model=SimpleNamespace(ngram=cfg),
            optim=OptimConfig(),
            guards=SimpleNamespace(nan_policy=nan_policy),
        ),
        rank=rank,
        world=world,
        device=torch.device("cpu"),
        total_steps=2,
        model=SimpleNamespace(attach_ngram=lambda table: None),
    )
    return NgramCycle(fake)


def _whole(cycles: list[NgramCycle]) -> dict:
    states = [c.state() for c in cycles]
    return {k: torch.cat([s[k] for s in states]) for k in ("shard", "exp_avg_sq", "last_event")}


def test_resume_across_world_sizes_reshards_rows_and_adam_state_exactly(tmp_path):
    """1 -> 2 -> 3 -> 1 ranks through the shard files: every row, second moment and event stamp in place."""
    cfg = NgramConfig(enabled=True, rows=998, dim=8)  # 3 ranks: 333 rows each, one padding row
    (one,) = cycles = [_cycle(0, 1, cfg)]
    g = torch.Generator().manual_seed(0)
    one.table.shard.copy_(torch.randn(998, 8, generator=g))
    one.opt.exp_avg_sq.copy_(torch.rand(998, generator=g))
    one.opt.last_event.copy_(torch.randint(0, 4, (998,), generator=g))
    one.opt.events = 3
    one.opt.beta2_history[1:4] = torch.tensor([0.95, 0.95, 0.9025])
    original = _whole(cycles)
    for step, world in enumerate([2, 3, 1], start=1):
        ckpt = tmp_path / f"w{world}"
        for c in cycles:
            c.save(ckpt, step)
        (ckpt / checkpoint.checkpoint_name(step)).write_bytes(b"")  # the main file the side files sit beside
        cycles = [_cycle(r, world, cfg) for r in range(world)]
        for c in cycles:
            c.load(ckpt / checkpoint.checkpoint_name(step))
            assert c.opt.events == 3 and torch.equal(c.opt.beta2_history[:4], one.opt.beta2_history[:4])
        assert_tree_bitwise_equal(_whole(cycles), original, f"world {world}")
        if world == 3:
            assert cycles[-1].table.shard[-1].eq(0).all()  # the padding row


def test_a_cycle_in_progress_resumes_only_on_its_world_size(tmp_path):
    cfg = NgramConfig(enabled=True, rows=64, dim=4)
    cycles = [_cycle(r, 2, cfg) for r in range(2)]
    for c in cycles:
        c.table.carry_gradient(torch.tensor([1, 40]), torch.ones(2, 4))
        c.save(tmp_path, 2)
    main = tmp_path / checkpoint.checkpoint_name(2)
    main.write_bytes(b"")
    with pytest.raises(CheckpointError, match="inside an n-gram update cycle on 2 ranks"):
        _cycle(0, 1, cfg).load(main)
    (tmp_path / "step_000002.ngram-001-of-002.pt").unlink()
    with pytest.raises(CheckpointError, match="not one whole set"):
        _cycle(0, 2, cfg).load(main)


def _gloo_train(rank, world, runs_root):
    r = trainer.run(short_cfg(runs_root, *CKPT, *NG, "run_name=gloo"))
    return {"run_dir": str(r.run_dir), "table": table_state(r.trainer), "losses": r.train_losses}


@pytest.mark.slow
def test_two_gloo_ranks_train_checkpoint_and_resume_on_one(tmp_path):
    """Two ranks train with the table sharded; their step-4 checkpoint resumes on one process, which loads
    exactly the two shards' rows."""
    ranks = run_ranks(_gloo_train, 2, str(tmp_path))
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["table"]["events"] == 3
    ckpt = Path(ranks[0]["run_dir"]) / "checkpoints" / "step_000004.pt"
    saved = [checkpoint.load_side_file(f) for f in checkpoint.side_files(ckpt)]
    assert [s["world_size"] for s in saved] == [2, 2]
    cfg = short_cfg(str(tmp_path), *CKPT, *NG, f"resume={ckpt}", "run_name=one")
    with run_route(cfg):
        t = build(cfg)
        t.resume(str(ckpt))
    assert torch.equal(t.ngram.table.shard, torch.cat([s["shard"] for s in saved]))
    assert torch.equal(t.ngram.opt.exp_avg_sq, torch.cat([s["exp_avg_sq"] for s in saved]))
    assert t.ngram.opt.events == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.0])
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_row_gradient_stops_or_skips_the_step_through_the_guards(policy, bad):
    """The table is sharded, so the replica checksum cannot see it: at its update step the merged row
    gradients' flag joins the guards' one read of the step (no sync of its own), and a bad one stops the run
    naming the table or skips the step (the model's gradients and the table's update, on every rank); a
    finite one lets the update through."""
    cfg = NgramConfig(enabled=True, rows=64, dim=4)
    cycle = _cycle(0, 1, cfg)
    cycle.table.shard.fill_(1.0)
    ids, pool = torch.tensor([3, 5, 0, 0]), torch.ones(1, 4, dtype=torch.bfloat16)
    cycle.table.pull([ids])
    # position 0 reads rows 3 and 0, position 1 rows 5 and 0
    out = ngram_embed(cycle.table.lookup(ids), pool, torch.zeros(4, dtype=torch.int64))
    (out.float() * torch.tensor([[1.0], [bad]])).sum().backward()
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    guards = Guards(GuardConfig(nan_policy=policy), FaultInjectionConfig(), {"w": weight}, {}, [])
    before = cycle.table.shard.clone()
    with pytest.raises(RuntimeError, match="close_cycle"):
        cycle.after_step(1, 1.0, applied=True)  # an update step whose flag the guards never saw
    flag = cycle.close_cycle(1)
    finite = math.isfinite(bad)
    if not finite and policy == "stop":
        with pytest.raises(NonFiniteGradError, match="'ngram_table' \\(on 1 of 1"):
            guards.grads_ok(1, {"ngram_table": flag})
        assert torch.equal(cycle.table.shard, before)
        return
    applied = guards.grads_ok(1, {"ngram_table": flag})
    assert applied == finite and (weight.grad is None) == (not finite)
    cycle.after_step(1, 1.0, applied)
    assert cycle.skipped_updates == ([] if finite else [1]) and cycle.opt.events == int(finite)
    moved = ~(cycle.table.shard == before).all(1)
    assert moved.nonzero().flatten().tolist() == ([0, 3, 5] if finite else [])


def test_the_warmup_restores_one_ranks_state_of_a_sharded_table_in_place():
    """A resumed run on several ranks warms up, then restores its own shard, Adam rows and carried
    gradient: nothing of the other ranks is needed (or read)."""
    cfg = NgramConfig(enabled=True, rows=998, dim=8)
    cycle = _cycle(1, 3, cfg)
    g = torch.Generator().manual_seed(1)
    cycle.table.shard.copy_(torch.randn(333, 8, generator=g))
    cycle.opt.exp_avg_sq.copy_(torch.rand(333, generator=g))
    cycle.opt.events = 2
    cycle.table.carry_gradient(torch.tensor([5, 400]), torch.randn(2, 8, generator=g))
    snap = cycle.snapshot()
    assert not snap.get("fresh")
    before = cycle.state()
    cycle.table.shard.zero_()
    cycle.opt.exp_avg_sq.zero_()
    cycle.opt.events = 7
    cycle.table.carry = None
    cycle.restore(snap)
    assert_tree_bitwise_equal(cycle.state(), before, "restored")
    fresh = _cycle(0, 3, cfg)
    assert fresh.snapshot() == {"fresh": True}


def test_a_model_config_saved_before_the_table_existed_compares_as_one_without_it():
    from omegaconf import OmegaConf

    from track_1_short.model.config import ModelConfig, saved_model_config

    current = OmegaConf.to_container(OmegaConf.structured(ModelConfig))
    old = {k: v for k, v in current.items() if k != "ngram"}
    assert saved_model_config(old) == current
    on = {**current, "ngram": {**current["ngram"], "enabled": True}}
    assert saved_model_config(on) == on  # a saved table config is compared as it is


def test_a_model_config_saved_before_a_switch_existed_compares_as_one_with_its_default():
    from omegaconf import OmegaConf

    from track_1_short.model.config import ModelConfig, saved_model_config

    current = OmegaConf.to_container(OmegaConf.structured(ModelConfig))
    old = {k: v for k, v in current.items() if k != "mlp_impl"}
    old["fp8"] = {k: v for k, v in current["fp8"].items() if k != "mlp_impl"}
    old["ngram"] = {k: v for k, v in current["ngram"].items() if k != "embed_impl"}
    assert saved_model_config(old) == current
    # a value that was saved is compared as it is: a run written with the kernel is not the reference's
    kernel = {**current, "mlp_impl": "triton", "fp8": {**current["fp8"], "mlp_impl": "triton"}}
    assert saved_model_config(kernel) == kernel != current
