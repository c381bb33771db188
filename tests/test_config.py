"""The config schema: every group option and preset composes; typos, bad types, impossible runs fail."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from track_1_short import schedule
from track_1_short.config import ConfigError, TrainConfig, accumulation_steps, check_run, to_object

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("model", "data", "optim", "schedule", "experiment")


def compose_train(*overrides: str):
    with initialize_config_dir(str(CONFIGS), version_base=None):
        return compose("train", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_into_the_schema(group, option):
    cfg = to_object(compose_train(f"{group}={option}"))
    assert isinstance(cfg, TrainConfig)
    assert schedule.total_steps(cfg.schedule) > 0


def test_every_group_the_issue_names_has_its_options():
    assert {"tiny", "track1"} <= set(options("model"))
    assert {"synthetic", "fineweb10B"} <= set(options("data"))
    assert {"anvil_adam"} <= set(options("optim"))
    assert {"smoke", "track1"} <= set(options("schedule"))
    assert {"default", "record", "smoke_record"} <= set(options("experiment"))


def test_default_composition_is_the_embedded_cpu_run():
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("train", return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    assert (choices.model, choices.data, choices.optim, choices.schedule) == (
        "tiny",
        "synthetic",
        "anvil_adam",
        "smoke",
    )
    assert cfg.optim.replicated_impl == "fused"  # the replicated fast path is on by default


def test_record_preset_selects_the_full_model_data_and_schedule():
    cfg = to_object(compose_train("experiment=record"))
    assert schedule.total_steps(cfg.schedule) == 1194
    assert cfg.smoke_target == 3.28
    check_run(cfg, world_size=8)
    check_run(cfg, world_size=1)  # gradient accumulation keeps the global batch on one GPU


@pytest.mark.parametrize("experiment", ["record", "record_1gpu"])
def test_record_presets_run_the_host_side_fast_paths(experiment):
    cfg = to_object(compose_train(f"experiment={experiment}"))
    assert cfg.gc_freeze  # the collector frozen in the timed loop (track_1_short/frozen_gc.py)
    assert cfg.optim.replicated_impl == "fused" and cfg.optim.replicated_graphs


def test_bank_update_switch_reaches_the_typed_config_eager_by_default_triton_in_the_gpu_presets():
    # The base config runs anywhere; the GPU presets take the measured winners (perf/RESULTS.md,
    # "Optimizer step"): the Triton bank update, and the Gram-space cascade where it pays (elsewhere the
    # squared one); the base config keeps the reference.
    base = to_object(compose_train()).optim
    assert (base.bank_update, base.cascade_gram) == ("eager", "bmm")
    for preset in ("record", "record_1gpu"):
        optim = to_object(compose_train(f"experiment={preset}")).optim
        assert (optim.bank_update, optim.cascade_gram) == ("triton", "gram_space"), preset
    # Bank graphs and streams: measured on one GPU only, so in the one-GPU preset only.
    one_gpu = to_object(compose_train("experiment=record_1gpu")).optim
    assert (one_gpu.bank_graphs, one_gpu.bank_streams) == (True, True)
    eight = to_object(compose_train("experiment=record")).optim
    assert (eight.bank_graphs, eight.bank_streams, base.bank_graphs, base.bank_streams) == (False,) * 4
    with pytest.raises(ConfigError, match=r"optim\.bank_update='compiled'.*\['eager', 'triton'\]"):
        to_object(compose_train("optim.bank_update=compiled"))


def test_smoke_record_preset_names_a_target():
    cfg = to_object(compose_train("experiment=smoke_record"))
    assert cfg.smoke_target is not None and cfg.smoke_target > 0


def test_command_line_overrides_reach_the_typed_config():
    cfg = to_object(
        compose_train("seed=7", "schedule.lr_floor=0.25", "optim.adam_every=3", "checkpoint.every=6")
    )
    assert (cfg.seed, cfg.schedule.lr_floor, cfg.optim.adam_every, cfg.checkpoint.every) == (7, 0.25, 3, 6)


@pytest.mark.parametrize(
    "override",
    ["sedd=1", "model.no_such_field=1", "schedule.lr_flor=0.3", "checkpoint.evry=3"],
)
def test_unknown_key_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException, match=override.split("=")[0].split(".")[-1]):
        compose_train(override)


@pytest.mark.parametrize("override", ["seed=abc", "checkpoint.every=often", "schedule.lr_floor=low"])
def test_wrong_type_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        compose_train(override)


def test_unknown_group_option_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="huge"):
        compose_train("model=huge")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("log_every=0", "log_every"),
        ("device=tpu", "device"),
        ("checkpoint.every=-1", "checkpoint.every"),
        ("micro_batch_tokens=-5", "micro_batch_tokens"),
        ("checkpoint.every=3", "multiple of optim.adam_every"),
        # The default run has 58 steps: a cadence of the run's length or more would write nothing.
        ("checkpoint.every=58", "writes no checkpoint in a run of 58 steps"),
    ],
)
def test_impossible_run_fields_raise_config_error(override, match):
    with pytest.raises(ConfigError, match=match):
        to_object(compose_train(override))


def test_schedule_errors_surface_as_config_errors():
    with pytest.raises(ConfigError, match="cooldown_frac"):
        to_object(compose_train("schedule.cooldown_frac=2.0"))


def test_batch_that_cannot_split_over_the_world_is_rejected_with_the_fix():
    cfg = to_object(compose_train())
    cfg.schedule.stages[0].batch_tokens = 1000
    with pytest.raises(ConfigError, match=r"batch_tokens=1000 cannot be split over 3 rank"):
        check_run(cfg, world_size=3)


def test_data_vocabulary_larger_than_the_model_is_rejected():
    cfg = to_object(compose_train())
    cfg.model.vocab_size = 64
    with pytest.raises(ConfigError, match="vocab"):
        check_run(cfg, world_size=1)


def test_accumulation_keeps_the_global_batch_for_any_world_size():
    assert accumulation_steps(8192, 1, 4096) == 2
    assert accumulation_steps(8192, 2, 4096) == 1
    assert accumulation_steps(8192, 4, 4096) == 1
    assert accumulation_steps(8192, 1, 0) == 1
    assert accumulation_steps(131072, 1, 49152) == 4  # 3 would not split evenly; 4 x 32768 does
    for world in (1, 2, 4, 8):
        accum = accumulation_steps(393216, world, 49152)
        assert (393216 // world // accum) * world * accum == 393216


def test_schema_is_registered_for_the_yaml_defaults():
    cfg = compose_train()
    assert OmegaConf.get_type(cfg) is TrainConfig


# -- the README's command lines compose what the README says they do --
README = CONFIGS.parent / "README.md"
GPT2 = {"model.vocab_size": 50257, "data.vocab_size": 50257, "data.bos_id": 50256}
COMPACT = {"model.vocab_size": 2176, "data.vocab_size": 2176, "data.bos_id": 2175, "data.val_tokens": 8192}
# Every `python -m track_1_short.train` line of the README (its overrides) -> what it must compose.
README_COMMANDS = {
    "": {**COMPACT, "steps": 58, "model.num_layers": 8, "data.kind": "synthetic"},
    "experiment=record": {**GPT2, "steps": 1194, "model.num_layers": 11, "data.kind": "shards"},
    "seed=3 schedule.lr_floor=0.2 optim.adam_every=1": {
        **COMPACT,
        "seed": 3,
        "schedule.lr_floor": 0.2,
        "optim.adam_every": 1,
    },
    "model=track1 data=fineweb10B schedule=track1": {
        **GPT2,
        "data.val_tokens": 10485760,
        "steps": 1194,
        "model.num_layers": 11,
        "data.kind": "shards",
    },
    "checkpoint.every=20": {**COMPACT, "checkpoint.every": 20},
    "checkpoint.every=20 checkpoint.final=true": {
        **COMPACT,
        "checkpoint.final": True,
        "checkpoint.every": 20,
    },
    "resume=runs/<run>": {**COMPACT, "resume": "runs/RUN"},  # <run>: a placeholder
    "experiment=smoke_record": {**COMPACT, "steps": 16, "smoke_target": 6.47},
    # The one-GPU record preset: the record's model and stage geometries, 134 steps, the synthetic corpus with
    # GPT-2's vocabulary, micro batches of 65,536 tokens (every stage a whole number of them: one graph).
    "experiment=record_1gpu": {
        **GPT2,
        "steps": 134,
        "model.num_layers": 11,
        "data.kind": "synthetic",
        "micro_batch_tokens": 65536,
        "model.check_inputs": False,
    },
}


def readme_commands() -> set[str]:
    """The overrides of every README line that runs the entry point (comments and --cfg flags dropped)."""
    found = set()
    for line in README.read_text().splitlines():
        if "-m track_1_short.train" not in line or line.lstrip().startswith(("`", "|")):
            continue
        tail = line.split("-m track_1_short.train", 1)[1].split("#", 1)[0].split("&&", 1)[0]
        found.add(" ".join(w for w in tail.split() if "=" in w and not w.startswith("-")))
    return found


def test_every_readme_command_line_has_an_expectation():
    assert readme_commands() <= set(README_COMMANDS), readme_commands() - set(README_COMMANDS)
    assert {"", "model=track1 data=fineweb10B schedule=track1"} <= readme_commands()


@pytest.mark.parametrize("line", sorted(README_COMMANDS))
def test_readme_command_line_composes_what_the_readme_says(line):
    cfg = to_object(compose_train(*line.replace("<run>", "RUN").split()))
    for key, want in README_COMMANDS[line].items():
        got = (
            schedule.total_steps(cfg.schedule)
            if key == "steps"
            else OmegaConf.select(OmegaConf.structured(cfg), key)
        )
        assert got == want, f"{line!r}: {key} = {got}, the README promises {want}"
    world = 8 if cfg.data.kind == "shards" else 1
    check_run(cfg, world_size=world)  # the composed run fits together (vocabulary, batches)


def test_tiny_model_follows_the_data_vocabulary():
    cfg = to_object(compose_train("model=tiny", "data=fineweb10B"))
    assert cfg.model.vocab_size == cfg.data.vocab_size == 50257


# -- unknown keys, in every form --
@pytest.mark.parametrize("form", ["", "+", "++"])
def test_unknown_key_is_refused_in_every_override_form_with_a_suggestion(form):
    from track_1_short.config import check_override_keys

    with pytest.raises(ConfigError, match=r"'schedul\.lr_floor'.*Did you mean 'schedule\.lr_floor'"):
        check_override_keys([f"{form}schedul.lr_floor=0.2"], groups=GROUPS)


@pytest.mark.parametrize("override", ["+schedul.lr_floor=0.2", "++schedul.lr_floor=0.2", "++seedd=1"])
def test_a_key_added_with_plus_is_refused_in_the_composed_config(override):
    cfg = compose_train(override)  # Hydra lets + and ++ add a key the schema lacks
    with pytest.raises(ConfigError, match="Did you mean"):
        to_object(cfg)


@pytest.mark.parametrize(
    "override",
    ["seed=3", "+model=track1", "experiment=record", "model.param_table.lm_head.lr_mul=2", "hydra.run.dir=x",
     "schedule.stages.0.steps=3", "++seed=4", "resume=runs/x"],
)  # fmt: skip
def test_known_keys_and_group_choices_pass_the_override_check(override):
    from track_1_short.config import check_override_keys

    check_override_keys([override], groups=GROUPS)


def test_cpu_threads_is_a_config_field_with_a_checked_range():
    assert to_object(compose_train()).cpu_threads == 1
    with pytest.raises(ConfigError, match="cpu_threads"):
        to_object(compose_train("cpu_threads=-1"))


ONE_OF = r"cpu_bf16_matmul='bf16' must be one of \['auto', 'native', 'fp32'\]"


def test_cpu_bf16_matmul_is_a_config_field_with_checked_values():
    assert to_object(compose_train()).cpu_bf16_matmul == "auto"
    with pytest.raises(ConfigError, match=ONE_OF):
        to_object(compose_train("cpu_bf16_matmul=bf16"))


@pytest.mark.parametrize("native_gemm", [False, True])
def test_the_trainers_bf16_matmul_route_follows_the_cpu_kind_and_what_it_compiles(native_gemm, monkeypatch):
    from track_1_short import cpu_bf16_matmul
    from track_1_short.trainer import bf16_matmul_route

    monkeypatch.setattr(cpu_bf16_matmul, "native_bf16_gemm", lambda: native_gemm)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    route = lambda *o: bf16_matmul_route(to_object(compose_train(*o)), cpu)[0]  # noqa: E731
    # compile (true by default) compiles the model on CUDA only: on the CPU it does not decide the route.
    assert route() == route("compile=true") == route("compile=false") == ("native" if native_gemm else "fp32")
    assert route("cpu_bf16_matmul=native") == "native"
    assert route("cpu_bf16_matmul=fp32") == "fp32"
    assert bf16_matmul_route(to_object(compose_train()), cuda)[0] == "native"
