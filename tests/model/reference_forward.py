"""An independent statement of the GPT's forward, for tests/model/test_forward_reference.py.

Written from the model's definition (the docstrings of track_1_short/model/gpt.py, attention.py and
layers.py), not from its code paths: float64 throughout, one token-by-token document bookkeeping, one full
[S, S] masked softmax per layer, rotary positions counted inside each document (attention only sees position
differences, so this must equal the model's packed-stream positions), and no shared helper from the package.
It reads the model's parameters and rotary buffers and nothing else.

``drop`` names features to leave out or misapply (FEATURES lists them); a test checks that each one moves the
output far beyond the comparison's tolerance, so the comparison can tell when the model drops that feature.
"""

from __future__ import annotations

import math

import torch

EPS = 2.0**-23  # F.rms_norm's default eps for the model's fp32 compute, used by every norm there

FEATURES = (
    "smear",  # the one-token look-back in the embedding
    "x0_inject",  # + x0 * gate after the attention sublayer of x0_inject_layers
    "resid_lambda_attn",  # resid_lambdas[i, 0] scaling x before the attention sublayer
    "resid_lambda_mlp",  # resid_lambdas[i, 1] before the MLP sublayer
    "post_lambda_attn",  # post_lambdas[i, 0] on the attention output
    "post_lambda_mlp",  # post_lambdas[i, 1] on the MLP output
    "sa_lambda_qkv",  # scalars[2 i] on the QKV weights
    "sa_lambda_o",  # scalars[2 i + 1] on the O weights
    "qk_norm",  # RMS norm of every query and key head
    "rotary",  # rotary embedding of the leading rotary_dim dims
    "windows_swapped",  # short-window layers get the long window and vice versa
    "attn_scale_swapped",  # the two kinds' softmax scales swapped
    "key_offset",  # stationary key dims from the previous token on long layers
    "paired_heads",  # head pairs sharing one interleaved stream
    "xsa",  # gated XSA
    "attn_gate",  # per-head output gate
    "value_embeds",  # value-embedding planes added into V (gated)
    "ve_gate",  # the value-embedding gate (2 sigmoid) of the non-MUDD layers: left at 1
    "late_input",  # later attention layers read norm(cache[late_input_layer])
    "skip",  # the U-net skip into skip_target_layer
    "parallel_mlp",  # the second MLP of parallel_mlp_layer
    "mudd_last",  # MUDD coefficients at the last layer (replaced by the static lambdas)
    "mudd_mix",  # the post-loop MUDD mix
    "mudd_groups",  # the per-channel-group deltas of that mix
)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _documents(cu: list[int], t: int) -> tuple[list[int], list[int]]:
    """Per token: its document index and its position inside that document."""
    doc, pos = [0] * t, [0] * t
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        for j in range(a, b):
            doc[j], pos[j] = d, j - a
    return doc, pos


