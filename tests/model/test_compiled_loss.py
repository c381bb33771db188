"""The loss under torch.compile gives the eager loss and gradients, bit for bit.

The chunked softcapped CE computes its gradients in its forward. As an autograd.Function traced by Dynamo on
CUDA (torch 2.11) those gradients came out as zeros, so no compiled model learned; as a custom op it runs the
same eager kernels inside the graph, so compiled and eager agree bitwise on every device.
"""

import pytest
import torch

from track_1_short.model.layers import softcapped_cross_entropy_sum

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def loss_and_grads(fn, x, w, targets, mtp):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, targets, mtp)
    (loss * 0.37).backward()  # a scale: backward must multiply the stored gradients by it
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_loss_and_gradients_equal_eager_bitwise(device, backend):
    if device == "cpu" and backend == "inductor":
        pytest.importorskip("torch._inductor")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(32, 256, generator=g) * 0.05).to(device)
    targets = torch.randint(0, 256, (300,), generator=g).to(device)
    mtp = torch.tensor([1.0, 0.5, 0.25], device=device)

    def f(x, w, targets, mtp):
        return softcapped_cross_entropy_sum(x, w, targets, mtp, 23.0, 5.0, 7.5, 128)

    eager = loss_and_grads(f, x, w, targets, mtp)
    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(f, backend=backend, dynamic=False), x, w, targets, mtp)
    assert eager[1].abs().sum() > 0 and eager[2].abs().sum() > 0  # a real gradient to compare
    assert torch.equal(eager[0], compiled[0])  # the op's forward: the same kernels
    for a, b, name in zip(eager[1:], compiled[1:], ("grad x", "grad w")):
        assert a.dtype == b.dtype, name
        if backend == "aot_eager":
            assert torch.equal(a, b), name
        else:
            # Inductor compiles the backward's scale (stored gradient x incoming scalar) and drops the
            # scalar's cast to bf16 (it keeps fp32 between ops): eager rounds the scalar and then the
            # product, Inductor the exact product once, and the two differ by at most one ulp of the
            # gradient's dtype (2^-7 relative in bf16, 2^-23 in fp32).
            ulp = 2.0**-7 if a.dtype == torch.bfloat16 else 2.0**-23
            assert bool(((a.float() - b.float()).abs() <= ulp * a.float().abs()).all()), name


@pytest.mark.parametrize("device", DEVICES)
def test_new_mtp_weights_reach_a_compiled_loss_without_a_new_graph(device):
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g).to(device)
    w = (torch.randn(16, 128, generator=g) * 0.05).to(device)
    targets = torch.randint(0, 128, (64,), generator=g).to(device)

    def f(x, w, targets, mtp):
        return softcapped_cross_entropy_sum(x, w, targets, mtp, 23.0, 5.0, 7.5, 32)

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, backend="aot_eager", dynamic=False)
    for third in (0.25, 0.2, 0.1, 0.0):  # a ramp, as stage 0's MTP weights
        mtp = torch.tensor([1.0, 0.5, third], device=device)
        with torch.no_grad():
            assert torch.equal(cf(x, w, targets, mtp), f(x, w, targets, mtp))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_sampled_loss_makes_one_graph_for_every_candidate_count_and_equals_eager(device):
    # The trainer's inputs: the candidate set built outside the graph by CandidateSets.build (its length
    # dynamic), the prefix weight a device tensor: a new P, weight or offset is data, not a new graph.
    from torch._dynamo.utils import counters

    from track_1_short.model.sampled_softmax import CandidateSets

    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 16, generator=g).to(device)
    w = (torch.randn(16, 256, generator=g) * 0.05).to(device)
    targets = torch.randint(0, 128, (64,), generator=g).to(device)
    prefix = torch.randint(-1, 256, (64,), generator=g).to(device)
    mtp = torch.tensor([1.0, 0.5], device=device)
    sets = CandidateSets(256)

    def f(x, w, targets, prefix_weight, cand):
        return softcapped_cross_entropy_sum(
            x,
            w,
            targets,
            mtp,
            23.0,
            5.0,
            7.5,
            32,
            prefix_targets=prefix,
            prefix_weight=prefix_weight,
            candidates=cand,
        )

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, backend="aot_eager", dynamic=False)
    for step, (weight, p) in enumerate([(0.25, 96), (0.2, 96), (0.1, 128), (0.0, 128), (0.0, 192)]):
        cand = sets.build(targets, p, torch.tensor(step * 37, device=device))
        args = (torch.tensor([weight], device=device), cand)
        eager = loss_and_grads(lambda x, w, t, args: f(x, w, t, *args), x, w, targets, args)
        compiled = loss_and_grads(lambda x, w, t, args: cf(x, w, t, *args), x, w, targets, args)
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), step
    assert counters["stats"]["unique_graphs"] == 1  # P = 96, 128 and 192
