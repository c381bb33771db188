"""The track-1 GPT: embeddings, a U-net/MUDD-connected stack of attention and ReLU^2 MLP sublayers, the
softcapped loss, and the param table the optimizer serves.

A faithful subset of the record-#92 ("ANVIL2") model of KellerJordan/modded-nanogpt (package layout, gpt.py
at f380c1f0, param table in training.py at 55865738), written from its description. ``model=track1`` has the
record's parameter inventory: 11 layers (attention on 0, 1, 2, 3, 5, 8, 10), dim 768, 6 heads of 128 (64-wide
query/key on short-window layers, 64-wide values on 1 and 8), MLP hidden 2816 with a parallel MLP on layer 8,
banks qk [48, 256, 768], vo [16, 768, 768], mlp [12, 2, 2816, 768], and 13 replicated small tensors. Every
feature is a field of :class:`ModelConfig`; ``model=tiny`` is the same structure at CPU size.

The forward pass, per packed batch of whole documents (T tokens; documents never see each other):
  x = embed[tokens] -> smear gate (one-token look-back) -> x0 = norm(x); per-token MUDD "pre" gates from x0
  per layer i:  [post gates computed from x at the start of post_gate_layer]
     attention    x = resid_lambda * x + attn(norm(x)) (post_lambda folded into O), then + x0 * gate
                  (layers without attention keep the scaling and the x0 injection; the skip target layer adds
                  sigmoid(skip_lambda) * gate * cache[skip_source] instead; layers after late_input_layer
                  read norm(cache[late_input_layer]) as their attention input)
     MLP          x = resid_lambda * x + post_lambda * relu(norm(x) W1^T)^2 W2 (+ the parallel MLP)
  the last layer mixes its residual and V with MUDD coefficients; after the loop MUDD mixes earlier
  activations (caches, value embeddings) back in, per token and per channel group; then norm, lm_head,
  softcap 23 * sigmoid((z + 5) / 7.5) and the summed multi-token cross-entropy.

Out of scope (upstream has them, this model does not): the hashed n-gram embedding table and its gates (their
lanes in mudd_gate_w2 / mudd_b2 are kept, unused, so the shapes match), FP8 projections and loss, the sampled
softmax, canonical-token masking at validation, the prefix-token auxiliary loss, end-of-run tail averaging.
Deliberate differences: the smear gate and the partial key offset stop at document starts (upstream lets them
read the previous document's last token), so no information crosses a document boundary;
``cross_document_lookback=true`` gives upstream's behaviour instead (on the CPU smoke record, seed 1: val
6.4831 ours, 6.4819 upstream's, inside the seeds' spread of 0.006). The rotary position of a paired-head
layer's heads is the position in the interleaved stream (model/attention.py says where upstream's differs).

Where upstream's numerics are followed (model/layers.py, pinned by tests/model/test_layers.py): an evaluation
forward (eval mode or no gradients) computes the softcap in the compute dtype before an fp32 CE, as upstream's
validation does in bf16, so the reported val loss carries upstream's roundings; the training loss's softmax
normaliser counts every MTP weight on every row, past the end of the batch too (upstream's S_w).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from track_1_short.model.attention import ATTENTION_IMPLS, AttnSpec, PackedSequence, causal_self_attention
from track_1_short.model.layers import (
    LOSS_IMPLS,
    MLP_IMPLS,
    document_ids,
    document_starts,
    lookback_starts,
    next_multiple_of,
    norm,
    relu2_mlp,
    rope_base_frequencies,
    smear,
    softcap,
    softcapped_cross_entropy_eval_sum,
    softcapped_cross_entropy_sum,
    yarn_rescale_,
)

# MUDD block 0 (start of the last layer) emits this many coefficients, in this layout (upstream init_mudd):
#   0-2 V add-in over (cache[0], cache[late], x)   3-5 residual recombination over the same sources
#   6-7 value-embedding gates (tiled over head halves)   8-9 dynamic resid / post attention lambdas
#   10 x0 injection   11 n-gram injection (reserved: out of scope)   12-13 dynamic resid / post MLP lambdas
# Block 1 (after the loop) uses its first len(sources) coefficients. A fact of the layout, not a knob.
MUDD_COEFS = 14
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Communication and work schedules over the full label set (upstream training.py @55865738). Labels a config
# does not create are dropped; the relative order of the rest is kept.
SCATTER_ORDER = (
    "qk_bank vo_bank mlp_bank value_embeds lm_head embed scalars smear_gate ve_gate_bank post_lambdas "
    "resid_lambdas mudd_w1 mudd_w2 mudd_w2g mudd_b2 mudd_gate_w1 mudd_gate_w2 mudd_gate_b2 "
    "_mudd_gate_scale"
).split()
# qk/vo first (their gathers are waited first next step), lm_head before embed (tied copy), the replicated
# labels together (one fused update), mlp_bank (the largest gather) last.
WORK_ORDER = (
    "qk_bank vo_bank lm_head embed value_embeds scalars smear_gate ve_gate_bank mudd_b2 mudd_gate_b2 "
    "_mudd_gate_scale post_lambdas resid_lambdas mudd_w2 mudd_w2g mudd_gate_w2 mudd_w1 mudd_gate_w1 "
    "mlp_bank"
).split()


class ModelConfigError(ValueError):
    """A model config or a forward input that cannot work; the message names the field and the fix."""


# -- config ----------------------------------------------------------------------------------------


@dataclass
class AdamHyper:
    """Per-parameter Adam settings of one param-table entry (base lr / wd / eps live in OptimConfig)."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """Adam (beta1, beta2)."""
    lr_mul: float = 1.0
    """Multiplier on the Adam base lr."""
    wd_mul: float = 1.0
    """Multiplier on the Adam base weight decay (0 = no decay)."""


def _adam(b1: float, b2: float, lr_mul: float = 1.0, wd_mul: float = 1.0):
    return field(default_factory=lambda: AdamHyper([b1, b2], lr_mul, wd_mul))


@dataclass
class ParamTableConfig:
    """The param table's per-label optimizer multipliers; defaults are upstream's (training.py @55865738)."""

    lm_head: AdamHyper = _adam(0.5, 0.95, 1.0, 150.0)
    """Output head (sharded Adam): low beta1, strong decay."""
    embed: AdamHyper = _adam(0.5, 0.95, 1.0, 150.0)
    """Token embedding (sharded Adam; optimised only after the split, tied to lm_head before)."""
    value_embeds: AdamHyper = _adam(0.75, 0.95, 70.0, 5.0)
    """Value-embedding planes (sharded Adam). From optim.value_embed_period4_start (336) the optimizer updates
    them every other Adam step with these betas squared and wd_mul doubled (upstream's cadence)."""
    scalars: AdamHyper = _adam(0.9, 0.99, 5.0, 0.0)
    """sa_lambdas, smear_lambda, skip_lambda (replicated, fp32)."""
    smear_gate: AdamHyper = _adam(0.9, 0.99, 0.01, 0.0)
    """Smear gate weights (replicated, bf16)."""
    ve_gate_bank: AdamHyper = _adam(0.9, 0.99, 1.0, 1.0)
    """Value-embedding gates (replicated, bf16)."""
    post_lambdas: AdamHyper = _adam(0.9, 0.95, 1.0, 0.0)
    """Sublayer output gains (replicated, fp32)."""
    resid_lambdas: AdamHyper = _adam(0.9, 0.95, 5.0, 0.0)
    """Residual scales (replicated, fp32)."""
    mudd_w1: AdamHyper = _adam(0.9, 0.99, 0.25, 1.0)
    """MUDD hidden projections (replicated, bf16); the other MUDD entries likewise."""
    mudd_w2: AdamHyper = _adam(0.9, 0.99, 0.25, 1.0)
    mudd_w2g: AdamHyper = _adam(0.9, 0.99, 0.25, 1.0)
    mudd_b2: AdamHyper = _adam(0.9, 0.99, 0.25, 0.0)
    mudd_gate_w1: AdamHyper = _adam(0.9, 0.99, 0.1, 1.0)
    """MUDD gate hidden projections (replicated, bf16); the other gate entries likewise."""
    mudd_gate_w2: AdamHyper = _adam(0.9, 0.99, 0.1, 1.0)
    mudd_gate_b2: AdamHyper = _adam(0.9, 0.99, 0.1, 0.0)
    mudd_gate_scale: AdamHyper = _adam(0.9, 0.99, 0.1, 0.0)
    """For the label ``_mudd_gate_scale`` (a leading underscore is not a valid config key)."""
    mlp_proj_lr_mul: float = 2.0
    """ANVIL lr multiplier of every c_proj matrix of mlp_bank (c_fc gets 1.0, frozen and pad matrices 0.0)."""


@dataclass
class ModelConfig:
    """Every size, topology choice and constant of the GPT; defaults are the record model (model=track1).

    Layer lists hold 0-based layer indices. Windows are counted in blocks of ``block_size`` tokens.
    """

    # -- sizes --
    vocab_size: int = 50257
    """Token ids the data may hold (GPT-2: 50257); ids >= this are rejected."""
    vocab_multiple: int = 128
    """Embedding / lm_head rows are padded to a multiple of this (50257 -> 50304 as upstream; GEMM speed)."""
    num_layers: int = 11
    """Layers (attention and/or MLP sublayers each), record #360's 11 slots."""
    model_dim: int = 768
    """Residual stream width."""
    num_heads: int = 6
    """Attention heads per layer."""
    head_dim: int = 128
    """Full head width; num_heads * head_dim must equal model_dim (the value banks are square)."""
    narrow_head_dim: int = 64
    """Query/key width of short-window layers and value width of half-V layers (record #360)."""
    rotary_dim: int = 64
    """Rotating dims per query/key head (32 frequencies); the rest of a wider head is stationary."""
    mlp_hidden: int = 2816
    """ReLU^2 MLP hidden width (record #360 cut it from 4 * 768)."""
    max_seq_len: int = 262144
    """Most tokens in one forward (upstream: validation tokens per rank); longer batches are rejected."""
    block_size: int = 128
    """Tokens per window block (windows are given in blocks) and the attention kernels' block size."""
    shard_multiple: int = 8
    """Bank matrix counts and the scalars vector are padded to a multiple of this (upstream: world size 8),
    so the banks shard evenly on any world size dividing it."""

    # -- topology (layer indices) --
    attn_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 5, 8, 10])
    """Layers with an attention sublayer (record #360's depth cut removes 4, 6, 7, 9)."""
    long_window_layers: list[int] = field(default_factory=lambda: [3, 10])
    """Attention layers with the long window, full-width query/key heads and (long_key_offset) key offset."""
    long_key_offset: bool = True
    """Partial key offset on the long-window layers (stationary key dims from the previous token)."""
    half_v_layers: list[int] = field(default_factory=lambda: [1, 8])
    """Attention layers whose value/output heads are narrow_head_dim wide."""
    paired_head_layers: list[int] = field(default_factory=lambda: [0, 2, 5])
    """Attention layers whose head pairs (h, h + H/2) share one interleaved stream (halving the window)."""
    xsa_layers: list[int] = field(default_factory=lambda: [1, 3])
    """Attention layers with gated XSA (strength per head from the pre MUDD gate); not paired ones."""
    attn_gate_layers: list[int] = field(default_factory=lambda: [3, 10])
    """Attention layers with a per-head output gate from the MUDD gates."""
    value_embed_layers: list[int] = field(default_factory=lambda: [1, 2, 8, 10])
    """Attention layers that add a value-embedding plane into V, plane j for the j-th listed layer."""
    ve_gate_channels: int = 6
    """The value-embedding gate reads this many leading channels of the normed input and of the plane row."""
    x0_inject_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 5, 7])
    """Layers that add x0 * (per-token gate) into the residual after their attention sublayer."""
    no_mlp_layers: list[int] = field(default_factory=lambda: [7])
    """Layers without an MLP (their bank slot stays, frozen)."""
    parallel_mlp_layer: int = 8
    """Layer that runs a second MLP (bank slot num_layers) on the same input; -1 = none."""
    skip_source_layer: int = 3
    """U-net skip: this layer's output is cached ...; -1 = no skip."""
    skip_target_layer: int = 6
    """... and added by this layer (which has no attention) times sigmoid(skip_lambda) * gate."""
    late_input_layer: int = 7
    """Attention layers after this one read norm(its output) as their input; MUDD reads it too. -1 = off."""
    post_gate_layer: int = 4
    """The post MUDD gate is computed at the start of this layer and serves it and later layers."""

    # -- switches --
    smear: bool = True
    """The smear gate (one-token look-back in the embedding)."""
    smear_channels: int = 12
    """The smear gate reads this many leading channels of the token embedding (upstream 12)."""
    cross_document_lookback: bool = False
    """Upstream's look-backs: the smear gate and the partial key offset read the previous token of the packed
    batch even where a document (or attention segment) starts, since upstream's ignore cu_seqlens; only the
    batch's first token has none. False: both stop at every start in cu_seqlens, so nothing crosses one."""
    mudd: bool = True
    """MUDD dense connections: dynamic coefficients at the last layer and the post-loop mix."""
    mudd_gates: bool = True
    """Per-token MUDD gates (XSA strengths, attention gates, x0 gates, skip gate). Off = those features need
    empty layer lists and the skip is gated by sigmoid(skip_lambda) alone."""

    # -- MUDD --
    mudd_dim: int = 64
    """Hidden width of the MUDD coefficient MLPs."""
    mudd_groups: int = 12
    """Channel groups of the post-loop mix (model_dim must divide), each with its own coefficient delta."""
    mudd_scale: float = 0.1
    """Fixed output scale of the MUDD coefficients (biases are stored divided by it)."""
    mudd_gate_dim: int = 64
    """Hidden width of the MUDD gate MLPs."""
    mudd_gate_lanes: int = 23
    """Rows of mudd_gate_w2 / mudd_gate_b2 (upstream 23, which includes 5 n-gram lanes unused here)."""
    mudd_gate_scale_init: float = 0.1
    """Initial value of the learnable gate scale _mudd_gate_scale."""

    # -- attention --
    attn_scale_short: float = 0.13
    """Initial softmax scale of short-window (narrow query/key) layers (record #360)."""
    attn_scale_long: float = 0.085
    """Initial softmax scale of long-window (full-width query/key) layers (record #360)."""
    yarn_alpha: float = 1.0
    """YaRN: frequencies turning fewer times than this over the old window are fully interpolated."""
    yarn_beta: float = 32.0
    """YaRN: frequencies turning more times than this are kept."""
    attention_impl: str = "auto"
    """"auto" (FlexAttention on CUDA, the reference path elsewhere), "reference" or "flex"."""
    attention_full_blocks: bool = True
    """FlexAttention only: its block mask lists the key blocks whose pairs are all visible apart, so the
    kernel skips the mask function on them (faster, same mask; the compiled kernels' sums differ in rounding).
    False: every visited block runs the mask function, the reference the fast mask is checked against."""

    # -- head and loss --
    logit_cap: float = 23.0
    """Softcap logit_cap * sigmoid((z + logit_shift) / logit_temperature): logits lie in (0, logit_cap)."""
    logit_shift: float = 5.0
    """See logit_cap (upstream 5)."""
    logit_temperature: float = 7.5
    """See logit_cap (upstream 7.5)."""
    lm_head_init_std: float = 0.005
    """lm_head ~ N(0, std^2); embed starts as its transpose."""
    loss_chunk_rows: int = 4096
    """Rows of the [rows, vocab] logit block the loss builds at a time: memory and speed, and the weight
    gradient's rounding (one chunk: one GEMM, rounded once; several: each chunk's product rounded to the
    compute dtype, summed in fp32). The record presets use one chunk per micro batch."""
    loss_impl: str = "auto"
    """The training loss between its GEMMs: "auto" (the fused Triton kernel on CUDA, the reference path
    elsewhere), "reference" (eager torch ops) or "fused" (on a CPU only under TRITON_INTERPRET=1)."""
    mlp_impl: str = "reference"
    """The ReLU² MLP: "reference" (torch ops; Inductor fuses the square into its own elementwise kernels) or
    "fused" (the square, and in the backward its derivative, in the epilogue of a Triton GEMM:
    track_1_short/perf/kernels/relu2_mlp.py; bf16 compute, CUDA, or a CPU under TRITON_INTERPRET=1)."""
    loss_programs_per_sm: int = 0
    """The fused loss kernel's grid: 0 launches one program per row; k > 0 launches k programs per
    multiprocessor (one on a CPU) that stride over the rows, so fewer rows are in flight and the kernel's
    second pass may find its row still in L2. The same bits either way (tests/perf/test_softcapped_ce.py);
    perf/bench_loss.py --programs-per-sm times the choices."""

    # -- numerics and checks --
    compute_dtype: str = "bfloat16"
    """Activation dtype: "bfloat16" (upstream) or "float32" (CPU reference runs; weights stay in their storage
    dtype and are cast at use)."""
    check_inputs: bool = True
    """Validate token ids, cu_seqlens and windows before each forward (a host sync; off in timed GPU runs)."""

    param_table: ParamTableConfig = field(default_factory=ParamTableConfig)
    """Optimizer multipliers per parameter label."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ModelConfigError naming the first field that cannot work, and the fix."""

        def fail(msg: str) -> None:
            raise ModelConfigError(f"model config: {msg}")

        for name in (
            "vocab_size",
            "vocab_multiple",
            "num_layers",
            "model_dim",
            "num_heads",
            "head_dim",
            "narrow_head_dim",
            "rotary_dim",
            "mlp_hidden",
            "max_seq_len",
            "block_size",
            "shard_multiple",
            "mudd_dim",
            "mudd_groups",
            "mudd_gate_dim",
            "loss_chunk_rows",
        ):
            if getattr(self, name) <= 0:
                fail(f"{name}={getattr(self, name)} must be > 0.")
        if self.num_heads * self.head_dim != self.model_dim:
            fail(
                f"num_heads * head_dim = {self.num_heads} * {self.head_dim} must equal model_dim="
                f"{self.model_dim} (value embeddings and MUDD add full-width rows into V); change one."
            )
        if self.narrow_head_dim > self.head_dim:
            fail(f"narrow_head_dim={self.narrow_head_dim} must be <= head_dim={self.head_dim}.")
        if self.rotary_dim % 2:
            fail(f"rotary_dim={self.rotary_dim} must be even (dims rotate in pairs).")
        if self.compute_dtype not in COMPUTE_DTYPES:
            fail(f"compute_dtype={self.compute_dtype!r} must be one of {sorted(COMPUTE_DTYPES)}.")
        if self.attention_impl not in ATTENTION_IMPLS:
            fail(f"attention_impl={self.attention_impl!r} must be one of {list(ATTENTION_IMPLS)}.")
        if self.loss_impl not in LOSS_IMPLS:
            fail(f"loss_impl={self.loss_impl!r} must be one of {list(LOSS_IMPLS)}.")
        if self.mlp_impl not in MLP_IMPLS:
            fail(f"mlp_impl={self.mlp_impl!r} must be one of {list(MLP_IMPLS)}.")
        if self.mlp_impl == "fused" and self.compute_dtype != "bfloat16":
            fail(
                f"mlp_impl='fused' runs in bf16, but compute_dtype={self.compute_dtype!r}; use "
                "mlp_impl=reference or compute_dtype=bfloat16."
            )
        if self.loss_programs_per_sm < 0:
            fail(
                f"loss_programs_per_sm={self.loss_programs_per_sm} must be >= 0 (0: one program per row; "
                "k: k programs per multiprocessor)."
            )
        n = self.num_layers
        lists = (
            "attn_layers",
            "long_window_layers",
            "half_v_layers",
            "paired_head_layers",
            "xsa_layers",
            "attn_gate_layers",
            "value_embed_layers",
            "x0_inject_layers",
            "no_mlp_layers",
        )
        for name in lists:
            values = list(getattr(self, name))
            if any(not 0 <= v < n for v in values) or len(set(values)) != len(values):
                fail(f"{name}={values} must hold distinct layer indices in [0, {n}).")
        attn = set(self.attn_layers)
        for name in lists[1:7]:
            extra = sorted(set(getattr(self, name)) - attn)
            if extra:
                fail(f"{name} lists layers {extra} without attention; add them to attn_layers or drop them.")
        for name in (
            "parallel_mlp_layer",
            "skip_source_layer",
            "skip_target_layer",
            "late_input_layer",
            "post_gate_layer",
        ):
            v = getattr(self, name)
            if not -1 <= v < n or (name == "post_gate_layer" and v < 0):
                fail(
                    f"{name}={v} must be a layer index in [0, {n})"
                    + (" or -1." if name != "post_gate_layer" else ".")
                )
        short = attn - set(self.long_window_layers)
        if short and self.rotary_dim > self.narrow_head_dim:
            fail(
                f"rotary_dim={self.rotary_dim} must be <= narrow_head_dim={self.narrow_head_dim} "
                "(short-window layers have narrow query/key heads)."
            )
        if self.rotary_dim > self.head_dim:
            fail(f"rotary_dim={self.rotary_dim} must be <= head_dim={self.head_dim}.")
        if self.long_key_offset and self.long_window_layers and self.head_dim <= self.rotary_dim:
            fail(
                f"long_key_offset needs stationary dims: head_dim={self.head_dim} must exceed rotary_dim="
                f"{self.rotary_dim}; or set long_key_offset=false."
            )
        if self.paired_head_layers and self.num_heads % 2:
            fail(f"paired_head_layers need an even num_heads, got {self.num_heads}.")
        if set(self.paired_head_layers) & set(self.long_window_layers) and self.long_key_offset:
            fail("a paired-head layer cannot be a long-window layer with key offset; drop it from one list.")
        if set(self.paired_head_layers) & set(self.xsa_layers):
            both = sorted(set(self.paired_head_layers) & set(self.xsa_layers))
            fail(f"xsa_layers and paired_head_layers overlap at {both}; XSA needs un-paired values.")
        if self.smear and not 0 < self.smear_channels <= self.model_dim:
            fail(f"smear_channels={self.smear_channels} must be in (0, model_dim={self.model_dim}].")
        if self.value_embed_layers and not 0 < self.ve_gate_channels <= self.model_dim:
            fail(f"ve_gate_channels={self.ve_gate_channels} must be in (0, model_dim].")
        if self.parallel_mlp_layer in self.no_mlp_layers:
            fail(f"parallel_mlp_layer={self.parallel_mlp_layer} has no MLP (it is in no_mlp_layers).")
        if (self.skip_source_layer < 0) != (self.skip_target_layer < 0):
            fail("skip_source_layer and skip_target_layer must both be -1 (no skip) or both be layers.")
        if self.skip_target_layer >= 0:
            if self.skip_source_layer >= self.skip_target_layer:
                fail(
                    f"skip_source_layer={self.skip_source_layer} must come before skip_target_layer="
                    f"{self.skip_target_layer}."
                )
            if self.skip_target_layer in attn or self.skip_target_layer in self.x0_inject_layers:
                fail(
                    f"skip_target_layer={self.skip_target_layer} replaces its attention sublayer: remove it "
                    "from attn_layers and x0_inject_layers."
                )
        gated = {
            "xsa_layers": self.xsa_layers,
            "attn_gate_layers": self.attn_gate_layers,
            "x0_inject_layers": self.x0_inject_layers,
        }
        if not self.mudd_gates:
            for name, values in gated.items():
                if values:
                    fail(
                        f"{name}={list(values)} needs the per-token MUDD gates: set mudd_gates=true or "
                        "empty it."
                    )
        else:
            late = [v for v in self.xsa_layers if v >= self.post_gate_layer]
            if late:
                fail(
                    f"xsa_layers {late} come at or after post_gate_layer={self.post_gate_layer}; XSA "
                    "strengths come from the pre gate. Move post_gate_layer later."
                )
            if 0 <= self.skip_target_layer < self.post_gate_layer:
                fail(
                    f"skip_target_layer={self.skip_target_layer} comes before post_gate_layer="
                    f"{self.post_gate_layer}, which computes its gate."
                )
            needed = max(_pre_lanes(self), _post_lanes(self))
            if needed > self.mudd_gate_lanes:
                fail(f"the MUDD gates need {needed} lanes but mudd_gate_lanes={self.mudd_gate_lanes}.")
        if self.mudd:
            last = n - 1
            if last not in attn or last in self.no_mlp_layers:
                fail(
                    f"mudd=true mixes the last layer's attention and MLP: layer {last} must be in "
                    "attn_layers and not in no_mlp_layers (or set mudd=false)."
                )
            if not 0 <= self.late_input_layer < last:
                fail(
                    f"mudd=true reads cache[late_input_layer]: late_input_layer={self.late_input_layer} "
                    f"must be a layer before {last}."
                )
            if last in self.x0_inject_layers:
                fail(f"layer {last} injects x0 through its MUDD coefficient; drop it from x0_inject_layers.")
            if self.num_heads % 2:
                fail("mudd=true tiles two value-embedding gates over head halves: num_heads must be even.")
            if self.model_dim % self.mudd_groups:
                fail(f"model_dim={self.model_dim} must be divisible by mudd_groups={self.mudd_groups}.")
            if len(_mudd_sources(self)) > MUDD_COEFS:
                fail(
                    f"the post-loop MUDD mix has {len(_mudd_sources(self))} sources, more than {MUDD_COEFS}; "
                    "use fewer value-embedding layers."
                )


