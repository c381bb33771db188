"""Windows given as a device tensor: the same model as Python ints, and one compiled graph for every stage.

The trainer passes each stage's (short, long) windows as an int64 [2] tensor, so a compiled model does not
specialise on them (five record stage geometries of one micro-batch shape would otherwise be five graphs,
each a compile of about a minute on an H200). The values must be exactly those of the int path.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.model.conftest import packed_batch
from track_1_short.compile_watch import graphs_made
from track_1_short.model.config import ModelConfigError

STAGES = [(1, 3), (3, 7), (5, 11)]
# Two stages suffice to tell one graph from one per stage, and each int-window graph is a Dynamo trace of the
# whole model (about 15 s on a 2-core CPU).
COMPILED_STAGES = STAGES[:2]


def _copy(model, impl):
    m = copy.deepcopy(model)
    m.label_parameters()
    m.cfg.attention_impl = impl
    return m


def _loss_and_grads(model, inputs, targets, cu, windows, follow, backward):
    model.zero_grad(set_to_none=True)
    if follow is not None:
        model.follow_windows(follow)
    with torch.set_grad_enabled(backward):
        loss = model(inputs, targets, cu, windows, torch.tensor([1.0, 0.5], device=inputs.device))
    if not backward:
        return loss, {}
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# FlexAttention has no backward on the CPU (torch 2.13): there its forward is compared, the backward on CUDA.
CASES = [
    ("reference", "cpu", True),
    ("flex", "cpu", False),
    pytest.param("flex", "cuda", True, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("impl, device, backward", CASES)
def test_tensor_windows_train_and_evaluate_bitwise_like_int_windows(tiny_fp32, impl, device, backward):
    inputs, targets, cu = (x.to(device) for x in packed_batch([300, 140, 72], seed=3))
    a, b = _copy(tiny_fp32, impl).to(device).train(), _copy(tiny_fp32, impl).to(device).train()
    for windows in STAGES:  # window changes move the rotary state: both models must follow alike
        la, ga = _loss_and_grads(a, inputs, targets, cu, windows, windows, backward)
        w = torch.tensor(windows, device=device)
        lb, gb = _loss_and_grads(b, inputs, targets, cu, w, windows, backward)
        assert torch.equal(la, lb), windows
        assert ga.keys() == gb.keys() and (len(ga) > 10 or not backward)
        for name in ga:
            if device == "cpu":
                assert torch.equal(ga[name], gb[name]), (windows, name)
            else:
                # On CUDA FlexAttention's backward is a Triton kernel compiled per mask: an int window is a
                # constant of its code, a tensor window a loaded value, so the two kernels may order their
                # fp32 accumulation differently. The forward (the loss) stays bitwise; gradients, stored in
                # bf16 for the bf16 parameters, differed by at most 2^-9 of their largest entry on an H200
                # (after a window change); the bound is one bf16 ulp of that entry, 2^-8.
                bound = 2.0**-8 * ga[name].float().abs().max()
                assert (ga[name].float() - gb[name].float()).abs().max() <= bound, (windows, name)
        assert torch.equal(a.rope_freq, b.rope_freq) and a.rope_windows.tolist() == b.rope_windows.tolist()
    with torch.no_grad():
        ints = a.eval().logits(inputs, cu, (2, 9))
        tensor = b.eval().logits(inputs, cu, torch.tensor([2, 9], device=device))
    assert torch.equal(ints, tensor)


def test_tensor_windows_not_followed_by_the_rotary_state_are_refused(tiny_fp32):
    inputs, targets, cu = packed_batch([256], seed=4)
    m = _copy(tiny_fp32, "reference").train()
    m.follow_windows((1, 3))
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ModelConfigError, match=r"follow_windows"):
        m(inputs, targets, cu, torch.tensor([3, 7]))
    with pytest.raises(ModelConfigError, match=r"int32/int64 \[2\]"):
        m(inputs, targets, cu, torch.tensor([1.0, 3.0]))
    with pytest.raises(ModelConfigError, match=r">= 1 block"):
        m.eval()(inputs, targets, cu, torch.tensor([0, 3]))
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before anything moved


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("as_tensor, graphs", [(True, 1), (False, len(COMPILED_STAGES))])
def test_a_compiled_model_makes_one_graph_for_every_stage_when_windows_are_tensors(
    tiny_fp32, device, as_tensor, graphs
):
    # FlexAttention, as on the GPU: Dynamo traces it into the model's graph (the reference path reads the
    # window on the host and would break the graph). aot_eager: the graph and its backward, without
    # Inductor's compile time; what is counted is Dynamo's graphs, the same for every backend. On the CPU
    # FlexAttention has no backward, so there the forward runs without gradients.
    backward = device == "cuda"
    inputs, targets, cu = (x.to(device) for x in packed_batch([200, 56], seed=5))
    m = _copy(tiny_fp32, "flex").to(device).train()
    m.cfg.check_inputs = False  # its host reads are a graph break of their own, off in timed runs
    torch._dynamo.reset()
    start = graphs_made()
    compiled = torch.compile(m, backend="aot_eager", dynamic=False)
    losses = []
    for windows in COMPILED_STAGES:
        m.follow_windows(windows)
        w = torch.tensor(windows, device=device) if as_tensor else windows
        # Without gradients the forward scores as a validation does: plain CE, no MTP weights.
        mtp = torch.tensor([1.0, 0.5], device=device) if backward else None
        with torch.set_grad_enabled(backward):
            loss = compiled(inputs, targets, cu, w, mtp)
        if backward:
            loss.backward()
        losses.append(loss.detach())
    assert graphs_made() - start == graphs
    assert len({float(x) for x in losses}) == len(COMPILED_STAGES)  # the windows did reach the graph
