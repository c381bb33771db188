"""The trainer on CUDA, compiled: it learns from the first step, matches eager, and compiles only in warmup.

These run the trainer itself (trainer.run), not a copy of its step, on the tiny model with the compact
vocabulary, so that compiling takes seconds per graph.
"""

from __future__ import annotations

import json

import pytest

from tests.test_train import short_cfg
from track_1_short import trainer

pytestmark = pytest.mark.gpu


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_compiled_steps_lower_the_loss_from_the_first_step_and_match_eager(tmp_path):
    common = ["device=cuda", "warmup=false", "check_every=1", "log_every=1", "schedule.lr_floor=1.0"]
    compiled = trainer.run(short_cfg(str(tmp_path / "c"), *common, "compile=true"))
    eager = trainer.run(short_cfg(str(tmp_path / "e"), *common, "compile=false"))
    lc, le = compiled.train_losses, eager.train_losses
    assert len(lc) == len(le) == 8
    # Learning from step 0: every one of the first three steps lowers the loss (the bug kept it flat).
    assert lc[1] < lc[0] and lc[2] < lc[1] and lc[3] < lc[2], lc
    # Step 0 is the same forward of the same weights: Inductor fuses bf16 elementwise chains and keeps them
    # in fp32 between ops, where eager rounds every op's output to bf16, so the two agree to bf16 rounding of
    # a sum over T tokens (2^-8 relative per term, averaging out): 2e-3 relative.
    assert abs(lc[0] - le[0]) <= 2e-3 * abs(le[0]), (lc[0], le[0])
    # Later steps add the optimizer's response to those differences (sign-like updates can flip where a
    # gradient is near zero), so the runs drift apart slowly: 3% over 8 steps.
    for k, (a, b) in enumerate(zip(lc, le)):
        assert abs(a - b) <= 0.03 * abs(b), (k, a, b)
    assert abs(compiled.val_loss - eager.val_loss) <= 0.03 * eager.val_loss


def test_the_timed_loop_makes_no_graph_over_the_record_schedules_shapes(tmp_path):
    # The one-GPU record schedule's five geometries (micro batches of 32,768 / 49,152 / 40,960 tokens,
    # windows, MTP counts and the ramp, the embed split) with 8 steps a stage, on the tiny model. The warmup
    # runs 22 of the 40 steps; the timed loop meets MTP ramp values and loader batches the warmup never saw.
    stages = ",".join(
        f"{{steps:8,batch_tokens:{b},max_doc_len:{d},window_short:{ws},window_long:{wl},mtp_weights:{m}"
        + (f",mtp_weights_end:{e}" if e else "")
        + (",extension:true" if x else "")
        + "}"
        for b, d, ws, wl, m, e, x in (
            (131072, 896, 1, 3, "[1.0,0.5,0.25]", "[1.0,0.5,0.0]", False),
            (262144, 2048, 3, 7, "[1.0,0.5]", "[1.0,0.0]", False),
            (393216, 3072, 5, 11, "[1.0]", "", False),
            (327680, 3072, 5, 11, "[1.0]", "", False),
            (131072, 3072, 6, 13, "[1.0]", "", True),
        )
    )
    from hydra import compose, initialize_config_dir

    from tests.test_train import CONFIGS

    overrides = [
        f"runs_root={tmp_path}",
        "device=cuda",
        "progress_bar=false",
        f"schedule.stages=[{stages}]",
        "schedule.split_embed_step=33",
        "schedule.rail_warmup_steps=4",
        "schedule.rail_cooldown_steps=2",
        "micro_batch_tokens=49152",
        "data.val_tokens=262144",
        "data.val_batch_tokens=262144",
        "data.synthetic.train_tokens=12582912",
        "data.synthetic.val_tokens=262144",
        "data.synthetic.shard_tokens=4194304",
        "model.max_seq_len=262144",
        "log_every=1",
    ]
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=overrides)
    result = trainer.run(cfg)
    end = events(result.run_dir)[-1]
    assert end["status"] == "finished"
    assert end["timed_loop_graphs"] == 0, end
    # Each geometry compiles its forward once (training), plus validation; Dynamo may split a graph, so a
    # few per geometry, not one per step (40 steps).
    assert 6 <= end["graphs"] <= 3 * 6, end
    warm = [e for e in events(result.run_dir) if e["event"] == "phase" and e["name"] == "warmup"]
    assert warm and warm[0]["graphs"] == end["graphs"]
