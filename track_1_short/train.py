"""Train: ``python -m track_1_short.train [overrides]``; N processes: ``torchrun --nproc_per_node=N -m ...``.

With no arguments this is the embedded default run (the tiny model on the synthetic corpus, CPU-sized). The
phases live in trainer.py; this file composes the config, runs them and reports. A first reader can skip
``track_1_short/perf/``: fast paths with the same results as their references.

Exit status, one convention for every path (README "Exit status"):
    0    the run finished
    1    the run started and failed (a non-finite loss or gradient, replicas that drifted apart)
    2    bad input, nothing ran: flags (ours or Hydra's: an unknown key, a wrong type, an unknown group
         option), data, checkpoint, run directory; one paragraph says what and how to fix it
    130  interrupted (Ctrl-C); the paragraph names the last checkpoint and the command that resumes
Every stop that leaves a checkpoint (Ctrl-C, a crash, a NaN stop) ends with ``resume=<run dir>``, which
continues the run with the settings of its own config.yaml (track_1_short/resume.py).
Set HYDRA_FULL_ERROR=1 for the traceback.
"""

import os
import sys
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter, which is chosen when @triton.jit decorates
    # a kernel, i.e. when its module is imported: so this must happen before the imports below reach one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from track_1_short import config as _schema  # noqa: E402,F401  (registers train_schema)
from track_1_short import distributed, run_report, trainer  # noqa: E402

EXIT_USER_ERROR = 2  # bad data, flags, checkpoint or run directory: nothing ran
EXIT_FAILED = 1  # the run started and failed (e.g. a NaN loss)
EXIT_INTERRUPTED = 130  # Ctrl-C (the shell's 128 + SIGINT)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
_entered_main = False  # set once Hydra composed the config: an exit of 1 before it is Hydra's error


def _user_errors() -> tuple[type[BaseException], ...]:
    from track_1_short import data
    from track_1_short.checkpoint import CheckpointError
    from track_1_short.config import ConfigError
    from track_1_short.guards import GuardConfigError
    from track_1_short.optim.anvil import OptimizerStateError
    from track_1_short.preflight import RunDirError

    return (
        ConfigError,
        CheckpointError,
        OptimizerStateError,
        GuardConfigError,
        RunDirError,
        *data.USER_ERRORS,
    )


def _run_failures() -> tuple[type[BaseException], ...]:
    """Failures of a run that started: a non-finite loss or gradient, replicas that drifted apart."""
    from track_1_short import guards

    return (trainer.NonFiniteLossError, guards.NonFiniteGradError, guards.ReplicaDivergenceError)


# An absolute path: the same configs whether this runs as ``python -m``, as a module a test imports, or from
# another working directory (Hydra reads a relative one against the calling module's package).
@hydra.main(config_path=str(CONFIGS), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    global _entered_main
    _entered_main = True
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"  # Hydra's own switch for tracebacks
    try:
        cfg = _follow_resume(cfg)
        _note_stopped_runs(cfg)
        result = trainer.run(cfg)
    except run_report.RunInterrupted as e:
        if full_error:
            raise
        if distributed.is_main():
            print(f"\n{e.paragraph()}", file=sys.stderr)
        distributed.destroy()
        sys.exit(EXIT_INTERRUPTED)
    except (*_user_errors(), *_run_failures()) as e:
        if full_error:
            raise
        if distributed.is_main():
            print(f"error: {e}", file=sys.stderr)
            _say_how_to_continue(e)
        distributed.destroy()
        sys.exit(EXIT_FAILED if isinstance(e, _run_failures()) else EXIT_USER_ERROR)
    except Exception as e:  # a crash: its traceback, then how to continue from the last checkpoint
        if full_error:
            raise
        if distributed.is_main():
            traceback.print_exc()
            _say_how_to_continue(e)
        distributed.destroy()
        sys.exit(EXIT_FAILED)
    distributed.destroy()
    for line in result.summary:
        print(line)


def _groups() -> list[str]:
    return [p.name for p in CONFIGS.iterdir() if p.is_dir()]


def _follow_resume(cfg: DictConfig) -> DictConfig:
    """With ``resume=``: the run's own config.yaml, the command line's overrides checked against it."""
    if not cfg.get("resume"):
        return cfg
    from hydra.core.hydra_config import HydraConfig

    from track_1_short import resume

    return resume.follow(cfg, list(HydraConfig.get().overrides.task), _groups())


def _note_stopped_runs(cfg: DictConfig) -> None:
    """A fresh start names the runs under runs_root that a kill left behind, and how to continue each."""
    if cfg.get("resume") or os.environ.get("RANK", "0") != "0":
        return
    from track_1_short import resume

    for stopped in resume.stopped_runs(cfg.runs_root):
        print(f"note: {stopped.line()}", file=sys.stderr)


def _say_how_to_continue(e: BaseException) -> None:
    stop = getattr(e, "run_stop", None)
    line = stop.continue_line() if stop is not None else None
    if line is not None:
        print(f"the run stopped at step {stop.step} of {stop.total_steps}. {line}", file=sys.stderr)


def _overrides() -> list[str]:
    return [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]


def cli() -> None:
    """Refuse unknown keys in every override form first, then run; Hydra's own errors exit 2 as ours do."""
    from track_1_short.config import ConfigError, check_override_keys

    args = sys.argv[1:]
    # The schema's field docs (track_1_short/help.py), not Hydra's dump of the composed YAML.
    if "--help" in args or "-h" in args:
        from track_1_short import help as cli_help

        print(cli_help.render(CONFIGS))
        sys.exit(0)
    if "--cfg" in args and "--resolve" not in args:  # show the values the run will use, not ${...}
        sys.argv.append("--resolve")

    try:
        check_override_keys(_overrides(), _groups())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _entered_main:  # Hydra printed its composition error and exits 1
            sys.exit(EXIT_USER_ERROR)
        raise


if __name__ == "__main__":
    cli()
