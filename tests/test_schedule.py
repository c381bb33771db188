"""The schedule's pure functions against the upstream record's published values (upstream-optim 6.1)."""

import pytest
from omegaconf import OmegaConf

from track_1_short import schedule
from track_1_short.schedule import ScheduleConfig, StageConfig

CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[1] / "configs"


def load(name: str) -> ScheduleConfig:
    merged = OmegaConf.merge(
        OmegaConf.structured(ScheduleConfig), OmegaConf.load(CONFIGS / "schedule" / f"{name}.yaml")
    )
    return OmegaConf.to_object(merged)


@pytest.fixture(scope="module")
def track1() -> ScheduleConfig:
    return load("track1")


def test_track1_stage_boundaries_and_token_volume_match_the_record(track1):
    assert schedule.total_steps(track1) == 1194
    assert schedule.main_steps(track1) == 1174
    assert schedule.stage_starts(track1) == [0, 320, 681, 1107, 1174]
    assert schedule.flops_budget_tokens(track1) == 328_663_040  # upstream-model 1.3


def test_track1_lr_multiplier_matches_published_effective_values(track1):
    # Published to 2 decimals: 1.41 at 320, 1.05 at 681, 0.39 at 1107; flat until step int(1174*0.2).
    assert schedule.lr_multiplier(track1, 0) == 1.0
    assert schedule.lr_multiplier(track1, 234) == 1.0
    assert schedule.lr_multiplier(track1, 235) < 1.0
    assert round(schedule.lr_multiplier(track1, 320), 2) == 1.41
    assert round(schedule.lr_multiplier(track1, 681), 2) == 1.05
    assert round(schedule.lr_multiplier(track1, 1107), 2) == 0.39
    assert [schedule.lr_multiplier(track1, s) for s in (1174, 1193)] == [0.30, 0.30]


def test_track1_rail_beta_matches_published_values(track1):
    got = [schedule.rail_beta(track1, s) for s in (0, 120, 240, 1144, 1193)]
    assert got == pytest.approx([0.85, 0.89, 0.93, 0.93, 0.8516], abs=1e-12)


def test_lr_multiplier_is_continuous_inside_the_cooldown_of_one_stage(track1):
    # Within a stage the cooldown is linear: equal steps give equal decrements (up to float rounding).
    d1 = schedule.lr_multiplier(track1, 400) - schedule.lr_multiplier(track1, 401)
    d2 = schedule.lr_multiplier(track1, 500) - schedule.lr_multiplier(track1, 501)
    assert d1 > 0 and d1 == pytest.approx(d2, rel=1e-9)


def test_adam_runs_on_odd_steps_for_cadence_two():
    assert [schedule.do_adam(s, 2) for s in range(6)] == [False, True, False, True, False, True]
    assert all(schedule.do_adam(s, 1) for s in range(4))
    assert [schedule.do_adam(s, 3) for s in range(6)] == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="adam_every"):
        schedule.do_adam(0, 0)


def test_mtp_weights_lerp_across_the_stage(track1):
    assert schedule.mtp_weights(track1, 0) == [1.0, 0.5, 0.25]
    assert schedule.mtp_weights(track1, 320) == [1.0, 0.5]
    assert schedule.mtp_weights(track1, 700) == [1.0]


@pytest.mark.parametrize("step", [0, 1, 160, 318, 319])
def test_mtp_ramp_is_upstreams_fraction_of_the_stage_done(track1, step):
    # Upstream TrainingSchedule.lookup: t = (step - start) / (end - start), end exclusive (stage 0: 320).
    t = (step - 0) / (320 - 0)
    expected = [a + (b - a) * t for a, b in zip([1.0, 0.5, 0.25], [1.0, 0.5, 0.0])]
    assert schedule.mtp_weights(track1, step) == expected
    t1 = (step + 320 - 320) / (681 - 320)  # stage 1, same offset into it
    expected1 = [a + (b - a) * t1 for a, b in zip([1.0, 0.5], [1.0, 0.0])]
    assert schedule.mtp_weights(track1, 320 + step) == expected1


def test_taper_lr_mul_is_upstreams_formula_to_the_double(track1):
    assert track1.stages[3].lr_mul == 1.73 * (20 / 24) ** 0.5  # upstream config.py TAPER_BATCH_UNITS = 20


def test_embed_split_follows_the_last_tied_update(track1):
    # Upstream: step 1175 (odd, an Adam step) updates tied, then copy_lm_state_to_embed; 1176 is untied.
    assert [s for s in range(1194) if schedule.embed_split(track1, s)] == [1176]
    assert schedule.do_adam(track1.split_embed_step, 2)
    never = ScheduleConfig(split_embed_step=-1)
    assert not any(schedule.embed_split(never, s) for s in range(schedule.total_steps(never)))


def test_plan_gathers_the_stage_geometry(track1):
    p = schedule.plan(track1, 700, adam_every=2)
    assert (p.stage, p.batch_tokens, p.max_doc_len, p.windows) == (2, 393216, 3072, (5, 11))
    assert p.do_adam is False and schedule.plan(track1, 701, 2).do_adam is True
    assert schedule.val_windows(track1) == (6, 20)


