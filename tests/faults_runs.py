"""Runs for tests/test_faults.py: the short config, a process that dies on cue, and the gloo-rank workers.

As a program (``python -m tests.faults_runs RUNS_ROOT RUN_NAME THREADS MODE STEP [overrides...]``) it trains
the short config and dies by SIGKILL, which no handler can intercept, at the moment MODE names:

    step    at the start of training step STEP (STEP steps are complete)
    bytes   while writing the checkpoint of step STEP: half its bytes are on disk (in the ``.tmp`` file)
    latest  after the checkpoint of step STEP is complete, before ``latest`` is moved to it
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from track_1_short import checkpoint, cpu_bf16_matmul, distributed, trainer
from track_1_short.config import to_object
from track_1_short.schedule import StageConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = (4, 2)  # two stages, 6 steps: Adam and non-Adam steps, a stage transition and the embedding split
SPLIT_STEP = 4
BATCH = 512  # global tokens per step; one rank runs 2 microbatches of 256, two ranks one each
MICRO = f"micro_batch_tokens={BATCH // 2}"


# A 1,024-token vocabulary (its own small synthetic corpus, built once): checkpoints of ~30 MB instead of
# ~350 MB (the embeddings and their moments dominate), and a 20x cheaper softmax.
SMALL_VOCAB = (
    "model.vocab_size=1024",
    "data.vocab_size=1024",
    "data.bos_id=1023",
    "data.synthetic.n_words=512",
    "data.synthetic.train_tokens=65536",
    "data.synthetic.shard_tokens=65536",
    "data.synthetic.val_tokens=4096",
)


def short_cfg(runs_root: str, *overrides: str, batch: int = BATCH):
    """The default run cut to 6 steps of ``batch`` (512) tokens and a 512-token validation, on a small
    vocabulary (tests/test_gpu_multi.py scales the batch with the number of GPUs)."""
    base = [
        f"runs_root={runs_root}",
        "progress_bar=false",
        "data.val_tokens=512",
        "data.val_batch_tokens=512",
        f"schedule.split_embed_step={SPLIT_STEP}",
        MICRO,
        *SMALL_VOCAB,
    ]
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", overrides=[*base, *overrides])
    first, last = (OmegaConf.to_container(cfg.schedule.stages[i]) for i in (0, -1))
    common = {"batch_tokens": batch, "mtp_weights": [1.0], "mtp_weights_end": [], "extension": False}
    cfg.schedule.stages = [
        StageConfig(**{**first, **common, "steps": STEPS[0]}),
        StageConfig(**{**last, **common, "steps": STEPS[1]}),
    ]
    cfg.schedule.rail_warmup_steps, cfg.schedule.rail_cooldown_steps = 2, 2
    return cfg


def build(cfg) -> trainer.Trainer:
    """What trainer.run builds, without running it (the tests step or resume it themselves)."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    tcfg = to_object(cfg)
    device = distributed.init(trainer.select_device(tcfg))
    trainer.apply_cpu_threads(tcfg, device)
    return trainer.Trainer(tcfg, resolved, device)


def run_route(cfg) -> contextlib.AbstractContextManager:
    """The bf16 matmul route trainer.run takes for ``cfg`` (cpu_bf16_matmul), for a test that builds and
    steps a trainer itself: the routes round differently near ties, so a trainer stepped outside it would not
    reproduce the bits of the runs it is compared with."""
    tcfg = to_object(cfg)
    device = torch.device(trainer.select_device(tcfg))
    return cpu_bf16_matmul.route(trainer.bf16_matmul_route(tcfg, device)[0])


def final_state(t: trainer.Trainer) -> dict:
    """Parameters and optimizer state by label, on the CPU (the optimizer's state_dict is a collective)."""
    return {"params": checkpoint.model_state(t.model), "optimizer": t.opt.state_dict()}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_on_cue(mode: str, step: int) -> None:
    if mode == "step":
        real_step = trainer.Trainer.train_step

        def train_step(self, s):
            if s == step:
                _die()
            return real_step(self, s)

        trainer.Trainer.train_step = train_step
    elif mode == "bytes":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("step") == step:
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                f.write(buf.getvalue()[: buf.tell() // 2])
                f.flush()
                os.fsync(f.fileno())
                _die()
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    elif mode == "latest":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if (
                Path(dst).name == checkpoint.LATEST
                and Path(dst).with_name(checkpoint.checkpoint_name(step)).is_file()
            ):
                _die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    else:
        raise SystemExit(f"unknown mode {mode!r}; one of step, bytes, latest")


def main_logged(log: str, argv: list[str]) -> None:
    """main in a process forked for it (tests/test_faults.py's die): its output goes to the file ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(argv)


def main(argv: list[str]) -> None:
    runs_root, run_name, threads, mode, step, *overrides = argv
    torch.set_num_threads(int(threads))  # the parent's count: the same kernels, the same bits
    _die_on_cue(mode, int(step))
    trainer.run(short_cfg(runs_root, f"run_name={run_name}", *overrides))


# -- workers for gloo ranks (tests.distributed_harness.run_ranks) --
def train_worker(rank, world, runs_root, overrides):
    """A whole run; returns its losses, val loss, final state and skipped steps, or the error it raised."""
    try:
        r = trainer.run(short_cfg(runs_root, *overrides))
    except (trainer.NonFiniteError, RuntimeError) as e:
        return {"error": type(e).__name__, "message": str(e), "labels": getattr(e, "labels", None)}
    t = r.trainer
    return {
        "losses": r.train_losses,
        "val": r.val_loss,
        "skipped": t.guards.skipped_steps,
        "run_dir": str(r.run_dir),
        **final_state(t),
    }


def resume_worker(rank, world, runs_root, resume, overrides):
    """Resume at this world size: the optimizer state right after the load, then the finished run's."""
    cfg = short_cfg(runs_root, f"resume={resume}", *overrides)
    with run_route(cfg):
        t = build(cfg)
        t.resume(resume)
        loaded = t.opt.state_dict()
        r = t.train()
        return {"loaded": loaded, "losses": r.train_losses, "val": r.val_loss, **final_state(t)}


def scenarios_worker(rank, world, scenarios):
    """Several runs in one set of processes (spawning ranks costs seconds): ``scenarios`` maps a name to
    ("train", runs_root, overrides) or ("resume", runs_root, checkpoint, overrides); every rank runs them in
    the same order, so a run that raises on every rank leaves the group in step for the next."""
    workers = {"train": train_worker, "resume": resume_worker}
    return {name: workers[kind](rank, world, *args) for name, (kind, *args) in scenarios.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
