"""The run-level config schema: one dataclass per Hydra group, composed into :class:`TrainConfig`.

Each group's dataclass lives next to its owner (ModelConfig in model/config.py, DataConfig in data.py,
OptimConfig in optim/anvil.py, ScheduleConfig in schedule.py); this module adds the run fields and registers
the whole tree in Hydra's ConfigStore as ``train_schema``. ``configs/train.yaml`` names that schema first in
its defaults list, so every group file and every command-line override is merged into typed nodes: an unknown
key or a value of the wrong type fails at compose time with Hydra's message, before anything runs.

Cross-group checks that need more than one group (vocabulary, batch geometry against the world size) are in
:func:`check_run`, called once the world size is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from track_1_short.cpu_bf16_matmul import SETTINGS as CPU_BF16_MATMUL_SETTINGS
from track_1_short.data import DataConfig
from track_1_short.guards import FaultInjectionConfig, GuardConfig
from track_1_short.model.config import ModelConfig
from track_1_short.optim.anvil import OptimConfig
from track_1_short.optim.tail_average import TailConfig, check_tail
from track_1_short.schedule import ScheduleConfig, total_steps


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
    final: bool = False
    """Also write one after the last step (before the final validation, off the clock): the trained model and
    its optimizer state, e.g. to compare two runs bitwise with tools/compare_checkpoints.py."""


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
    tail: TailConfig = field(default_factory=TailConfig)
    """End-of-run tail averaging of the weights (track_1_short/optim/tail_average.py); off by default."""

    cpu_threads: int = 1
    """Intra-op threads of torch on the CPU (torch.set_num_threads at the start of a run); 0 = torch's default
    (one per core). 1 because a second thread gains little on an idle 2-core machine and loses up to 10x when
    another process competes for the cores (the README has the figures)."""
    cpu_bf16_matmul: str = "auto"
    """How a CPU run multiplies bf16 matrices (track_1_short/cpu_bf16_matmul.py): "native" (torch's CPU
    kernel), "fp32" (through fp32 GEMMs: bf16 inputs, fp32 accumulation, one rounding to bf16, the native
    kernel's contract) or "auto": fp32 exactly when the CPU has no native bf16 GEMM (no AVX512-BF16 or AMX;
    there torch's kernel is a scalar fallback, about 20x slower than fp32) and nothing in the run is compiled
    (torch.compile refuses a frame under the fp32 route's dispatch mode; ``compile`` applies to CUDA runs
    only, so a CPU run compiles nothing). The two routes round
    differently near ties, so runs on them are close, not bitwise equal. A CUDA run always uses its native
    kernels."""
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
    deterministic: bool = False
    """torch.use_deterministic_algorithms for the run (Inductor follows it: no atomic scatter-adds, fixed
    reduction configs), so that two runs of one config give the same bits on CUDA too, at some cost in speed.
    For checking paths that promise the same bits over a whole run (tools/compare_checkpoints.py); records
    keep it off. Restored to its previous value when the run ends."""
    gc_freeze: bool = True
    """Python's cyclic garbage collector out of the timed loop (track_1_short/frozen_gc.py): one
    collection and gc.freeze() before the clock starts, gc.disable() until the loop ends (restored then, also
    on an error); false = the collector runs as Python schedules it. Results do not change; upstream's record
    freezes it the same way."""
    progress_bar: bool = True
    """Progress on rank 0: a tqdm bar (loss, tokens/s, ETA) when stderr is a terminal, plain lines otherwise
    (CI, nohup, tee: every log_every steps or progress_seconds, whichever comes first); false = neither."""
    progress_seconds: float = 30.0
    """Longest wait between two plain progress lines when stderr is not a terminal; 0 = by steps only."""
    smoke_target: float | None = None
    """Target val loss the record gate tests this preset's runs against; null = none (record: 3.28)."""
    canonical_mask: bool = False
    """The final validation drops the tokens GPT-2's BPE never emits after the previous token (logit -60
    after the softcap; model/canonical_mask.py); it reports the unmasked loss beside it, and its val_loss,
    the one the record gate reads, is the masked one. FineWeb (data.kind=shards) only (record: true)."""
    canonical_mask_dir: str = ".cache/canonical_mask"
    """Where the mask is cached, keyed by the vocabulary's content hash (built once, ~10-30 s on a CPU)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_tokens", "val_every", "check_every", "loss_sum_ranks", "cpu_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0.")
        if self.progress_seconds < 0:
            raise ConfigError(f"progress_seconds={self.progress_seconds} must be >= 0 (0 = by steps only).")
        if self.log_every < 1:
            raise ConfigError(f"log_every={self.log_every} must be >= 1.")
        if self.cpu_bf16_matmul not in CPU_BF16_MATMUL_SETTINGS:
            raise ConfigError(
                f"cpu_bf16_matmul={self.cpu_bf16_matmul!r} must be one of {list(CPU_BF16_MATMUL_SETTINGS)}."
            )
        try:
            check_tail(self.tail, total_steps(self.schedule), self.optim.adam_every)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if self.canonical_mask and self.data.kind != "shards":
            raise ConfigError(
                "canonical_mask=true needs GPT-2-tokenized text (data.kind=shards, e.g. data=fineweb10B); "
                f"the {self.data.kind} corpus has no BPE structure, so the mask would be wrong there. Set "
                "canonical_mask=false."
            )
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
        steps = total_steps(self.schedule)
        if self.checkpoint.every and self.checkpoint.every >= steps:
            # One falls due after every `every` steps but the last (checkpoint.final covers the end).
            raise ConfigError(
                f"checkpoint.every={self.checkpoint.every} writes no checkpoint in a run of {steps} steps: "
                f"use a multiple of optim.adam_every={self.optim.adam_every} below {steps}, or "
                "checkpoint.final=true for one after the last step."
            )


def register() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent; done at import)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


register()


# -- unknown keys --------------------------------------------------------------------------------------------
# Hydra refuses ``key=value`` for a key the schema lacks, but ``+key=value`` and ``++key=value`` open the node
# and add it; OmegaConf.to_object then drops it, so the run would ignore the value while config.yaml records
# it. Both checks below refuse such keys: one on the command line (every form), one on the composed config.


def _field_types(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _child(tp: typing.Any, key: str) -> tuple[bool, typing.Any]:
    """(known, type of the child) for ``key`` under a node of type ``tp``; a type of None takes any key."""
    if dataclasses.is_dataclass(tp):
        fields = _field_types(tp)
        return (key in fields, fields.get(key))
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _child(args[0], key) if len(args) == 1 else (True, None)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        args = typing.get_args(tp)
        return (key.isdigit(), args[0] if args else None)
    if origin is dict or tp is dict or tp is typing.Any or tp is None:
        return (True, None)
    return (False, None)  # a leaf (int, str, ...) has no keys below it


def schema_paths(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (dataclass fields, recursively), for "did you mean"."""
    cls = cls or TrainConfig
    out = []
    for name, tp in _field_types(cls).items():
        path = f"{prefix}{name}"
        out.append(path)
        if dataclasses.is_dataclass(tp):
            out += schema_paths(tp, path + ".")
    return out


def unknown_key(path: str) -> str | None:
    """The first prefix of the dotted ``path`` the schema does not know, or None if it knows all of it."""
    tp: typing.Any = TrainConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        if tp is None:
            return None
        known, tp = _child(tp, part)
        if not known:
            return ".".join(parts[: i + 1])
    return None


def _unknown_key_error(key: str, where: str) -> ConfigError:
    # Candidates at the key's own depth: 'model.foo' should suggest a model field, not 'model' itself.
    same_depth = [p for p in schema_paths() if p.count(".") == key.count(".")]
    close = difflib.get_close_matches(key, same_depth, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown config key {key!r} ({where}).{hint} The schema (track_1_short/config.py) has no such "
        "field; a key added with + or ++ would be ignored by the run, so every form is refused."
    )


def check_override_keys(overrides: Sequence[str], groups: Sequence[str] = ()) -> None:
    """Refuse a command-line override whose key the schema lacks, in every form (key=, +key=, ++key=, ~key).

    ``groups`` are the config group names (``model=track1`` selects a file, it sets no key); Hydra's own
    ``hydra.*`` keys and ``hydra/...`` groups are Hydra's to check. Overrides that do not parse are left to
    Hydra, which reports them.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException:
            continue
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or "/" in key or "@" in key:
            continue
        if key in groups:
            continue
        bad = unknown_key(key)
        if bad is not None:
            raise _unknown_key_error(key, f"in the override {text!r}")


def assert_no_unknown_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse a composed config holding a key its schema lacks (one added by + or ++, or by a group file)."""
    tp = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(tp):
        return
    fields = _field_types(tp)
    for key in cfg.keys():
        if key not in fields:
            raise _unknown_key_error(f"{prefix}{key}", "in the composed config")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            assert_no_unknown_keys(node, f"{prefix}{key}.")


def to_object(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """A composed DictConfig as TrainConfig instances, running every group's ``__post_init__`` checks."""
    if isinstance(cfg, TrainConfig):
        return cfg
    assert_no_unknown_keys(cfg)
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
    check_loss_schedule(cfg)
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


def check_loss_schedule(cfg: TrainConfig) -> None:
    """The schedule's prefix weights need GPT-2's ids and the model's table; its sampled softmax a vocabulary
    the negatives' sweep covers."""
    from track_1_short.model.sampled_softmax import check_vocabulary

    stages = list(cfg.schedule.stages)
    weighted = [i for i, s in enumerate(stages) if any(w > 0 for w in s.prefix_weights)]
    if weighted:
        where = f"schedule.stages[{weighted[0]}].prefix_weights"
        vocabs = {"data.vocab_size": cfg.data.vocab_size, "model.vocab_size": cfg.model.vocab_size}
        for name, vocab in vocabs.items():
            if vocab != 50257:
                raise ConfigError(
                    f"{where} is nonzero, but {name}={vocab} is not GPT-2's 50257: the prefix table maps "
                    "GPT-2 token ids. Use data with GPT-2's vocabulary or set the prefix weights to [0.0]."
                )
        if not cfg.model.prefix_targets:
            raise ConfigError(
                f"{where} is nonzero, but the model has no prefix table: set model.prefix_targets=true, or "
                "every stage's prefix_weights to [0.0]."
            )
    if any(p > 0 for s in stages for p in s.sampled_candidates):
        try:
            check_vocabulary(-(-cfg.model.vocab_size // cfg.model.vocab_multiple) * cfg.model.vocab_multiple)
        except ValueError as e:
            raise ConfigError(str(e)) from None
