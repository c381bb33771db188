"""The parameter inventory, param table and label orders the optimizer consumes.

The track-1 table below is the record #92 inventory (upstream gpt.py @f380c1f0 and the param table of
training.py @55865738): shapes, dtypes, optimizer, comms, Adam betas, lr and wd multipliers. Built on the meta
device, so no 300M-value init runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.model.conftest import load_config
from track_1_short.model.config import ModelConfig
from track_1_short.model.gpt import GPT
from track_1_short.optim.anvil import OptimConfig
from track_1_short.optim.param_config import build_param_configs, labelled_params

BF16, F32 = torch.bfloat16, torch.float32
R, S = "replicated", "sharded"

# label: (shape, dtype, optim, comms, betas, lr_mul, wd_mul)
TRACK1 = {
    "qk_bank": ([48, 256, 768], BF16, "anvil", S, None, 1.0, 1.0),
    "vo_bank": ([16, 768, 768], BF16, "anvil", S, None, 1.0, 1.0),
    "mlp_bank": ([12, 2, 2816, 768], BF16, "anvil", S, None, 1.0, 1.0),
    "lm_head": ([768, 50304], BF16, "adam", S, [0.5, 0.95], 1.0, 150.0),
    "embed": ([50304, 768], BF16, "adam", S, [0.5, 0.95], 1.0, 150.0),
    "value_embeds": ([4 * 50304, 768], BF16, "adam", S, [0.75, 0.95], 70.0, 5.0),
    "scalars": ([24], F32, "adam", R, [0.9, 0.99], 5.0, 0.0),
    "smear_gate": ([1, 12], BF16, "adam", R, [0.9, 0.99], 0.01, 0.0),
    "ve_gate_bank": ([3, 6, 12], BF16, "adam", R, [0.9, 0.99], 1.0, 1.0),
    "post_lambdas": ([11, 2], F32, "adam", R, [0.9, 0.95], 1.0, 0.0),
    "resid_lambdas": ([11, 2], F32, "adam", R, [0.9, 0.95], 5.0, 0.0),
    "mudd_w1": ([2, 64, 768], BF16, "adam", R, [0.9, 0.99], 0.25, 1.0),
    "mudd_w2": ([2, 14, 64], BF16, "adam", R, [0.9, 0.99], 0.25, 1.0),
    "mudd_w2g": ([14, 12, 64], BF16, "adam", R, [0.9, 0.99], 0.25, 1.0),
    "mudd_b2": ([2, 14], BF16, "adam", R, [0.9, 0.99], 0.25, 0.0),
    "mudd_gate_w1": ([2, 64, 768], BF16, "adam", R, [0.9, 0.99], 0.1, 1.0),
    "mudd_gate_w2": ([2, 23, 64], BF16, "adam", R, [0.9, 0.99], 0.1, 1.0),
    "mudd_gate_b2": ([2, 23], BF16, "adam", R, [0.9, 0.99], 0.1, 0.0),
    "_mudd_gate_scale": ([], F32, "adam", R, [0.9, 0.99], 0.1, 0.0),
}
TRACK1_RESHAPES = {"qk_bank": [48, 256, 768], "vo_bank": [16, 768, 768], "mlp_bank": [24, 2816, 768]}
# upstream training.py @55865738
TRACK1_SCATTER = [
    "qk_bank",
    "vo_bank",
    "mlp_bank",
    "value_embeds",
    "lm_head",
    "embed",
    "scalars",
    "smear_gate",
    "ve_gate_bank",
    "post_lambdas",
    "resid_lambdas",
    "mudd_w1",
    "mudd_w2",
    "mudd_w2g",
    "mudd_b2",
    "mudd_gate_w1",
    "mudd_gate_w2",
    "mudd_gate_b2",
    "_mudd_gate_scale",
]
TRACK1_WORK = [
    "qk_bank",
    "vo_bank",
    "lm_head",
    "embed",
    "value_embeds",
    "scalars",
    "smear_gate",
    "ve_gate_bank",
    "mudd_b2",
    "mudd_gate_b2",
    "_mudd_gate_scale",
    "post_lambdas",
    "resid_lambdas",
    "mudd_w2",
    "mudd_w2g",
    "mudd_gate_w2",
    "mudd_w1",
    "mudd_gate_w1",
    "mlp_bank",
]


@pytest.fixture(scope="module")
def track1() -> GPT:
    return GPT(load_config("track1"), device="meta")


def test_track1_yaml_is_the_dataclass_default():
    assert load_config("track1") == ModelConfig()


def test_track1_parameters_match_the_record_inventory(track1):
    got = {p.label: (list(p.shape), p.dtype) for p in track1.parameters()}
    assert got == {label: (row[0], row[1]) for label, row in TRACK1.items()}
    # ~302.8 M values (upstream's count, n-gram table excluded)
    assert sum(p.numel() for p in track1.parameters()) == 302_792_179


def test_track1_param_table_matches_the_record_table(track1):
    table = track1.param_table()
    assert set(table) == set(TRACK1)
    for label, (_, _, optim, comms, betas, lr_mul, wd_mul) in TRACK1.items():
        entry = table[label]
        assert (entry["optim"], entry["comms"], entry["adam_betas"]) == (optim, comms, betas), label
        assert (entry["lr_mul"], entry["wd_mul"]) == (lr_mul, wd_mul), label
        assert entry.get("reshape") == TRACK1_RESHAPES.get(label), label
    assert table["embed"]["tied_to"] == "lm_head"
    assert "tied_to" not in table["lm_head"]


def test_track1_bank_matrix_multipliers_freeze_pads_and_the_dead_mlp_slot(track1):
    table = track1.param_table()
    assert table["qk_bank"]["matrix_lr_mul"] == [1.0] * 42 + [0.0] * 6  # 7 slots x 6 head pairs, 6 pads
    assert table["vo_bank"]["matrix_lr_mul"] == [1.0] * 14 + [0.0] * 2  # 7 slots x (V, O), 2 pads
    mlp = table["mlp_bank"]["matrix_lr_mul"]
    assert mlp[0::2] == [1.0] * 7 + [0.0] + [1.0] * 4  # c_fc; slot 7 (deleted layer 7's MLP) frozen
    assert mlp[1::2] == [2.0] * 7 + [0.0] + [2.0] * 4  # c_proj gets 2x lr


def test_track1_orders_are_upstreams(track1):
    assert track1.scatter_order() == TRACK1_SCATTER
    assert track1.work_order() == TRACK1_WORK


def test_replicated_set_is_the_small_tensors_in_bf16_and_fp32(track1):
    table = track1.param_table()
    replicated = [p for p in track1.parameters() if table[p.label]["comms"] == "replicated"]
    assert len(replicated) == 13
    assert {p.dtype for p in replicated} == {BF16, F32}
    assert sum(p.numel() for p in replicated) < 250_000  # ~212k values (upstream's figure)
    others = [p for p in track1.parameters() if table[p.label]["comms"] == "sharded"]
    assert min(p.numel() for p in others) > 10 * max(p.numel() for p in replicated)


def test_tiny_has_three_banks_and_a_replicated_set_in_two_dtypes(tiny_fp32):
    table = tiny_fp32.param_table()
    assert sorted(k for k, e in table.items() if e["optim"] == "anvil") == ["mlp_bank", "qk_bank", "vo_bank"]
    replicated = [p for p in tiny_fp32.parameters() if table[p.label]["comms"] == "replicated"]
    assert {p.dtype for p in replicated} == {BF16, F32}
    assert set(table) == set(TRACK1)  # every feature is on in the tiny preset
    assert tiny_fp32.embed.shape == (50304, 128) and tiny_fp32.lm_head.shape == (128, 50304)


@pytest.mark.parametrize("name", ["tiny", "track1"])
def test_labels_unique_and_tables_cover_every_parameter(name):
    model = GPT(load_config(name), device="meta")
    labels = [p.label for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    assert labels == [n.replace(".weight", "") for n in names]
    assert len(set(labels)) == len(labels)
    assert set(model.param_table()) == set(labels)
    for order in (model.scatter_order(), model.work_order()):
        assert sorted(order) == sorted(labels)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["tiny", "track1"])
def test_optimizer_accepts_the_param_table(name, world):
    model = GPT(load_config(name), device="meta")
    cfgs = build_param_configs(
        labelled_params(model.named_parameters()),
        model.param_table(),
        model.scatter_order(),
        model.work_order(),
        OptimConfig(),
        world,
    )
    for label, entry in model.param_table().items():
        if entry["optim"] == "anvil":
            # banks shard matrix by matrix, evenly, on any world dividing 8
            assert cfgs[label].chunk_size * world == entry["reshape"][0], label
            assert math.prod(entry["reshape"]) == math.prod(cfgs[label].shape), label


def test_split_embed_drops_the_tie(tiny_fp32):
    assert tiny_fp32.param_table()["embed"]["tied_to"] == "lm_head"
    model = GPT(load_config("tiny"), device="meta")
    model.split_embed()
    assert "tied_to" not in model.param_table()["embed"]
    assert (
        model.state_dict()["embed_is_split"].dtype == torch.bool
    )  # the split is a buffer, saved with the model


def test_disabled_features_drop_their_parameters_and_labels():
    cfg = load_config(
        "tiny",
        mudd=False,
        mudd_gates=False,
        smear=False,
        xsa_layers=[],
        attn_gate_layers=[],
        x0_inject_layers=[],
        value_embed_layers=[],
    )
    model = GPT(cfg, device="meta")
    labels = {p.label for p in model.parameters()}
    assert labels == {
        "lm_head",
        "embed",
        "qk_bank",
        "vo_bank",
        "mlp_bank",
        "scalars",
        "post_lambdas",
        "resid_lambdas",
    }
    assert sorted(model.scatter_order()) == sorted(labels) == sorted(model.work_order())