def _rotate(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x [S, h, d]: pairs (a, b) of the first 2 len(freq) dims -> (a cos + b sin, b cos - a sin)."""
    out = x.clone()
    for f in range(freq.numel()):
        theta = (pos * freq[f])[:, None]
        a, b = x[..., 2 * f], x[..., 2 * f + 1]
        out[..., 2 * f] = a * theta.cos() + b * theta.sin()
        out[..., 2 * f + 1] = b * theta.cos() - a * theta.sin()
    return out


def _attend(q, k, v, doc, pos, window):
    """Full masked softmax: key j visible from query i iff same document, j <= i, i - j <= window (stream)."""
    s = q.size(0)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    same = doc[:, None] == doc[None, :]
    back = pos[:, None] - pos[None, :]  # in-document distance; equals i - j inside one document
    visible = same & (j <= i) & (back <= window)
    scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def reference_hidden(model, inputs, cu_seqlens, windows, drop=frozenset()) -> torch.Tensor:
    """The final normed hidden states [T, D], float64."""
    unknown = set(drop) - set(FEATURES)
    assert not unknown, unknown
    cfg = model.cfg
    P = {name.replace(".weight", ""): p.detach().double() for name, p in model.named_parameters()}
    L, D, H, hd = cfg.num_layers, cfg.model_dim, cfg.num_heads, cfg.head_dim
    t = inputs.numel()
    tok = inputs.long()
    doc_l, pos_l = _documents([int(c) for c in cu_seqlens], t)
    doc, pos = torch.tensor(doc_l), torch.tensor(pos_l)
    start = pos == 0
    long_layers = set(cfg.long_window_layers)
    sa = P["scalars"]
    resid = P["resid_lambdas"].clone()
    post = P["post_lambdas"].clone()
    if "resid_lambda_attn" in drop:
        resid[:, 0] = 1.0
    if "resid_lambda_mlp" in drop:
        resid[:, 1] = 1.0
    if "post_lambda_attn" in drop:
        post[:, 0] = 1.0
    if "post_lambda_mlp" in drop:
        post[:, 1] = 1.0

    # -- embedding, smear, x0 --
    x = P["embed"][tok]
    if cfg.smear and "smear" not in drop:
        c = cfg.smear_channels
        prev = torch.zeros_like(x)
        prev[1:] = x[:-1]
        prev[start] = 0.0  # a document's first token has nothing to look back at
        gate = torch.sigmoid(x[:, :c] @ P["smear_gate"][0])[:, None]
        x = x + sa[2 * L] * gate * prev
    x = x0 = _rms(x)
    vp = model.topo.vocab_padded
    ve = {
        layer: P["value_embeds"][j * vp + tok] for j, layer in enumerate(cfg.value_embed_layers)
    }  # plane j for the j-th listed layer

    # -- the per-token MUDD gates: lanes in the documented order --
    p_layer = cfg.post_gate_layer

    def gate_block(block, inp):
        hid = _gelu(inp @ P["mudd_gate_w1"][block].T)
        return (hid @ P["mudd_gate_w2"][block].T + P["mudd_gate_b2"][block]) * P["_mudd_gate_scale"]

    def lanes_of(out, spec):
        got, a = {}, 0
        for kind, layer, width in spec:
            got[(kind, layer)] = out[:, a : a + width]
            a += width
        return got

    pre_spec = [("xsa", i, H) for i in cfg.xsa_layers if i < p_layer]
    pre_spec += [("gate", i, H) for i in cfg.attn_gate_layers if i < p_layer]
    pre_spec += [("x0", i, 1) for i in cfg.x0_inject_layers if i < p_layer]
    post_spec = [("gate", i, H) for i in cfg.attn_gate_layers if i >= p_layer]
    post_spec += [("x0", i, 1) for i in cfg.x0_inject_layers if i >= p_layer]
    post_spec += [("skip", cfg.skip_target_layer, 1)]
    lanes = lanes_of(gate_block(0, x0), pre_spec)

    # -- the bank slices of one attention layer --
    order = sorted(cfg.attn_layers, key=lambda i: (i in long_layers, i in cfg.half_v_layers, i))
    rot = cfg.rotary_dim

    def attention(i, inp, aux_v, kind, o_extra):
        slot = order.index(i)
        dq = hd if i in long_layers else cfg.narrow_head_dim
        dv = cfg.narrow_head_dim if i in cfg.half_v_layers else hd
        heads = P["qk_bank"][slot * H : (slot + 1) * H].reshape(2 * H, hd, D)  # Q heads, then K heads
        w_q, w_k = heads[:H, :dq], heads[H:, :dq]  # [H, dq, D]
        w_v = P["vo_bank"][2 * slot].reshape(H, hd, D)[:, :dv]
        w_o = P["vo_bank"][2 * slot + 1].reshape(D, H, hd)[:, :, :dv]
        g_qkv = 1.0 if "sa_lambda_qkv" in drop else sa[2 * i]
        g_o = 1.0 if "sa_lambda_o" in drop else sa[2 * i + 1]
        q = torch.einsum("td,hed->the", inp, w_q) * g_qkv
        k = torch.einsum("td,hed->the", inp, w_k) * g_qkv
        v = torch.einsum("td,hed->the", inp, w_v) * g_qkv
        if aux_v is not None:
            v = v + aux_v.reshape(t, H, hd)[..., :dv]
        if "qk_norm" not in drop:
            q, k = _rms(q), _rms(k)
        if cfg.long_key_offset and i in long_layers and "key_offset" not in drop:
            shifted = k.clone()
            for j in range(1, t):
                if not start[j]:
                    shifted[j, :, rot:] = k[j - 1, :, rot:]
            k = shifted
        s_doc, s_pos = doc, pos.double()
        paired = i in cfg.paired_head_layers and "paired_heads" not in drop
        if paired:
            # token j: heads 0..H/2-1 at stream row 2j, heads H/2..H-1 at row 2j+1
            q, k, vv = (u.reshape(t, 2, H // 2, -1).reshape(2 * t, H // 2, -1) for u in (q, k, v))
            s_doc = doc.repeat_interleave(2)
            s_pos = (2 * pos[:, None] + torch.arange(2)[None, :]).reshape(-1).double()
        else:
            vv = v
        if "rotary" not in drop:
            freq = model.rope_freq[kind].double()
            q, k = _rotate(q, s_pos, freq), _rotate(k, s_pos, freq)
        scale_kind = 1 - kind if "attn_scale_swapped" in drop else kind
        q = q * float(model.rope_attn_scale[scale_kind])
        w_kind = 1 - kind if "windows_swapped" in drop else kind
        window = int(windows[w_kind]) * cfg.block_size
        y = _attend(q, k, vv, s_doc, s_pos.long(), window).reshape(t, H, dv)
        if i in cfg.xsa_layers and "xsa" not in drop:
            alpha = torch.tanh(lanes[("xsa", i)])[..., None]
            proj = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True)
            y = y - alpha * proj * v
        if ("gate", i) in lanes and "attn_gate" not in drop:
            y = y * lanes[("gate", i)][..., None]
        return torch.einsum("the,dhe->td", y, w_o) * g_o * o_extra

    def mlp(slot, inp):
        c_fc, c_proj = P["mlp_bank"][slot, 0], P["mlp_bank"][slot, 1]
        return torch.relu(inp @ c_fc.T).square() @ c_proj

    # -- the layers --
    cache = {0: x}
    late = cfg.late_input_layer
    last = L - 1
    last_input = mlp_in = None
    for i in range(L):
        mu = None
        if i == p_layer:
            lanes.update(lanes_of(gate_block(1, x), post_spec))
        if i == cfg.skip_target_layer:
            if "skip" not in drop:
                x = x + torch.sigmoid(sa[2 * L + 1]) * lanes[("skip", i)] * cache[cfg.skip_source_layer]
        elif i not in cfg.attn_layers:
            x = resid[i, 0] * x
            if ("x0", i) in lanes and "x0_inject" not in drop:
                x = x + lanes[("x0", i)] * x0
        else:
            if i > late and "late_input" not in drop:
                inp = _rms(cache[late])
            else:
                inp = _rms(x)
            kind = 1 if i in long_layers else 0
            aux_v = None
            if i == last:
                last_input = x
            if i == last and cfg.mudd and "mudd_last" not in drop:
                hid = _gelu(x @ P["mudd_w1"][0].T)
                mu = (hid @ P["mudd_w2"][0].T + P["mudd_b2"][0]) * cfg.mudd_scale  # [T, 14]
                aux_v = mu[:, 0:1] * cache[0] + mu[:, 1:2] * cache[late] + mu[:, 2:3] * x
                x = (1 + mu[:, 5:6]) * x + mu[:, 3:4] * cache[0] + mu[:, 4:5] * cache[late]
                if i in ve and "value_embeds" not in drop:
                    head_gate = torch.cat([mu[:, 6:7].expand(t, H // 2), mu[:, 7:8].expand(t, H // 2)], 1)
                    aux_v = aux_v + (head_gate[..., None] * ve[i].reshape(t, H, hd)).reshape(t, D)
            elif i in ve and "value_embeds" not in drop:
                gated = [g for g in cfg.value_embed_layers if not (cfg.mudd and g == last)]
                gate = torch.ones(t, H, dtype=torch.float64)
                if "ve_gate" not in drop and i in gated:
                    c = cfg.ve_gate_channels
                    gate_in = torch.cat([inp[:, :c], ve[i][:, :c]], -1)
                    gate = 2 * torch.sigmoid(gate_in @ P["ve_gate_bank"][gated.index(i)].T)
                aux_v = (gate[..., None] * ve[i].reshape(t, H, hd)).reshape(t, D)
            o_extra = 1.0 if mu is not None else post[i, 0]
            out = attention(i, inp, aux_v, kind, o_extra)
            if mu is not None:
                x = mu[:, 8:9] * x + mu[:, 9:10] * out + mu[:, 10:11] * cache[0]
            else:
                x = resid[i, 0] * x + out
                if ("x0", i) in lanes and "x0_inject" not in drop:
                    x = x + lanes[("x0", i)] * x0
        if i in cfg.no_mlp_layers:
            x = resid[i, 1] * x
        else:
            mlp_in = _rms(x)
            out = mlp(i, mlp_in)
            if i == cfg.parallel_mlp_layer and "parallel_mlp" not in drop:
                out = out + mlp(L, mlp_in)  # the parallel MLP's slot follows the per-layer ones
            if mu is not None:
                x = mu[:, 12:13] * x + mu[:, 13:14] * out
            else:
                x = resid[i, 1] * x + post[i, 1] * out
        if i in (cfg.skip_source_layer, late):
            cache[i] = x

    if cfg.mudd and "mudd_mix" not in drop:
        sources = [cache[0], cache[late], last_input, cache[cfg.skip_source_layer]]
        sources += [ve[layer] for layer in cfg.value_embed_layers]
        sources += [mlp_in, _rms(cache[late])]
        n, g = len(sources), cfg.mudd_groups
        hid = _gelu(x @ P["mudd_w1"][1].T)
        coefs = (hid @ P["mudd_w2"][1, :n].T + P["mudd_b2"][1, :n]) * cfg.mudd_scale  # [T, n]
        deltas = torch.einsum("tm,kgm->tkg", hid, P["mudd_w2g"][:n]) * cfg.mudd_scale  # [T, n, G]
        if "mudd_groups" in drop:
            deltas = torch.zeros_like(deltas)
        mixed = x.reshape(t, g, D // g).clone()
        for k, src in enumerate(sources):
            mixed = mixed + (coefs[:, k : k + 1] + deltas[:, k])[..., None] * src.reshape(t, g, D // g)
        x = mixed.reshape(t, D)
    return _rms(x)


def reference_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """cap * sigmoid((h @ lm_head + shift) / temperature), float64 [T, padded vocab]."""
    cfg = model.cfg
    z = hidden @ model.lm_head.detach().double()
    return cfg.logit_cap * torch.sigmoid((z + cfg.logit_shift) / cfg.logit_temperature)
