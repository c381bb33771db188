"""Bad input to AnvilAndAdam's constructor and OptimConfig: one clear error, before anything changes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.optim import fake_model as fm
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig, ParamTableError

CONFIG_FILE = Path(__file__).resolve().parents[2] / "configs" / "optim" / "anvil_adam.yaml"


def construct(named=None, table=None, scatter=None, work=None, cfg=None):
    named = fm.make_params() if named is None else named
    return AnvilAndAdam(
        named,
        fm.param_table() if table is None else table,
        fm.SCATTER_ORDER if scatter is None else scatter,
        fm.WORK_ORDER if work is None else work,
        OptimConfig(replicated_impl="reference") if cfg is None else cfg,
    )


def test_valid_inputs_build_configs_for_every_label():
    opt = construct()
    assert list(opt.param_cfgs) == list(fm.SPECS)
    assert opt.param_cfgs["mlp_bank"].lr_mul == pytest.approx((24 / 8) ** 0.5)  # the tall shape factor
    assert opt.param_cfgs["qk_bank"].lr_mul == 1.0 and opt.param_cfgs["vo_bank"].lr_mul == 1.0
    assert opt.replicated_labels == fm.REPLICATED


def _table_with(label, **changes):
    table = fm.param_table()
    table[label] = {**table[label], **changes}
    for k, v in changes.items():
        if v is ...:
            del table[label][k]
    return table


BAD_TABLES = {
    "unknown optim": (_table_with("scalars", optim="sgd"), "'scalars': optim='sgd'"),
    "unknown comms": (_table_with("lm_head", comms="broadcast"), "'lm_head': comms='broadcast'"),
    "unknown key": (_table_with("scalars", lr_scale=2.0), "'scalars': unknown keys \\['lr_scale'\\]"),
    "replicated bank": (_table_with("vo_bank", comms="replicated"), "'vo_bank': ANVIL banks are sharded"),
    "reshape of wrong size": (
        _table_with("vo_bank", reshape=[2, 16, 8]),
        "'vo_bank': reshape=\\[2, 16, 8\\]",
    ),
    "reshape not 3-D": (_table_with("vo_bank", reshape=[32, 16]), "'vo_bank': reshape"),
    "matrix multipliers of wrong length": (_table_with("mlp_bank", matrix_lr_mul=[1.0, 2.0]), "'mlp_bank'"),
    "adam without betas": (_table_with("post_lambdas", adam_betas=None), "'post_lambdas': adam_betas"),
    "betas out of range": (_table_with("post_lambdas", adam_betas=[0.9, 1.0]), "'post_lambdas': adam_betas"),
    "bank with betas": (_table_with("qk_bank", adam_betas=[0.9, 0.95]), "'qk_bank': adam_betas must be None"),
    "negative lr_mul": (_table_with("scalars", lr_mul=-1.0), "'scalars': lr_mul"),
    "sharded 0-D": (_table_with("_gate_scale", comms="sharded"), "'_gate_scale': a 0-D parameter"),
    "tied to a replicated": (_table_with("embed", tied_to="scalars"), "'embed': tied_to='scalars'"),
    "tied to itself": (_table_with("embed", tied_to="embed"), "'embed': tied_to='embed'"),
    "tied to a non-transpose": (_table_with("embed", tied_to="value_embeds"), "not the transpose"),
    "tie on a replicated": (_table_with("scalars", tied_to="lm_head"), "'scalars': tied_to is only"),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_bad_param_table_entry_names_the_label_and_changes_nothing(case):
    table, message = BAD_TABLES[case]
    named = fm.make_params()
    before = {p.label: (p.data_ptr(), p.detach().clone()) for _, p in named}
    with pytest.raises(ParamTableError, match=message):
        construct(named, table=table)
    for _, p in named:
        ptr, value = before[p.label]
        assert p.data_ptr() == ptr and torch.equal(p, value)


def test_bank_that_is_not_bf16_is_refused():
    named = fm.make_params()
    qk = dict((p.label, p) for _, p in named)["qk_bank"]
    qk.data = qk.data.float()
    with pytest.raises(ParamTableError, match="'qk_bank': ANVIL banks must be bf16"):
        construct(named)


def test_missing_and_unknown_labels_are_all_listed():
    table = fm.param_table()
    del table["scalars"], table["mlp_bank"]
    table["ghost"] = table["vo_bank"]
    with pytest.raises(
        ParamTableError, match=r"missing labels \['mlp_bank', 'scalars'\]; unknown labels \['ghost'\]"
    ):
        construct(table=table)


@pytest.mark.parametrize("which", ["scatter", "work"])
def test_orders_must_cover_every_label_once(which):
    order = [k for k in fm.SCATTER_ORDER if k != "embed"] + ["scalars", "nope"]
    with pytest.raises(
        ParamTableError, match=rf"{which}_order .*missing labels \['embed'\].*\['nope'\].*\['scalars'\]"
    ):
        construct(**{which: order})


def test_parameters_need_unique_labels():
    named = fm.make_params()
    named[1][1].label = named[0][1].label
    with pytest.raises(ParamTableError, match="labels used by two parameters: 'qk_bank'"):
        construct(named)
    named = fm.make_params()
    del named[2][1].label
    with pytest.raises(ParamTableError, match="without a string .label: mlp_bank.weight"):
        construct(named)


@pytest.mark.parametrize(
    "field, value",
    [
        ("replicated_impl", "triton"),
        ("bank_update", "compiled"),
        ("cascade_gram", "folded"),
        ("adam_every", 0),
        ("adam_lr", -1.0),
        ("adam_eps", 0.0),
        ("slow_rail_beta", 1.5),
        ("frobenius_margin", 1.0),
        ("rail_engage_step", -1),
    ],
)
def test_optim_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"optim.{field}"):
        OptimConfig(**{field: value})


def test_config_group_file_is_complete_typed_and_matches_the_defaults():
    raw = OmegaConf.load(CONFIG_FILE)
    assert set(raw) == {f.name for f in dataclasses.fields(OptimConfig)}
    merged = OmegaConf.merge(OmegaConf.structured(OptimConfig), raw)
    assert OmegaConf.to_object(merged) == OptimConfig()
    with pytest.raises(Exception, match="adam_every"):
        OmegaConf.merge(OmegaConf.structured(OptimConfig), {"adam_every": "often"})