def _pre_lanes(cfg: ModelConfig) -> int:
    """Lanes of the pre gate: XSA strengths (H each), early attention gates (H each), early x0 gates (1)."""
    h, p = cfg.num_heads, cfg.post_gate_layer
    return (
        h * len(cfg.xsa_layers)
        + h * sum(i < p for i in cfg.attn_gate_layers)
        + sum(i < p for i in cfg.x0_inject_layers)
    )


def _post_lanes(cfg: ModelConfig) -> int:
    """Lanes of the post gate: late attention gates (H each), late x0 gates (1 each), the skip gate (1)."""
    h, p = cfg.num_heads, cfg.post_gate_layer
    return (
        h * sum(i >= p for i in cfg.attn_gate_layers)
        + sum(i >= p for i in cfg.x0_inject_layers)
        + (cfg.skip_target_layer >= 0)
    )


def _mudd_sources(cfg: ModelConfig) -> list[str]:
    """Names of the post-loop MUDD mix's sources, in coefficient order."""
    names = ["cache0", "cache_late", "last_input"]
    if cfg.skip_source_layer >= 0:
        names.append("cache_skip")
    names += [f"ve{layer}" for layer in cfg.value_embed_layers]
    return names + ["last_mlp_input", "late_attn_input"]


# -- topology derived from the config --------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Facts derived once from a ModelConfig: bank slots, widths, gate lanes, caches."""

    attn_bank_order: tuple[int, ...]
    """Layer of each qk/vo bank slot: narrow, then half-V, then long-window layers (grouped by shape)."""
    specs: dict[int, AttnSpec]
    num_attn_slots: int
    num_qk_matrices: int
    """Live qk_bank matrices: one per (slot, head pair of the 2H query and key heads)."""
    qk_bank_len: int
    vo_bank_len: int
    mlp_slots: int
    """mlp_bank slots: one per layer, the parallel MLP's (index num_layers), then frozen pads."""
    frozen_mlp_slots: tuple[int, ...]
    ve_gated_layers: tuple[int, ...]
    """Value-embedding layers gated by ve_gate_bank (the MUDD layer's gate comes from MUDD)."""
    pre_lanes: dict[str, dict[int, tuple[int, int]]]
    post_lanes: dict[str, dict[int, tuple[int, int]]]
    """kind -> layer -> (first lane, width), kinds "xsa", "attn_gate", "x0", "skip"."""
    cache_layers: tuple[int, ...]
    scalars_len: int
    vocab_padded: int

    @staticmethod
    def of(cfg: ModelConfig) -> Topology:
        attn = sorted(cfg.attn_layers)
        long_w, half_v = set(cfg.long_window_layers), set(cfg.half_v_layers)
        order = tuple(sorted(attn, key=lambda i: (i in long_w, i in half_v, i)))
        specs = {
            i: AttnSpec(
                num_heads=cfg.num_heads,
                head_dim=cfg.head_dim,
                qk_dim=cfg.head_dim if i in long_w else cfg.narrow_head_dim,
                v_dim=cfg.narrow_head_dim if i in half_v else cfg.head_dim,
                paired=i in cfg.paired_head_layers,
                key_offset=cfg.long_key_offset and i in long_w,
                xsa=i in cfg.xsa_layers,
            )
            for i in attn
        }
        n_slots = len(order)
        mlp_slots = cfg.num_layers + (cfg.parallel_mlp_layer >= 0)
        mlp_slots_padded = next_multiple_of(2 * mlp_slots, cfg.shard_multiple) // 2
        if (2 * mlp_slots_padded) % cfg.shard_multiple:  # odd shard_multiple: pad in whole slots
            mlp_slots_padded = next_multiple_of(mlp_slots, cfg.shard_multiple)
        frozen = tuple(sorted(set(cfg.no_mlp_layers) | set(range(mlp_slots, mlp_slots_padded))))
        last = cfg.num_layers - 1
        ve_gated = tuple(i for i in cfg.value_embed_layers if not (cfg.mudd and i == last))
        p, h = cfg.post_gate_layer, cfg.num_heads
        pre: dict[str, dict[int, tuple[int, int]]] = {"xsa": {}, "attn_gate": {}, "x0": {}, "skip": {}}
        post: dict[str, dict[int, tuple[int, int]]] = {"xsa": {}, "attn_gate": {}, "x0": {}, "skip": {}}
        if cfg.mudd_gates:
            lane = 0
            for kind, layers, width in (
                ("xsa", cfg.xsa_layers, h),
                ("attn_gate", cfg.attn_gate_layers, h),
                ("x0", cfg.x0_inject_layers, 1),
            ):
                for i in layers:
                    if i < p:
                        pre[kind][i] = (lane, width)
                        lane += width
            lane = 0
            for kind, layers, width in (
                ("attn_gate", cfg.attn_gate_layers, h),
                ("x0", cfg.x0_inject_layers, 1),
                ("skip", [cfg.skip_target_layer] if cfg.skip_target_layer >= 0 else [], 1),
            ):
                for i in layers:
                    if i >= p:
                        post[kind][i] = (lane, width)
                        lane += width
        caches = {i for i in (cfg.skip_source_layer, cfg.late_input_layer) if i >= 0}
        return Topology(
            attn_bank_order=order,
            specs=specs,
            num_attn_slots=n_slots,
            num_qk_matrices=n_slots * cfg.num_heads,
            qk_bank_len=next_multiple_of(max(n_slots * cfg.num_heads, 1), cfg.shard_multiple),
            vo_bank_len=next_multiple_of(max(2 * n_slots, 1), cfg.shard_multiple),
            mlp_slots=mlp_slots_padded,
            frozen_mlp_slots=frozen,
            ve_gated_layers=ve_gated,
            pre_lanes=pre,
            post_lanes=post,
            cache_layers=tuple(sorted(caches)),
            scalars_len=next_multiple_of(2 * cfg.num_layers + 2, cfg.shard_multiple),
            vocab_padded=next_multiple_of(cfg.vocab_size, cfg.vocab_multiple),
        )


