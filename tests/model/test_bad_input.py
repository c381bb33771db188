"""Bad forward inputs and impossible configs: one ModelConfigError naming the thing and the fix, raised
before any compute.

"Before compute" is checked by the rotary state: a training forward fits it to the windows right after the
input checks, so an error raised before that leaves it untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.model.conftest import load_config, packed_batch
from track_1_short.model.config import FP8Config, ModelConfig, ModelConfigError, NgramConfig
from track_1_short.model.gpt import GPT

WINDOWS = (1, 3)


@pytest.fixture
def model(tiny_fp32):
    m = copy.deepcopy(tiny_fp32)
    m.train()
    return m


def _good():
    return packed_batch([50, 78])


def _bad_cases():
    inputs, targets, cu = _good()
    too_big = inputs.clone()
    too_big[7] = 50257
    negative = inputs.clone()
    negative[3] = -1
    bad_target = targets.clone()
    bad_target[0] = 60000
    return {
        "token id >= vocab": ((too_big, targets, cu, WINDOWS), "outside the vocabulary"),
        "negative token id": ((negative, targets, cu, WINDOWS), "outside the vocabulary"),
        "target id >= vocab": ((inputs, bad_target, cu, WINDOWS), "targets holds token ids"),
        "2-D inputs": ((inputs[None], targets, cu, WINDOWS), "1-D int32/int64"),
        "float inputs": ((inputs.float(), targets, cu, WINDOWS), "1-D int32/int64"),
        "int32 targets": ((inputs, targets.int(), cu, WINDOWS), "targets must be an int64"),
        "short targets": ((inputs, targets[:-1], cu, WINDOWS), "targets must be an int64"),
        "cu_seqlens int64": ((inputs, targets, cu.long(), WINDOWS), "cu_seqlens must be a 1-D int32"),
        "cu_seqlens short of T": ((inputs, targets, cu[:-1], WINDOWS), "end at T=128"),
        "cu_seqlens not from 0": ((inputs, targets, cu + 1, WINDOWS), "start at 0"),
        "cu_seqlens decreasing": (
            (inputs, targets, torch.tensor([0, 60, 50, 128], dtype=torch.int32), WINDOWS),
            "never decrease",
        ),
        "cu_seqlens on another device": ((inputs, targets, cu.to("meta"), WINDOWS), "on one device"),
        "one window": ((inputs, targets, cu, (3,)), "windows must be \\(short, long\\)"),
        "zero window": ((inputs, targets, cu, (0, 3)), "two ints >= 1"),
        "float window": ((inputs, targets, cu, (1.5, 3)), "two ints >= 1"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_forward_input_raises_one_clear_error_before_compute(model, case):
    args, message = _bad_cases()[case]
    with pytest.raises(ModelConfigError, match=message):
        model(*args)
    assert model.rope_windows.tolist() == [-1, -1]  # nothing ran past the checks


def test_sequence_longer_than_max_seq_len_is_rejected(model):
    model.cfg.max_seq_len = 100
    with pytest.raises(ModelConfigError, match="more than max_seq_len=100"):
        model(*_good(), WINDOWS)
    assert model.rope_windows.tolist() == [-1, -1]


@pytest.mark.parametrize("mtp", [[], [1.0, -0.5], [float("nan")]])
def test_bad_mtp_weights_are_rejected(model, mtp):
    with pytest.raises(ModelConfigError, match="mtp_weights"):
        model(*_good(), WINDOWS, mtp)


def test_logits_check_their_inputs_too(model):
    inputs, _, cu = _good()
    inputs[0] = 99999
    with pytest.raises(ModelConfigError, match="outside the vocabulary"):
        model.logits(inputs, cu, WINDOWS)


BAD_CONFIGS = {
    "heads x head_dim != model_dim": (dict(num_heads=3), "num_heads \\* head_dim"),
    "mudd groups do not divide model_dim": (dict(mudd_groups=5), "divisible by mudd_groups"),
    "narrow wider than head": (dict(narrow_head_dim=256), "narrow_head_dim=256 must be <= head_dim"),
    "odd rotary dim": (dict(rotary_dim=63), "rotary_dim=63 must be even"),
    "rotary wider than narrow heads": (dict(rotary_dim=96), "rotary_dim=96 must be <= narrow_head_dim"),
    "layer out of range": (dict(attn_layers=[0, 1, 11]), "attn_layers=\\[0, 1, 11\\] must hold distinct"),
    "duplicate layer": (dict(no_mlp_layers=[7, 7]), "no_mlp_layers"),
    "feature on a layer without attention": (dict(xsa_layers=[1, 4]), "without attention"),
    "xsa on a paired layer": (dict(xsa_layers=[0, 3]), "overlap at \\[0\\]"),
    "xsa after the post gate": (dict(post_gate_layer=2), "come at or after post_gate_layer"),
    "gated features without gates": (dict(mudd_gates=False), "needs the per-token MUDD gates"),
    "too few gate lanes": (dict(mudd_gate_lanes=20), "need 21 lanes"),
    "skip target with attention": (dict(skip_target_layer=5), "replaces its attention sublayer"),
    "half a skip": (dict(skip_source_layer=-1), "both be -1"),
    "parallel MLP on a layer without MLP": (dict(parallel_mlp_layer=7), "has no MLP"),
    "mudd without a late cache": (dict(late_input_layer=-1), "late_input_layer=-1 must be a layer before 10"),
    "unknown compute dtype": (dict(compute_dtype="float16"), "compute_dtype='float16'"),
    "unknown attention path": (dict(attention_impl="fa3"), "attention_impl='fa3'"),
    "zero width": (dict(mlp_hidden=0), "mlp_hidden=0 must be > 0"),
    "unknown FP8 quantise path": (dict(fp8=FP8Config(quantize_impl="torch")), "fp8.quantize_impl='torch'"),
    "unknown n-gram fold": (
        dict(ngram=NgramConfig(enabled=True, rows=1000, dim=64, fold_impl="cuda")),
        "ngram.fold_impl='cuda'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_impossible_config_raises_naming_the_field(case):
    fields, message = BAD_CONFIGS[case]
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig(**fields)


def test_config_mutated_after_construction_is_checked_again_by_the_model():
    cfg = ModelConfig()
    cfg.model_dim = 512  # dataclasses do not re-run __post_init__ on assignment
    with pytest.raises(ModelConfigError, match="must equal model_dim=512"):
        GPT(cfg, device="meta")


def test_gpt_wants_a_model_config():
    with pytest.raises(TypeError, match="needs a ModelConfig"):
        GPT({"model_dim": 768})


def test_tiny_preset_is_valid_and_small():
    cfg = load_config("tiny")
    model = GPT(cfg, device="meta")
    assert (
        sum(p.numel() for p in model.parameters() if p.label not in ("embed", "lm_head", "value_embeds"))
        < 3e6
    )
