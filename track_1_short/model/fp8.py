"""FP8 projections of the training step: the MLP (up and down, forward and backward), the attention's QKV
projection (forward and backward) and the training loss's logits GEMM.

What it replaces: the bf16 GEMMs of model/layers.py's relu2_mlp, of the QKV projection in
model/attention.py and of the logits in the training loss (``ModelConfig.fp8``: one switch per path; the
bf16 path is the reference, and every evaluation forward takes it).

Why faster: an H100 runs e4m3/e5m2 GEMMs (``torch._scaled_mm``, per-tensor fp32 scales, bf16 out) 1.4-1.8x
faster than bf16 at the record's shapes. The weight operands are quantised once per optimizer update into
FP8 copies in both layouts cuBLAS wants (:meth:`FP8State.refresh`), not once per micro batch.

Formats and scales (a scale s means the FP8 number holds v / s, saturated to the format's range):
  MLP      x e4m3, static 2^-4 (a normed row has |x| <= sqrt(768) < 448 * 2^-4); incoming gradient e5m2,
           static 2^-6 (every gradient scale is upstream's for the backward of the loss summed over a rank's
           tokens, divided by the trainer's loss divisor: FP8State.set_loss_divisor); weights e4m3, per
           bank slot: exact amax / 448 for the first EXACT_SCALE_REFRESHES refreshes, then the previous
           refresh's amax * 1.12 / 448 (weights move well under 12% a step); relu(pre)^2 e4m3 and its
           gradient dpre e5m2 with delayed scales: the largest |value| since the last refresh times
           1.03 / 448 and 1.25 / 57344 (initially 1 and 2^-6).
  QKV      x e4m3, static 8/448 (entries beyond 8 saturate); gradient e5m2, static 1/448; weights e4m3,
           exact amax / 448 per layer at every refresh. The layer's QKV gain (sa_lambda) rides in the
           weight's GEMM scale.
  lm_head  x e4m3, static 100/448; weight e4m3, static 2/448. Only the logits GEMM: its gradient GEMMs
           stay bf16, since quantising the [T, V] logit gradient is a pass over T x V that costs more than
           the FP8 GEMM saves unless the loss kernel writes it (LM_GRAD_SCALE is upstream's scale for that).
GEMM accumulation: use_fast_accum on the forward GEMMs, off on every gradient GEMM (upstream reports NaNs
otherwise).

Invariants (tests/model/test_fp8.py): the emulation (quantise, dequantise, fp32 matmul: the CPU's path)
agrees with the bf16 path within the bound e4m3/e5m2 rounding allows, propagated GEMM by GEMM; it equals a
plain restatement of the formats and scales bitwise; switches off leave the model's bits unchanged; the
weight copies are refreshed once per optimizer update; on CUDA, ``_scaled_mm`` agrees with the emulation
within its accumulation and output rounding. Saturation is counted per operand (FP8State.clip_counts)
and read only at log steps, so the timed loop never waits on it.

Provenance: upstream modded-nanogpt record #92 ("ANVIL2"; perf/kernels/mlp.py, cross_entropy.py,
qkv_rope.py at 55865738 / f380c1f0): the formats, the scales and the fast-accumulation choices. Here every
GEMM is a plain ``torch._scaled_mm``; each activation and gradient operand of the MLP and QKV is one Triton
pass that writes it in both layouts with its clip count and amax (``model.fp8.quantize_impl=triton``,
track_1_short/perf/kernels/fp8_quantize.py; :func:`quantize_both`'s torch ops are its reference).
Upstream fuses the quantises into Triton GEMM epilogues; ``model.fp8.mlp_impl=triton`` does so for the MLP's
up-projection GEMMs, forward and backward (track_1_short/perf/kernels/fp8_relu2_mlp.py: the GEMM, relu^2 or
its gradient, and the quantise in both layouts in one kernel each way, the bits of fp8_mm then
quantize_both where the GEMMs' sums agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # the config imports the layers, which call into this module
    from track_1_short.model.config import FP8Config


E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Saturation changes a value only beyond the midpoint between the largest number and the next one the format
# would have (480 and 61440): below it round-to-nearest gives the largest number anyway, so an exact scale
# (amax / 448, whose fp32 division can land a hair above 448) never counts as clipping.
CLIP_AT = {E4M3: 464.0, E5M2: 59392.0}

MLP_X_SCALE = 2.0**-4
MLP_GRAD_SCALE = 2.0**-6
POST_HEADROOM = 1.03
DPRE_HEADROOM = 1.25
POST_SCALE_INIT = 1.0
DPRE_SCALE_INIT = MLP_GRAD_SCALE
EXACT_SCALE_REFRESHES = 16
WEIGHT_SCALE_HEADROOM = 1.12
QKV_X_SCALE = 8.0 / 448.0
QKV_GRAD_SCALE = 1.0 / 448.0
LM_X_SCALE = 100.0 / 448.0
LM_W_SCALE = 2.0 / 448.0
LM_GRAD_SCALE = (0.75 / 8.0) / 448.0

# The operands whose saturation is counted, in the order of FP8State.clips.
SITES = ("mlp.x", "mlp.w", "mlp.post", "mlp.grad", "mlp.dpre", "qkv.x", "qkv.grad", "lm_head.x", "lm_head.w")
SITE = {name: i for i, name in enumerate(SITES)}


def quantize(v: Tensor, scale: Tensor | float, fmt: torch.dtype, clips: Tensor | None = None, site: int = 0):
    """fmt's value of v / scale (in fp32), saturated to fmt's range. With ``clips`` (int64 [2, len(SITES)]),
    the elements that saturated (beyond CLIP_AT) and the elements seen are added to column ``site``."""
    lim = FP8_MAX[fmt]
    scaled = v.float() / scale
    if clips is not None:
        clips[0, site].add_((scaled.abs() > CLIP_AT[fmt]).sum())
        clips[1, site].add_(scaled.numel())
    return scaled.clamp(-lim, lim).to(fmt)


def fp8_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype,
    fast_accum: bool,
    emulate: bool,
    out: Tensor | None = None,
):
    """(a * scale_a) @ (b * scale_b) in out_dtype: a [M, K] FP8 row-major, b [K, N] FP8 column-major (b.T
    contiguous, the layout cuBLAS's FP8 GEMM wants), scales fp32 0-D tensors; written into ``out`` if given.

    ``emulate``: dequantise and multiply in fp32 (any device; the CPU's path and the GPU's reference).
    Otherwise ``torch._scaled_mm``, which scales the fp32 accumulator once and rounds to out_dtype.
    """
    if emulate:
        y = ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)
        return y if out is None else out.copy_(y)
    if a.size(1) % 16 or b.size(1) % 16:
        raise ValueError(
            f"an FP8 GEMM [{a.size(0)}, {a.size(1)}] @ [{b.size(0)}, {b.size(1)}] needs its inner and output "
            "widths divisible by 16 (cuBLAS); use micro batches and widths that are, or model.fp8 off."
        )
    kw = {} if out is None else {"out": out}
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum, **kw
    )


def _t(q: Tensor) -> Tensor:
    """The transpose of a 2-D FP8 tensor, materialised (a column-major operand's storage)."""
    return q.t().contiguous()


IDENTITY, RELU_SQUARE, DRELU_SQUARE = 0, 1, 2  # the prologues of quantize_both (its kernel's PROLOGUE)


def quantize_both(
    a: Tensor,
    b: Tensor | None,
    scale: Tensor,
    fmt: torch.dtype,
    clips: Tensor,
    site: int,
    prologue: int,
    amax: Tensor | None,
    reference: bool,
) -> tuple[Tensor, Tensor]:
    """(q, q.T contiguous) of v = a (IDENTITY), relu(a)^2 in a's dtype (RELU_SQUARE) or 2 a relu(b) in fp32
    (DRELU_SQUARE, b = pre): quantize(v, scale, fmt, clips, site); with ``amax``, first raised to max |v|.

    ``reference``: torch ops (the CPU's path); otherwise one Triton pass (CUDA, or a CPU under Triton's
    interpreter), the same bits: track_1_short/perf/kernels/fp8_quantize.py."""
    if not reference:
        # imported here: the kernel module's interpreter choice is fixed when it is imported
        from track_1_short.perf.kernels.fp8_quantize import quantize_both as kernel

        return kernel(a, b, scale, clips, amax, site, prologue, fmt == E5M2, CLIP_AT[fmt])
    if prologue == RELU_SQUARE:
        v = F.relu(a).square()
    elif prologue == DRELU_SQUARE:
        v = 2.0 * a.float() * F.relu(b).float()
    else:
        v = a
    if amax is not None:
        amax.copy_(torch.maximum(amax, v.abs().amax().float()))
    q = quantize(v, scale, fmt, clips, site)
    return q, _t(q)


def fp8_relu2_up(*args) -> tuple[Tensor, Tensor, Tensor]:
    """The forward's up-projection GEMM with relu^2 and its e4m3 quantise in the epilogue (fp8.mlp_impl=
    triton): (pre, post_q, post_qt), the bits of fp8_mm then quantize_both's RELU_SQUARE where the GEMM's
    sums agree."""
    # imported here: the kernel module's interpreter choice is fixed when it is imported
    from track_1_short.perf.kernels.fp8_relu2_mlp import fp8_relu2_up as op

    return op(*args)


def fp8_relu2_up_grad(*args) -> tuple[Tensor, Tensor]:
    """The backward's g W2^T GEMM with dpre and its e5m2 quantise in the epilogue: (dpre_q, dpre_qt)."""
    from track_1_short.perf.kernels.fp8_relu2_mlp import fp8_relu2_up_grad as op

    return op(*args)


# -- the MLP ---------------------------------------------------------------------------------------------


class FP8ReLU2MLP(torch.autograd.Function):
    """relu(x @ W1.T)^2 @ W2 with every GEMM in FP8; x [T, D], W1 and W2 [hidden, D] bank slices (bf16).

    The FP8 copies (w*_row [hidden, D], w*_t [D, hidden]) and their scales come from FP8State; w1, w2 are
    passed only so that autograd routes their gradients to the bank.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        w1,
        w2,
        w1_row,
        w1_t,
        w1_s,
        w2_row,
        w2_t,
        w2_s,
        post_s,
        post_amax,
        dpre_s,
        dpre_amax,
        x_s,
        g_s,
        clips,
        emulate,
        quant_ref,
        fused_up,
    ):
        dt = x.dtype
        xq, xqt = quantize_both(x, None, x_s, E4M3, clips, SITE["mlp.x"], IDENTITY, None, quant_ref)
        site = SITE["mlp.post"]
        if fused_up:  # the GEMM, relu^2 and the quantise in one kernel
            pre, pq, pqt = fp8_relu2_up(xq, w1_row, x_s, w1_s, post_s, post_amax, clips, site, CLIP_AT[E4M3])
        else:
            pre = fp8_mm(xq, w1_row.t(), x_s, w1_s, dt, True, emulate)  # [T, hidden]
            pq, pqt = quantize_both(pre, None, post_s, E4M3, clips, site, RELU_SQUARE, post_amax, quant_ref)
        out = fp8_mm(pq, w2_t.t(), post_s, w2_s, dt, True, emulate)  # [T, D]
        # Activations through save_for_backward (the transposed copies: the weight-gradient GEMMs' operands);
        # the persistent copies, scales and counters by name (the counters change between forward and
        # backward, which save_for_backward's version check forbids).
        ctx.save_for_backward(xqt, pre, pqt)
        ctx.state = (w1_t, w1_s, w2_row, w2_s, post_s, dpre_s, dpre_amax, x_s, g_s, clips)
        ctx.emulate, ctx.quant_ref, ctx.wdtype, ctx.fused_up = emulate, quant_ref, w1.dtype, fused_up
        return out

    @staticmethod
    def backward(ctx, g):
        xqt, pre, pqt = ctx.saved_tensors
        w1_t, w1_s, w2_row, w2_s, post_s, dpre_s, dpre_amax, x_s, g_s, clips = ctx.state
        em, qr, wdt = ctx.emulate, ctx.quant_ref, ctx.wdtype
        gq, gqt = quantize_both(g, None, g_s, E5M2, clips, SITE["mlp.grad"], IDENTITY, None, qr)
        dw2 = fp8_mm(pqt, gqt.t(), post_s, g_s, wdt, False, em)  # post^T g: [hidden, D]
        site = SITE["mlp.dpre"]
        if ctx.fused_up:
            dq, dqt = fp8_relu2_up_grad(
                gq, w2_row, g_s, w2_s, pre, dpre_s, dpre_amax, clips, site, CLIP_AT[E5M2]
            )
        else:
            # g W2^T [T, hidden] in g's dtype: a [T, hidden] fp32 tensor would double this pass's traffic,
            # and upstream's kernel rounds dpre to bf16 anyway
            dpost = fp8_mm(gq, w2_row.t(), g_s, w2_s, g.dtype, False, em)
            # dpre = 2 dpost relu(pre) in fp32, quantised with its amax taken
            dq, dqt = quantize_both(dpost, pre, dpre_s, E5M2, clips, site, DRELU_SQUARE, dpre_amax, qr)
        dx = fp8_mm(dq, w1_t.t(), dpre_s, w1_s, g.dtype, False, em)  # dpre W1: [T, D]
        dw1 = fp8_mm(dqt, xqt.t(), dpre_s, x_s, wdt, False, em)  # dpre^T x: [hidden, D]
        return (dx, dw1, dw2) + (None,) * 16


# -- the QKV projection -------------------------------------------------------------------------------------


class FP8Linear(torch.autograd.Function):
    """(x @ W.T) * gain with both GEMMs of the backward in FP8: x [T, D], w [N, D] (bf16), gain fp32 0-D
    (the layer's sa_lambda, rounded to x's dtype as the bf16 path rounds it). Its gradient is <dW_eff, W>
    with dW_eff = g^T x, the weight's gradient gain * dW_eff."""

    @staticmethod
    def forward(ctx, x, w, gain, w_row, w_t, w_s, x_s, g_s, clips, x_site, g_site, emulate, quant_ref):
        gain_c = gain.to(x.dtype).float()
        xq, xqt = quantize_both(x, None, x_s, E4M3, clips, x_site, IDENTITY, None, quant_ref)
        out = fp8_mm(xq, w_row.t(), x_s, w_s * gain_c, x.dtype, True, emulate)
        ctx.save_for_backward(xqt, w, gain, gain_c)
        ctx.state = (w_t, w_s, x_s, g_s, clips)  # persistent: by name, as in FP8ReLU2MLP
        ctx.emulate, ctx.quant_ref, ctx.g_site = emulate, quant_ref, g_site
        return out

    @staticmethod
    def backward(ctx, g):
        xqt, w, gain, gain_c = ctx.saved_tensors
        w_t, w_s, x_s, g_s, clips = ctx.state
        em = ctx.emulate
        gq, gqt = quantize_both(g, None, g_s, E5M2, clips, ctx.g_site, IDENTITY, None, ctx.quant_ref)
        dx = fp8_mm(gq, w_t.t(), g_s, w_s * gain_c, g.dtype, False, em)  # g W: [T, D]
        dw_eff = fp8_mm(gqt, xqt.t(), g_s, x_s, torch.float32, False, em)  # g^T x: [N, D]
        dgain = (dw_eff * w.float()).sum().to(gain.dtype).reshape(gain.shape)
        return (dx, (dw_eff * gain_c).to(w.dtype), dgain) + (None,) * 10


# -- the logits GEMM -----------------------------------------------------------------------------------------


def fp8_logits(xq: Tensor, w_col: Tensor, out: Tensor | None = None, emulate: bool | None = None) -> Tensor:
    """x @ lm_head from FP8 operands: xq [rows, D] = quantize(x, LM_X_SCALE, e4m3), w_col [V', D] the e4m3
    copy of lm_head.T (any subset of its rows: a sampled softmax gathers its candidates' rows). Returns
    [rows, V'] bf16 (into ``out`` when given). No autograd: the loss computes its gradients itself."""
    if emulate is None:
        emulate = not xq.is_cuda
    # Fills, not a copy from the host: a host-to-device copy would wait for the stream.
    x_s = torch.full((), LM_X_SCALE, dtype=torch.float32, device=xq.device)
    w_s = torch.full((), LM_W_SCALE, dtype=torch.float32, device=xq.device)
    dt = out.dtype if out is not None else torch.bfloat16
    # Straight into ``out`` (the loss's logit buffer): a copy would be another pass over [rows, V].
    return fp8_mm(xq, w_col.t(), x_s, w_s, dt, True, emulate, out=out)


# -- the weight copies, scales and counters ----------------------------------------------------------------


class FP8State:
    """The FP8 copies of the weights, the delayed scales and the saturation counters of one model.

    Not module buffers: checkpoints and the warmup's snapshots never carry them; they are derived state,
    rebuilt by :meth:`refresh` from the weights (and re-armed by :meth:`rearm` after a weight reset).
    """

    def __init__(self, cfg: FP8Config, emulate: bool | None = None) -> None:
        self.cfg = cfg
        self.force_emulate = emulate
        self.refreshes = 0  # calls of refresh() since construction or rearm()
        self.ready = False
        self.device: torch.device | None = None
        self.loss_divisor = 1.0
        self._w_amax_prev: Tensor | None = None

    def _allocate(self, device: torch.device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.device = device
        # Counters and amaxes that a backward writes are separate tensors per MLP slot and per QKV layer,
        # never views of one base: a compiled backward checks the version of each tensor it saved, so a
        # write by another layer's graph (the model split at a graph break) must not touch it.
        self.clips = torch.zeros(2, len(SITES), dtype=torch.int64, device=device)  # refresh, lm_head x
        self.owner_clips: dict[tuple[str, int], Tensor] = {}
        self.consts = {
            name: torch.tensor(v, **f32)
            for name, v in (
                ("mlp_x", MLP_X_SCALE),
                ("mlp_g", MLP_GRAD_SCALE / self.loss_divisor),
                ("qkv_x", QKV_X_SCALE),
                ("qkv_g", QKV_GRAD_SCALE / self.loss_divisor),
            )
        }
        self.mlp: dict[str, Tensor] = {}
        self.qkv: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.lm_col: Tensor | None = None
        self.lm_w_scale = torch.tensor(LM_W_SCALE, **f32)

    @property
    def quantize_reference(self) -> bool:
        """Whether activations and gradients are quantised by torch ops (quantize_both's reference), not by
        the one-pass kernel: the emulation, or model.fp8.quantize_impl=reference."""
        return self.emulate or self.cfg.quantize_impl == "reference"

    @property
    def emulate(self) -> bool:
        if self.force_emulate is not None:
            return self.force_emulate
        return self.device is None or self.device.type != "cuda"

    @torch.no_grad()
    def set_loss_divisor(self, divisor: float) -> None:
        """The static gradient scales for a loss that is backpropagated divided by ``divisor``.

        Upstream's gradient scales are for its per-rank backward of the summed loss (divisor 1: the record
        preset, loss_sum_ranks = world size); a run that divides its loss by the tokens it sums over has
        gradients that much smaller, and the same scales would put them among e5m2's subnormals. The trainer
        calls this before each step's forwards (outside any graph: two fills when the divisor changes)."""
        divisor = float(divisor)
        if divisor == self.loss_divisor:
            return
        self.loss_divisor = divisor
        if self.device is not None:
            self.consts["mlp_g"].fill_(MLP_GRAD_SCALE / divisor)
            self.consts["qkv_g"].fill_(QKV_GRAD_SCALE / divisor)

    @torch.no_grad()
    def rearm(self) -> None:
        """After the weights were reset (the post-warmup restore): exact weight scales again, delayed
        activation scales back to their initial values, counters cleared."""
        self.refreshes = 0
        if self.device is None:
            return
        if self.mlp:
            torch._foreach_zero_(self.mlp["post_amax"] + self.mlp["dpre_amax"])
            for post_s, dpre_s in zip(self.mlp["post_s"], self.mlp["dpre_s"]):
                post_s.fill_(POST_SCALE_INIT)
                dpre_s.fill_(DPRE_SCALE_INIT / self.loss_divisor)
            self._w_amax_prev = None
        torch._foreach_zero_([self.clips, *self.owner_clips.values()])

    @torch.no_grad()
    def refresh(self, mlp_bank: Tensor | None, qkv: dict[int, Tensor] | None, lm_head: Tensor | None) -> None:
        """Requantise the weight copies from the current weights: once after every optimizer update.

        mlp_bank [slots, 2, hidden, D]; qkv: layer -> its [N, D] QKV weight; lm_head [D, V]."""
        given = [t for t in (mlp_bank, lm_head) if t is not None] + list((qkv or {}).values())
        if not given:
            return
        device = given[0].device
        if self.device != device:
            if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
                raise RuntimeError(
                    "model.fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer); set "
                    "model.fp8.mlp/qkv/lm_head=false on this card."
                )
            self._allocate(device)
        clips = self.clips
        if mlp_bank is not None:
            self._refresh_mlp(mlp_bank, clips)
        if qkv is not None:
            for layer, w in qkv.items():
                s = (w.abs().amax().float().clamp(min=1e-12) / FP8_MAX[E4M3]).reshape(())
                row = quantize(w, s, E4M3)
                if layer in self.qkv:
                    self.qkv[layer][0].copy_(row)
                    self.qkv[layer][1].copy_(row.t())
                    self.qkv[layer][2].copy_(s)
                else:
                    self.qkv[layer] = (row, _t(row), s)
                    self.owner_clips[("qkv", layer)] = torch.zeros_like(self.clips)
        if lm_head is not None:
            col = quantize(lm_head.t(), self.lm_w_scale, E4M3, clips, SITE["lm_head.w"])
            if self.lm_col is None:
                self.lm_col = col.contiguous()
            else:
                self.lm_col.copy_(col)
        self.refreshes += 1
        self.ready = True

    def _refresh_mlp(self, bank: Tensor, clips: Tensor) -> None:
        m = self.mlp
        f32 = dict(dtype=torch.float32, device=bank.device)
        if not m:
            slots = bank.shape[0]
            m["row"] = torch.empty(bank.shape, dtype=E4M3, device=bank.device)
            m["t"] = torch.empty(bank.transpose(-1, -2).shape, dtype=E4M3, device=bank.device)
            # Every scale a GEMM reads is its own allocation, never an element of a stacked tensor: cuBLASLt
            # refuses a scale pointer off its alignment (CUBLAS_STATUS_NOT_SUPPORTED for w_s[slot, 1], seen
            # on an H100), and Inductor (torch 2.11) fails to lower _scaled_mm on a view's 0-D scale.
            m["w_s"] = [[torch.ones((), **f32) for _ in range(2)] for _ in range(slots)]
            m["post_s"] = [torch.full((), POST_SCALE_INIT, **f32) for _ in range(slots)]
            m["dpre_s"] = [torch.full((), DPRE_SCALE_INIT / self.loss_divisor, **f32) for _ in range(slots)]
            m["post_amax"] = [torch.zeros((), **f32) for _ in range(slots)]
            for slot in range(slots):
                self.owner_clips[("mlp", slot)] = torch.zeros_like(clips)
            m["dpre_amax"] = [torch.zeros((), **f32) for _ in range(slots)]
        amax = bank.abs().amax(dim=(2, 3)).float()  # [slots, 2]
        if self.refreshes < EXACT_SCALE_REFRESHES or self._w_amax_prev is None:
            w_s = amax.clamp(min=1e-12) / FP8_MAX[E4M3]
        else:  # one refresh late: the weights moved by one update since that amax was taken
            w_s = self._w_amax_prev.clamp(min=1e-12) * (WEIGHT_SCALE_HEADROOM / FP8_MAX[E4M3])
        torch._foreach_copy_([t for pair in m["w_s"] for t in pair], list(w_s.flatten().unbind(0)))
        # Kept outside self.mlp: the compiled forward reads that dict, and its keys must never change.
        self._w_amax_prev = amax
        scaled = bank.float() / w_s[:, :, None, None]
        lim = FP8_MAX[E4M3]
        clips[0, SITE["mlp.w"]].add_((scaled.abs() > CLIP_AT[E4M3]).sum())
        clips[1, SITE["mlp.w"]].add_(scaled.numel())
        m["row"].copy_(scaled.clamp(-lim, lim).to(E4M3))
        m["t"].copy_(m["row"].transpose(-1, -2))
        _delayed_scale_(m["post_amax"], m["post_s"], POST_HEADROOM / FP8_MAX[E4M3], 1e-6)
        _delayed_scale_(m["dpre_amax"], m["dpre_s"], DPRE_HEADROOM / FP8_MAX[E5M2], 1e-12)

    # -- the paths ---------------------------------------------------------------------------------------

    def mlp_forward(self, x: Tensor, slot: int, w1: Tensor, w2: Tensor) -> Tensor:
        m, c = self.mlp, self.consts
        return FP8ReLU2MLP.apply(
            x,
            w1,
            w2,
            m["row"][slot, 0],
            m["t"][slot, 0],
            m["w_s"][slot][0],
            m["row"][slot, 1],
            m["t"][slot, 1],
            m["w_s"][slot][1],
            m["post_s"][slot],
            m["post_amax"][slot],
            m["dpre_s"][slot],
            m["dpre_amax"][slot],
            c["mlp_x"],
            c["mlp_g"],
            self._owner_clips("mlp", slot),
            self.emulate,
            self.quantize_reference,
            self.cfg.mlp_impl == "triton",
        )

    def qkv_forward(self, layer: int):
        """The QKV projection of ``layer`` as a function (x [T, D], w [N, D], gain) -> [T, N]."""
        row, t, s = self.qkv[layer]
        c = self.consts
        clips = self._owner_clips("qkv", layer)

        def project(x: Tensor, w: Tensor, gain: Tensor) -> Tensor:
            return FP8Linear.apply(
                x,
                w,
                gain,
                row,
                t,
                s,
                c["qkv_x"],
                c["qkv_g"],
                clips,
                SITE["qkv.x"],
                SITE["qkv.grad"],
                self.emulate,
                self.quantize_reference,
            )

        return project

    def lm_head_input(self, x: Tensor) -> Tensor:
        """The loss's e4m3 copy of its hidden states x [T, D] (no gradient flows through it)."""
        return quantize(x.detach(), LM_X_SCALE, E4M3, self.clips, SITE["lm_head.x"])

    # -- saturation ----------------------------------------------------------------------------------------

    def _owner_clips(self, kind: str, index: int) -> Tensor:
        return self.owner_clips[(kind, index)]  # made by refresh(), outside any compiled graph

    def clip_counts(self) -> Tensor:
        """int64 [2, len(SITES)]: elements saturated (row 0) and seen (row 1) per site since the last
        take_clips, over every counter."""
        return torch.stack([self.clips, *self.owner_clips.values()]).sum(0)

    def take_clips(self) -> dict[str, tuple[int, int]]:
        """site -> (saturated, seen) since the last call, and clear: one device read (call it where the
        host waits on the device anyway, e.g. a log step)."""
        if self.device is None:
            return {}
        counts = self.clip_counts().tolist()
        torch._foreach_zero_([self.clips, *self.owner_clips.values()])
        return {name: (counts[0][i], counts[1][i]) for i, name in enumerate(SITES) if counts[1][i]}

    def clip_report(self) -> list[str]:
        """One line per operand whose saturated fraction since the last call exceeds
        cfg.clip_report_fraction."""
        lines = []
        for name, (clipped, seen) in self.take_clips().items():
            if clipped > self.cfg.clip_report_fraction * seen:
                lines.append(
                    f"fp8: {name} saturated {clipped} of {seen} elements ({clipped / seen:.2e} > "
                    f"{self.cfg.clip_report_fraction:g}): its scale is too small for this run"
                )
        return lines


def _delayed_scale_(amax: list[Tensor], scale: list[Tensor], gain: float, floor: float) -> None:
    """scale[i] = amax[i] since the last refresh * gain (at least ``floor``); a slot that saw nothing (amax
    0: no training forward yet, or a frozen slot) keeps its scale. Then every amax restarts at 0."""
    a = torch.nan_to_num(torch.stack(amax), nan=0.0, posinf=0.0, neginf=0.0).clamp(max=1e12)
    torch._foreach_copy_(
        scale, list(torch.where(a > 0, (a * gain).clamp(min=floor), torch.stack(scale)).unbind(0))
    )
    torch._foreach_zero_(amax)
