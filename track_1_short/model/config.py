"""The track-1 GPT's configuration: ModelConfig and its validation, the Topology derived from it, the param
table's per-label Adam settings, and the label orders the optimizer follows.

Every size, topology choice and constant of the network in model/gpt.py is a field here;
``model=track1`` is the record #92 model (upstream gpt.py @ f380c1f0, param table in training.py @ 55865738)
and ``model=tiny`` the same structure at CPU size. :class:`Topology` holds the facts derived once from a
config (bank slots, widths, gate lanes), so the network, the optimizer's tests and the benchmarks read one
source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from track_1_short.model.attention import ATTENTION_IMPLS, AttnSpec
from track_1_short.model.layers import LOSS_IMPLS, next_multiple_of

# MUDD block 0 (start of the last layer) emits this many coefficients, in this layout (upstream init_mudd):
#   0-2 V add-in over (cache[0], cache[late], x)   3-5 residual recombination over the same sources
#   6-7 value-embedding gates (tiled over head halves)   8-9 dynamic resid / post attention lambdas
#   10 x0 injection   11 n-gram injection (read only with model.ngram.enabled)
#   12-13 dynamic resid / post MLP lambdas
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
class NgramConfig:
    """The hashed n-gram embedding table (model/ngram.py); defaults are record #92's (upstream ngram_table.py
    @ f380c1f0). Off by default: ``model=track1`` is the record model without the table unless a preset turns
    it on."""

    enabled: bool = False
    """The table, its gate lanes and MUDD coefficient 11. Off: the model has none of them (and the lanes stay
    in mudd_gate_w2 / mudd_gate_b2 unused, as upstream's shapes)."""
    rows: int = 84_602_880
    """Rows of the whole table (all ranks together): [0, rows/2) the bigram channel, [rows/2, rows) the
    trigram channel, each channel's last row reserved for positions without enough history. Even, < 2**31."""
    dim: int = 768
    """ngram_dim: width of a row; the n-gram embedding enters the residual's first ``dim`` channels."""
    sign_pool_rows: int = 8192
    """Rows of the +-1 sign pool (a power of two: the sign hash is reduced with a mask)."""
    bigram_row_muls: list[int] = field(default_factory=lambda: [36313, 27191])
    """Multipliers of x[t], x[t-1] in the bigram row hash (int32 products wrap, XOR, then mod)."""
    trigram_row_muls: list[int] = field(default_factory=lambda: [17351, 60961, 45259])
    """Multipliers of x[t], x[t-1], x[t-2] in the trigram row hash."""
    bigram_sign_muls: list[int] = field(default_factory=lambda: [48271, 30011])
    """Multipliers of x[t], x[t-1] in the bigram sign-row hash (independent of the row hash)."""
    trigram_sign_muls: list[int] = field(default_factory=lambda: [58699, 39779, 26801])
    """Multipliers of x[t], x[t-1], x[t-2] in the trigram sign-row hash."""
    inject_layers: list[int] = field(default_factory=lambda: [0, 1, 4, 5, 9])
    """Layers that add the gated n-gram embedding into the residual (layer 0's before the loop, so it is part
    of cache[0]); each has one MUDD gate lane (pre gate before post_gate_layer, post gate from it on). The
    last layer injects through MUDD coefficient 11 instead, when mudd is on."""
    gate_init: float = 0.05
    """Initial value of every n-gram gate lane and of MUDD coefficient 11 (biases are stored divided by the
    gates' scale)."""
    lr_mul: float = 70.0
    """Multiplier on the Adam base lr (optim.adam_lr times the lr schedule)."""
    wd_mul: float = 5.0
    """Multiplier on the Adam base weight decay; doubled from optim.value_embed_period4_start (cautious decay
    of strength lr^2 * weight_decay * wd_mul)."""
    beta2: float = 0.95
    """The row second moment's decay per update (squared from optim.value_embed_period4_start); beta1 is 0."""
    adam_impl: str = "reference"
    """The row update: "reference" (torch ops, optim/ngram_adam.py) or "triton" (one kernel a row,
    track_1_short/perf/kernels/ngram_adam.py; CUDA, or a CPU under TRITON_INTERPRET=1). The same bits."""
    fold_impl: str = "reference"
    """How a micro batch's row gradients join the cycle's fp32 sums: "reference" (an fp32 copy and index_add,
    model/ngram.py) or "triton" (a sorted segment sum, one program a row, no atomics:
    track_1_short/perf/kernels/ngram_fold.py; CUDA, or a CPU under TRITON_INTERPRET=1). The CPU reference's
    bits; on CUDA the reference's atomics add in no fixed order."""
    embed_impl: str = "reference"
    """The embedding read from the cycle's cache, forward and backward: "reference" (torch ops: gathers,
    products and a sum) or "triton" (one kernel each way: track_1_short/perf/kernels/ngram_embed.py; CUDA,
    or a CPU under TRITON_INTERPRET=1). The same bits; either runs as one custom op (model/ngram.py)."""

    def validate(self, model_dim: int, num_layers: int) -> None:
        def fail(msg: str) -> None:
            raise ModelConfigError(f"model config: ngram.{msg}")

        if not self.enabled:
            return
        if self.rows % 2 or not 4 <= self.rows < 2**31:
            fail(f"rows={self.rows} must be even, >= 4 and < 2**31 (two channels of int32 row ids).")
        if not 0 < self.dim <= model_dim:
            fail(f"dim={self.dim} must be in (0, model_dim={model_dim}]: it fills the residual's first ones.")
        p = self.sign_pool_rows
        if p <= 0 or p & (p - 1):
            fail(f"sign_pool_rows={p} must be a power of two (the sign hash is reduced with a mask).")
        for name, n in (
            ("bigram_row_muls", 2),
            ("trigram_row_muls", 3),
            ("bigram_sign_muls", 2),
            ("trigram_sign_muls", 3),
        ):
            muls = list(getattr(self, name))
            if len(muls) != n or any(not 0 < int(m) < 2**31 for m in muls):
                fail(f"{name}={muls} must hold {n} multipliers in (0, 2**31), one per token of the n-gram.")
        layers = list(self.inject_layers)
        if any(not 0 <= v < num_layers for v in layers) or len(set(layers)) != len(layers):
            fail(f"inject_layers={layers} must hold distinct layer indices in [0, {num_layers}).")
        if not self.lr_mul >= 0 or not self.wd_mul >= 0:
            fail(f"lr_mul={self.lr_mul} and wd_mul={self.wd_mul} must be >= 0.")
        if not 0.0 <= self.beta2 < 1.0:
            fail(f"beta2={self.beta2} must lie in [0, 1).")
        for name in ("adam_impl", "fold_impl", "embed_impl"):
            if getattr(self, name) not in KERNEL_IMPLS:
                fail(f"{name}={getattr(self, name)!r} must be one of {list(KERNEL_IMPLS)}.")


KERNEL_IMPLS = ("reference", "triton")  # a switch between torch ops and one Triton kernel
FP8_MLP_IMPLS = ("scaled_mm", "triton")  # the FP8 MLP's up-projection GEMMs (FP8Config.mlp_impl)


def saved_model_config(saved: dict) -> dict:
    """A checkpoint's model config as this version compares it: every field added since it was written takes
    its default, which is how the code that wrote it behaved (a field is added with the old behaviour as its
    default: a config saved before ``ngram`` existed had no table, i.e. the disabled block; one saved before
    an ``*_impl`` switch existed ran its reference)."""
    if not isinstance(saved, dict):
        return saved
    from omegaconf import OmegaConf

    return _with_defaults(saved, OmegaConf.to_container(OmegaConf.structured(ModelConfig)))


def _with_defaults(saved: dict, defaults: dict) -> dict:
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_defaults(out[key], value)
    return out


@dataclass
class FP8Config:
    """FP8 GEMMs of the training forward and backward, one switch per path (model/fp8.py says which GEMMs,
    which formats and which scales). Evaluation forwards always run the bf16 path."""

    mlp: bool = False
    """The MLP's up and down projections, forward and backward (e4m3 operands, e5m2 gradients)."""
    qkv: bool = False
    """The attention's QKV projection, forward and backward."""
    lm_head: bool = False
    """The training loss's logits GEMM (its gradient GEMMs stay bf16)."""
    quantize_impl: str = "triton"
    """How the MLP's and QKV's activations and gradients are quantised on CUDA: "triton" (one pass writing
    both layouts with the clip count and amax, track_1_short/perf/kernels/fp8_quantize.py) or "reference"
    (torch ops, which Inductor fuses into several passes; model/fp8.py). The same bits. The CPU's emulation
    always takes the reference."""
    mlp_impl: str = "scaled_mm"
    """The FP8 MLP's up-projection GEMMs and the operands they feed: "scaled_mm" (``torch._scaled_mm``
    writes pre, then the quantise of relu(pre)^2; likewise dpost, then the quantise of dpre) or "triton"
    (one Triton GEMM each way, quantising in its epilogue: track_1_short/perf/kernels/fp8_relu2_mlp.py;
    CUDA, or a CPU under TRITON_INTERPRET=1; micro batches a multiple of 16 tokens). The same bits where
    the GEMMs' sums agree."""
    clip_report_fraction: float = 1e-3
    """At log steps, every FP8 operand whose scale saturated more than this fraction of its elements since
    the last log step is reported in the run log."""

    @property
    def any(self) -> bool:
        return self.mlp or self.qkv or self.lm_head


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
    """"auto" (FlexAttention on CUDA, the reference path elsewhere), "reference", "flex" or "fa4"
    (flash-attn-4 on the unpaired layers of equal query/key and value widths, FlexAttention on the others;
    CUDA with the flash-attn-4 wheel; the windows enter as host ints: model/attention.py)."""
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
    mlp_impl: str = "reference"
    """The bf16 ReLU^2 MLP (training without model.fp8.mlp, and every evaluation forward): "reference" (torch
    ops, model/layers.py relu2_mlp: Inductor runs the activation and its gradient as kernels of their own) or
    "triton" (the activation in the up-projection GEMM's epilogue, both ways: model/mlp.py and
    track_1_short/perf/kernels/relu2_mlp.py; CUDA, or a CPU under TRITON_INTERPRET=1; bf16, model_dim and
    mlp_hidden multiples of 8)."""
    loss_impl: str = "auto"
    """The training loss between its GEMMs: "auto" (the fused Triton kernel on CUDA, the reference path
    elsewhere), "reference" (eager torch ops) or "fused" (on a CPU only under TRITON_INTERPRET=1)."""
    prefix_targets: bool = True
    """Build the prefix-token table (model/prefix_targets.py) so that the training loss can score every
    position also against prefix(next token), with the schedule's ``prefix_weights``; needs GPT-2's
    vocabulary (vocab_size 50257), the ids the table maps (model=tiny, on any vocabulary, leaves it off)."""

    # -- numerics and checks --
    compute_dtype: str = "bfloat16"
    """Activation dtype: "bfloat16" (upstream) or "float32" (CPU reference runs; weights stay in their storage
    dtype and are cast at use)."""
    check_inputs: bool = True
    """Validate token ids, cu_seqlens and windows before each forward (a host sync; off in timed GPU runs)."""

    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 projections of the training step (off: every GEMM in the compute dtype)."""
    param_table: ParamTableConfig = field(default_factory=ParamTableConfig)
    """Optimizer multipliers per parameter label."""
    ngram: NgramConfig = field(default_factory=NgramConfig)
    """The hashed n-gram embedding table (off unless ``ngram.enabled``)."""

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
        if self.mlp_impl not in KERNEL_IMPLS:
            fail(f"mlp_impl={self.mlp_impl!r} must be one of {list(KERNEL_IMPLS)}.")
        if self.mlp_impl == "triton" and (
            self.compute_dtype != "bfloat16" or self.model_dim % 8 or self.mlp_hidden % 8
        ):
            fail(
                f"mlp_impl='triton' runs bf16 GEMMs on rows of 16-byte multiples, but compute_dtype="
                f"{self.compute_dtype!r}, model_dim={self.model_dim}, mlp_hidden={self.mlp_hidden}; use "
                "mlp_impl=reference, or bfloat16 with both sizes multiples of 8."
            )
        if self.loss_impl not in LOSS_IMPLS:
            fail(f"loss_impl={self.loss_impl!r} must be one of {list(LOSS_IMPLS)}.")
        if self.fp8.quantize_impl not in KERNEL_IMPLS:
            fail(f"fp8.quantize_impl={self.fp8.quantize_impl!r} must be one of {list(KERNEL_IMPLS)}.")
        if self.fp8.mlp_impl not in FP8_MLP_IMPLS:
            fail(f"fp8.mlp_impl={self.fp8.mlp_impl!r} must be one of {list(FP8_MLP_IMPLS)}.")
        if not 0 < self.fp8.clip_report_fraction <= 1:
            fail(f"fp8.clip_report_fraction={self.fp8.clip_report_fraction} must be in (0, 1].")
        if self.prefix_targets and self.vocab_size != 50257:
            fail(
                f"prefix_targets=true maps GPT-2's token ids, but vocab_size={self.vocab_size}; use data "
                "with GPT-2's vocabulary (vocab_size 50257) or model.prefix_targets=false."
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
        self.ngram.validate(self.model_dim, n)
        if self.ngram.enabled:
            inject = set(self.ngram.inject_layers)
            if not self.mudd_gates:
                fail("ngram.enabled needs the per-token MUDD gates: set mudd_gates=true.")
            if self.skip_target_layer in inject:
                fail(
                    f"ngram.inject_layers holds skip_target_layer={self.skip_target_layer}, which adds the "
                    "skip instead of injections; drop it from ngram.inject_layers."
                )
            if self.mudd and n - 1 in inject:
                fail(
                    f"layer {n - 1} injects the n-gram embedding through MUDD coefficient 11; drop it from "
                    "ngram.inject_layers."
                )
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
    """Lanes of the pre gate: XSA strengths (H each), early attention gates (H each), early x0 gates (1 each),
    early n-gram gates (1 each)."""
    h, p = cfg.num_heads, cfg.post_gate_layer
    return (
        h * len(cfg.xsa_layers)
        + h * sum(i < p for i in cfg.attn_gate_layers)
        + sum(i < p for i in cfg.x0_inject_layers)
        + sum(i < p for i in _ngram_layers(cfg))
    )


def _post_lanes(cfg: ModelConfig) -> int:
    """Lanes of the post gate: late attention gates (H each), late x0 gates (1 each), late n-gram gates
    (1 each), the skip gate (1)."""
    h, p = cfg.num_heads, cfg.post_gate_layer
    return (
        h * sum(i >= p for i in cfg.attn_gate_layers)
        + sum(i >= p for i in cfg.x0_inject_layers)
        + sum(i >= p for i in _ngram_layers(cfg))
        + (cfg.skip_target_layer >= 0)
    )


def _ngram_layers(cfg: ModelConfig) -> list[int]:
    """Layers with an n-gram gate lane (none while the table is off)."""
    return list(cfg.ngram.inject_layers) if cfg.ngram.enabled else []


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
    """kind -> layer -> (first lane, width), kinds "xsa", "attn_gate", "x0", "ngram", "skip"."""
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
        kinds = ("xsa", "attn_gate", "x0", "ngram", "skip")
        pre: dict[str, dict[int, tuple[int, int]]] = {k: {} for k in kinds}
        post: dict[str, dict[int, tuple[int, int]]] = {k: {} for k in kinds}
        ngram = _ngram_layers(cfg)
        if cfg.mudd_gates:
            lane = 0
            # upstream's lane order: the n-gram lanes after the x0 lanes in both gates, before the skip lane
            for kind, layers, width in (
                ("xsa", cfg.xsa_layers, h),
                ("attn_gate", cfg.attn_gate_layers, h),
                ("x0", cfg.x0_inject_layers, 1),
                ("ngram", ngram, 1),
            ):
                for i in layers:
                    if i < p:
                        pre[kind][i] = (lane, width)
                        lane += width
            lane = 0
            for kind, layers, width in (
                ("attn_gate", cfg.attn_gate_layers, h),
                ("x0", cfg.x0_inject_layers, 1),
                ("ngram", ngram, 1),
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
