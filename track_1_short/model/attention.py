"""Causal self-attention over one packed sequence of whole documents (batch 1, varlen).

Which key a query sees (the mask, identical on every path): key j is visible from query i when both belong to
the same document, j <= i, and i - j <= window, where window is in tokens (upstream's FlashAttention-3
``window_size=(window, 0)``: window + 1 keys counting the query's own).

Two paths compute it, chosen by ``ModelConfig.attention_impl``:
  "reference"  a plain masked softmax, query block by query block over only the keys the window can
               reach; runs anywhere, used on the CPU ("auto" picks it for CPU tensors).
  "flex"       FlexAttention with a block mask enumerated from the document starts and the window, so only the
               key blocks the window can reach are visited ("auto" picks it for CUDA tensors, compiled once);
               blocks whose pairs are all visible are listed apart and skip the mask function
               (``ModelConfig.attention_full_blocks``, kv_block_lists_split).
               On the CPU FlexAttention runs unfused and forward only (tests use it there at small sizes).
  "fa4"        flash-attn-4's varlen kernel (``flash_attn.cute``, the flash-attn-4 wheel; CUDA) on the layers
               it runs: unpaired heads whose query/key and value widths agree; FlexAttention on the paired
               64/128 layers, which it refuses. It takes the window as a host int, so the trainer passes the
               windows as host ints (a graph per window pair, each made in the warmup at its stage's start),
               and it runs outside the compiled graph (its own autograd function, called eagerly).
               perf/RESULTS.md, "Attention kernel", has it against FlexAttention at the record's shapes.
Upstream (record #92) runs a patched FlashAttention-3 varlen kernel instead, with the window semantics above.

One layer (``causal_self_attention``): QKV from bank slices (scaled by sa_lambda[0]), QK-norm in fp32, partial
key offset, rotary, optional paired heads, value-embedding / MUDD add-ins to V, attention, gated XSA, per-head
output gate, output projection scaled by sa_lambda[1] and the layer's post-lambda.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from track_1_short.model.layers import FP32_EPS, apply_rotary

ATTENTION_IMPLS = ("auto", "reference", "flex", "fa4")


# -- the mask ------------------------------------------------------------------------------------------------


def visible(doc_q: Tensor, doc_k: Tensor, pos_q: Tensor, pos_k: Tensor, window: int | Tensor) -> Tensor:
    """The attention mask (broadcasting): same document, causal, and at most ``window`` tokens back."""
    return (doc_q == doc_k) & (pos_k <= pos_q) & (pos_q - pos_k <= window)


def _document_firsts(doc_ids: Tensor) -> Tensor:
    """int64 [S]: the position of the first token of each token's document (a run of equal ids)."""
    s = doc_ids.numel()
    is_start = torch.ones(s, dtype=torch.bool, device=doc_ids.device)
    is_start[1:] = doc_ids[1:] != doc_ids[:-1]
    # Each token's run number never decreases along the sequence, so the first position holding a token's
    # run number is its run's start: a binary search per token. (A running maximum of the start positions,
    # torch.cummax, gives the same positions, but its CUDA kernel scans a long row in one block: 0.14 ms a
    # call at 32,768 tokens in the trainer's profile, two calls a micro batch.)
    run = torch.cumsum(is_start, 0)
    return torch.searchsorted(run, run)


def kv_block_lists(doc_ids: Tensor, window: int | Tensor, block: int) -> tuple[Tensor, Tensor]:
    """For each block of ``block`` queries, the key blocks that can hold a visible key.

    doc_ids int32 [S] (S a multiple of ``block``). Returns (kv_num_blocks int32 [n], kv_indices int32 [n, n]),
    n = S / block, in FlexAttention's ordered layout: row i lists its kv_num_blocks[i] key blocks first (at
    most ceil(window / block) + 1 of them), the rest of the row is ignored. Query block i can see keys from
    max(i * block - window, start of the document holding its first query) up to its own last query.
    """
    s = doc_ids.numel()
    n_q = s // block
    doc_first = _document_firsts(doc_ids)
    first_q = torch.arange(n_q, device=doc_ids.device) * block  # [n_q]
    first_key = torch.maximum(first_q - window, doc_first[first_q]).clamp(min=0)
    lo = first_key // block  # [n_q]
    hi = torch.arange(n_q, device=doc_ids.device)  # a query block's last visible key is in its own block
    idx = lo[:, None] + torch.arange(n_q, device=doc_ids.device)[None, :]  # [n_q, n_q], FlexAttention's width
    num = (hi - lo + 1).to(torch.int32)
    return num, torch.minimum(idx, hi[:, None]).to(torch.int32)


