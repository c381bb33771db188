"""The run-level config schema: one dataclass per Hydra group, composed into :class:`TrainConfig`.

Each group's dataclass lives next to its owner (ModelConfig in model/gpt.py, DataConfig in data.py,
OptimConfig in optim/anvil.py, ScheduleConfig in schedule.py); this module adds the run fields and registers
the whole tree in Hydra's ConfigStore as ``train_schema``. ``configs/train.yaml`` names that schema first in
its defaults list, so every group file and every command-line override is merged into typed nodes: an unknown
key or a value of the wrong type fails at compose time with Hydra's message, before anything runs.

Cross-group checks that need more than one group (vocabulary, batch geometry against the world size) are in
:func:`check_run`, called once the world size is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from track_1_short.data import DataConfig
from track_1_short.guards import FaultInjectionConfig, GuardConfig
from track_1_short.model.gpt import ModelConfig
from track_1_short.optim.anvil import OptimConfig
from track_1_short.schedule import ScheduleConfig


class ConfigError(ValueError):
    """A config that cannot run; the message is one paragraph naming the field and the fix."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a checkpoint every this many completed steps (a multiple of optim.adam_every); 0 = never (record
    runs keep it off)."""
    dir: str = ""
    """Where checkpoints go; "" = ``<run_dir>/checkpoints``."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints; 0 = keep all."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    """A test facility (track_1_short/guards.py): breaks a run on purpose; off by default."""

    seed: int = 0
    """Seed of the model init and every generator (same on every rank, so replicas start equal)."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cuda" or "cpu"."""
    runs_root: str = "runs"
    """Directory that holds one subdirectory per run."""
    run_name: str = ""
    """Name of this run's directory under runs_root; "" = a timestamp plus a random suffix."""
    resume: str | None = None
    """Checkpoint file, checkpoint directory or run directory to continue from; null = start fresh."""
    micro_batch_tokens: int = 0
    """Most tokens one rank runs in one forward; batches beyond it accumulate gradients. 0 = no accumulation.
    Fixes the global batch for any world size: 1 rank with 2 microbatches = 2 ranks with one."""
    loss_sum_ranks: int = 0
    """How the loss is normalised before backward. 0 = the per-token mean of the step's batch (ours: the
    gradient's scale does not move with the batch size). N > 0 = upstream's summed loss: the loss summed over
    the tokens one of N ranks holds (batch_tokens / N), whatever the world size here; N = 8 is the record's
    (its gradient scale grows with the stage's batch, which changes how Adam's moments, the rails and the
    epsilons weigh gradients across stage boundaries). The logged train loss is the per-token mean either
    way."""
    val_every: int = 0
    """Validate every this many steps as well as at the end; 0 = only the final validation (upstream)."""
    log_every: int = 25
    """Progress line in log.txt every this many steps and on the last two (upstream PRINT_EVERY 25)."""
    check_every: int = 0
    """Read the loss back (NaN/inf check, train event, progress bar) every this many steps;
    0 = every step on the CPU, every log_every steps on CUDA (a read-back is a device sync)."""
    compile: bool = True
    """torch.compile the model on CUDA (ignored on the CPU)."""
    warmup: bool | None = None
    """Run the representative steps untimed, then restore the initial state in place; null = on CUDA only."""
    progress_bar: bool = True
    """tqdm bar on rank 0 (loss, tokens/s, ETA)."""
    smoke_target: float | None = None
    """Target val loss the record gate tests this preset's runs against; null = none (record: 3.28)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_tokens", "val_every", "check_every", "loss_sum_ranks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0.")
        if self.log_every < 1:
            raise ConfigError(f"log_every={self.log_every} must be >= 1.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r} must be 'auto', 'cpu' or 'cuda'.")
        if self.checkpoint.every < 0 or self.checkpoint.keep_last < 0:
            raise ConfigError("checkpoint.every and checkpoint.keep_last must be >= 0.")
        if self.checkpoint.every % self.optim.adam_every:
            # Between Adam steps the Adam gradients accumulate in .grad, per rank and unreduced: a checkpoint
            # there would have to hold them, so checkpoints are taken only after Adam steps.
            raise ConfigError(
                f"checkpoint.every={self.checkpoint.every} must be a multiple of optim.adam_every="
                f"{self.optim.adam_every}: checkpoints are written after Adam steps, when no gradient is "
                "pending."
            )


def register() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent; done at import)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


register()


def to_object(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """A composed DictConfig as TrainConfig instances, running every group's ``__post_init__`` checks."""
    if isinstance(cfg, TrainConfig):
        return cfg
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not isinstance(obj, TrainConfig):
        raise ConfigError(
            "the composed config is not a TrainConfig: configs/train.yaml must list 'train_schema' first in "
            "its defaults."
        )
    return obj


def accumulation_steps(batch_tokens: int, world_size: int, micro_batch_tokens: int) -> int:
    """Microbatches per rank per step: the fewest equal ones of at most ``micro_batch_tokens`` tokens each.

    Equal microbatches keep every rank's forward the same shape; when the per-rank batch has no divisor in
    range, the function returns one that splits it unevenly and :func:`check_run` rejects the combination.
    """
    per_rank = batch_tokens // world_size
    if micro_batch_tokens <= 0 or per_rank <= micro_batch_tokens:
        return 1
    k = -(-per_rank // micro_batch_tokens)
    while per_rank % k:
        k += 1
    return k


def check_run(cfg: TrainConfig, world_size: int) -> None:
    """Checks across groups, once the world size is known; raises ConfigError naming the fix."""
    model_vocab = getattr(cfg.model, "vocab_size", None)
    data_vocab = getattr(cfg.data, "vocab_size", None)
    if model_vocab is not None and data_vocab is not None and data_vocab > model_vocab:
        raise ConfigError(
            f"data.vocab_size={data_vocab} does not fit model.vocab_size={model_vocab}: the data holds token "
            "ids the model cannot embed. Pick a model preset built for this data (model=track1 for "
            "fineweb10B) or set model.vocab_size to at least the data's vocabulary."
        )
    for i, stage in enumerate(cfg.schedule.stages):
        accum = accumulation_steps(stage.batch_tokens, world_size, cfg.micro_batch_tokens)
        if stage.batch_tokens % world_size or stage.batch_tokens % (world_size * accum):
            raise ConfigError(
                f"schedule.stages[{i}].batch_tokens={stage.batch_tokens} cannot be split over {world_size} "
                f"rank(s) x {accum} microbatch(es) of equal size "
                f"(micro_batch_tokens={cfg.micro_batch_tokens}). "
                f"Use a global batch divisible by {world_size * accum}, or another process count or "
                "micro_batch_tokens."
            )
