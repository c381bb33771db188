"""Small building blocks of the GPT, bottom-up: norms, the ReLU^2 MLP, rotary embeddings with YaRN, the
smear gate and the softcapped multi-token cross-entropy.

Shapes: T tokens of one packed sequence (batch 1), D = model_dim, V = padded vocabulary, H heads.
Every function here is row-local (token t's output reads token t's row only) except ``smear`` and
``shift_within_documents``, which read token t-1 and stop at document starts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# F.rms_norm's eps for fp32 inputs; QK-norm runs in fp32 with it, as upstream's fused kernel does.
FP32_EPS = torch.finfo(torch.float32).eps


def next_multiple_of(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n (vocab padding, bank padding)."""
    return -(-n // multiple) * multiple


def norm(x: Tensor) -> Tensor:
    """Parameter-free RMSNorm over the last dim, F.rms_norm's default eps for x's dtype (upstream's norm)."""
    return F.rms_norm(x, (x.size(-1),))


def relu2_mlp(x: Tensor, c_fc: Tensor, c_proj: Tensor) -> Tensor:
    """relu(x @ c_fc.T)^2 @ c_proj: x [T, D]; c_fc and c_proj both stored [hidden, D] (upstream's banks).
    Inductor fuses the square into its own elementwise kernels."""
    h = F.relu(x @ c_fc.type_as(x).T)  # [T, hidden]
    return h.square() @ c_proj.type_as(x)  # [T, D]


def document_starts(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """bool [T]: True at the first token of every document (cu_seqlens [n_docs+1], ending at T)."""
    starts = torch.zeros(num_tokens + 1, dtype=torch.bool, device=cu_seqlens.device)
    starts[cu_seqlens.long()] = True  # repeated or final entries (== T) land on the spare slot or coincide
    return starts[:num_tokens]


def document_ids(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """int32 [T]: the index of the document each token belongs to."""
    return (torch.cumsum(document_starts(cu_seqlens, num_tokens).int(), 0) - 1).int()


def lookback_starts(doc_start: Tensor, cross_documents: bool) -> Tensor:
    """Where the one-token look-backs (smear, key offset) stop: every document start, or with
    ``cross_documents`` (upstream, whose look-backs ignore document boundaries) only the batch's first
    token."""
    if not cross_documents:
        return doc_start
    first = torch.zeros_like(doc_start)
    first[:1] = True
    return first


def shift_within_documents(x: Tensor, doc_start: Tensor) -> Tensor:
    """Row t of the result is x[t-1], or zeros where t starts a document: x [T, ...], doc_start bool [T]."""
    prev = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
    keep = (~doc_start).view(-1, *([1] * (x.dim() - 1)))
    return prev * keep.to(x.dtype)


def smear(x: Tensor, gate_w: Tensor, smear_lambda: Tensor, doc_start: Tensor) -> Tensor:
    """x[t] += smear_lambda * sigmoid(gate_w . x[t, :C]) * x[t-1], upstream's one-token look-back.

    x [T, D]; gate_w [1, C] reads the first C channels. Upstream also smears a document's first token with the
    previous document's last one; here the look-back stops at document starts, so no document sees another.
    """
    c = gate_w.size(-1)
    gate = torch.sigmoid(x[:, :c] @ gate_w.type_as(x).T)  # [T, 1]
    return x + smear_lambda.to(x.dtype) * gate * shift_within_documents(x, doc_start)


# -- rotary embeddings ------------------------------------------------------------------------------------


def rope_base_frequencies(rotary_dim: int) -> Tensor:
    """fp32 [rotary_dim // 2]: (1/1024) ** linspace(0, 1), one frequency per rotating pair (upstream)."""
    return (1.0 / 1024) ** torch.linspace(0, 1, steps=rotary_dim // 2, dtype=torch.float32)


def yarn_rescale_(freq: Tensor, old_window: int, new_window: int, alpha: float, beta: float) -> float:
    """YaRN: rescale ``freq`` [pairs] in place for a window that grew from ``old_window`` to ``new_window``
    tokens and return the factor the softmax scale is multiplied by.

    Frequencies that turn less than ``alpha`` times over the old window are interpolated by old/new (they must
    not see angles they were never trained on); those that turn more than ``beta`` times are kept; in between
    the two are blended linearly. Upstream's Yarn.apply (alpha 1, beta 32) and its 1 + 0.2 ln(new/old) scale.
    """
    rotations = old_window * freq / (2 * math.pi)
    ratio = old_window / new_window
    weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
    freq.mul_(ratio + weight * (1 - ratio))
    return 1.0 + 0.2 * math.log(new_window / old_window)


def apply_rotary(x: Tensor, positions: Tensor, freq: Tensor) -> Tensor:
    """Rotate the first 2 * len(freq) dims of x [T, H, d] in adjacent pairs by angle position * freq; the
    other dims are stationary (upstream's half-truncated RoPE on wide heads). fp32 in, fp32 out.

    Pair (a, b) -> (a cos + b sin, b cos - a sin), the sign convention of upstream's tables.
    """
    r = 2 * freq.numel()
    theta = positions.float()[:, None] * freq[None, :]  # [T, r/2]
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]  # [T, 1, r/2] broadcast over heads
    pairs = x[..., :r].unflatten(-1, (r // 2, 2))  # [T, H, r/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos + b * sin, b * cos - a * sin), dim=-1).flatten(-2)  # [T, H, r]
    return torch.cat((rotated, x[..., r:]), dim=-1)


# -- loss ----------------------------------------------------------------------------------------------------


def softcap(logits: Tensor, cap: float, shift: float, temperature: float) -> Tensor:
    """cap * sigmoid((logits + shift) / temperature), in (0, cap); upstream 23 * sigmoid((z + 5) / 7.5)."""
    return cap * torch.sigmoid((logits + shift) / temperature)


def mtp_row_weights(mtp_weights: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """For the multi-token targets: (valid [K, T] bool, softmax-normaliser weight per row [T] fp32).

    mtp_weights fp32 [K]. Row t is scored against targets[t + k] with weight mtp_weights[k] while t + k < T
    (upstream's bound). The normaliser weight of every row is the sum of all K weights, past the end
    included: upstream's fused CE kernel (S_w in perf/kernels/cross_entropy.py) sums mtp_weights without the
    bound, so the last K - 1 rows of a batch push their softmax down as if their missing targets were there.
    Their gradient is then not the gradient of the returned loss (which counts only valid targets); it is
    upstream's gradient.
    """
    k, device = mtp_weights.numel(), mtp_weights.device
    t = torch.arange(num_tokens, device=device)
    valid = (t[None, :] + torch.arange(k, device=device)[:, None]) < num_tokens  # [K, T]
    return valid, mtp_weights.float().sum().expand(num_tokens)


LOSS_IMPLS = ("auto", "reference", "fused")


def as_mtp_tensor(mtp_weights, device) -> Tensor:
    """The MTP weights as an fp32 [K] tensor on ``device`` (a list, a tuple or a tensor)."""
    if isinstance(mtp_weights, Tensor):
        return mtp_weights.to(device=device, dtype=torch.float32)
    return torch.tensor([float(w) for w in mtp_weights], dtype=torch.float32, device=device)


def _reference_block(
    x, weight, tgt, valid, w_k, row_weight, cap, shift, temperature, chunk_rows, need_grad, prefix=None
):
    """The per-chunk loss and logit gradient in eager torch ops over fp32 [rows, V] buffers (the reference
    the fused kernel must match): a function (l, lo, hi) -> (loss fp32 0-D, g like l or None) of the chunk's
    logits l = x W; the softcap's argument is (l + shift) * (1 / temperature), formed in fp32.

    prefix: None, or (int64 [T] the prefix target's column, clamped where there is none; fp32 [T] its weight,
    0 there): one more target per row, added apart from the K MTP terms, so that weight 0 adds exact zeros
    (row_weight already counts it)."""
    # One set of [rows, V] buffers reused by every chunk: a fresh block per chunk would be a fresh mmap on the
    # CPU, and its page faults cost as much as the arithmetic.
    rows = min(chunk_rows, x.size(0))
    shape = (rows, weight.size(1))
    sig_buf = torch.empty(shape, dtype=torch.float32, device=x.device)
    exp_buf = torch.empty_like(sig_buf)
    grad_buf = torch.empty(shape, dtype=x.dtype, device=x.device) if need_grad else None
    neg_cap = torch.tensor(-cap, dtype=torch.float32, device=x.device)
    inv_t = 1.0 / temperature  # applied as an fp32 multiply, as the kernel does

    def block(logits: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor | None]:
        s = sig_buf[: hi - lo]
        s.copy_(logits).add_(shift).mul_(inv_t).sigmoid_()  # s = sigmoid((x W + shift) / temperature): fp32
        # z = cap * s lies in (0, cap]: cap is a safe fixed max for the log-sum-exp (upstream's kernel)
        e = torch.add(neg_cap, s, alpha=cap, out=exp_buf[: hi - lo]).exp_()  # exp(z - cap)
        sum_e = e.sum(-1)  # [rows]
        lse = cap + sum_e.log()  # [rows]
        t_c, v_c = tgt[:, lo:hi].T, valid[:, lo:hi].T.float()  # [rows, K]
        s_t = s.gather(1, t_c)  # [rows, K]
        loss = ((lse[:, None] - cap * s_t) * v_c * w_k).sum()
        if prefix is not None:
            p_c, p_w = prefix[0][lo:hi, None], prefix[1][lo:hi]
            s_p = s.gather(1, p_c)[:, 0]
            loss = loss + ((lse - cap * s_p) * p_w).sum()
        if not need_grad:
            return loss, None
        # dLoss/dz = row_weight * softmax(z) - sum_k w_k onehot(target_k) (row_weight: all K weights, as
        # upstream's kernel, see mtp_row_weights); dz/dlogit = cap/temp * s(1-s).
        # Built as q = (row_weight * cap/temp / sum_e) * e * s, minus cap/temp * w_k * s_t at the targets,
        # then g = q (1 - s) = q - q s, rounded once into the compute dtype.
        q = e.mul_(s).mul_((row_weight[lo:hi] * (cap / temperature) / sum_e)[:, None])
        q.scatter_add_(1, t_c, -(cap / temperature) * w_k * v_c * s_t)
        if prefix is not None:
            q.scatter_add_(1, p_c, (-(cap / temperature) * p_w * s_p)[:, None])
        return loss, torch.addcmul(q, q, s, value=-1.0, out=grad_buf[: hi - lo])

    return block


def _fused_block(tgt, valid, w_k, row_weight, cap, shift, temperature, need_grad, prefix=None):
    """The per-chunk loss and logit gradient as one Triton kernel over the GEMM's output, the gradient
    written over it (track_1_short/perf/kernels/softcapped_ce.py): the same contract as _reference_block,
    prefix included."""
    from track_1_short.perf.kernels.softcapped_ce import softcapped_ce_rows_

    targets_kt = tgt.contiguous()
    coef = (valid.float() * w_k[:, None]).contiguous()  # [K, T]: target k's weight, 0 past the batch's end
    row_weight = row_weight.float().contiguous()
    if prefix is not None:
        prefix = (prefix[0].contiguous(), prefix[1].float().contiguous())

    def block(logits: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor | None]:
        loss_rows = softcapped_ce_rows_(
            logits,
            targets_kt,
            coef,
            row_weight,
            lo,
            cap,
            shift,
            temperature,
            need_grad,
            prefix=prefix,
        )
        return loss_rows.sum(), (logits if need_grad else None)

    return block


@torch.library.custom_op("track_1_short::softcapped_ce_sum", mutates_args=())
def _softcapped_ce_sum(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    mtp_weights: Tensor,
    prefix_targets: Tensor,
    prefix_weight: Tensor,
    candidates: Tensor,
    cap: float,
    shift: float,
    temperature: float,
    chunk_rows: int,
    need_grad: bool,
    impl: str,
    x_fp8: Tensor | None = None,
    weight_fp8: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss fp32 0-D, dloss/dx like x, dloss/dweight like weight); the gradients are empty without need_grad.

    Each chunk of rows is turned into its loss and, when a gradient is wanted, straight away into its input
    gradient and its share of the weight gradient, so no [T, V] tensor outlives its chunk (upstream's fused
    CE does the same on the GPU), and the [rows, V] buffers are reused from chunk to chunk. On the 2-core dev
    CPU (one thread, T = 2048, tiny model, bf16) this loss takes ~0.55 s of the ~0.8 s forward + backward
    (plain autograd ops: ~3.5 s).

    impl "reference": eager torch ops over fp32 [rows, V] buffers; "fused": one Triton kernel per chunk
    between the same GEMMs (track_1_short/perf/kernels/softcapped_ce.py, which says what it saves and how
    closely it agrees). x_fp8, weight_fp8: the logits GEMM in FP8 from these copies (model/fp8.py).

    prefix_targets int64 [T] (a token id or -1 per row) with prefix_weight fp32 [1]: the prefix term; both
    empty: none. candidates int64 [P]: the sampled softmax's columns of weight (model/sampled_softmax.py),
    every target among them; empty: the full softmax.
    """
    # x [T, D] (compute dtype), weight [D, V], targets int64 [T], mtp_weights fp32 [K].
    num_tokens, k = x.size(0), mtp_weights.numel()
    w_k = mtp_weights.float()
    valid, row_weight = mtp_row_weights(w_k, num_tokens)
    sampled = candidates.numel() > 0
    if sampled:
        # Targets become positions in the candidate set: the block then sees a P-wide vocabulary.
        column_of = _candidate_positions(candidates, weight.size(1))
        targets = _check_targets_are_candidates(column_of[targets], candidates.numel())
        full_weight, weight = weight, weight[:, candidates]  # [D, P]: all the logits and gradient touch
        if weight_fp8 is not None:  # the FP8 copy is lm_head.T, [V, D]: the candidates are its rows
            weight_fp8 = weight_fp8[candidates]
    # targets[t + k] for every k, clamped where invalid (their weight is zeroed instead): [K, T]
    idx = (
        torch.arange(num_tokens, device=x.device)[None, :] + torch.arange(k, device=x.device)[:, None]
    ).clamp(max=num_tokens - 1)
    tgt = targets[idx]
    prefix = None
    if prefix_targets.numel():
        p_tgt = prefix_targets
        if sampled:  # a prefix target outside the candidate set is dropped for its row (upstream's rule)
            p_tgt = torch.where(p_tgt >= 0, column_of[p_tgt.clamp(min=0)], p_tgt)
        has = p_tgt >= 0
        p_coef = has.float() * prefix_weight.float()
        prefix = (p_tgt.clamp(min=0), p_coef)
        row_weight = row_weight + p_coef  # the normaliser counts the prefix weight where the row has one
    if impl == "fused":
        block = _fused_block(tgt, valid, w_k, row_weight, cap, shift, temperature, need_grad, prefix=prefix)
    else:
        block = _reference_block(
            x, weight, tgt, valid, w_k, row_weight, cap, shift, temperature, chunk_rows, need_grad, prefix
        )
    weight_c = weight.to(x.dtype)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    logit_buf = torch.empty((min(chunk_rows, num_tokens), weight.size(1)), dtype=x.dtype, device=x.device)
    grad_x = torch.empty_like(x) if need_grad else x.new_empty(0)
    # One chunk: grad_w is one GEMM (one rounding). Several: their partial products summed in fp32.
    one_chunk = num_tokens <= chunk_rows
    grad_w = None
    if need_grad and not one_chunk:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    grad_w_part = torch.empty_like(weight_c) if grad_w is not None and x.dtype != torch.float32 else None
    for lo in range(0, num_tokens, chunk_rows):
        hi = min(lo + chunk_rows, num_tokens)
        xc = x[lo:hi]
        # The plain logits: the blocks add the shift and divide by the temperature in fp32 (an addmm with a
        # broadcast bias would first write the bias over the whole [rows, V] output, then read it back).
        if weight_fp8 is None:
            logits = torch.mm(xc, weight_c, out=logit_buf[: hi - lo])
        else:
            from track_1_short.model.fp8 import fp8_logits

            logits = fp8_logits(x_fp8[lo:hi], weight_fp8, out=logit_buf[: hi - lo])
        loss, g = block(logits, lo, hi)
        total += loss
        if not need_grad:
            continue
        torch.mm(g, weight_c.T, out=grad_x[lo:hi])
        if one_chunk:
            grad_w = torch.mm(xc.T, g)
        elif grad_w_part is None:
            grad_w.addmm_(xc.T, g)
        else:
            grad_w.add_(torch.mm(xc.T, g, out=grad_w_part))
    grad_w = grad_w.to(weight.dtype) if need_grad else weight.new_empty(0)
    if sampled and need_grad:
        # Exact over the candidates, zero elsewhere: the dense [D, V] gradient the optimizer expects.
        grad_w = torch.zeros_like(full_weight).index_copy_(1, candidates, grad_w)
    return total, grad_x, grad_w


def _candidate_positions(candidates: Tensor, vocab: int) -> Tensor:
    """int64 [V]: each column's position in the candidate set, -1 where it is not a candidate."""
    out = torch.full((vocab,), -1, dtype=torch.int64, device=candidates.device)
    return out.index_copy_(0, candidates, torch.arange(candidates.numel(), device=candidates.device))


def _check_targets_are_candidates(positions: Tensor, p: int) -> Tensor:
    """The targets' positions in the candidate set; a target outside it would be scored against nothing.

    On the CPU that stops the run here. On CUDA a check would wait for the device, and a device assert
    kills the process without a readable message: such a target is scored against candidate 0 (an in-bounds
    read) and CandidateSets.check (model/sampled_softmax.py) stops the run with the message below at the
    trainer's next log step."""
    if positions.is_cuda:
        return positions.clamp(min=0)
    if int(positions.min()) < 0:
        raise ValueError(
            f"sampled softmax: the micro batch holds more distinct targets than its {p} candidates; raise "
            "the stage's sampled_candidates or lower micro_batch_tokens."
        )
    return positions


@_softcapped_ce_sum.register_fake
def _softcapped_ce_sum_fake(
    x,
    weight,
    targets,
    mtp_weights,
    prefix_targets,
    prefix_weight,
    candidates,
    cap,
    shift,
    temperature,
    chunk_rows,
    need_grad,
    impl,
    x_fp8=None,
    weight_fp8=None,
):
    total = x.new_empty((), dtype=torch.float32)
    if not need_grad:
        return total, x.new_empty(0), weight.new_empty(0)
    return total, torch.empty_like(x), torch.empty_like(weight)


def _softcapped_ce_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _softcapped_ce_backward(ctx, grad_out, _grad_x_out, _grad_w_out):
    # The loss is a sum: backward only scales the gradients the forward stored by the incoming scalar.
    grad_x, grad_w = ctx.saved_tensors
    g = grad_out.to(torch.float32)
    return (grad_x * g.to(grad_x.dtype), grad_w * g.to(grad_w.dtype)) + (None,) * 13


_softcapped_ce_sum.register_autograd(_softcapped_ce_backward, setup_context=_softcapped_ce_setup)


def softcapped_cross_entropy_eval_sum(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    mtp_weights: list[float],
    cap: float,
    shift: float,
    temperature: float,
    chunk_rows: int,
    canonical_mask: Tensor | None = None,
    prev_tokens: Tensor | None = None,
) -> Tensor:
    """The loss of a forward without gradients (validation), computed as upstream's validation does; fp32 0-D.

    Per chunk of rows: logits = x @ W, then + shift, / temperature, sigmoid and x cap, each op in x's dtype
    (bf16 in record runs: upstream's ``(23 * torch.sigmoid((lm_head(x) + 5) / 7.5)).float()``), then fp32
    F.cross_entropy against targets[t + k] for t + k < T, weighted by mtp_weights[k] and summed. In bf16 this
    rounds the logit five times where the training path (one fused GEMM, fp32 sigmoid) rounds once, which is
    what upstream's reported val loss, the one the record gate tests against 3.28, carries.

    ``canonical_mask`` (uint8 [V, V / 8], model/canonical_mask.py) with ``prev_tokens`` (the inputs, [T]):
    after the softcap, the logit of every token that never follows prev_tokens[t] becomes -60 (upstream's
    final validation). It is a next-token mask, so it takes plain CE only (mtp_weights of length 1).
    """
    if isinstance(mtp_weights, Tensor):  # evaluation runs eagerly: one read-back per forward is fine
        mtp_weights = mtp_weights.tolist()
    if canonical_mask is not None and (prev_tokens is None or len(mtp_weights) != 1):
        raise ValueError("canonical_mask needs prev_tokens and plain next-token CE (one MTP weight).")
    num_tokens = x.size(0)
    weight_c = weight.to(x.dtype)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for lo in range(0, num_tokens, chunk_rows):
        hi = min(lo + chunk_rows, num_tokens)
        logits = (cap * torch.sigmoid((x[lo:hi] @ weight_c + shift) / temperature)).float()  # [rows, V]
        if canonical_mask is not None:
            _mask_non_canonical_(logits, canonical_mask, prev_tokens[lo:hi])
        for k, w in enumerate(mtp_weights):
            rows = min(hi, num_tokens - k) - lo  # rows whose target t + k exists
            if rows > 0 and w != 0:
                ce = F.cross_entropy(logits[:rows], targets[lo + k : lo + k + rows], reduction="sum")
                total += w * ce
    return total


# Rows of the canonical mask unpacked at a time: its bool [rows, V] stays small next to the logits.
_MASK_ROWS = 4096


def _mask_non_canonical_(logits: Tensor, mask: Tensor, prev: Tensor) -> None:
    from track_1_short.model.canonical_mask import FILL, unpack

    for lo in range(0, logits.size(0), _MASK_ROWS):
        hi = min(lo + _MASK_ROWS, logits.size(0))
        logits[lo:hi].masked_fill_(unpack(mask, prev[lo:hi]), FILL)


def softcapped_cross_entropy_sum(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    mtp_weights,
    cap: float,
    shift: float,
    temperature: float,
    chunk_rows: int,
    impl: str = "reference",
    x_fp8: Tensor | None = None,
    weight_fp8: Tensor | None = None,
    *,
    prefix_targets: Tensor | None = None,
    prefix_weight: Tensor | float = 0.0,
    candidates: Tensor | None = None,
) -> Tensor:
    """Summed multi-token softcapped CE of hidden states x [T, D] against lm_head ``weight`` [D, V]; fp32 0-D.

    Row t is scored against targets[t + k] with weight mtp_weights[k] (a list or an fp32 [K] tensor) for every
    t + k < T; the softmax runs over all V (padded) columns, as upstream's loss does.

    A custom op (opaque to torch.compile) rather than an autograd.Function: the chunked loop computes its
    gradients in the forward into reused buffers with ``out=`` and in-place ops, and where Dynamo traced that
    Function on CUDA (torch 2.11, aot_eager and inductor alike) the gradients came out as zeros, so a compiled
    model never learned (tests/model/test_compiled_loss.py, GPU). As an op it runs the same eager kernels
    inside any graph; the MTP weights arrive as a tensor, so a weight that changes every step is data, not a
    new graph.

    impl: one of LOSS_IMPLS; "auto" is "fused" on CUDA, "reference" elsewhere (the interpreter runs the
    kernel on a CPU, but slower than the eager ops). x_fp8 [T, D], weight_fp8 [V, D]: the e4m3 copies of x and
    lm_head.T that the logits GEMM then reads (model/fp8.py); the gradient GEMMs stay in x's dtype.

    prefix_targets (int64 [T], a token id or -1) and prefix_weight (a float or an fp32 tensor): row t is also
    scored against prefix_targets[t] with that weight where it is >= 0 (model/prefix_targets.py), and the
    softmax normaliser's weight of that row grows by it (upstream's S_w); weight 0 gives the loss and the
    gradients without the term, bitwise. candidates (int64 [P], ascending, model/sampled_softmax.py): the
    softmax runs over these columns of ``weight`` only, and the weight gradient is zero outside them; None:
    over all V.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r} must be one of {list(LOSS_IMPLS)} (model.loss_impl).")
    if impl == "auto":
        impl = "fused" if x.is_cuda else "reference"
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    empty = torch.empty(0, dtype=torch.int64, device=x.device)
    if prefix_targets is None:
        prefix_targets, prefix_w = empty, empty.float()
    elif isinstance(prefix_weight, Tensor):
        prefix_w = prefix_weight.to(device=x.device, dtype=torch.float32).reshape(1)
    else:
        prefix_w = torch.tensor([float(prefix_weight)], dtype=torch.float32, device=x.device)
    loss, _, _ = _softcapped_ce_sum(
        x,
        weight,
        targets,
        as_mtp_tensor(mtp_weights, x.device),
        prefix_targets,
        prefix_w,
        empty if candidates is None else candidates,
        cap,
        shift,
        temperature,
        chunk_rows,
        need_grad,
        impl,
        x_fp8,
        weight_fp8,
    )
    return loss