def kv_block_lists_split(
    doc_ids: Tensor, window: int | Tensor, block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """kv_block_lists split into the blocks that need the mask and the blocks every pair of which is visible.

    Returns (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), each pair in kv_block_lists'
    layout (int32 [n] counts, int32 [n, n] rows listing their blocks first, in increasing order). It replaces
    kv_block_lists in flex_attention_varlen: there every listed block ran mask_mod (two gathers of doc_ids and
    three compares) on each of its block^2 pairs; FlexAttention's kernels skip mask_mod on "full" blocks
    (BlockMask.from_kv_blocks' full_kv_num_blocks / full_kv_indices), and with windows of several blocks most
    listed blocks are full. Upstream modded-nanogpt builds its masks the same way, a partial and a full list.

    Key block kb is full for query block qb when every pair is visible: kb starts at or after the start of the
    document holding qb's last query (documents are contiguous, so the whole span is one document), kb ends at
    or before qb's first query (causal for every pair), and qb's last query is at most ``window`` after kb's
    first key. Those bounds make the full blocks one run inside kv_block_lists' run [lo, qb]; the partial
    blocks are the rest of it, [lo, first full) and (last full, qb]. Invariants, tested in
    tests/model/test_attention.py: partial and full are disjoint, their union is kv_block_lists' list, a block
    is full exactly when all its pairs are visible, and every listed block holds a visible pair. Tensor ops
    only, so a window given as a device tensor costs no host sync and no recompile.
    """
    n = doc_ids.numel() // block
    dev = doc_ids.device
    doc_first = _document_firsts(doc_ids)
    qb = torch.arange(n, device=dev)
    first_q, last_q = qb * block, qb * block + block - 1
    lo = torch.maximum(first_q - window, doc_first[first_q]).clamp(min=0) // block  # as kv_block_lists
    hi = qb
    # Full run [f_lo, f_hi]; ceil(x / block) is -(-x // block).
    f_lo = torch.maximum(-(-doc_first[last_q] // block), -((window - last_q) // block)).clamp(min=0)
    f_hi = (first_q - block + 1) // block  # qb - 1, or qb itself when block is 1
    n_full = (f_hi - f_lo + 1).clamp(min=0)
    # With no full block the partial run is all of [lo, hi]: an empty cut placed after hi.
    cut_lo = torch.where(n_full > 0, f_lo, hi + 1)
    cut_hi = torch.where(n_full > 0, f_hi, hi)
    left = cut_lo - lo  # partial blocks before the full run
    j = torch.arange(n, device=dev)[None, :]
    part_idx = torch.where(j < left[:, None], lo[:, None] + j, cut_hi[:, None] + 1 + j - left[:, None])
    n_part = left + hi - cut_hi
    full_idx = f_lo[:, None] + j
    # Entries past a row's count are ignored but kept in [0, n) so no kernel can index out of range.
    return (
        n_part.to(torch.int32),
        torch.minimum(part_idx, hi[:, None]).to(torch.int32),
        n_full.to(torch.int32),
        full_idx.clamp(max=n - 1).to(torch.int32),
    )


# -- the two paths -------------------------------------------------------------------------------------------


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, window: int | Tensor, block: int
) -> Tensor:
    """Masked softmax attention, fp32 scores. q, k [S, h, dq] (q already scaled), v [S, h, dv] -> [S, h, dv].

    Queries go block by block; each block scores only keys in [block start - window, block end), the only ones
    the mask can let through, so the cost is S * (window + block) instead of S^2.
    """
    s = q.size(0)
    window = int(window)  # a device tensor of the window is read once here: this path slices on the host
    pos = torch.arange(s, device=q.device)
    out = []
    for a in range(0, s, block):
        b = min(a + block, s)
        ka = max(0, a - window)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k[ka:b].float())  # [h, bq, bk]
        mask = visible(doc_ids[a:b, None], doc_ids[None, ka:b], pos[a:b, None], pos[None, ka:b], window)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # every query sees itself
        out.append(torch.einsum("hqk,khd->qhd", probs.to(v.dtype), v[ka:b]))
    return torch.cat(out)


_compiled_flex = None


def _flex_function(device_type: str):
    """FlexAttention: compiled once on CUDA (uncompiled it materialises all S^2 scores); eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor,
    window: int | Tensor,
    block: int,
    full_blocks: bool = True,
) -> Tensor:
    """The same attention through FlexAttention with a block-sparse mask. Shapes as reference_attention.

    The sequence is padded to a multiple of ``block`` with a document id of -1 (pads see only pads) and the
    pad rows are dropped from the output. ``full_blocks``: the block mask lists the blocks whose pairs are all
    visible separately (kv_block_lists_split), so the kernel skips mask_mod there; False lists every block as
    needing mask_mod (kv_block_lists), the reference the fast mask is checked against. Same mask either way,
    but the compiled kernels visit a row's partial blocks before its full ones, so the online softmax sums in
    another order and the two differ in rounding; eager FlexAttention (the CPU's) evaluates mask_mod on every
    pair and never reads the block lists, so there they agree bitwise.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    s = q.size(0)
    pad = -s % block
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        doc_ids = torch.cat([doc_ids, torch.full((pad,), -1, dtype=doc_ids.dtype, device=doc_ids.device)])
    sp = s + pad
    if full_blocks:
        num, idx, full_num, full_idx = kv_block_lists_split(doc_ids, window, block)
        full = dict(full_kv_num_blocks=full_num[None, None], full_kv_indices=full_idx[None, None])
    else:
        num, idx = kv_block_lists(doc_ids, window, block)
        full = {}

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(doc_ids[q_idx], doc_ids[kv_idx], q_idx, kv_idx, window)

    block_mask = BlockMask.from_kv_blocks(
        num[None, None], idx[None, None], **full, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(sp, sp)
    )
    # [S, h, d] -> [1, h, S, d], FlexAttention's layout; q carries the softmax scale already.
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    if torch.compiler.is_compiling():
        y = flex_attention(qh, kh, vh, block_mask=block_mask, scale=1.0)  # lowered into the caller's graph
    elif q.is_cuda:
        y = _flex_function("cuda")(qh, kh, vh, block_mask=block_mask, scale=1.0)
    else:
        with warnings.catch_warnings():  # eager is the CPU's only mode; the advice to compile does not apply
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            y = _flex_function("cpu")(qh, kh, vh, block_mask=block_mask, scale=1.0)
    return y[0].transpose(0, 1)[:s]


def _flash_attn_varlen(device: torch.device):
    """flash-attn-4's varlen attention function for tensors on ``device``, or one clear error saying why not
    and what to use instead."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # an ImportError, or CuTeDSL failing to set up
        raise RuntimeError(
            f"model.attention_impl=fa4 needs flash-attn-4 (flash_attn.cute), which failed to import: "
            f"{type(e).__name__}: {e}. Install it (pip install flash-attn-4) or use "
            "model.attention_impl=flex."
        ) from e
    if device.type != "cuda":
        raise RuntimeError(
            f"model.attention_impl=fa4 runs on CUDA, got {device.type} tensors; use "
            "model.attention_impl=auto."
        )
    return flash_attn_varlen_func


@torch.compiler.disable
def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int) -> Tensor:
    """The attention through flash-attn-4's varlen kernel: q, k [S, h, d], v [S, h, dv], cu_seqlens int32
    [docs + 1] (empty documents allowed), window a host int in tokens; q carries the softmax scale.

    Outside the compiled graph (a graph break each side): the kernel is its own autograd function, which
    Dynamo cannot trace. ``max_seqlen`` is the sequence's length, an upper bound that costs no host read of
    the document lengths (the library's own default for it)."""
    if not isinstance(window, int):
        raise TypeError(
            "model.attention_impl=fa4 takes the window as a host int, got "
            f"{type(window).__name__}: pass the windows as ints (the trainer does with attention_impl=fa4)."
        )
    s = q.size(0)
    q, k, v = (t.contiguous() for t in (q, k, v))  # v is a strided view of the QKV projection
    out = _flash_attn_varlen(q.device)(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=s, max_seqlen_k=s,
        softmax_scale=1.0, causal=True, window_size=(window, 0),
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out  # some versions return (out, lse)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor,
    window: int | Tensor,
    block: int,
    impl: str,
    full_blocks: bool = True,
) -> Tensor:
    """Dispatch on ``impl`` ("auto": flex on CUDA, reference elsewhere; "fa4" reaches here for the layers
    flash-attn-4 does not run, which take flex); ``full_blocks`` goes to flex.

    Inside a compiled model FlexAttention is traced into the model's graph (Inductor lowers it with the block
    mask built in the same graph), so a forward is one graph per micro-batch shape: new documents, and windows
    given as a device tensor, change only tensor values, never the graph.
    """
    if impl == "auto":
        impl = "flex" if q.is_cuda else "reference"
    if impl in ("flex", "fa4"):
        return flex_attention_varlen(q, k, v, doc_ids, window, block, full_blocks)
    return reference_attention(q, k, v, doc_ids, window, block)


# -- one attention sublayer ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttnSpec:
    """The static shape of one attention layer."""

    num_heads: int
    head_dim: int
    """Full head width: the width of the value add-ins (aux_v) and of the banks' rows per head."""
    qk_dim: int
    """This layer's query/key width per head (head_dim on long-window layers, narrow_head_dim elsewhere)."""
    v_dim: int
    """This layer's value/output width per head (narrow_head_dim on half-V layers)."""
    paired: bool
    """Paired heads: heads h and h + H/2 share one interleaved stream and see each other's keys."""
    key_offset: bool
    """Partial key offset: a key's stationary (non-rotating) dims come from its document's previous token."""
    xsa: bool
    """Gated XSA: subtract tanh(alpha) times the projection of the output onto the token's own value."""


@dataclass(frozen=True, slots=True)
class PackedSequence:
    """Per-forward facts about the packed batch every attention layer shares."""

    doc_ids: Tensor
    """int32 [T]: document index of each token."""
    doc_start: Tensor
    """bool [T]: where the key offset's look-back stops: each document's first token (only the batch's first
    with ModelConfig.cross_document_lookback, upstream's)."""
    block: int
    """Query block size of the reference path and FlexAttention's block size (tokens)."""
    impl: str
    """"auto", "reference", "flex" or "fa4"."""
    full_blocks: bool = True
    """FlexAttention's mask lists the all-visible key blocks apart (ModelConfig.attention_full_blocks)."""
    cu_seqlens: Tensor | None = None
    """int32 [docs + 1]: the documents' boundaries (flash-attn-4's varlen input; None: not needed)."""


def causal_self_attention(
    x: Tensor,
    qk_w: Tensor,
    v_w: Tensor,
    o_w: Tensor,
    spec: AttnSpec,
    seq: PackedSequence,
    window: int | Tensor,
    freq: Tensor,
    attn_scale: Tensor,
    qkv_gain: Tensor,
    o_gain: Tensor,
    aux_v: Tensor | None = None,
    xsa_alpha: Tensor | None = None,
    gate: Tensor | None = None,
    qkv_fp8=None,
) -> Tensor:
    """One attention sublayer on the normed input x [T, D]; returns [T, D] in x's dtype.

    Weights in nn.Linear layout, already cut to this layer's widths: qk_w [2 H qk_dim, D] (Q heads then K
    heads), v_w [H v_dim, D], o_w [D, H v_dim]. window: tokens. freq: fp32 [rotary_dim / 2] rotary
    frequencies; attn_scale: 0-D softmax scale. qkv_gain, o_gain: 0-D scales of the QKV and O weights
    (sa_lambdas; o_gain also carries the post-lambda). aux_v [T, H head_dim]: added to V (cut to v_dim per
    head). xsa_alpha, gate: [T, H]. qkv_fp8: the QKV projection in FP8, (x, w, gain) -> [T, N] (model/fp8.py),
    or None for the compute dtype's.
    """
    t, h, dq, dv = x.size(0), spec.num_heads, spec.qk_dim, spec.v_dim
    if qkv_fp8 is not None:
        qkv = qkv_fp8(x, torch.cat((qk_w, v_w)), qkv_gain)
    else:
        qkv = x @ (torch.cat((qk_w, v_w)).type_as(x) * qkv_gain.to(x.dtype)).T  # [T, 2 H dq + H dv]
    qk, v = qkv.split((2 * h * dq, h * dv), dim=-1)
    qk = F.rms_norm(qk.view(t, 2 * h, dq).float(), (dq,), eps=FP32_EPS)  # QK-norm in fp32: [T, 2H, dq]
    q, k = qk[:, :h], qk[:, h:]
    v = v.view(t, h, dv)
    if aux_v is not None:
        v = v + aux_v.view(t, h, spec.head_dim)[..., :dv].to(v.dtype)
    rotary_dim = 2 * freq.numel()
    if spec.key_offset:
        # Stationary dims of each key from the previous token; a key where seq.doc_start is set keeps its own.
        prev = torch.cat([k[:1], k[:-1]])
        shifted = torch.where(seq.doc_start[:, None, None], k, prev)
        k = torch.cat((k[..., :rotary_dim], shifted[..., rotary_dim:]), dim=-1)
    doc_ids = seq.doc_ids
    if spec.paired:
        # [T, H, d] -> [2T, H/2, d]: token t's heads 0..H/2-1 go to stream row 2t, heads H/2..H-1 to row 2t+1,
        # so the pair (j, j + H/2) shares one stream. Rotary positions are stream positions 2t + (h >= H/2).
        # Upstream's kernel (qkv_rope.py) rotates head h by 2t + h % 2 instead: the same wherever
        # h % 2 == (h >= H/2), at H = 6 every head but the middle pair (1, 4), whose two rows then carry
        # each other's rotary order reversed. Kept: the stream position is the one the causal mask orders by
        # (tests/model/test_attention.py pins both formulas and where they differ).
        q, k, v = (u.reshape(2 * t, h // 2, u.size(-1)) for u in (q, k, v))
        doc_ids = doc_ids.repeat_interleave(2)
    positions = torch.arange(q.size(0), device=x.device)
    q = (apply_rotary(q, positions, freq) * attn_scale).to(x.dtype)
    k = apply_rotary(k, positions, freq).to(x.dtype)
    if seq.impl == "fa4" and not spec.paired and dq == dv:  # the layers flash-attn-4 runs
        y = flash_attention_varlen(q, k, v, seq.cu_seqlens, window)
    else:
        y = attend(q, k, v, doc_ids, window, seq.block, seq.impl, seq.full_blocks)  # [S, h', dv]
    y = y.reshape(t, h, dv)
    if spec.xsa and xsa_alpha is not None:
        v = v.reshape(t, h, dv)
        coef = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)
        y = y - torch.tanh(xsa_alpha).to(y.dtype)[..., None] * coef * v
    if gate is not None:
        y = y * gate.to(y.dtype)[..., None]
    return y.reshape(t, h * dv) @ (o_w.type_as(x) * o_gain.to(x.dtype)).T
