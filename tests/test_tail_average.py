"""Tail averaging through the trainer (track_1_short/optim/tail_average.py) on the 6-step short config.

The windows are 4 steps (of 6), the periods 2: every accumulator seeds and ticks several times, Adam and
non-Adam steps alike. The shipped weights are checked against a restatement from the weights recorded after
every step, in float64, from the documented cadences (not from the module's code).
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from tests.distributed_harness import run_ranks
from tests.faults_runs import final_state, scenarios_worker, short_cfg
from tests.test_faults import CKPT, assert_params_within_reduction_order, assert_tree_bitwise_equal, die
from track_1_short import checkpoint, trainer
from track_1_short.config import ConfigError, to_object
from track_1_short.optim.tail_average import TailAverages

N, W, PERIOD = 6, 4, 2
TAIL = (
    "tail.enabled=true",
    f"tail.ema_window={W}",
    f"tail.avg_window={W}",
    f"tail.avg_period={PERIOD}",
    f"tail.value_embed_window={W}",
    f"tail.bank_blend_window={W}",
    f"tail.bank_blend_period={PERIOD}",
)
LABELS = ("lm_head", "embed", "value_embeds", "qk_bank", "vo_bank", "mlp_bank")
EMA_BLEND, AVG_RATE, BANK_BLEND, RICHARDSON = 0.65, 4 / 53, 0.55, 0.2007
SLOW_TICK, SLOW_S = 4, 0.25  # the fixture's tick after this step sleeps: the tail timer must see it there


@pytest.fixture(scope="module")
def tail_run(tmp_path_factory):
    """One process with tail averaging and checkpoints every 2 steps; the weights after every step, and the
    shipped weights before their norms are restored."""
    root = tmp_path_factory.mktemp("tail")
    after_step: dict[int, dict[str, torch.Tensor]] = {}
    seen: dict[str, object] = {}
    real_tick, real_restore = TailAverages.tick, TailAverages.restore_norms

    def tick(self, step):
        after_step[step] = {k: self.opt.params[k].detach().double().clone() for k in LABELS}
        if step == SLOW_TICK:
            time.sleep(SLOW_S)
        return real_tick(self, step)

    def restore_norms(self, before):
        seen["before"] = dict(before)
        seen["shipped"] = {k: self.opt.params[k].detach().clone() for k in LABELS}
        ratios = real_restore(self, before)
        seen["ratios"] = ratios
        return ratios

    mp = pytest.MonkeyPatch()
    mp.setattr(TailAverages, "tick", tick)
    mp.setattr(TailAverages, "restore_norms", restore_norms)
    try:
        r = trainer.run(short_cfg(str(root), *TAIL, *CKPT, "run_name=tail"))
    finally:
        mp.undo()
    return {"result": r, "after_step": after_step, **seen, **final_state(r.trainer)}


def _ema(values: list[torch.Tensor], rates: list[float]) -> torch.Tensor:
    acc = values[0].clone()  # the first tick seeds
    for v, r in zip(values[1:], rates[1:]):
        acc = (1 - r) * acc + r * v
    return acc


def _restated(after_step: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The module docstring's table, restated for N = 6 steps, windows 4 (steps 2..5), periods 2, adam_every
    2 (Adam on odd steps) and value_embeds updated on every Adam step (its period-4 cadence starts later)."""
    w = lambda s, k: after_step[s][k]  # noqa: E731
    r = 2 / (W + 1)
    # tail-ema: seeds at step 2, ticks on the Adam step 3 at 1 - (1 - r)^2, and on the last step at r.
    ema_steps, ema_rates = [2, 3, 5], [None, 1 - (1 - r) ** 2, r]
    # tail-avg: steps 5 and 3 ((N - 1 - s) % 2 == 0, s >= 2); value-embed-avg: its update steps 3 and 5.
    avg_steps = [3, 5]
    # bank-blend: s % 2 == 1 or s >= N - 2, s >= 2: steps 3, 4, 5; rate 2 / (4 // 2 + 1).
    bank_steps, bank_r = [3, 4, 5], 2 / (W // PERIOD + 1)
    last = {k: w(N - 1, k) for k in LABELS}
    out = {}
    out_avg = {}
    for k in ("lm_head", "embed"):
        ema = _ema([w(s, k) for s in ema_steps], ema_rates)
        out[k] = (1 - EMA_BLEND) * last[k] + EMA_BLEND * ema
    for k in ("vo_bank", "mlp_bank", "value_embeds"):
        out[k] = out_avg[k] = _ema([w(s, k) for s in avg_steps], [None, AVG_RATE])
    for k, b in (
        ("qk_bank", BANK_BLEND),
        ("vo_bank", BANK_BLEND - RICHARDSON),
        ("mlp_bank", BANK_BLEND - RICHARDSON),
    ):
        ema = _ema([w(s, k) for s in bank_steps], [None, bank_r, bank_r])
        start = last[k] if k == "qk_bank" else out[k]  # vo/mlp blend from their shipped tail average
        out[k] = (1 - b) * start + b * ema
    return out, out_avg


@pytest.mark.slow
def test_the_shipped_weights_equal_a_restatement_from_the_per_step_weights(tail_run):
    want, avg = _restated(tail_run["after_step"])
    last = tail_run["after_step"][N - 1]
    for k in LABELS:
        got = tail_run["shipped"][k].double()
        # One rounding to the weight's dtype on the store (relative eps / 2), plus the fp32 accumulators'
        # roundings over three ticks (a few fp32 ulps of the largest element). vo/mlp are stored twice: the
        # tail average, rounded, then the blend from it, which carries (1 - b) of that first rounding.
        eps = torch.finfo(tail_run["shipped"][k].dtype).eps
        tol = eps / 2 * want[k].abs() + 1e-6 * want[k].abs().max()
        if k in ("vo_bank", "mlp_bank"):
            tol = tol + eps / 2 * (1 - (BANK_BLEND - RICHARDSON)) * avg[k].abs()
        excess = ((got - want[k]).abs() - tol).max().item()
        assert excess <= 0, f"{k}: exceeds the rounding bound by {excess:.3g}"
        # The ship moved a good share of every label's elements beyond that bound: a wrong blend or a blend
        # on the wrong label shows.
        moved = ((want[k] - last[k]).abs() > tol).double().mean().item()
        assert moved > 0.05, (k, moved)


@pytest.mark.slow
def test_the_norms_are_restored_to_their_pre_ship_values(tail_run):
    before, ratios = tail_run["before"], tail_run["ratios"]
    assert set(before) == {"embed", "lm_head", "mlp_bank", "qk_bank", "vo_bank"}
    last = tail_run["after_step"][N - 1]
    for k, norm in before.items():
        assert norm == pytest.approx(float(last[k].norm()), rel=1e-6)  # the last iterate's norm
        shipped = tail_run["shipped"][k].double()
        # The rescale itself, before its store rounds: the norm to 1e-6 relative (fp32 norms, one ratio).
        assert float((ratios[k] * shipped).norm()) == pytest.approx(norm, rel=1e-6), k
        # The stored weights are that rescale, each element rounded once to the weight's dtype (eps / 2
        # relative; 1e-6 for the fp32 product before it), so their norm is within that of the target.
        final, scaled = tail_run["params"][k].double(), ratios[k] * shipped
        rel = torch.finfo(tail_run["params"][k].dtype).eps / 2 + 1e-6
        assert bool(((final - scaled).abs() <= rel * scaled.abs()).all()), k
        assert abs(float(final.norm()) - norm) <= rel * norm, k
    # Averaging shrank the embeddings' and the MLP bank's norms by far more than any rounding: the restore
    # is visible (measured here: ratios of 1.02 to 1.11).
    for k in ("embed", "lm_head", "mlp_bank"):
        assert ratios[k] > 1.005, (k, ratios[k])


@pytest.mark.slow
def test_tail_off_is_bitwise_the_last_iterate(tail_run, tmp_path):
    off = trainer.run(short_cfg(str(tmp_path), "run_name=off"))
    params = final_state(off.trainer)["params"]
    for k in LABELS:  # accumulating never touches the weights it reads
        assert torch.equal(params[k].double(), tail_run["after_step"][N - 1][k]), k
    events = (off.run_dir / "events.jsonl").read_text()
    assert '"weights": "last iterate"' in events and "val_loss_last_iterate" not in events


@pytest.mark.slow
def test_the_run_reports_the_last_iterate_and_the_averaged_loss(tail_run):
    r = tail_run["result"]
    log = (r.run_dir / "log.txt").read_text()
    events = [
        line for line in (r.run_dir / "events.jsonl").read_text().splitlines() if '"event": "val"' in line
    ]
    final = json.loads(events[-1])
    assert (
        final["weights"] == "tail-averaged" and final["val_loss"] == final["val_loss_unmasked"] == r.val_loss
    )
    assert math.isfinite(final["val_loss_last_iterate"]) and final["val_loss_last_iterate"] != r.val_loss
    assert f"val_loss_last_iterate:{final['val_loss_last_iterate']:.4f}" in log
    assert "final validation (tail-averaged weights)" in log


def test_train_events_time_the_tail_accumulators_in_the_interval_that_holds_them(tail_run):
    # check_every is 1 on the CPU: each train event covers one step, and the step-4 tick slept SLOW_S.
    events = (tail_run["result"].run_dir / "events.jsonl").read_text().splitlines()
    train = {e["step"]: e for e in map(json.loads, events) if e["event"] == "train"}
    assert sorted(train) == list(range(1, N + 1))
    slow = {s - 1 for s, e in train.items() if e["tail_ms"] >= 1e3 * SLOW_S}
    assert slow == {SLOW_TICK}, {s: e["tail_ms"] for s, e in train.items()}


@pytest.mark.slow
def test_killed_inside_the_tail_and_resumed_ends_bitwise_equal(tail_run, tmp_path):
    die(tmp_path, "step", 5, *TAIL)  # SIGKILL at the start of step 5: the last checkpoint is step 4's
    ckpts = tmp_path / "killed" / "checkpoints"
    assert checkpoint.resolve(ckpts).name == checkpoint.checkpoint_name(4)
    saved = checkpoint.load(checkpoint.resolve(ckpts))["tail"]
    assert saved["tail-ema/lm_head"]["seeded"] and saved["bank-blend/qk_bank"]["seeded"]  # inside the tail
    resumed = trainer.run(short_cfg(str(tmp_path), *TAIL, f"resume={ckpts}"))
    state = final_state(resumed.trainer)
    assert_tree_bitwise_equal(state["params"], tail_run["params"], "params")
    assert resumed.val_loss == tail_run["result"].val_loss


def test_windows_longer_than_the_run_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"tail\.ema_window=298 must lie in \[1, 6\]"):
        to_object(short_cfg(str(tmp_path), "tail.enabled=true"))
    to_object(short_cfg(str(tmp_path)))  # off, upstream's windows are not checked


