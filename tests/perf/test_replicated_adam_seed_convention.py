"""The seed module's calling convention: dicts keyed by parameter and ``active`` as a set of parameters.

Upstream's own optimizer calls perf/replicated_adam.py as ``ReplicatedAdam(params, param_cfgs, param_states,
device)`` with ``param_cfgs`` / ``param_states`` its whole ``{parameter: cfg}`` / ``{parameter: state}`` dicts
(replicated or not), reads ``group.params`` and ``group.grad_views[p]``, and calls ``adam_scalar_table(params,
param_cfgs, param_states, active)`` with ``active`` a set. Each test runs that convention next to this
project's sequences and compares bits.
"""

import numpy as np
import pytest
import torch

from tests.perf.replicated_adam_cases import assert_bitwise, clone_inventory, make_inventory, random_grads
from track_1_short.perf.replicated_adam import ReplicatedAdam, adam_scalar_table, flatten_replicated


def _seed_dicts(params, cfgs, states):
    """The seed's dicts: keyed by parameter, plus one (sharded, say) parameter it does not flatten."""
    extra = torch.nn.Parameter(torch.zeros(3))
    param_cfgs = {p: c for p, c in zip(params, cfgs)}
    param_states = {p: s for p, s in zip(params, states)}
    param_cfgs[extra] = cfgs[0]
    param_states[extra] = {"step": 0}
    return param_cfgs, param_states


def test_the_seed_convention_steps_bitwise_like_the_sequence_convention():
    params, cfgs, states = make_inventory(seed=11, wd_boost=50.0)
    seq = clone_inventory(params, cfgs, states)
    param_cfgs, param_states = _seed_dicts(params, cfgs, states)
    seed_opt = ReplicatedAdam(params, param_cfgs, param_states, torch.device("cpu"))  # the seed's call
    seq_opt = ReplicatedAdam(*seq, "cpu")
    gen = torch.Generator().manual_seed(12)
    for step in range(4):
        missing = {step, 7} if step % 2 else set()  # some steps leave parameters without a gradient
        grads = random_grads(params, gen, missing=missing)
        for opt, ps in ((seed_opt, params), (seq_opt, seq[0])):
            for p, g in zip(ps, grads):
                p.grad = None if g is None else g.clone()
            opt.launch_reduce()
            opt.update()
            for p in ps:  # the seed's Phase 3 drops the gradients itself
                p.grad = None
    for i, p in enumerate(params):
        state = param_states[p]
        assert_bitwise(p, seq[0][i], f"{p.label} param")
        assert_bitwise(state["exp_avg"], seq[2][i]["exp_avg"], f"{p.label} exp_avg")
        assert_bitwise(state["exp_avg_sq"], seq[2][i]["exp_avg_sq"], f"{p.label} exp_avg_sq")
        assert state["step"] == seq[2][i]["step"] > 0
    seed_opt.assert_views_intact()


def test_flat_groups_list_their_params_and_look_up_grad_views_by_parameter():
    params, cfgs, states = make_inventory(seed=13)
    _, param_states = _seed_dicts(params, cfgs, states)
    groups = flatten_replicated(params, param_states, torch.device("cpu"))
    seen = []
    for group in groups:
        assert [id(p) for p in group.params] == [id(params[i]) for i in group.indices]
        for k, p in enumerate(group.params):
            view = group.grad_views[p]  # the seed's lookup
            assert view is group.grad_views[k]  # and this project's, by position
            assert view.shape == p.shape and p in group.grad_views
            assert view.data_ptr() == group.grad[group.span(k)].data_ptr()
            # the mapping's moments were rebound to the flat views, as the seed's code reads them back
            assert param_states[p]["exp_avg"].data_ptr() == group.exp_avg[group.span(k)].data_ptr()
        assert [id(p) for p in group.grad_views.keys()] == [id(p) for p in group.params]
        seen += group.params
    assert len(seen) == len(params)
    stranger = torch.nn.Parameter(torch.zeros(1))
    assert stranger not in groups[0].grad_views
    with pytest.raises(KeyError, match="not a member"):
        groups[0].grad_views[stranger]


def test_adam_scalar_table_takes_active_as_a_set_with_the_same_bits_and_step_counts():
    params, cfgs, states = make_inventory(seed=14)
    active_set = {params[i] for i in (0, 2, 5, 12)}
    flags = [any(p is q for q in active_set) for p in params]
    by_seq = [{"step": 3} for _ in params]
    by_dict = {p: {"step": 3} for p in params}
    expected = adam_scalar_table(params, cfgs, by_seq, flags)
    got = adam_scalar_table(params, dict(zip(params, cfgs)), by_dict, active_set)  # the seed's call
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))
    assert (
        [by_dict[p]["step"] for p in params] == [s["step"] for s in by_seq] == [4 if f else 3 for f in flags]
    )


def test_a_mapping_missing_a_parameter_or_a_stray_active_entry_is_refused_before_anything_changes():
    params, cfgs, states = make_inventory(seed=15)
    param_cfgs, param_states = _seed_dicts(params, cfgs, states)
    del param_states[params[4]]
    before = [p.data_ptr() for p in params]
    with pytest.raises(
        ValueError, match=r"param_states is a mapping without an entry for parameter 4 \(resid_lambdas\)"
    ):
        ReplicatedAdam(params, param_cfgs, param_states, "cpu")
    assert [p.data_ptr() for p in params] == before  # nothing was flattened
    stray = {torch.nn.Parameter(torch.zeros(1))}
    with pytest.raises(ValueError, match="not among params"):
        adam_scalar_table(params, cfgs, states, stray)
    assert all(s["step"] == 0 for s in states)
