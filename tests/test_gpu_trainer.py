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


def run_stages(tmp_path, stages: str, *overrides: str):
    """trainer.run on CUDA over the schedule ``stages`` (comma-joined stage dicts), with record-sized micro
    batches (49,152 tokens) and a 65,536-token validation, plus ``overrides``."""
    from hydra import compose, initialize_config_dir

    from tests.test_train import CONFIGS

    common = [
        f"runs_root={tmp_path}",
        "device=cuda",
        "progress_bar=false",
        f"schedule.stages=[{stages}]",
        "schedule.rail_warmup_steps=4",
        "schedule.rail_cooldown_steps=2",
        "micro_batch_tokens=49152",
        "data.val_tokens=65536",
        "data.val_batch_tokens=65536",
        "data.synthetic.val_tokens=65536",
        "model.max_seq_len=65536",
        "log_every=1",
    ]
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=common + list(overrides))
    return trainer.run(cfg)


@pytest.mark.parametrize("mlp_impl", ["reference", "triton"])
def test_compiled_steps_lower_the_loss_from_the_first_step_and_match_eager(tmp_path, mlp_impl):
    # the compiled run's MLPs as torch ops (Inductor's fusions) or as the fused-epilogue kernels' custom ops;
    # the eager run is the reference either way
    common = ["device=cuda", "warmup=false", "check_every=1", "log_every=1", "schedule.lr_floor=1.0"]
    compiled = trainer.run(
        short_cfg(str(tmp_path / "c"), *common, "compile=true", f"model.mlp_impl={mlp_impl}")
    )
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


@pytest.mark.parametrize("attention", ["auto", "fa4"])
def test_the_timed_loop_makes_no_graph_over_the_record_schedules_shapes(tmp_path, attention):
    # The one-GPU record schedule's five geometries on the tiny model, 6 steps a stage: its three micro-batch
    # shapes (32,768 / 49,152 / 40,960 tokens, here one or two micro batches a step instead of 4-8, which
    # changes no graph), its windows, MTP counts and ramps, the extension and the embed split. The warmup runs
    # the representative steps; the timed loop meets MTP ramp values and loader batches the warmup never saw.
    # With flash-attn-4 the windows enter as host ints: a graph per window pair, each made in the warmup at
    # its stage's start, and graph breaks around its layers.
    if attention == "fa4":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed on this machine")
    stages = ",".join(
        f"{{steps:6,batch_tokens:{b},max_doc_len:{d},window_short:{ws},window_long:{wl},mtp_weights:{m}"
        + (f",mtp_weights_end:{e}" if e else "")
        + (",extension:true" if x else "")
        + "}"
        for b, d, ws, wl, m, e, x in (
            (65536, 896, 1, 3, "[1.0,0.5,0.25]", "[1.0,0.5,0.0]", False),
            (65536, 2048, 3, 7, "[1.0,0.5]", "[1.0,0.0]", False),
            (98304, 3072, 5, 11, "[1.0]", "", False),
            (81920, 3072, 5, 11, "[1.0]", "", False),
            (32768, 3072, 6, 13, "[1.0]", "", True),
        )
    )
    result = run_stages(
        tmp_path,
        stages,
        "schedule.split_embed_step=25",
        "data.synthetic.train_tokens=4194304",
        "data.synthetic.shard_tokens=2097152",
        f"model.attention_impl={attention}",
    )
    ev = events(result.run_dir)
    end = next(e for e in ev if e["event"] == "end")  # the run's summary event follows it
    assert end["status"] == "finished"
    assert end["timed_loop_graphs"] == 0, end
    # Each micro-batch shape compiles its training forward once, plus validation and the optimizer's pieces;
    # Dynamo may split a graph, so a few per shape, not one per step (30 steps) or per stage.
    # On failure, where the graphs came from: the warmup's per-step counts from the run's log.
    growth = [
        line.strip() for line in (result.run_dir / "log.txt").read_text().splitlines() if "graphs so" in line
    ]
    if attention == "auto":
        assert 3 <= end["graphs"] <= 4 * 3, (end["graphs"], growth)
    warm = [e for e in ev if e["event"] == "phase" and e["name"] == "warmup"]
    assert warm and warm[0]["graphs"] == end["graphs"]


def test_the_timed_loop_makes_no_graph_over_the_sampled_softmaxs_candidate_counts(tmp_path):
    # Three stages of two micro-batch shapes with the sampled softmax's counts changing at stage boundaries
    # and inside stage 2 (its thirds, as the record's), then the full softmax: each (shape, P) is a graph,
    # all made in the warmup. 512 corpus words, so every micro batch's distinct targets fit P = 640.
    stages = ",".join(
        f"{{steps:6,batch_tokens:{b},max_doc_len:2048,window_short:1,window_long:3,sampled_candidates:{p}}}"
        for b, p in ((32768, "[640]"), (49152, "[640]"), (49152, "[768,768,1024]"), (32768, "[0]"))
    )
    result = run_stages(
        tmp_path,
        stages,
        "data.synthetic.n_words=512",
        "data.synthetic.train_tokens=2097152",
        "data.synthetic.shard_tokens=1048576",
    )
    ev = events(result.run_dir)
    end = next(e for e in ev if e["event"] == "end")
    assert end["status"] == "finished"
    assert end["timed_loop_graphs"] == 0, end
    warm = [e for e in ev if e["event"] == "phase" and e["name"] == "warmup"]
    assert warm and warm[0]["graphs"] == end["graphs"]
    # (32768, 640), (49152, 640), (49152, 768), (49152, 1024), (32768, full): five training graphs at least.
    assert end["graphs"] >= 5, end


def test_the_fused_replicated_adam_ends_a_deterministic_compiled_run_with_the_reference_bits(tmp_path):
    # deterministic=true makes the compiled CUDA run repeat itself bit for bit (fused twice: without it,
    # Inductor's atomic scatter-adds in the embedding backwards differ from run to run), which is what makes
    # the fused path's promise testable over a whole run: its end state is the per-parameter path's.
    import torch._dynamo

    from tests.test_train import MICRO, STEPS
    from tools.compare_checkpoints import compare
    from track_1_short import checkpoint

    torch._dynamo.reset()  # no graph compiled outside deterministic mode by an earlier test is reused
    common = ["device=cuda", MICRO, "deterministic=true", "checkpoint.final=true"]
    runs = {
        name: trainer.run(short_cfg(str(tmp_path / name), *common, f"optim.replicated_impl={impl}"))
        for name, impl in (("fused", "fused"), ("again", "fused"), ("reference", "reference"))
    }
    final = {name: checkpoint.load(r.run_dir / "checkpoints") for name, r in runs.items()}
    assert final["fused"]["step"] == sum(STEPS)
    for name in ("again", "reference"):
        entries, diffs = compare(final["fused"], final[name])
        assert diffs == [], (name, entries, diffs[:5])
        assert runs[name].train_losses == runs["fused"].train_losses, name
    torch._dynamo.reset()