@pytest.mark.slow
def test_two_gloo_ranks_match_one_within_reduction_order_and_reshard_the_accumulators(tail_run, tmp_path):
    root = str(tmp_path)
    step4 = str(tail_run["result"].run_dir / "checkpoints" / checkpoint.checkpoint_name(4))
    scenarios = {
        "train": ("train", root, (*TAIL, "run_name=two")),
        "from_one": ("resume", root, step4, (*TAIL, "run_name=from_one")),
    }
    ranks = run_ranks(scenarios_worker, 2, scenarios)
    for name in scenarios:
        a, b = (r[name] for r in ranks)
        assert "error" not in a, a
        assert_tree_bitwise_equal(a["params"], b["params"], f"{name}: the ranks agree")
    # Six steps at two ranks: the bounds of tests/test_train.py for the same global batch (fp32 reduction
    # order, amplified through bf16 weights), on the losses and on the final (tail-averaged) val loss.
    two, one = ranks[0]["train"], tail_run["result"]
    assert max(abs(x - y) for x, y in zip(two["losses"], one.train_losses)) < 0.05
    assert abs(two["val"] - one.val_loss) < 0.02
    # Resumed at two ranks from the one-rank checkpoint of step 4, inside the tail: the accumulators reshard,
    # and the two remaining steps land within the reduction-order bound of tests/test_faults.py.
    assert_params_within_reduction_order(ranks[0]["from_one"]["params"], tail_run["params"], one.trainer, 2)