def test_warmup_steps_cover_every_transition_and_the_split(track1):
    steps = schedule.warmup_steps(track1, adam_every=2)
    for start in (320, 681, 1107, 1174):
        assert {start - 2, start - 1, start, start + 1} <= set(steps)
    assert {0, 1, 1175, 1176, 1177, 1178} <= set(steps)
    assert steps == sorted(set(steps)) and max(steps) < 1194


def test_step_outside_the_schedule_is_rejected(track1):
    with pytest.raises(ValueError, match="outside"):
        schedule.lr_multiplier(track1, 1194)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": []}, "empty"),
        ({"stages": [StageConfig(steps=0)]}, "positive"),
        ({"stages": [StageConfig(window_short=4, window_long=2)]}, "window"),
        ({"stages": [StageConfig(mtp_weights=[1.0, 0.5], mtp_weights_end=[1.0])]}, "mtp_weights_end"),
        ({"stages": [StageConfig(extension=True), StageConfig()]}, "extension"),
        ({"stages": [StageConfig(extension=True)]}, "main stage"),
        ({"cooldown_frac": 1.5}, "cooldown_frac"),
        ({"split_embed_step": -3}, "split_embed_step"),
    ],
)
def test_impossible_schedules_are_rejected_with_the_field_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_every_schedule_preset_is_valid():
    for path in sorted((CONFIGS / "schedule").glob("*.yaml")):
        cfg = load(path.stem)
        assert schedule.total_steps(cfg) > 0


# -- exact endpoints, on a schedule small enough to state every value by hand --
M0, M1, FLOOR = 2.0, 1.0, 0.25  # stage lr multipliers and the floor: exact binary fractions
HAND = ScheduleConfig(
    stages=[
        StageConfig(steps=10, lr_mul=M0, window_short=1, window_long=2, mtp_weights=[1.0, 0.5, 0.25],
                    mtp_weights_end=[1.0, 0.0, 0.75]),
        StageConfig(steps=10, lr_mul=M1, batch_tokens=4096, window_short=2, window_long=4),
        StageConfig(steps=4, lr_mul=M0, extension=True),
    ],
    cooldown_frac=0.4,  # main stages 20 steps: the cooldown runs from step 12 to the floor at step 20
    lr_floor=FLOOR,
    rail_beta_start=0.5,
    rail_beta_peak=0.75,
    rail_beta_end=0.25,
    rail_warmup_steps=4,
    rail_cooldown_steps=8,  # of the 24 steps: from step 16
)  # fmt: skip


def test_lr_cooldown_starts_where_stated_and_reaches_the_floor_exactly_where_the_main_stages_end():
    lr = [schedule.lr_multiplier(HAND, s) for s in range(24)]
    assert lr[:10] == [M0] * 10 and lr[10:13] == [M1] * 3  # flat until the cooldown's first step, 12
    # Linear from M1 at step 12 to FLOOR at step 20: step 12 + k is k/8 of the way.
    for k in range(8):
        assert lr[12 + k] == pytest.approx(M1 + (FLOOR - M1) * k / 8, rel=1e-15, abs=0), 12 + k
    assert lr[19] == pytest.approx(FLOOR + (M1 - FLOOR) / 8, rel=1e-15) and lr[19] > FLOOR
    assert lr[20:] == [FLOOR] * 4  # the floor from the end of the main stages, extension included


def test_rail_beta_warmup_and_cooldown_endpoints_are_exact():
    beta = [schedule.rail_beta(HAND, s) for s in range(24)]
    assert beta[0] == 0.5 and beta[4] == 0.75 and beta[15] == 0.75 and beta[16] == 0.75
    assert beta[3] == pytest.approx(0.5 + 0.25 * 3 / 4, rel=1e-15) and beta[3] < 0.75
    # The cooldown heads for rail_beta_end one step after the last: 7/8 of the way at step 23.
    assert beta[23] == pytest.approx(0.75 - 0.5 * 7 / 8, rel=1e-15) and beta[23] > 0.25
    assert beta[17] == pytest.approx(0.75 - 0.5 / 8, rel=1e-15)


def test_stage_boundaries_and_the_mtp_taper_are_exact():
    last0, first1 = schedule.plan(HAND, 9, 2), schedule.plan(HAND, 10, 2)
    assert (last0.stage, last0.windows, last0.batch_tokens) == (0, (1, 2), 8192)
    assert (first1.stage, first1.windows, first1.batch_tokens) == (1, (2, 4), 4096)
    assert schedule.plan(HAND, 20, 2).stage == 2 and schedule.plan(HAND, 19, 2).stage == 1
    # The taper runs linearly from the stage's first step (mtp_weights) toward mtp_weights_end with upstream's
    # fraction (step - start) / steps: over 10 steps the last one reaches 9/10 of the way, not the end.
    assert schedule.mtp_weights(HAND, 0) == [1.0, 0.5, 0.25]
    assert schedule.mtp_weights(HAND, 9) == pytest.approx([1.0, 0.5 - 0.45, 0.25 + 0.45], rel=1e-15)
    assert schedule.mtp_weights(HAND, 3) == pytest.approx([1.0, 0.5 - 0.15, 0.25 + 0.15], rel=1e-15)
    assert first1.mtp_weights == (1.0,)
