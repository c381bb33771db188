"""Train: ``python -m track_1_short.train [overrides]``; N processes: ``torchrun --nproc_per_node=N -m ...``.

With no arguments this is the embedded default run (the tiny model on the synthetic corpus, CPU-sized). The
phases live in trainer.py; this file composes the config, runs them and reports. User errors (bad data, bad
flags, bad checkpoints) print one paragraph and exit with status 2; set HYDRA_FULL_ERROR=1 for the traceback.
A first reader can skip ``track_1_short/perf/``: fast paths with the same results as their references.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter, which is chosen when @triton.jit decorates
    # a kernel, i.e. when its module is imported: so this must happen before the imports below reach one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from track_1_short import config as _schema  # noqa: E402,F401  (registers train_schema)
from track_1_short import distributed, trainer  # noqa: E402

EXIT_USER_ERROR = 2  # bad data, flags or checkpoint: nothing ran
EXIT_FAILED = 1  # the run started and failed (e.g. a NaN loss)


def _user_errors() -> tuple[type[BaseException], ...]:
    from track_1_short import data
    from track_1_short.checkpoint import CheckpointError
    from track_1_short.config import ConfigError
    from track_1_short.optim.anvil import OptimizerStateError

    return (ConfigError, CheckpointError, OptimizerStateError, *data.USER_ERRORS)


def _run_failures() -> tuple[type[BaseException], ...]:
    """Failures of a run that started: a non-finite loss or gradient, replicas that drifted apart."""
    from track_1_short import guards

    return (trainer.NonFiniteLossError, guards.NonFiniteGradError, guards.ReplicaDivergenceError)


def _report(result: trainer.RunResult) -> None:
    facts = result.corpus
    line = f"final val loss {result.val_loss:.4f} nats/token after {result.steps} steps"
    if "unigram_entropy" in facts and "entropy_floor" in facts:
        line += (
            f" | corpus unigram entropy {facts['unigram_entropy']:.4f},"
            f" entropy floor {facts['entropy_floor']:.4f}"
            " (a model without context scores the first at best, a perfect one the second)"
        )
    print(line)
    print(f"train time {result.train_time_ms / 1e3:.1f} s; run directory {result.run_dir}")


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"  # Hydra's own switch for tracebacks
    try:
        result = trainer.run(cfg)
    except (*_user_errors(), *_run_failures()) as e:
        if full_error:
            raise
        if distributed.is_main():
            print(f"error: {e}", file=sys.stderr)
        distributed.destroy()
        sys.exit(EXIT_FAILED if isinstance(e, _run_failures()) else EXIT_USER_ERROR)
    main_rank = distributed.is_main()
    distributed.destroy()
    if main_rank:
        _report(result)


if __name__ == "__main__":
    main()
