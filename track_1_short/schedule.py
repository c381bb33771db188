"""The training schedule: what every step trains on and with which multipliers, as pure functions of the step.

A run is a list of stages, each a number of steps with one global batch size (tokens), one document length
cap (tokens), one pair of attention windows (short, long; in 128-token blocks) and one lr multiplier. On top
of the stages:

- the lr multiplier cools down linearly from the stage's own multiplier to ``lr_floor``, starting at
  ``(1 - cooldown_frac)`` of the main stages and reaching the floor where the main stages end; extension
  stages (``extension: true``, after the main stages) run at the floor;
- the ANVIL fast-rail beta warms up from ``rail_beta_start`` to ``rail_beta_peak`` over
  ``rail_warmup_steps`` and cools down to ``rail_beta_end`` over the last ``rail_cooldown_steps`` steps;
- Adam runs on steps with ``step % adam_every == adam_every - 1`` (the cadence lives in OptimConfig);
- the prefix-token target's weight and the sampled softmax's candidate count are per stage, a list of values
  that splits the stage into equal parts (upstream's stage-1 quarters and stage-2 thirds);
- the tied embedding splits from lm_head after ``split_embed_step``: that step's update is still tied (as
  upstream's, which copies the moments to embed after its optimizer step), the next step's forward is untied.

Where this follows upstream's formulas exactly (each pinned by tests/test_schedule.py): a stage's MTP
weights lerp by ``(step - start) / steps`` (upstream ``TrainingSchedule.lookup``: the fraction of the stage
done, so the end weights are approached, not reached, by its last step), and the taper's lr multiplier is
``1.73 * sqrt(20 / 24)`` to the double (configs/schedule/track1.yaml), not a 4-decimal rounding of it.

Nothing here holds state: the training loop, the warmup planner and the tests all ask the same functions.
Defaults and the track-1 stage table come from the upstream record (package ``config.py``/``schedule.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageConfig:
    steps: int = 100
    """Length of the stage in optimizer steps."""
    batch_tokens: int = 8192
    """Global batch in tokens per step, summed over ranks and accumulation microbatches."""
    max_doc_len: int = 1024
    """Longest document piece the loader emits, in tokens; longer documents are cut (upstream 896..3072)."""
    window_short: int = 1
    """Short sliding attention window, in 128-token blocks."""
    window_long: int = 3
    """Long sliding attention window, in 128-token blocks."""
    lr_mul: float = 1.0
    """lr multiplier of the stage before cooldown (upstream 1.0 / 1.52 / 1.73 / 1.73*sqrt(20/24))."""
    mtp_weights: list[float] = field(default_factory=lambda: [1.0])
    """Loss weights of predicting t+1, t+2, ... at the start of the stage."""
    mtp_weights_end: list[float] = field(default_factory=list)
    """Weights at the end of the stage, lerped linearly over it; empty = constant ``mtp_weights``."""
    extension: bool = False
    """An extension stage follows the main stages and trains at the lr floor (upstream's last 20 steps)."""
    prefix_weights: list[float] = field(default_factory=lambda: [0.0])
    """Weight of the prefix-token target (model/prefix_targets.py), one per equal part of the stage: upstream
    [0.25] in stage 0, [0.20, 0.15, 0.10, 0.05] (its quarters) in stage 1, 0 after; needs
    model.prefix_targets."""
    sampled_candidates: list[int] = field(default_factory=lambda: [0])
    """Candidates P of the sampled softmax (model/sampled_softmax.py), one per equal part of the stage, for
    micro batches of ``ScheduleConfig.sampled_candidates_tokens``; 0 = the full softmax. Upstream [10240] in
    stages 0 and 1, [14336, 14336, 24576] (its thirds) in stage 2, the full softmax after."""


def _default_stages() -> list[StageConfig]:
    return [StageConfig()]


@dataclass
class ScheduleConfig:
    stages: list[StageConfig] = field(default_factory=_default_stages)
    """The stages in order; extension stages must come last."""
    cooldown_frac: float = 0.8
    """Fraction of the main stages over which lr cools down linearly to the floor (upstream 0.8)."""
    lr_floor: float = 0.30
    """lr multiplier at the end of the main stages and during extension stages (upstream code 0.30)."""
    rail_beta_start: float = 0.85
    """ANVIL fast-rail beta at step 0 (upstream 0.85)."""
    rail_beta_peak: float = 0.93
    """Fast-rail beta after the warmup (upstream 0.93)."""
    rail_beta_end: float = 0.85
    """Fast-rail beta the cooldown heads for, reached one step after the last (upstream 0.85)."""
    rail_warmup_steps: int = 240
    """Steps of the linear rail-beta warmup (upstream 240)."""
    rail_cooldown_steps: int = 50
    """Last steps of the run over which the rail beta cools down linearly (upstream 50)."""
    split_embed_step: int = -1
    """The last step whose update is tied: the embedding splits from lm_head after it, so step
    split_embed_step + 1 is the first untied forward; -1 = never (upstream 1175, an Adam step)."""
    val_window_long: int = 0
    """Long window used by validation, in 128-token blocks; 0 = the last stage's (upstream extends to 20)."""
    sampled_candidates_tokens: int = 49152
    """The micro-batch size (tokens) the stages' ``sampled_candidates`` are set for (upstream's per-rank
    49,152); a larger micro batch holds more distinct targets and gets P scaled up in proportion
    (model/sampled_softmax.candidates_for)."""

    def __post_init__(self) -> None:
        validate(self)


def _stages(cfg) -> list:
    # Hydra hands us DictConfig nodes of StageConfig; both expose the same attributes.
    return list(cfg.stages)


def validate(cfg: ScheduleConfig) -> None:
    """Reject a schedule that cannot run, naming the field and the fix."""
    stages = _stages(cfg)
    if not stages:
        raise ValueError("schedule.stages is empty: give at least one stage (steps, batch_tokens, ...).")
    seen_extension = False
    for i, s in enumerate(stages):
        where = f"schedule.stages[{i}]"
        if s.steps <= 0 or s.batch_tokens <= 0 or s.max_doc_len <= 0:
            raise ValueError(f"{where}: steps, batch_tokens and max_doc_len must be positive.")
        if not 0 < s.window_short <= s.window_long:
            raise ValueError(
                f"{where}: windows must satisfy 0 < window_short <= window_long (128-token blocks)."
            )
        if s.mtp_weights_end and len(s.mtp_weights_end) != len(s.mtp_weights):
            raise ValueError(f"{where}: mtp_weights_end must be empty or as long as mtp_weights.")
        if not s.mtp_weights or s.mtp_weights[0] <= 0:
            raise ValueError(f"{where}: mtp_weights must start with a positive next-token weight.")
        if not s.prefix_weights or any(w < 0 for w in s.prefix_weights):
            raise ValueError(
                f"{where}: prefix_weights must be a non-empty list of weights >= 0 ([0.0]: none)."
            )
        if not s.sampled_candidates or any(p < 0 for p in s.sampled_candidates):
            raise ValueError(
                f"{where}: sampled_candidates must be a non-empty list of counts >= 0 ([0]: full softmax)."
            )
        if max(len(s.prefix_weights), len(s.sampled_candidates)) > s.steps:
            raise ValueError(
                f"{where}: prefix_weights and sampled_candidates have more parts than the stage steps."
            )
        if s.extension:
            seen_extension = True
        elif seen_extension:
            raise ValueError(f"{where}: a main stage follows an extension stage; put extension stages last.")
    if all(s.extension for s in stages):
        raise ValueError(
            "schedule.stages: every stage is an extension stage; at least one must be a main stage."
        )
    if not 0.0 <= cfg.cooldown_frac <= 1.0:
        raise ValueError(f"schedule.cooldown_frac={cfg.cooldown_frac} must lie in [0, 1].")
    if cfg.rail_warmup_steps < 0 or cfg.rail_cooldown_steps < 0:
        raise ValueError("schedule.rail_warmup_steps and rail_cooldown_steps must be >= 0.")
    if cfg.sampled_candidates_tokens <= 0:
        raise ValueError("schedule.sampled_candidates_tokens must be > 0 (upstream's micro batch: 49152).")
    if cfg.split_embed_step < -1:
        raise ValueError("schedule.split_embed_step must be -1 (never) or a step >= 0.")


def total_steps(cfg: ScheduleConfig) -> int:
    return sum(s.steps for s in _stages(cfg))


def main_steps(cfg: ScheduleConfig) -> int:
    """Steps of the main stages, i.e. the step at which the lr reaches its floor."""
    return sum(s.steps for s in _stages(cfg) if not s.extension)


def stage_starts(cfg: ScheduleConfig) -> list[int]:
    """First step of every stage."""
    starts, at = [], 0
    for s in _stages(cfg):
        starts.append(at)
        at += s.steps
    return starts


def stage_index(cfg: ScheduleConfig, step: int) -> int:
    if not 0 <= step < total_steps(cfg):
        raise ValueError(f"step {step} is outside the schedule's {total_steps(cfg)} steps.")
    for i, start in reversed(list(enumerate(stage_starts(cfg)))):
        if step >= start:
            return i
    raise AssertionError("unreachable")


def lr_multiplier(cfg: ScheduleConfig, step: int) -> float:
    """The stage's lr multiplier, lerped linearly to ``lr_floor`` over the cooldown; the floor after it."""
    stage = _stages(cfg)[stage_index(cfg, step)]
    end = main_steps(cfg)
    start = int(end * (1.0 - cfg.cooldown_frac))
    if step >= end or stage.extension:
        return float(cfg.lr_floor)
    if step < start or end == start:
        return float(stage.lr_mul)
    t = (step - start) / (end - start)
    return float(stage.lr_mul * (1.0 - t) + cfg.lr_floor * t)


def rail_beta(cfg: ScheduleConfig, step: int) -> float:
    """ANVIL fast-rail beta: linear warmup, plateau, linear cooldown over the last steps."""
    n = total_steps(cfg)
    beta = cfg.rail_beta_peak
    if cfg.rail_warmup_steps > 0 and step < cfg.rail_warmup_steps:
        t = step / cfg.rail_warmup_steps
        beta = cfg.rail_beta_start + (cfg.rail_beta_peak - cfg.rail_beta_start) * t
    cool_start = n - cfg.rail_cooldown_steps
    if cfg.rail_cooldown_steps > 0 and step >= cool_start:
        # Upstream: 0.93 at step 1144, 0.8516 at the last step 1193; rail_beta_end would be step 1194.
        t = (step - cool_start) / cfg.rail_cooldown_steps
        beta = min(beta, cfg.rail_beta_peak + (cfg.rail_beta_end - cfg.rail_beta_peak) * t)
    return float(beta)


def do_adam(step: int, adam_every: int) -> bool:
    """Adam updates on the last step of every ``adam_every``-step cycle (odd steps for 2)."""
    if adam_every < 1:
        raise ValueError(f"optim.adam_every={adam_every} must be >= 1.")
    return step % adam_every == adam_every - 1


def mtp_weights(cfg: ScheduleConfig, step: int) -> list[float]:
    """Multi-token-prediction loss weights at ``step``, lerped over the stage when an end is given.

    The lerp fraction is upstream's (step - stage start) / stage steps: 0 at the first step, (n - 1) / n at
    the last, so the end weights belong to the stage's (exclusive) end.
    """
    i = stage_index(cfg, step)
    stage = _stages(cfg)[i]
    start = list(stage.mtp_weights)
    if not stage.mtp_weights_end:
        return [float(w) for w in start]
    t = (step - stage_starts(cfg)[i]) / stage.steps
    return [float(a + (b - a) * t) for a, b in zip(start, stage.mtp_weights_end)]


def _stage_part(cfg: ScheduleConfig, step: int, values) -> tuple[int, int]:
    """(stage index, index into ``values(stage)``): a stage with n values splits into n equal parts, part
    (step - start) * n // steps (upstream's candidate_count_at)."""
    i = stage_index(cfg, step)
    stage = _stages(cfg)[i]
    return i, (step - stage_starts(cfg)[i]) * len(values(stage)) // stage.steps


def prefix_weight(cfg: ScheduleConfig, step: int) -> float:
    """The prefix-token target's loss weight at ``step``: its stage part's (constant within the part)."""
    i, part = _stage_part(cfg, step, lambda s: s.prefix_weights)
    return float(_stages(cfg)[i].prefix_weights[part])


def sampled_candidates(cfg: ScheduleConfig, step: int) -> int:
    """The sampled softmax's candidate count at ``step`` for the reference micro batch; 0 = full softmax."""
    i, part = _stage_part(cfg, step, lambda s: s.sampled_candidates)
    return int(_stages(cfg)[i].sampled_candidates[part])


def uses_prefix(cfg: ScheduleConfig) -> bool:
    return any(w > 0 for s in _stages(cfg) for w in s.prefix_weights)


def embed_split(cfg: ScheduleConfig, step: int) -> bool:
    """True on the step at whose start the embedding unties from lm_head: the one after split_embed_step.

    Untying at the start of step s + 1 is untying after step s's update: nothing runs in between. Upstream
    unties after step 1175's optimizer step (``copy_lm_state_to_embed``), so 1175's update is still tied.
    """
    return cfg.split_embed_step >= 0 and step == cfg.split_embed_step + 1


def val_windows(cfg: ScheduleConfig) -> tuple[int, int]:
    last = _stages(cfg)[-1]
    return int(last.window_short), int(cfg.val_window_long or last.window_long)


@dataclass(frozen=True)
class StepPlan:
    """Everything the training loop needs to know about one step."""

    step: int
    stage: int
    batch_tokens: int  # global, tokens
    max_doc_len: int  # tokens
    windows: tuple[int, int]  # (short, long), 128-token blocks
    lr_multiplier: float
    rail_beta: float
    do_adam: bool
    mtp_weights: tuple[float, ...]
    split_embed: bool
    prefix_weight: float = 0.0  # the prefix-token target's weight
    sampled_candidates: int = 0  # P for the reference micro batch (sampled_candidates_tokens); 0 = full


def plan(cfg: ScheduleConfig, step: int, adam_every: int) -> StepPlan:
    i = stage_index(cfg, step)
    s = _stages(cfg)[i]
    return StepPlan(
        step=step,
        stage=i,
        batch_tokens=int(s.batch_tokens),
        max_doc_len=int(s.max_doc_len),
        windows=(int(s.window_short), int(s.window_long)),
        lr_multiplier=lr_multiplier(cfg, step),
        rail_beta=rail_beta(cfg, step),
        do_adam=do_adam(step, adam_every),
        mtp_weights=tuple(mtp_weights(cfg, step)),
        split_embed=embed_split(cfg, step),
        prefix_weight=prefix_weight(cfg, step),
        sampled_candidates=sampled_candidates(cfg, step),
    )


def warmup_steps(cfg: ScheduleConfig, adam_every: int) -> list[int]:
    """Steps whose shapes and branches the untimed warmup must exercise before the clock starts.

    Steps 0..adam_every (both Adam and non-Adam steps), two before to one after every stage transition (new
    batch geometry, windows and MTP count), the step before and the first step of every new sampled-softmax
    count inside a stage (each P is its own graph), the last tied step and the three after it (a new forward).
    """
    n = total_steps(cfg)
    wanted = set(range(min(n, adam_every + 1)))
    for start in stage_starts(cfg)[1:]:
        wanted.update(range(start - 2, start + 2))
    for s in range(1, n):
        if sampled_candidates(cfg, s) != sampled_candidates(cfg, s - 1):
            wanted.update((s - 1, s))
    if cfg.split_embed_step >= 0:
        wanted.update(range(cfg.split_embed_step, cfg.split_embed_step + 4))
    return sorted(s for s in wanted if 0 <= s < n)


def flops_budget_tokens(cfg: ScheduleConfig) -> int:
    """Training tokens over the whole schedule."""
    return sum(s.steps * s.batch_tokens for s in _stages(cfg))