def _unpack_lanes(gate: Tensor, lanes: dict[str, dict[int, tuple[int, int]]]) -> dict[str, dict[int, Tensor]]:
    """Slice a gate output [T, lanes] into kind -> layer -> [T, width]."""
    return {kind: {i: gate[:, a : a + w] for i, (a, w) in per.items()} for kind, per in lanes.items()}


# -- the model -------------------------------------------------------------------------------------


class GPT(nn.Module):
    """The network. Parameters are plain ``nn.Parameter`` attributes named by their labels (``p.label``).

    Storage dtypes (upstream's cast_matrix_weights_bf16): banks, embed, lm_head, value_embeds, gates and MUDD
    weights bf16; scalars, post/resid lambdas and _mudd_gate_scale fp32. Init draws from torch's global RNG on
    the CPU, so ``torch.manual_seed(s); GPT(cfg)`` is reproducible; ``device="meta"`` builds shapes only.
    """

    def __init__(self, cfg: ModelConfig, *, device: str | torch.device = "cpu") -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(
                f"GPT needs a ModelConfig, got {type(cfg).__name__}; build one with OmegaConf.to_object."
            )
        cfg.validate()
        self.cfg = cfg
        self.topo = topo = Topology.of(cfg)
        self.compute_dtype = COMPUTE_DTYPES[cfg.compute_dtype]
        device = torch.device(device)
        if cfg.mlp_impl == "fused" and device.type != "meta":
            from track_1_short.perf.kernels.relu2_mlp import check_device

            check_device(device)  # a clear error now, not at the first forward
        build = "meta" if device.type == "meta" else "cpu"
        d, h, hd, vp, L = cfg.model_dim, cfg.num_heads, cfg.head_dim, topo.vocab_padded, cfg.num_layers
        bf16, f32 = torch.bfloat16, torch.float32

        def param(*shape: int, dtype=bf16) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=build))

        # bf16 first, then fp32: the optimizer's flat replicated buffers follow registration order.
        self.lm_head = param(d, vp)  # stored transposed: logits = x @ lm_head
        self.embed = param(vp, d)
        if cfg.value_embed_layers:
            self.value_embeds = param(len(cfg.value_embed_layers) * vp, d)
        self.qk_bank = param(topo.qk_bank_len, 2 * hd, d)  # matrix = one head pair (of the 2H Q then K heads)
        # slot j of vo_bank: V = matrix 2j [H hd, D], O = matrix 2j+1 [D, H hd] (nn.Linear layout)
        self.vo_bank = param(topo.vo_bank_len, h * hd, d)
        self.mlp_bank = param(topo.mlp_slots, 2, cfg.mlp_hidden, d)  # slot: (c_fc, c_proj), both [hidden, D]
        if topo.ve_gated_layers:
            self.ve_gate_bank = param(len(topo.ve_gated_layers), h, 2 * cfg.ve_gate_channels)
        if cfg.smear:
            self.smear_gate = param(1, cfg.smear_channels)
        if cfg.mudd:
            self.mudd_w1 = param(2, cfg.mudd_dim, d)
            self.mudd_w2 = param(2, MUDD_COEFS, cfg.mudd_dim)
            self.mudd_w2g = param(MUDD_COEFS, cfg.mudd_groups, cfg.mudd_dim)
            self.mudd_b2 = param(2, MUDD_COEFS)
        if cfg.mudd_gates:
            self.mudd_gate_w1 = param(2, cfg.mudd_gate_dim, d)
            self.mudd_gate_w2 = param(2, cfg.mudd_gate_lanes, cfg.mudd_gate_dim)
            self.mudd_gate_b2 = param(2, cfg.mudd_gate_lanes)
        # scalars: (sa_lambda qkv, sa_lambda o) per layer, smear_lambda, skip_lambda, then padding
        self.scalars = param(topo.scalars_len, dtype=f32)
        self.post_lambdas = param(L, 2, dtype=f32)  # [:, 0] attention, [:, 1] MLP
        self.resid_lambdas = param(L, 2, dtype=f32)
        if cfg.mudd_gates:
            self._mudd_gate_scale = param(dtype=f32)

        # Rotary state per window kind (0 short, 1 long): frequencies and softmax scale, rescaled by YaRN when
        # a training forward sees a window change; the windows (tokens) they were fitted to, -1 = none yet.
        self.register_buffer("rope_freq", rope_base_frequencies(cfg.rotary_dim).repeat(2, 1).to(build))
        self.register_buffer(
            "rope_attn_scale", torch.tensor([cfg.attn_scale_short, cfg.attn_scale_long], device=build)
        )
        self.register_buffer("rope_windows", torch.full((2,), -1, dtype=torch.int64, device=build))
        self.register_buffer("embed_is_split", torch.zeros((), dtype=torch.bool, device=build))
        self._rope_windows = [-1, -1]  # host mirror of rope_windows (no device sync per forward)
        self._embed_split = False
        self.register_load_state_dict_post_hook(GPT._sync_host_state)

        self.label_parameters()
        if build != "meta":
            self._init_weights()
        if device.type not in ("cpu", "meta"):
            self.to(device)

    # -- init --

    @torch.no_grad()
    def _init_weights(self) -> None:
        cfg, topo = self.cfg, self.topo
        d, L = cfg.model_dim, cfg.num_layers

        def fill_(p: Tensor, values: Tensor) -> None:
            p.copy_(values.to(p.dtype))

        fill_(self.lm_head, torch.randn(self.lm_head.shape) * cfg.lm_head_init_std)
        self.embed.copy_(self.lm_head.T)  # tied at init
        if hasattr(self, "value_embeds"):
            fill_(self.value_embeds, 0.01 * torch.randn(self.value_embeds.shape))
        # Uniform with std 0.5 / sqrt(D) on every live matrix (upstream's bank init); pads stay zero.
        bound = math.sqrt(3) * 0.5 * d**-0.5
        uniform = lambda *shape: torch.empty(shape).uniform_(-bound, bound)  # noqa: E731
        fill_(self.qk_bank[: topo.num_qk_matrices], uniform(topo.num_qk_matrices, *self.qk_bank.shape[1:]))
        n_vo = 2 * topo.num_attn_slots
        fill_(self.vo_bank[:n_vo], uniform(n_vo, *self.vo_bank.shape[1:]))
        real_slots = cfg.num_layers + (cfg.parallel_mlp_layer >= 0)  # later slots are zero pads
        # c_fc uniform on every real slot (the frozen no-MLP slots too, as upstream); c_proj zero, so every
        # MLP starts as the zero function.
        fill_(self.mlp_bank[:real_slots, 0], uniform(real_slots, *self.mlp_bank.shape[2:]))
        # ve_gate_bank and smear_gate start at zero: gates 2 * sigmoid(0) = 1 and sigmoid(0) = 1/2.
        if cfg.mudd:
            for j in range(2):  # kaiming-uniform(a=sqrt(5)) bound = 1 / sqrt(fan_in); w2, w2g start at zero
                fill_(self.mudd_w1[j], torch.empty(cfg.mudd_dim, d).uniform_(-(d**-0.5), d**-0.5))
            s = cfg.mudd_scale
            b = torch.zeros(2, MUDD_COEFS)
            b[0, 6] = b[0, 7] = 2.0 / s  # value-embedding gates start at 2 (the max of 2 sigmoid elsewhere)
            b[0, 8] = b[0, 12] = math.sqrt(1.1) / s  # dynamic resid lambdas = the static init
            b[0, 9] = b[0, 13] = 1.0 / s  # dynamic post lambdas
            b[0, 11] = 0.05 / s  # n-gram lambda (reserved lane, upstream's init kept)
            b[1, 1] = -0.5 / s  # post-loop coefficient of cache[late]: upstream's absorbed "backout"
            fill_(self.mudd_b2, b)
        if cfg.mudd_gates:
            for j in range(2):
                fill_(self.mudd_gate_w1[j], torch.empty(cfg.mudd_gate_dim, d).uniform_(-(d**-0.5), d**-0.5))
            s = cfg.mudd_gate_scale_init
            b = torch.zeros(2, cfg.mudd_gate_lanes)
            for block, lanes in enumerate((topo.pre_lanes, topo.post_lanes)):
                for a, w in lanes["attn_gate"].values():
                    b[block, a : a + w] = 0.25 / s  # attention gates start at 0.25
                for a, w in lanes["skip"].values():
                    b[block, a : a + w] = 0.5 / s  # skip gate starts at 0.5; XSA and x0 lanes at 0
            fill_(self.mudd_gate_b2, b)
            self._mudd_gate_scale.fill_(s)
        sc = torch.ones(topo.scalars_len)  # pads are ones, as upstream
        sc[0 : 2 * L : 2] = 0.5  # sa_lambda[0] scales the QKV weights
        sc[1 : 2 * L : 2] = 1.0  # sa_lambda[1] scales O
        sc[2 * L] = 0.0  # smear_lambda: the smear starts off
        sc[2 * L + 1] = -1.5  # skip_lambda: sigmoid(-1.5) ~ 0.18
        fill_(self.scalars, sc)
        self.post_lambdas.fill_(1.0)
        self.resid_lambdas.fill_(math.sqrt(1.1))  # the two sublayers together scale the residual by 1.1

    # -- host-side state --

    def _sync_host_state(self, incompatible_keys) -> None:
        self._rope_windows = [int(w) for w in self.rope_windows.tolist()]
        self._embed_split = bool(self.embed_is_split.item())

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Initial rotary frequencies and softmax scales, no window fitted yet (the post-warmup reset)."""
        self.rope_freq.copy_(rope_base_frequencies(self.cfg.rotary_dim).repeat(2, 1))
        self.rope_attn_scale.copy_(torch.tensor([self.cfg.attn_scale_short, self.cfg.attn_scale_long]))
        self.rope_windows.fill_(-1)
        self._rope_windows = [-1, -1]

    @torch.compiler.disable
    @torch.no_grad()
    def follow_windows(self, windows) -> None:
        """Fit the rotary state to (short, long) windows in blocks: a window that changed since the last call
        rescales its frequencies and softmax scale (YaRN, upstream's Yarn.apply); the first call only records.

        Training forwards call it (training mode, gradients enabled); evaluation forwards, in eval mode or
        under no_grad, do not: upstream extends the final validation's long window without a rotary update,
        and a validation between training steps must not move the training's rotary state.
        """
        for kind, blocks in enumerate(windows):
            new = int(blocks) * self.cfg.block_size
            old = self._rope_windows[kind]
            if old > 0 and new != old:
                gain = yarn_rescale_(self.rope_freq[kind], old, new, self.cfg.yarn_alpha, self.cfg.yarn_beta)
                self.rope_attn_scale[kind] *= gain
            if new != old:
                self.rope_windows[kind] = new
                self._rope_windows[kind] = new

    def split_embed(self) -> None:
        """Untie embed from lm_head: param_table() stops listing ``tied_to``.

        The forward always reads embed for inputs and lm_head for outputs; while they are tied the optimizer
        keeps embed equal to lm_head^T. The split is a buffer (``embed_is_split``), saved with the model.
        """
        self.embed_is_split.fill_(True)
        self._embed_split = True

    # -- param table and orders --

    def label_parameters(self) -> dict[str, nn.Parameter]:
        """Set ``p.label`` (the name, ``.weight`` stripped) on every parameter; return label -> parameter.

        Called at construction and by every table/order method: ``copy.deepcopy`` builds fresh Parameters
        without attributes, so a copied model regains its labels when its table is read.
        """
        params = {}
        for name, p in self.named_parameters():
            p.label = name.replace(".weight", "")
            params[p.label] = p
        return params

    def param_table(self) -> dict[str, dict]:
        """label -> optimizer entry (the model/optimizer contract; see optim/param_config.py)."""
        pt = self.cfg.param_table
        table: dict[str, dict] = {}
        for label, p in self.label_parameters().items():
            if label.endswith("_bank") and label != "ve_gate_bank":
                table[label] = self._bank_entry(label, p)
                continue
            hyper: AdamHyper = getattr(pt, label.lstrip("_"))
            sharded = label in ("lm_head", "embed", "value_embeds")
            entry = {
                "optim": "adam",
                "comms": "sharded" if sharded else "replicated",
                "adam_betas": [float(b) for b in hyper.betas],
                "lr_mul": float(hyper.lr_mul),
                "wd_mul": float(hyper.wd_mul),
            }
            if label == "embed" and not self._embed_split:
                entry["tied_to"] = "lm_head"
            table[label] = entry
        return table

    def _bank_entry(self, label: str, p: Tensor) -> dict:
        topo = self.topo
        if label == "mlp_bank":
            reshape = [2 * p.shape[0], p.shape[2], p.shape[3]]
            mults = []
            for s in range(p.shape[0]):
                frozen = s in topo.frozen_mlp_slots
                mults += [0.0, 0.0] if frozen else [1.0, float(self.cfg.param_table.mlp_proj_lr_mul)]
        else:
            live = topo.num_qk_matrices if label == "qk_bank" else 2 * topo.num_attn_slots
            reshape = list(p.shape)
            mults = [1.0] * live + [0.0] * (p.shape[0] - live)  # pads: zero, never read, never moved
        return {
            "optim": "anvil",
            "comms": "sharded",
            "adam_betas": None,
            "lr_mul": 1.0,  # the optimizer folds in the shape factor sqrt(max(1, rows / cols))
            "wd_mul": 1.0,
            "reshape": [int(n) for n in reshape],
            "matrix_lr_mul": mults,
        }

    def scatter_order(self) -> list[str]:
        """Labels in the order their gradient reductions are launched (every label once)."""
        present = set(self.label_parameters())
        return [label for label in SCATTER_ORDER if label in present]

    def work_order(self) -> list[str]:
        """Labels in the order they are waited for, updated and gathered (every label once)."""
        present = set(self.label_parameters())
        return [label for label in WORK_ORDER if label in present]

    # -- input checks --

    @torch.compiler.disable
    def check_inputs(
        self, inputs: Tensor, targets: Tensor | None, cu_seqlens: Tensor, windows, mtp_weights
    ) -> None:
        """Raise ModelConfigError naming the bad argument, before any compute.

        Shapes, dtypes, windows and weights are checked on the host; the value checks (token ids, cu_seqlens)
        read their numbers back in one device-to-host copy, the one sync this costs per forward.
        """
        cfg = self.cfg

        def fail(msg: str) -> None:
            raise ModelConfigError(msg)

        if (
            not isinstance(inputs, Tensor)
            or inputs.dim() != 1
            or inputs.dtype not in (torch.int32, torch.int64)
        ):
            fail("inputs must be a 1-D int32/int64 tensor [T] (one packed sequence, batch 1).")
        t = inputs.numel()
        if t == 0:
            fail("inputs is empty: pass at least one token.")
        if t > cfg.max_seq_len:
            fail(
                f"inputs has {t} tokens, more than max_seq_len={cfg.max_seq_len}: split the batch or raise "
                "model.max_seq_len."
            )
        if targets is not None and (
            not isinstance(targets, Tensor) or targets.shape != inputs.shape or targets.dtype != torch.int64
        ):
            fail(f"targets must be an int64 tensor shaped like inputs [{t}].")
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
            fail("cu_seqlens must be a 1-D int32 tensor [n_docs + 1] of document start offsets ending at T.")
        tensors = [inputs, cu_seqlens] + ([targets] if targets is not None else [])
        if any(x.device != inputs.device for x in tensors):
            devices = [str(x.device) for x in tensors]
            fail(f"inputs, targets and cu_seqlens must be on one device, got {devices}.")
        window_tensor = isinstance(windows, Tensor)
        if window_tensor:
            if windows.shape != (2,) or windows.dtype not in (torch.int32, torch.int64):
                fail(
                    "windows as a tensor must be int32/int64 [2] (short, long) in blocks of "
                    f"{cfg.block_size} tokens, got {windows.dtype} {tuple(windows.shape)}."
                )
            if windows.device != inputs.device:
                fail(f"windows is on {windows.device}, inputs on {inputs.device}: put them on one device.")
        elif not hasattr(windows, "__len__") or len(windows) != 2:
            fail(f"windows must be (short, long) in blocks of {cfg.block_size} tokens, got {windows!r}.")
        elif any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in windows):
            fail(f"windows must be two ints >= 1 (blocks of {cfg.block_size} tokens), got {windows!r}.")
        if len(mtp_weights) == 0 or any(not math.isfinite(w) or w < 0 for w in mtp_weights):
            fail(f"mtp_weights must be a non-empty list of finite weights >= 0, got {mtp_weights!r}.")

        ranges = [inputs.min(), inputs.max()]
        if targets is not None:
            ranges += [targets.min(), targets.max()]
        if window_tensor:
            ranges += list(windows.long().unbind())
        values = torch.cat([torch.stack(ranges).long(), cu_seqlens.long()]).tolist()  # the one sync
        ranges, cu = values[: len(ranges)], values[len(ranges) :]
        if window_tensor:
            blocks, ranges = ranges[-2:], ranges[:-2]
            if min(blocks) < 1:
                fail(f"windows must be >= 1 block of {cfg.block_size} tokens, got {blocks}.")
            fitted = [w // cfg.block_size for w in self._rope_windows]
            if self.training and torch.is_grad_enabled() and fitted != blocks:
                fail(
                    f"windows {blocks} (a tensor) differ from the windows the rotary state is fitted to "
                    f"({fitted}; -1 = none yet): a training forward does not read a tensor's values on the "
                    "host, so call model.follow_windows(windows) with the ints first."
                )
        if ranges[0] < 0 or ranges[1] >= cfg.vocab_size:
            fail(
                f"inputs holds token ids in [{ranges[0]}, {ranges[1]}], outside the vocabulary "
                f"[0, {cfg.vocab_size}): the data was tokenised for another vocabulary; use matching data or "
                "model.vocab_size."
            )
        if targets is not None and (ranges[2] < 0 or ranges[3] >= cfg.vocab_size):
            fail(
                f"targets holds token ids in [{ranges[2]}, {ranges[3]}], outside the vocabulary "
                f"[0, {cfg.vocab_size})."
            )
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != t or any(b < a for a, b in zip(cu, cu[1:])):
            fail(f"cu_seqlens must start at 0, never decrease and end at T={t}; got {cu[:4]}...{cu[-2:]}.")

    # -- forward --

    def forward(
        self,
        inputs: Tensor,
        targets: Tensor,
        cu_seqlens: Tensor,
        windows,
        mtp_weights: list[float] | Tensor | None = None,
    ) -> Tensor:
        """Summed multi-token softcapped CE over the T tokens (fp32 0-D); mtp_weights None = [1.0] (plain CE).

        inputs int32/int64 [T] of whole documents, targets int64 [T], cu_seqlens int32 [n_docs + 1] (it may
        end in repeated T entries: empty documents, so that its length stays fixed), windows (short, long) in
        blocks of block_size tokens (two ints, or an int [2] tensor on the model's device: a compiled model
        then takes every stage's windows with one graph; a training forward leaves the rotary state to the
        caller's ``follow_windows``, which the input checks verify), mtp_weights: weight of predicting t+1,
        t+2, ... (a list, or an fp32 [K] tensor on the model's device: a compiled model then takes new
        weights without a new graph).
        """
        mtp = [1.0] if mtp_weights is None else mtp_weights
        if self.cfg.check_inputs:
            listed = mtp.tolist() if isinstance(mtp, Tensor) else [float(w) for w in mtp]
            self.check_inputs(inputs, targets, cu_seqlens, windows, listed)
        if self.training and torch.is_grad_enabled() and not isinstance(windows, Tensor):
            self.follow_windows(windows)  # a training step, not an evaluation (a tensor: the caller's job)
        hidden = self.hidden(inputs, cu_seqlens, windows)
        cfg = self.cfg
        # An evaluation forward scores its logits with upstream's validation numerics (softcap in the compute
        # dtype, then fp32 CE); a training forward with the chunked fused loss (fp32 softcap).
        evaluation = not (self.training and torch.is_grad_enabled())
        loss = softcapped_cross_entropy_eval_sum if evaluation else softcapped_cross_entropy_sum
        args = (cfg.logit_cap, cfg.logit_shift, cfg.logit_temperature, cfg.loss_chunk_rows)
        if evaluation:
            return loss(hidden, self.lm_head, targets, mtp, *args)
        return loss(hidden, self.lm_head, targets, mtp, *args, cfg.loss_impl, cfg.loss_programs_per_sm)

    @torch.no_grad()
    def val_loss_sum(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, windows) -> Tensor:
        """Plain next-token CE summed over the T tokens (fp32 0-D), without gradients or rotary updates."""
        was_training = self.training
        self.eval()
        try:
            return self.forward(inputs, targets, cu_seqlens, windows, None)
        finally:
            self.train(was_training)

    def logits(self, inputs: Tensor, cu_seqlens: Tensor, windows) -> Tensor:
        """Softcapped logits fp32 [T, vocab_padded] as the evaluation loss scores them, for evaluation and
        tests (the training loss never builds them)."""
        if self.cfg.check_inputs:
            self.check_inputs(inputs, None, cu_seqlens, windows, [1.0])
        hidden = self.hidden(inputs, cu_seqlens, windows)
        cfg = self.cfg
        # The softcap in the compute dtype, then fp32: the evaluation loss's logits (upstream's validation).
        return softcap(
            hidden @ self.lm_head.type_as(hidden),
            cfg.logit_cap,
            cfg.logit_shift,
            cfg.logit_temperature,
        ).float()

    def _attn_weights(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """layer -> (qk_w [2 H qk_dim, D], v_w [H v_dim, D], o_w [D, H v_dim]) cut from the banks."""
        topo, h, hd, d = self.topo, self.cfg.num_heads, self.cfg.head_dim, self.cfg.model_dim
        qk_heads = self.qk_bank[: topo.num_qk_matrices].view(topo.num_attn_slots, 2 * h, hd, d)
        weights = {}
        for slot, layer in enumerate(topo.attn_bank_order):
            dq, dv = topo.specs[layer].qk_dim, topo.specs[layer].v_dim
            qk_w = qk_heads[slot, :, :dq].reshape(2 * h * dq, d)  # each head's leading dq rows
            v_w = self.vo_bank[2 * slot].view(h, hd, d)[:, :dv].reshape(h * dv, d)
            # O's columns that the kept V rows feed
            o_w = self.vo_bank[2 * slot + 1].view(d, h, hd)[:, :, :dv].reshape(d, h * dv)
            weights[layer] = (qk_w, v_w, o_w)
        return weights

    def _gate(self, x: Tensor, block: int) -> Tensor:
        """MUDD gate ``block`` (0 pre, 1 post) on x [T, D]: [T, mudd_gate_lanes]."""
        hid = F.gelu(x @ self.mudd_gate_w1[block].type_as(x).T)
        out = hid @ self.mudd_gate_w2[block].type_as(x).T + self.mudd_gate_b2[block].type_as(x)
        return out * self._mudd_gate_scale.to(x.dtype)

    def _mudd(self, x: Tensor, block: int, n: int, grouped: bool = False):
        """MUDD coefficients of ``block`` on x [T, D]: [T, n], plus [T, n, groups] deltas when ``grouped``."""
        s = self.cfg.mudd_scale
        hid = F.gelu(x @ self.mudd_w1[block].type_as(x).T)  # [T, mudd_dim]
        coefs = (hid @ self.mudd_w2[block, :n].type_as(x).T + self.mudd_b2[block, :n].type_as(x)) * s
        if not grouped:
            return coefs
        deltas = torch.einsum("tm,kgm->tkg", hid, self.mudd_w2g[:n].type_as(x)) * s
        return coefs, deltas

    def hidden(self, inputs: Tensor, cu_seqlens: Tensor, windows) -> Tensor:
        """The final normed hidden states [T, D] (compute dtype) of one packed batch."""
        cfg, topo, cd = self.cfg, self.topo, self.compute_dtype
        t, d, h, hd, L = inputs.numel(), cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.num_layers
        last = L - 1
        tokens = inputs.long()
        doc_start = lookback_starts(document_starts(cu_seqlens, t), cfg.cross_document_lookback)
        seq = PackedSequence(
            document_ids(cu_seqlens, t),
            doc_start,
            cfg.block_size,
            cfg.attention_impl,
            cfg.attention_full_blocks,
        )
        if isinstance(windows, Tensor):  # device values: one graph for every window of a compiled model
            window_tokens = tuple((windows.long() * cfg.block_size).unbind())
        else:
            window_tokens = (int(windows[0]) * cfg.block_size, int(windows[1]) * cfg.block_size)

        sa = self.scalars[: 2 * L].view(L, 2)
        resid = self.resid_lambdas.to(cd)
        post = self.post_lambdas.to(cd)

        x = F.embedding(tokens, self.embed).to(cd)  # [T, D]
        if cfg.smear:
            x = smear(x, self.smear_gate, self.scalars[2 * L], doc_start)
        x0 = x = norm(x)
        ve: dict[int, Tensor] = {}
        if cfg.value_embed_layers:
            planes = self.value_embeds.view(len(cfg.value_embed_layers), topo.vocab_padded, d)[:, tokens]
            ve = {layer: planes[j].to(cd) for j, layer in enumerate(cfg.value_embed_layers)}  # [T, D] each
        lanes: dict[str, dict[int, Tensor]] = {"xsa": {}, "attn_gate": {}, "x0": {}, "skip": {}}
        if cfg.mudd_gates:
            lanes = _unpack_lanes(self._gate(x0, 0), topo.pre_lanes)

        cache = {0: x}
        late_in = None  # norm(cache[late_input_layer]), shared by every later attention layer
        attn_w = self._attn_weights()
        mlp = self.mlp_bank.unbind(0)
        mlp_in = x
        for i in range(L):
            mu = None
            if cfg.mudd_gates and i == cfg.post_gate_layer:
                for kind, per in _unpack_lanes(self._gate(x, 1), topo.post_lanes).items():
                    lanes[kind].update(per)
            # attention sublayer
            if i == cfg.skip_target_layer:
                g = torch.sigmoid(self.scalars[2 * L + 1]).to(cd)
                if i in lanes["skip"]:
                    g = g * lanes["skip"][i]
                x = x + g * cache[cfg.skip_source_layer]
            elif i not in topo.specs:
                x = x * resid[i, 0]
                if i in lanes["x0"]:
                    x = x + x0 * lanes["x0"][i]
            else:
                if late_in is not None:
                    attn_in = late_in
                elif cfg.late_input_layer in cache and i > cfg.late_input_layer:
                    attn_in = late_in = norm(cache[cfg.late_input_layer])
                else:
                    attn_in = norm(x)
                aux_v = None
                if cfg.mudd and i == last:
                    last_input = x
                    mu = self._mudd(x, 0, MUDD_COEFS)  # [T, 14]
                    c_late = cache[cfg.late_input_layer]
                    aux_v = mu[:, 0:1] * cache[0] + mu[:, 1:2] * c_late + mu[:, 2:3] * x  # V add-in [T, D]
                    x = (1 + mu[:, 5:6]) * x + mu[:, 3:4] * cache[0] + mu[:, 4:5] * c_late
                    if i in ve:
                        gate = torch.cat([mu[:, 6:7], mu[:, 7:8]], -1).repeat_interleave(h // 2, -1)  # [T, H]
                        aux_v = aux_v + (gate[..., None] * ve[i].view(t, h, hd)).view(t, d)
                elif i in ve:
                    c = cfg.ve_gate_channels
                    j = topo.ve_gated_layers.index(i)
                    gate_in = torch.cat([attn_in[:, :c], ve[i][:, :c]], -1)  # [T, 2c]
                    gate = 2 * torch.sigmoid(gate_in @ self.ve_gate_bank[j].type_as(gate_in).T)  # [T, H]
                    aux_v = (gate[..., None] * ve[i].view(t, h, hd)).view(t, d)
                kind = 1 if i in cfg.long_window_layers else 0
                o_gain = sa[i, 1] if mu is not None else sa[i, 1] * self.post_lambdas[i, 0]
                out = causal_self_attention(
                    attn_in,
                    *attn_w[i],
                    topo.specs[i],
                    seq,
                    window_tokens[kind],
                    self.rope_freq[kind],
                    self.rope_attn_scale[kind],
                    sa[i, 0],
                    o_gain,
                    aux_v=aux_v,
                    xsa_alpha=lanes["xsa"].get(i),
                    gate=lanes["attn_gate"].get(i),
                )
                if mu is not None:
                    x = mu[:, 8:9] * x + mu[:, 9:10] * out + mu[:, 10:11] * cache[0]
                else:
                    x = x * resid[i, 0] + out
                    if i in lanes["x0"]:
                        x = x + x0 * lanes["x0"][i]
            # MLP sublayer
            if i in cfg.no_mlp_layers:
                x = x * resid[i, 1]
            else:
                mlp_in = norm(x)
                out = relu2_mlp(mlp_in, mlp[i][0], mlp[i][1], cfg.mlp_impl)
                post_mlp = mu[:, 13:14] if mu is not None else post[i, 1]
                if i == cfg.parallel_mlp_layer:
                    p = L  # the parallel MLP's bank slot
                    out = out + relu2_mlp(mlp_in, mlp[p][0], mlp[p][1], cfg.mlp_impl)
                x = (mu[:, 12:13] if mu is not None else resid[i, 1]) * x + post_mlp * out
            if i in topo.cache_layers:
                cache[i] = x

        if cfg.mudd:
            # Post-loop mix: every source enters with a per-token coefficient plus a per-channel-group delta.
            named = {
                "cache0": cache[0],
                "cache_late": cache[cfg.late_input_layer],
                "last_input": last_input,
                "last_mlp_input": mlp_in,
                "late_attn_input": late_in,
            }
            if cfg.skip_source_layer >= 0:
                named["cache_skip"] = cache[cfg.skip_source_layer]
            named.update({f"ve{layer}": ve[layer] for layer in cfg.value_embed_layers})
            sources = [named[name] for name in _mudd_sources(cfg)]
            coefs, deltas = self._mudd(x, 1, len(sources), grouped=True)  # [T, n], [T, n, G]
            g = cfg.mudd_groups
            mixed = x.view(t, g, d // g)
            for k, src in enumerate(sources):
                mixed = mixed + (coefs[:, k : k + 1] + deltas[:, k, :])[..., None] * src.view(t, g, d // g)
            x = mixed.reshape(t, d)
        return norm(x)


# -- FLOPs -----------------------------------------------------------------------------------------


def _mean_keys(length: int, window: int) -> float:
    """Mean keys per query of causal attention, left window ``window`` tokens, over ``length`` tokens."""
    if length <= window + 1:
        return (length + 1) / 2
    full = (window + 1) * (window + 2) / 2 + (length - window - 1) * (window + 1)
    return full / length


def flops_per_token(cfg: ModelConfig, seq_len: int, windows: list[int] | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3 x the forward's matmul FLOPs) for documents of
    ``seq_len`` tokens, for MFU. windows (short, long) in blocks; None = no window limit.

    Counts every matmul: QKV and O projections, attention scores and values over the keys the mask lets
    through (paired layers: H/2 heads over a doubled stream), MLPs (plus the parallel one), lm_head, MUDD
    blocks and gates.
    Elementwise work, norms and embedding lookups are left out (under 1% at record size).
    """
    topo = Topology.of(cfg)
    d, h = cfg.model_dim, cfg.num_heads
    f = 0.0
    for i, spec in topo.specs.items():
        dq, dv = spec.qk_dim, spec.v_dim
        f += 2 * d * (2 * h * dq + h * dv) + 2 * h * dv * d  # QKV, O
        kind = 1 if i in cfg.long_window_layers else 0
        w = windows[kind] * cfg.block_size if windows is not None else 2 * seq_len
        keys = _mean_keys(2 * seq_len, w) if spec.paired else _mean_keys(seq_len, w)
        f += h * keys * 2 * (dq + dv)  # scores and weighted values, H head-queries per token either way
    n_mlp = cfg.num_layers - len(cfg.no_mlp_layers) + (cfg.parallel_mlp_layer >= 0)
    f += n_mlp * 2 * (2 * d * cfg.mlp_hidden)
    f += 2 * d * topo.vocab_padded
    if cfg.mudd_gates:
        f += 2 * (2 * d * cfg.mudd_gate_dim + 2 * cfg.mudd_gate_dim * cfg.mudd_gate_lanes)
    if cfg.mudd:
        n1 = len(_mudd_sources(cfg))
        f += 2 * d * cfg.mudd_dim + 2 * cfg.mudd_dim * MUDD_COEFS
        f += 2 * d * cfg.mudd_dim + 2 * cfg.mudd_dim * n1 * (1 + cfg.mudd_groups)
    f += len(topo.ve_gated_layers) * 2 * (2 * cfg.ve_gate_channels) * h
    return 3.0 * f
