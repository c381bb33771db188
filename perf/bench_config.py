"""The training config a benchmark measures, composed as ``python -m track_1_short.train OVERRIDES`` composes
it: the project's structured schema registered, configs/train.yaml with the overrides. Shared by the bench
scripts that build a trainer or read a preset (bench_train_step, bench_final_val, ablation)."""

from __future__ import annotations

from bench_meta import REPO_ROOT


def compose_train(overrides: list[str]):
    """The untyped (DictConfig) training config with ``overrides``; ``to_object`` types it."""
    from hydra import compose, initialize_config_dir

    from track_1_short.config import register

    register()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))
