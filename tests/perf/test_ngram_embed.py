"""perf/kernels/ngram_embed.py: the n-gram embedding read from the cache and its rows' gradient, one kernel
each way, against the torch-op reference bit for bit (under the interpreter on the CPU; ``gpu`` on CUDA),
alone and as the model's custom op (autograd, the sink's gradient, and compiled)."""

from __future__ import annotations

import pytest
import torch

from tests.perf.compile_sm90 import assert_kernels_compile
from track_1_short.model.ngram import NgramRows, ngram_embed, ngram_embedding, ngram_embedding_grad
from track_1_short.perf.kernels.ngram_embed import embed_backward, embed_forward


def _case(seed: int, t: int = 37, rows: int = 60, dim: int = 50, pool_rows: int = 8):
    """A cache whose rows span many magnitudes (so the sum of two of them rounds, and how shows in the bits),
    slots with repeats (the reserved rows), a +-1 sign pool, and an output gradient with zeros of both
    signs."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    cache = (torch.randn(rows, dim, generator=g) * scale).bfloat16()
    slots = torch.randint(0, rows, (2 * t,), generator=g)
    slots[:5] = rows - 1
    pool = torch.where(torch.randn(pool_rows, dim, generator=g) >= 0, 1.0, -1.0).bfloat16()
    signs = torch.randint(0, pool_rows, (2 * t,), generator=g)
    grad = torch.randn(t, dim, generator=g).bfloat16()
    grad[0, :3] = torch.tensor([0.0, -0.0, -0.0])
    return cache, slots, pool, signs, grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_both_kernels_give_the_references_bits(device):
    cache, slots, pool, signs, grad = _case(0)
    want = ngram_embedding(cache[slots], pool, signs)
    exact = (cache[slots].float() * pool[signs].float()).view(2, 37, -1).sum(0)
    assert (want.float() != exact).any()  # sums that round to bf16: the rounding is compared too
    got = embed_forward(*(x.to(device) for x in (cache, slots, pool, signs)))
    assert torch.equal(got.cpu(), want)
    want_grad = ngram_embedding_grad(grad, pool, signs)
    got_grad = embed_backward(*(x.to(device) for x in (grad, pool, signs))).cpu()
    assert torch.equal(got_grad, want_grad)
    assert torch.equal(torch.signbit(got_grad), torch.signbit(want_grad))  # -0 stays -0, +0 stays +0


def test_the_custom_op_puts_the_gradient_on_the_sink_alike_for_both_impls():
    cache, slots, pool, signs, grad = _case(1)
    got = {}
    for impl in ("reference", "triton"):
        sink = torch.empty(slots.numel(), cache.shape[1], dtype=cache.dtype).requires_grad_()
        out = ngram_embed(NgramRows(cache, slots, sink), pool, signs, impl)
        out.backward(grad)
        got[impl] = (out.detach(), sink.grad)
    assert torch.equal(got["triton"][0], got["reference"][0])
    assert torch.equal(got["triton"][1], got["reference"][1])
    # the sink's gradient is the gathered rows' gradient under autograd of the plain torch ops
    rows = cache[slots].requires_grad_()
    ngram_embedding(rows, pool, signs).backward(grad)
    assert torch.equal(got["reference"][1].float(), rows.grad.float())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_compiled_the_op_is_one_graph_with_the_eager_bits(impl):
    from torch._dynamo.testing import CompileCounterWithBackend

    cache, slots, pool, signs, grad = _case(2)

    def run(fn, cache):
        sink = torch.empty(slots.numel(), cache.shape[1], dtype=cache.dtype).requires_grad_()
        out = fn(NgramRows(cache, slots, sink), pool, signs)
        out.backward(grad)
        return out.detach(), sink.grad

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = lambda r, p, s: ngram_embed(r, p, s, impl) * 2  # noqa: E731
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)  # as the trainer compiles
    eager = run(fn, cache)
    # every cycle's cache has its own row count, marked dynamic (NgramTable.fill): one graph for all
    first, bigger = cache.clone(), torch.cat([cache, cache[:7]])
    for c in (first, bigger):
        torch._dynamo.mark_dynamic(c, 0)
    assert all(torch.equal(a, b) for a, b in zip(run(compiled, first), eager))
    run(compiled, bigger)
    torch._dynamo.reset()
    assert counter.frame_count == 1


def test_the_kernels_refuse_a_table_not_in_bf16():
    cache, slots, pool, signs, grad = _case(3)
    with pytest.raises(ValueError, match="contiguous bf16.*embed_impl=reference"):
        embed_forward(cache.float(), slots, pool, signs)
    with pytest.raises(ValueError, match="contiguous bf16"):
        embed_backward(grad.float(), pool, signs)


def test_the_kernels_compile_for_the_h100_on_this_machine():
    # The interpreter accepts code Triton's compiler refuses: the GPU variants compiled here, with no GPU.
    from track_1_short.perf.kernels.ngram_embed import BLOCK_T

    common = {"pool_ptr": "*bf16", "signs_ptr": "*i64", "T": "i32"}
    kernels = {
        "_embed_forward_kernel": {"out_ptr": "*bf16", "cache_ptr": "*bf16", "slots_ptr": "*i64", **common},
        "_embed_backward_kernel": {"out_ptr": "*bf16", "grad_ptr": "*bf16", **common},
    }
    consts = {"D": 768, "BLOCK_T": BLOCK_T, "BLOCK_D": 1024, "AS_BITS": False}
    assert_kernels_compile("track_1_short.perf.kernels.ngram_embed", kernels, consts)
