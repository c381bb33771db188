"""The whole network on the tiny preset (fp32 compute unless a test says otherwise), on the CPU.

Bitwise claims (torch.equal) hold because every op is row-local or reads other rows only through the attention
mask: a masked key gets probability exactly 0, so its value cannot move another row's output by even one ulp.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from tests.model.conftest import BOS, load_config, packed_batch
from track_1_short.model.config import MUDD_COEFS, ModelConfig
from track_1_short.model.gpt import GPT, flops_per_token
from track_1_short.model.layers import relu2_mlp, rope_base_frequencies, yarn_rescale_

WINDOWS = (1, 3)


@pytest.fixture
def model(tiny_fp32):
    """A private copy of the seeded tiny model, so tests may train it or change its rotary state."""
    m = copy.deepcopy(tiny_fp32)
    m.label_parameters()  # deepcopy makes fresh Parameters, without their labels
    return m


def test_forward_backward_shapes_finite_and_initial_loss_is_uniform(model):
    inputs, targets, cu = packed_batch([100, 200, 84])
    loss = model(inputs, targets, cu, WINDOWS)
    assert loss.shape == () and loss.dtype == torch.float32
    # At init the logits are all ~23 * sigmoid(5 / 7.5): the prediction is near uniform over the padded vocab.
    assert abs(loss.item() / 384 - math.log(50304)) < 0.02
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, p.label
        assert torch.isfinite(p.grad.float()).all(), p.label
    moving = [
        "lm_head",
        "embed",
        "value_embeds",
        "qk_bank",
        "vo_bank",
        "mudd_w2",
        "mudd_b2",
        "mudd_gate_w2",
        "mudd_gate_b2",
        "scalars",
        "post_lambdas",
        "resid_lambdas",
        "_mudd_gate_scale",
        "ve_gate_bank",
    ]
    for p in model.parameters():
        if p.label in moving:
            assert p.grad.abs().sum() > 0, p.label
    assert model.mlp_bank.grad[:, 1].abs().sum() > 0  # c_proj moves first (c_fc waits for it: c_proj = 0)


def test_pads_and_frozen_matrices_get_exactly_zero_gradient(model):
    inputs, targets, cu = packed_batch([300])
    model(inputs, targets, cu, WINDOWS).backward()
    topo = model.topo
    assert not model.qk_bank.grad[topo.num_qk_matrices :].any()
    assert not model.vo_bank.grad[2 * topo.num_attn_slots :].any()
    for slot in topo.frozen_mlp_slots:  # layer 5 has no MLP; slots past the parallel one are pads
        assert not model.mlp_bank.grad[slot].any(), slot
    assert model.param_table()["mlp_bank"]["matrix_lr_mul"][2 * 5 : 2 * 5 + 2] == [0.0, 0.0]


def test_bf16_compute_runs_forward_and_backward():
    torch.manual_seed(0)
    model = GPT(load_config("tiny"))  # the preset as shipped: bf16 compute (the other tests run fp32)
    assert model.compute_dtype == torch.bfloat16
    inputs, targets, cu = packed_batch([70, 58])
    loss = model(inputs, targets, cu, WINDOWS)
    loss.backward()
    assert abs(loss.item() / 128 - math.log(50304)) < 0.05
    assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters())


def test_loss_is_the_summed_cross_entropy_of_the_logits(model):
    model.eval()
    inputs, targets, cu = packed_batch([64, 100, 92], seed=3)
    logits = model.logits(inputs, cu, WINDOWS)
    assert logits.shape == (256, 50304) and logits.min() > 0 and logits.max() < 23
    expected = F.cross_entropy(logits.double(), targets, reduction="sum")
    # fp32 sums of 256 terms of ~10.8 each: 1e-5 relative
    torch.testing.assert_close(model(inputs, targets, cu, WINDOWS).double(), expected, rtol=1e-5, atol=0)
    mtp = model(inputs, targets, cu, WINDOWS, [1.0, 0.5, 0.25])
    expected = expected + 0.5 * F.cross_entropy(logits[:-1].double(), targets[1:], reduction="sum")
    expected = expected + 0.25 * F.cross_entropy(logits[:-2].double(), targets[2:], reduction="sum")
    torch.testing.assert_close(mtp.double(), expected, rtol=1e-5, atol=0)


def test_val_loss_sum_is_plain_ce_without_grad_or_rotary_update(model):
    inputs, targets, cu = packed_batch([128, 128], seed=4)
    model.train()
    model(inputs, targets, cu, WINDOWS)  # fits the rotary state to WINDOWS
    freq = model.rope_freq.clone()
    val = model.val_loss_sum(inputs, targets, cu, (3, 20))  # a longer window: no YaRN step
    assert model.training and not val.requires_grad
    assert torch.equal(model.rope_freq, freq) and model.rope_windows.tolist() == [128, 384]
    model.eval()
    assert torch.equal(val, model(inputs, targets, cu, (3, 20)).detach())


def _perturbed_logits(model, doc_lens, position, windows, seed=5):
    inputs, _, cu = packed_batch(doc_lens, seed=seed)
    base = model.logits(inputs, cu, windows)
    changed = inputs.clone()
    changed[position] = (changed[position] + 1000) % 50000
    return base, model.logits(changed, cu, windows)


def test_no_information_crosses_documents_or_flows_backward(model):
    model.eval()
    doc_lens = [70, 150, 60]  # document 1 spans [70, 220)
    p = 100
    base, out = _perturbed_logits(model, doc_lens, p, windows=(4, 8))
    moved = (out != base).any(-1)
    assert not moved[:p].any()  # the past, including the whole previous document
    assert not moved[220:].any()  # the next document
    assert moved[p:220].all()  # every later token of its own document sees it


def test_windows_bound_the_receptive_field(model):
    model.eval()
    model.cfg.block_size = 16  # windows count 16-token blocks here, so short documents show the bound
    p = 10
    # Per layer a token reaches back at most its window (the paired layer 0: half its window in tokens); the
    # smear gate and the key offset of the two long-window layers add one token each.
    reach = {}
    for blocks in (1, 2):
        base, out = _perturbed_logits(model, [200], p, windows=(blocks, blocks))
        moved = (out != base).any(-1).nonzero().flatten()
        reach[blocks] = int(moved.max()) - p
        bound = blocks * 16 * (4 + 0.5) + 3  # layers 1, 2, 6, 7 full window, layer 0 half
        assert moved.min() == p and reach[blocks] <= bound
    assert reach[1] >= 16  # at least one full window is used ...
    assert reach[2] > reach[1] + 16  # ... and a larger window reaches further


def test_deterministic_given_a_seed(tiny_fp32):
    cfg = load_config("tiny", compute_dtype="float32")
    inputs, targets, cu = packed_batch([40, 60])
    results = []
    for _ in range(2):
        torch.manual_seed(7)
        m = GPT(cfg)
        loss = m(inputs, targets, cu, WINDOWS)
        loss.backward()
        results.append((m, loss.detach()))
    (a, la), (b, lb) = results
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa.grad, pb.grad), pa.label
    assert torch.equal(la, lb)
    assert not torch.equal(a.qk_bank, tiny_fp32.qk_bank)  # another seed (1234), another model


def test_reference_and_flex_attention_paths_agree_on_cpu(tiny_fp32):
    inputs, _, cu = packed_batch([70, 58], seed=6)
    ref = copy.deepcopy(tiny_fp32).eval()
    ref.cfg.attention_impl = "reference"
    flex = copy.deepcopy(tiny_fp32).eval()
    flex.cfg.attention_impl = "flex"
    with torch.no_grad():
        # Same fp32 softmax over the same keys, different summation order: 1e-4 on logits in (0, 23).
        torch.testing.assert_close(
            flex.logits(inputs, cu, WINDOWS), ref.logits(inputs, cu, WINDOWS), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("full_blocks", [True, False])
def test_attention_full_blocks_reaches_every_flex_call(tiny_fp32, monkeypatch, full_blocks):
    from track_1_short.model import attention

    seen = []

    flex = attention.flex_attention_varlen

    def spy(*args, **kwargs):
        bound = inspect.signature(flex).bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(bound.arguments["full_blocks"])
        return flex(*args, **kwargs)

    monkeypatch.setattr(attention, "flex_attention_varlen", spy)
    inputs, _, cu = packed_batch([70, 58], seed=6)
    m = copy.deepcopy(tiny_fp32).eval()
    m.cfg.attention_impl = "flex"
    m.cfg.attention_full_blocks = full_blocks
    with torch.no_grad():
        m.logits(inputs, cu, WINDOWS)
    assert len(seen) == len(m.cfg.attn_layers) and set(seen) == {full_blocks}


def test_initial_gates_and_mudd_coefficients_are_their_documented_biases(model):
    x = torch.randn(7, 128)
    s = 0.1
    bf = lambda v: torch.tensor(v / s).bfloat16().float().item() * s  # noqa: E731  biases are stored in bf16
    pre = model._gate(x, 0)
    expected = torch.zeros(8)
    expected[4:6] = bf(0.25)  # layer 2's attention gate (after the 4 XSA lanes of layers 1 and 2), x0 gates 0
    torch.testing.assert_close(pre, expected.expand(7, 8), rtol=1e-6, atol=0)
    post = model._gate(x, 1)
    expected = torch.zeros(8)
    expected[0:2] = bf(0.25)  # layer 7's attention gate
    expected[4] = bf(0.5)  # the skip gate (after the x0 lanes of layers 3 and 5)
    torch.testing.assert_close(post, expected.expand(7, 8), rtol=1e-6, atol=0)
    mu = model._mudd(x, 0, MUDD_COEFS)
    expected = torch.tensor(
        [0, 0, 0, 0, 0, 0, bf(2), bf(2), bf(1.1**0.5), bf(1), 0, bf(0.05), bf(1.1**0.5), bf(1)]
    )
    torch.testing.assert_close(mu, expected.expand(7, 14), rtol=1e-6, atol=0)
    coefs, deltas = model._mudd(x, 1, 10, grouped=True)
    expected = torch.zeros(10)
    expected[1] = bf(-0.5)  # the post-loop "backout" of cache[late]
    torch.testing.assert_close(coefs, expected.expand(7, 10), rtol=1e-6, atol=0)
    assert not deltas.any()


def test_initial_model_is_invariant_to_weights_behind_zero_initialised_heads(model):
    """c_proj = 0 makes every MLP the zero function; w2 = 0 makes MUDD and gate outputs their biases;
    smear_lambda = 0 switches the smear off. So at init the logits cannot depend on c_fc, mudd_w1,
    mudd_gate_w1 or smear_gate, while c_proj (the control) does move them."""
    model.eval()
    inputs, _, cu = packed_batch([120, 80], seed=8)
    base = model.logits(inputs, cu, WINDOWS)
    assert torch.equal(model.embed, model.lm_head.T)  # tied at init
    h = torch.randn(5, 128)
    assert not relu2_mlp(h, model.mlp_bank[3, 0], model.mlp_bank[3, 1]).any()
    with torch.no_grad():
        for p in (model.mudd_w1, model.mudd_gate_w1, model.smear_gate):
            p.add_(torch.randn_like(p.float()).to(p.dtype))
        model.mlp_bank[:, 0].add_(torch.randn_like(model.mlp_bank[:, 0].float()).bfloat16())
    assert torch.equal(model.logits(inputs, cu, WINDOWS), base)
    with torch.no_grad():
        model.mlp_bank[3, 1].add_(0.01)
    assert not torch.equal(model.logits(inputs, cu, WINDOWS), base)


def test_rotary_state_follows_window_changes_in_training_only(model):
    inputs, targets, cu = packed_batch([128], seed=9)
    base = rope_base_frequencies(32)
    model.train()
    model(inputs, targets, cu, (1, 3))
    assert model.rope_windows.tolist() == [128, 384]
    assert torch.equal(model.rope_freq, base.repeat(2, 1))  # the first windows are only recorded
    model(inputs, targets, cu, (3, 7))
    short, long_ = base.clone(), base.clone()
    g_short = yarn_rescale_(short, 128, 384, 1.0, 32.0)
    g_long = yarn_rescale_(long_, 384, 896, 1.0, 32.0)
    assert torch.equal(model.rope_freq[0], short) and torch.equal(model.rope_freq[1], long_)
    torch.testing.assert_close(model.rope_attn_scale, torch.tensor([0.18 * g_short, 0.13 * g_long]))
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model(inputs, targets, cu, (3, 20))  # a validation in training mode, without gradients: no rescale
    model.eval()
    model(inputs, targets, cu, (3, 20))  # evaluation mode with a longer window: no rescale
    assert torch.equal(model.rope_freq[1], long_) and model.rope_windows.tolist() == [384, 896]
    fresh = copy.deepcopy(model)
    fresh.reset_rotary()
    assert torch.equal(fresh.rope_freq, base.repeat(2, 1)) and fresh.rope_windows.tolist() == [-1, -1]
    fresh.load_state_dict(state)  # a resumed model continues from the saved windows, not from scratch
    fresh.train()
    fresh(inputs, targets, cu, (3, 7))
    assert torch.equal(fresh.rope_freq, model.rope_freq)


def test_deepcopy_keeps_the_param_table(tiny_fp32):
    clone = copy.deepcopy(tiny_fp32)
    assert clone.param_table() == tiny_fp32.param_table()
    assert [p.label for p in clone.parameters()] == [p.label for p in tiny_fp32.parameters()]


def test_split_embed_is_saved_and_restored_with_the_model(tiny_fp32):
    a = copy.deepcopy(tiny_fp32)
    a.split_embed()
    b = copy.deepcopy(tiny_fp32)
    assert "tied_to" in b.param_table()["embed"]
    b.load_state_dict(a.state_dict())
    assert "tied_to" not in b.param_table()["embed"]


def test_flops_per_token_matches_the_hand_count_for_a_plain_stack():
    cfg = ModelConfig(
        num_layers=2,
        model_dim=64,
        num_heads=2,
        head_dim=32,
        narrow_head_dim=32,
        rotary_dim=16,
        mlp_hidden=256,
        attn_layers=[0, 1],
        long_window_layers=[],
        half_v_layers=[],
        paired_head_layers=[],
        xsa_layers=[],
        attn_gate_layers=[],
        value_embed_layers=[],
        x0_inject_layers=[],
        no_mlp_layers=[],
        parallel_mlp_layer=-1,
        skip_source_layer=-1,
        skip_target_layer=-1,
        late_input_layer=-1,
        post_gate_layer=0,
        smear=False,
        mudd=False,
        mudd_gates=False,
    )
    d, v, L, t = 64, 50304, 2, 1000
    # per layer: QKV 2*d*3d, O 2*d*d, scores + values 2 * keys * 2d, MLP 2 * 2*d*hidden; then lm_head
    keys = (t + 1) / 2
    forward = L * (2 * d * 3 * d + 2 * d * d + 2 * keys * 2 * d + 2 * 2 * d * 256) + 2 * d * v
    assert flops_per_token(cfg, t) == pytest.approx(3 * forward, rel=1e-12)
    w = 2  # blocks of 128 tokens: keys per query min(p, 256) + 1
    keys_w = sum(min(p, 256) + 1 for p in range(t)) / t
    forward_w = forward - L * 2 * keys * 2 * d + L * 2 * keys_w * 2 * d
    assert flops_per_token(cfg, t, [w, w]) == pytest.approx(3 * forward_w, rel=1e-12)


def test_flops_per_token_of_track1_is_dominated_by_its_matmul_weights():
    cfg = ModelConfig()
    dense = 6 * (
        2 * 768 * 50304 / 2 + 47.6e6 + 2 * 8.26e6 * 7 / 7
    )  # 6 x (lm_head + live mlp + qk/vo weights)
    f = flops_per_token(cfg, 2048, [1, 3])
    assert 0.9 * dense < f < 1.3 * dense  # attention over short windows and MUDD add little


@pytest.mark.gpu
def test_tiny_on_cuda_flex_matches_the_reference_path_forward_and_backward(tiny_fp32):
    inputs, targets, cu = packed_batch([300, 212], seed=10)
    losses, grads = [], []
    for impl in ("reference", "flex"):
        m = copy.deepcopy(tiny_fp32).cuda()
        m.cfg = copy.deepcopy(m.cfg)
        m.cfg.attention_impl = impl
        loss = m(inputs.cuda(), targets.cuda(), cu.cuda(), WINDOWS)
        loss.backward()
        losses.append(loss.item())
        grads.append(m.qk_bank.grad.float().cpu())
    # TF32 and kernel reduction order: relative 1e-3 on the loss; bank gradients agree to 5% of their norm
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert (grads[1] - grads[0]).norm() < 0.05 * grads[0].norm()


def test_bos_is_the_gpt2_end_of_text_token():
    assert BOS == 50256 and BOS < ModelConfig().vocab_size


def test_validation_scores_upstreams_bf16_softcap_bitwise():
    torch.manual_seed(0)
    model = GPT(load_config("tiny"))  # bf16 compute, as record runs
    inputs, targets, cu = packed_batch([70, 58], seed=6)  # 128 rows: one chunk of the tiny loss_chunk_rows
    val = model.val_loss_sum(inputs, targets, cu, WINDOWS)
    model.eval()
    with torch.no_grad():
        h = model.hidden(inputs, cu, WINDOWS)
        # upstream gpt.py _loss, validation: (23 * torch.sigmoid((lm_head(x) + 5) / 7.5)).float(), bf16 ops
        logits = (23 * torch.sigmoid((h @ model.lm_head.to(h.dtype) + 5) / 7.5)).float()
    assert h.dtype == torch.bfloat16
    assert torch.equal(val, F.cross_entropy(logits, targets, reduction="sum"))


@pytest.mark.parametrize("smear_lambda", [0.0, 0.5])  # 0: the key offset alone (the smear starts off)
def test_cross_document_lookback_reads_the_previous_documents_last_token_as_upstream(model, smear_lambda):
    model.eval()
    with torch.no_grad():
        model.scalars[2 * model.cfg.num_layers] = smear_lambda
    moved = {}
    for cross in (False, True):
        model.cfg.cross_document_lookback = cross
        base, out = _perturbed_logits(model, [70, 150], 69, windows=(4, 8))  # 69: document 0's last token
        moved[cross] = (out != base).any(-1)
        single = _perturbed_logits(model, [220], 69, windows=(4, 8))
        moved[(cross, "single")] = single
    assert not moved[False][70:].any()  # ours: nothing crosses into document 1
    assert moved[True][70:].any()  # upstream's: document 1 reads document 0's last token
    if smear_lambda:
        assert moved[True][70]  # the smear: token 70's own embedding
    # With one document there is no start to stop at: both settings compute the same bits.
    for a, b in zip(moved[(False, "single")], moved[(True, "single")]):
        assert torch.equal(a, b)
