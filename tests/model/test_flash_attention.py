"""model.attention_impl=fa4: flash-attn-4 on the layers it runs, FlexAttention on the others, the windows as
host ints. On the CPU flash-attn-4 is absent: a stand-in with its call signature (the masked softmax of
reference_attention over the documents cu_seqlens gives) checks what the model hands it; ``gpu`` tests the
library itself where it is installed."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import track_1_short.model.attention as attention
from tests.model.conftest import load_config
from track_1_short.model.attention import flash_attention_varlen, reference_attention


def _stand_in(calls: list):
    """A function with flash_attn_varlen_func's signature computing the model's mask (same document, causal,
    ``window`` back) by reference_attention; it records what it was given."""

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size
    ):
        assert cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
        assert causal and softmax_scale == 1.0 and window_size[1] == 0
        assert all(isinstance(w, int) for w in window_size)
        assert all(t.is_contiguous() for t in (q, k, v))
        s = q.size(0)
        doc_ids = torch.searchsorted(cu_seqlens_q[1:], torch.arange(s), right=True).to(torch.int32)
        calls.append(
            {"shape": (tuple(q.shape), tuple(v.shape)), "window": window_size[0], "max": max_seqlen_q}
        )
        return reference_attention(q, k, v, doc_ids, window_size[0], 16), None

    return flash_attn_varlen_func


def _batch():
    g = torch.Generator().manual_seed(0)
    inp = torch.randint(1, 1024, (256,), generator=g).int()
    inp[[0, 100]] = 0
    cu = torch.tensor([0, 100, 256, 256], dtype=torch.int32)  # the last document empty, as the trainer's
    return inp, torch.randint(0, 1024, (256,), generator=g), cu


# the tiny model's layers: 0 paired (32/64), 1 and 6 half-V (32/32), 2 long (64/64); with 7 also half-V,
# layer 7 is an unpaired layer of unequal widths (64/32), which flash-attn-4 is not given either
@pytest.mark.parametrize("half_v", [[1, 6], [1, 6, 7]])
def test_the_unpaired_equal_width_layers_run_flash_attn_4_the_others_flex(monkeypatch, half_v):
    from track_1_short.model.gpt import GPT

    calls = []
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda device: _stand_in(calls))
    inp, tgt, cu = _batch()
    losses = {}
    for impl in ("flex", "fa4"):
        torch.manual_seed(0)
        cfg = load_config(
            "tiny", vocab_size=1024, compute_dtype="float32", attention_impl=impl, half_v_layers=half_v
        )
        m = GPT(cfg)
        m.eval()
        with torch.no_grad():
            losses[impl] = m(inp, tgt, cu, (1, 2)).item()
    specs = m.topo.specs
    runs = [i for i, s in sorted(specs.items()) if not s.paired and s.qk_dim == s.v_dim]
    assert runs == ([1, 2, 6, 7] if half_v == [1, 6] else [1, 2, 6])
    assert len(calls) == len(runs)
    block = m.cfg.block_size
    long_layers = set(m.cfg.long_window_layers)
    for call, layer in zip(calls, runs):
        assert call["window"] == (2 if layer in long_layers else 1) * block  # host ints, in tokens
        assert call["max"] == 256  # the sequence's length bounds every document's
    # the stand-in is the reference's masked softmax, the others FlexAttention: the same mask, fp32 sums in
    # other orders
    assert abs(losses["fa4"] - losses["flex"]) <= 1e-5 * abs(losses["flex"])


def test_a_window_as_a_tensor_is_refused_with_the_fix():
    q = torch.zeros(8, 1, 16)
    with pytest.raises(TypeError, match="window as a host int.*pass the windows as ints"):
        flash_attention_varlen(q, q, q, torch.tensor([0, 8], dtype=torch.int32), torch.tensor(4))


def test_without_flash_attn_4_or_cuda_the_error_names_the_fix(monkeypatch):
    q, cu = torch.zeros(8, 1, 16), torch.tensor([0, 8], dtype=torch.int32)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed (as on this CPU)
    with pytest.raises(
        RuntimeError, match="needs flash-attn-4.*pip install flash-attn-4.*attention_impl=flex"
    ):
        flash_attention_varlen(q, q, q, cu, 4)
    installed = types.ModuleType("flash_attn.cute")
    installed.flash_attn_varlen_func = _stand_in([])
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", installed)
    with pytest.raises(RuntimeError, match="runs on CUDA, got cpu tensors; use model.attention_impl=auto"):
        flash_attention_varlen(q, q, q, cu, 4)


def test_the_trainer_passes_host_int_windows_with_fa4_and_a_device_tensor_otherwise(tmp_path):
    from tests.faults_runs import build
    from tests.test_train import short_cfg

    for impl, want in (("fa4", tuple), ("auto", torch.Tensor)):
        t = build(short_cfg(str(tmp_path / impl), f"model.attention_impl={impl}"))
        windows = t._window_tensor((3, 7))
        assert isinstance(windows, want), impl
        assert [int(w) for w in windows] == [3, 7]


@pytest.mark.gpu
def test_gpu_the_compiled_model_on_flash_attn_4_trains_as_on_flex():
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed on this machine")
    from track_1_short.model.gpt import GPT

    inp, tgt, cu = (t.cuda() for t in _batch())
    results = {}
    for impl in ("flex", "fa4"):
        torch.manual_seed(0)
        m = GPT(load_config("tiny", vocab_size=1024, attention_impl=impl), device="cuda")
        m.follow_windows((1, 2))
        f = torch.compile(m, dynamic=False)
        loss = f(inp, tgt, cu, (1, 2), torch.tensor([1.0, 0.5], device="cuda"))
        loss.backward()
        results[impl] = (loss.detach(), [p.grad.float() for p in m.parameters() if p.grad is not None])
    (lf, gf), (la, ga) = results["flex"], results["fa4"]
    # two bf16 attention kernels with other summation orders (perf/RESULTS.md, "Attention kernel": 1.5e-3
    # relative on the outputs and dq), carried through the model: the loss to 1e-2, each gradient to 5e-2
    assert abs(la - lf) <= 1e-2 * abs(lf)
    for a, b in zip(ga, gf):
        assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 5e-2
