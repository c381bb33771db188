"""The tiny model's forward against an independent statement of it (tests/model/reference_forward.py).

At init many features are invisible (c_proj = 0 makes every MLP zero, MUDD and gate heads output their biases,
smear_lambda = 0), so the model here has every parameter moved to a generic value first; then each feature
changes every row, and the ``drop`` variants of the reference check that dropping, swapping or misapplying any
one of them moves the output far beyond the comparison's tolerance.

Windows are unequal (short 1, long 3 blocks of 16 tokens) and documents longer than the long window, so a
window given to the wrong layer kind changes the result.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.model import reference_forward as ref
from tests.model.conftest import load_config, packed_batch
from track_1_short.model import gpt
from track_1_short.model.gpt import GPT

WINDOWS = (1, 3)  # blocks of BLOCK tokens: 16 and 48
BLOCK = 16
DOCS = [70, 44, 90]
# The model computes in fp32, the reference in fp64; through eight layers of norms, softmaxes and MUDD mixes
# the rounding of fp32 leaves about 1e-5 on the unit-RMS hidden states (measured ~3e-6): 1e-4 bounds it. The
# smallest effect a dropped feature has (test_every_feature_is_visible_to_the_comparison) is above 100x that.
ATOL = 1e-4


@torch.no_grad()
def lively_tiny_model() -> GPT:
    """The tiny preset (fp32 compute) with every parameter at a generic value, so every feature shows."""
    torch.manual_seed(1234)
    m = GPT(load_config("tiny", compute_dtype="float32", block_size=BLOCK)).eval()
    g = torch.Generator().manual_seed(0)

    def set_(p, values):
        p.copy_(values.to(p.dtype))

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    bound = math.sqrt(3) * 0.5 / math.sqrt(m.cfg.model_dim)  # the bank init
    L = m.cfg.num_layers
    set_(m.mlp_bank[: L + 1, 1], uniform(m.mlp_bank[: L + 1, 1].shape, -bound, bound))  # c_proj live
    set_(m.value_embeds, normal(m.value_embeds.shape, 0.5))
    set_(m.smear_gate, normal(m.smear_gate.shape, 0.5))
    set_(m.ve_gate_bank, normal(m.ve_gate_bank.shape, 0.5))
    for p in (m.mudd_w2, m.mudd_w2g, m.mudd_gate_w2):
        set_(p, normal(p.shape, 0.5))
    for p in (m.mudd_b2, m.mudd_gate_b2):
        set_(p, p.float() + normal(p.shape, 1.0))
    sc = m.scalars.clone()
    sc[: 2 * L] = uniform(2 * L, 0.5, 1.5)  # sa_lambdas
    sc[2 * L] = 0.8  # smear_lambda: the smear on
    set_(m.scalars, sc)
    set_(m.resid_lambdas, uniform(m.resid_lambdas.shape, 0.6, 1.4))
    set_(m.post_lambdas, uniform(m.post_lambdas.shape, 0.6, 1.4))
    m._mudd_gate_scale.fill_(0.7)
    m.rope_freq[1] *= 0.5  # the two window kinds' rotary states differ, as after a YaRN step
    return m


@pytest.fixture(scope="module")
def lively():
    m = lively_tiny_model()
    inputs, _, cu = packed_batch(DOCS, seed=11)
    return m, inputs, cu, ref.reference_hidden(m, inputs, cu, WINDOWS)


def test_forward_equals_the_independent_statement(lively):
    m, inputs, cu, expected = lively
    with torch.no_grad():
        hidden = m.hidden(inputs, cu, WINDOWS)
        logits = m.logits(inputs, cu, WINDOWS)
    assert hidden.dtype == torch.float32
    torch.testing.assert_close(hidden.double(), expected, atol=ATOL, rtol=0)
    # logits in (0, 23): the same fp32 error through a 128-wide dot product and the softcap's slope (< 1)
    torch.testing.assert_close(logits.double(), ref.reference_logits(m, expected), atol=10 * ATOL, rtol=0)


@pytest.mark.parametrize("feature", ref.FEATURES)
def test_every_feature_is_visible_to_the_comparison(lively, feature):
    m, inputs, cu, expected = lively
    dropped = ref.reference_hidden(m, inputs, cu, WINDOWS, drop={feature})
    assert (dropped - expected).abs().max() > 100 * ATOL, feature


def test_each_layer_kind_gets_its_own_window_rotary_state_and_scale(lively, monkeypatch):
    m, inputs, cu, _ = lively
    seen = []
    real = gpt.causal_self_attention

    def recording(x, qk_w, v_w, o_w, spec, seq, window, freq, attn_scale, *args, **kwargs):
        seen.append((window, freq.clone(), float(attn_scale)))
        return real(x, qk_w, v_w, o_w, spec, seq, window, freq, attn_scale, *args, **kwargs)

    monkeypatch.setattr(gpt, "causal_self_attention", recording)
    with torch.no_grad():
        m.hidden(inputs, cu, WINDOWS)
    layers = sorted(m.cfg.attn_layers)
    assert len(seen) == len(layers)
    for layer, (window, freq, scale) in zip(layers, seen):
        kind = 1 if layer in m.cfg.long_window_layers else 0
        assert window == WINDOWS[kind] * BLOCK, layer
        assert torch.equal(freq, m.rope_freq[kind]) and scale == float(m.rope_attn_scale[kind]), layer


def test_multi_token_loss_is_the_weighted_cross_entropy_of_the_independent_logits(lively):
    m, inputs, cu, expected = lively
    g = torch.Generator().manual_seed(12)
    targets = torch.randint(0, m.cfg.vocab_size, (inputs.numel(),), generator=g)
    weights = [1.0, 0.5, 0.25]
    logits = ref.reference_logits(m, expected)
    want = sum(
        w * torch.nn.functional.cross_entropy(logits[: logits.size(0) - k], targets[k:], reduction="sum")
        for k, w in enumerate(weights)
    )
    with torch.no_grad():
        got = m(inputs, targets, cu, WINDOWS, weights)
    # ~600 summed terms of ~11 nats, each off by the logits' fp32 error (< 1e-3): 1e-5 relative
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
