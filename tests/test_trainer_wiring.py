"""What the trainer hands the optimizer and the model at every step equals schedule.plan(step).

The run tests (tests/test_train.py) compare runs of the same code with one another, so a trainer that
passes the wrong schedule value to everyone still agrees with itself. Here the optimizer's and the model's
entry points are wrapped in one short run (the 1,024-token vocabulary of tests/faults_runs.py, 8 steps over
three stages with distinct windows, a lerped MTP stage, an lr cooldown, an extension stage and the embedding
split) and every call is checked against the schedule's own answer.
"""

from __future__ import annotations

import pytest
import torch

from tests.faults_runs import build, run_route, short_cfg
from track_1_short import schedule
from track_1_short.schedule import StageConfig

STAGES = [
    StageConfig(steps=4, batch_tokens=512, max_doc_len=256, window_short=1, window_long=2, lr_mul=1.5,
                mtp_weights=[1.0, 0.5], mtp_weights_end=[1.0, 0.0], sampled_candidates=[384]),
    StageConfig(steps=3, batch_tokens=512, max_doc_len=512, window_short=2, window_long=3, lr_mul=1.2,
                sampled_candidates=[512, 640, 0]),
    StageConfig(steps=1, batch_tokens=512, max_doc_len=512, window_short=2, window_long=3, lr_mul=1.0,
                extension=True),
]  # fmt: skip
SPLIT = 5
# Prefix weights per stage, set once the trainer is built: this run's 1,024-id vocabulary is not GPT-2's, so
# the run's checks would refuse them, and the model gets a stand-in table (the wiring is under test here,
# not the table: tests/model/test_prefix_targets.py).
PREFIX_WEIGHTS = [[0.25, 0.2], [0.15, 0.1, 0.05], [0.0]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    cfg = short_cfg(
        str(tmp_path_factory.mktemp("wiring")), "checkpoint.every=0", "schedule.cooldown_frac=0.5"
    )
    cfg.schedule.stages = STAGES
    cfg.schedule.split_embed_step = SPLIT
    cfg.schedule.rail_warmup_steps, cfg.schedule.rail_cooldown_steps = 3, 3
    cfg.schedule.sampled_candidates_tokens = 256  # the micro batch's size: P as planned, not scaled
    t = build(cfg)
    for stage, weights in zip(t.cfg.schedule.stages, PREFIX_WEIGHTS):
        stage.prefix_weights = weights
    vocab = t.model.topo.vocab_padded
    stand_in = torch.where(torch.arange(vocab) % 3 == 0, -1, torch.arange(vocab) // 2)
    t.model.register_buffer("prefix_table", stand_in, persistent=False)
    t.model.cfg.prefix_targets = t.prefix_on = True
    calls: dict[str, list] = {
        "schedule": [],
        "step": [],
        "forward": [],
        "window_types": [],
        "split_model": [],
        "split_opt": [],
        "loss_fields": [],
        "candidate_sets": [],
    }
    current = {"step": None}

    def wrap(obj, name, record):
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            record(*args, **kwargs)
            return out

        setattr(obj, name, wrapper)

    def on_schedule(lr_multiplier, rail_beta, step):
        # What the optimizer holds after the call, not only what it was told.
        applied = {label: c.lr / c.initial_lr for label, c in t.opt.param_cfgs.items() if c.initial_lr}
        momentum = {label: c.momentum for label, c in t.opt.param_cfgs.items() if c.optim == "anvil"}
        calls["schedule"].append((current["step"], lr_multiplier, rail_beta, step, applied, momentum))

    real_train_step = t.train_step

    def train_step(step):
        current["step"] = step
        try:
            return real_train_step(step)
        finally:
            current["step"] = None

    t.train_step = train_step
    wrap(t.opt, "set_schedule", on_schedule)
    wrap(t.opt, "step", lambda do_adam: calls["step"].append((current["step"], do_adam)))
    wrap(t.opt, "split_embed", lambda: calls["split_opt"].append(current["step"]))
    wrap(t.model, "split_embed", lambda: calls["split_model"].append(current["step"]))
    wrap(
        t.model.candidate_sets,
        "build",
        lambda targets, p, offset: calls["candidate_sets"].append((current["step"], p, int(offset))),
    )

    def recording(real_forward):
        def forward(inputs, targets, cu_seqlens, windows, mtp_weights=None, **loss_fields):
            as_ints = tuple(int(w) for w in windows)
            calls["forward"].append((current["step"], as_ints, mtp_weights, inputs.numel()))
            calls["window_types"].append((current["step"], type(windows)))
            calls["loss_fields"].append((current["step"], dict(loss_fields)))
            return real_forward(inputs, targets, cu_seqlens, windows, mtp_weights, **loss_fields)

        return forward

    t.forward, t.val_forward = recording(t.forward), recording(t.val_forward)  # training, validation
    with run_route(cfg):  # trainer.run's matmuls, and its speed
        t.train()
    return t, calls


def plans(t):
    return [schedule.plan(t.cfg.schedule, s, t.cfg.optim.adam_every) for s in range(t.total_steps)]


def test_optimizer_receives_the_planned_lr_multiplier_and_rail_beta_every_step(recorded):
    t, calls = recorded
    got = calls["schedule"]
    assert [c[0] for c in got] == list(range(t.total_steps))
    for (step, lr_multiplier, rail_beta, step_arg, applied, momentum), plan in zip(got, plans(t)):
        assert (lr_multiplier, rail_beta, step_arg) == (plan.lr_multiplier, plan.rail_beta, step), step
        # initial_lr * m / initial_lr: one rounding each way, so equal to m within 2 ulps
        assert all(v == pytest.approx(plan.lr_multiplier, rel=1e-15) for v in applied.values()), step
        assert all(m == plan.rail_beta for m in momentum.values()), step
    # The schedule really varies over this run: a constant would not pass the checks above.
    assert len({c[1] for c in got}) >= 5 and len({c[2] for c in got}) >= 3


def test_optimizer_steps_once_per_step_with_the_planned_adam_cadence(recorded):
    t, calls = recorded
    assert calls["step"] == [(p.step, p.do_adam) for p in plans(t)]
    assert {d for _, d in calls["step"]} == {True, False}


def test_model_receives_the_planned_windows_and_mtp_weights_on_every_microbatch(recorded):
    t, calls = recorded
    train = [c for c in calls["forward"] if c[0] is not None]
    by_step: dict[int, list] = {}
    for step, windows, mtp, tokens in train:
        by_step.setdefault(step, []).append((windows, mtp, tokens))
    assert sorted(by_step) == list(range(t.total_steps))
    for plan in plans(t):
        micro = by_step[plan.step]
        assert sum(tokens for *_, tokens in micro) == plan.batch_tokens  # one rank: the global batch
        for windows, mtp, _ in micro:
            assert windows == plan.windows, plan.step
            # A tensor (a compiled model takes a new ramp value without a new graph), in fp32.
            # Zero-padded to the widest stage's count, so that every stage runs one graph.
            width = max(len(st.mtp_weights) for st in t.cfg.schedule.stages)
            padded = list(plan.mtp_weights) + [0.0] * (width - len(plan.mtp_weights))
            expected = torch.tensor(padded, dtype=torch.float32)
            assert isinstance(mtp, torch.Tensor) and torch.equal(mtp.cpu(), expected), plan.step
    assert len({w for _, w, _, _ in train}) == 2 and len({tuple(m) for _, _, m, _ in train}) >= 3
    # Training windows are a tensor too (one compiled graph for every stage), validation's are ints.
    kinds = {(step is None, kind) for step, kind in calls["window_types"]}
    assert kinds == {(False, torch.Tensor), (True, tuple)}, kinds
    val = [c for c in calls["forward"] if c[0] is None]
    assert val and all(w == schedule.val_windows(t.cfg.schedule) and m is None for _, w, m, _ in val)


def test_model_receives_the_planned_prefix_weight_and_candidate_count_on_every_microbatch(recorded):
    t, calls = recorded
    train = [(step, f) for step, f in calls["loss_fields"] if step is not None]
    plan_of = {p.step: p for p in plans(t)}
    assert sorted({step for step, _ in train}) == list(range(t.total_steps))
    for step, fields in train:
        plan = plan_of[step]
        # A device tensor, so that a compiled model takes every weight with one graph.
        weight = fields["prefix_weight"]
        assert isinstance(weight, torch.Tensor) and torch.equal(
            weight.cpu(), torch.tensor([plan.prefix_weight])
        )
        # The candidate set of the planned P, a tensor built outside the forward (one graph for every P).
        cand = fields.get("candidates")
        assert (0 if cand is None else cand.numel()) == plan.sampled_candidates, step
    # The run really varies both: five prefix weights and 0, three candidate counts and the full softmax.
    assert len({float(f["prefix_weight"]) for _, f in train}) == 6
    assert {0 if f.get("candidates") is None else f["candidates"].numel() for _, f in train} == {
        384,
        512,
        640,
        0,
    }
    # One candidate set per sampled micro batch, of the planned P; each micro batch of a step starts its
    # negatives elsewhere.
    built = calls["candidate_sets"]
    assert [(s, p) for s, p, _ in built] == [
        (s, f["candidates"].numel()) for s, f in train if f.get("candidates") is not None
    ]
    by_step: dict[int, list] = {}
    for step, _, offset in built:
        by_step.setdefault(step, []).append(offset)
    assert by_step and all(len(set(o)) == len(o) == 2 for o in by_step.values())
    # Validation forwards get neither.
    assert all(f == {} for step, f in calls["loss_fields"] if step is None)


def test_embedding_splits_in_model_and_optimizer_at_the_planned_step_only(recorded):
    # split_embed_step is the last step whose update is tied (upstream): the split comes at the next one.
    t, calls = recorded
    assert (
        calls["split_model"]
        == calls["split_opt"]
        == [p.step for p in plans(t) if p.split_embed]
        == [SPLIT + 1]
    )
    assert "tied_to" not in t.model.param_table()["embed"] and not t.opt.tied
    assert bool(t.model.embed_is_split)


@pytest.mark.parametrize("bank_update", ["eager", "triton"])
def test_the_bank_update_switch_reaches_every_bank_of_the_trainers_optimizer(tmp_path, bank_update):
    # optim.bank_update from the command line to the function each bank's update() calls; one step shows the
    # update runs inside the trainer (eager only: the Triton one, interpreted here, costs minutes a step, and
    # tests/perf/test_anvil_bank_triton.py steps it through the optimizer).
    from track_1_short.optim.anvil_bank import bank_update_, triton_bank_update_

    cfg = short_cfg(str(tmp_path), "checkpoint.every=0", f"optim.bank_update={bank_update}")
    t = build(cfg)
    assert t.cfg.optim.bank_update == bank_update
    fns = {label: bank.update_fn for label, bank in t.opt.banks.items()}
    want = bank_update_ if bank_update == "eager" else triton_bank_update_  # interpreted here (conftest)
    assert fns and all(fn is want for fn in fns.values()), fns
    if bank_update == "eager":
        with run_route(cfg):
            t.train_step(0)
