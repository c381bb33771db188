"""The n-gram table in the trainer on CUDA: compiled (the lookup is a graph break), it learns, compiles only
in the warmup, and stays near the eager run; the Triton row update, fold and embedding run where the
references did."""

from __future__ import annotations

import json

import pytest
import torch

from tests.faults_runs import build
from tests.test_train import short_cfg
from track_1_short import trainer

pytestmark = pytest.mark.gpu

NG = (
    "model.mudd_gate_lanes=10",
    "model.ngram.enabled=true",
    "model.ngram.rows=65536",
    "model.ngram.dim=128",
    "model.ngram.sign_pool_rows=1024",
    "model.ngram.inject_layers=[0,1,3,6]",
)


def test_compiled_run_with_the_table_learns_compiles_in_warmup_and_stays_near_eager(tmp_path):
    common = ["device=cuda", "check_every=1", "log_every=1", "schedule.lr_floor=1.0", *NG]
    compiled = trainer.run(
        short_cfg(
            str(tmp_path / "c"),
            *common,
            "compile=true",
            "model.ngram.adam_impl=triton",
            "model.ngram.fold_impl=triton",
            "model.ngram.embed_impl=triton",
        )
    )
    eager = trainer.run(short_cfg(str(tmp_path / "e"), *common, "compile=false", "warmup=false"))
    lc, le = compiled.train_losses, eager.train_losses
    assert lc[1] < lc[0] and lc[2] < lc[1] and lc[3] < lc[2], lc
    # the bounds of tests/test_gpu_trainer.py: bf16 fusion differences, then the optimizer's response to them
    for k, (a, b) in enumerate(zip(lc, le)):
        assert abs(a - b) <= 0.03 * abs(b), (k, a, b)
    assert compiled.trainer.ngram.opt.events == eager.trainer.ngram.opt.events > 0
    events = [json.loads(line) for line in (compiled.run_dir / "events.jsonl").read_text().splitlines()]
    end = next(e for e in events if e["event"] == "end")
    assert end["timed_loop_graphs"] == 0, end
    assert any(e.get("ngram_pull_ms", 0) > 0 for e in events if e["event"] == "train")


def test_a_cycles_pull_leaves_the_queued_step_running_and_pulls_its_rows(tmp_path):
    """The pull's one host read (torch.unique's size, the shard cuts) waits for its own stream's read-ahead
    and hashing, not for the step queued before it on the main stream; the rows it pulls are the cycle's."""
    cfg = short_cfg(str(tmp_path), "device=cuda", "compile=false", "warmup=false", *NG)
    t = build(cfg)
    # once unmeasured, as the trainer's warmup does: first launches load kernels and first pinned buffers
    # are allocated, and either may wait for the device
    t.ngram._read_cycle(0)
    torch.cuda.synchronize()
    t.ngram.queue.clear()
    t.ngram._plan = None
    queued = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of the device's clock: the step still running
    queued.record()
    micro = t.ngram.batches(2)
    assert not queued.query(), "the pull waited for the work queued before it"
    torch.cuda.synchronize()
    cycle = [rows for s in [2, *t.ngram.queue] for _, (rows, _) in (micro if s == 2 else t.ngram.queue[s])]
    assert torch.equal(t.ngram.table.want, torch.unique(torch.cat(cycle)))
    assert t.ngram.table.cache.shape == (t.ngram.table.want.numel(), 128)
