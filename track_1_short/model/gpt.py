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

The hashed n-gram embedding (``model.ngram.enabled``, model/ngram.py): the sum of two signed rows of a
sharded table, gated per token, enters the residual's first ngram.dim channels before the loop (part of
cache[0]), after the sublayer of each ngram.inject_layers layer, and at the MUDD layer through coefficient 11;
off, its gate lanes and coefficient 11 stay in the shapes, unused.

FP8 (``model.fp8.*``, model/fp8.py): the MLP and QKV projections forward and backward and the training
loss's logits GEMM; evaluation forwards stay bf16.

The record's endgame: canonical-token masking at the final validation (model/canonical_mask.py; the trainer
sets ``canonical_mask`` for that one validation) and tail averaging of the weights before it
(optim/tail_average.py).

The training loss may add a prefix-token target per position (model/prefix_targets.py, with
``prefix_targets``) and run over a sampled candidate set of lm_head's columns (model/sampled_softmax.py); both
come per step from the schedule, and evaluation forwards use neither.
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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from track_1_short.model.attention import PackedSequence, causal_self_attention
from track_1_short.model.config import (
    COMPUTE_DTYPES,
    MUDD_COEFS,
    SCATTER_ORDER,
    WORK_ORDER,
    AdamHyper,
    ModelConfig,
    ModelConfigError,
    Topology,
    _mudd_sources,
)
from track_1_short.model.fp8 import FP8State
from track_1_short.model.inputs import check_inputs
from track_1_short.model.layers import (
    document_ids,
    document_starts,
    lookback_starts,
    norm,
    relu2_mlp,
    rope_base_frequencies,
    smear,
    softcap,
    softcapped_cross_entropy_eval_sum,
    softcapped_cross_entropy_sum,
    yarn_rescale_,
)
from track_1_short.model.mlp import fused_relu2_mlp
from track_1_short.model.ngram import NgramRows, NgramTable, new_sign_pool, ngram_embed, ngram_indices
from track_1_short.model.prefix_targets import prefix_table
from track_1_short.model.sampled_softmax import CandidateSets


def _unpack_lanes(gate: Tensor, lanes: dict[str, dict[int, tuple[int, int]]]) -> dict[str, dict[int, Tensor]]:
    """Slice a gate output [T, lanes] into kind -> layer -> [T, width]."""
    return {kind: {i: gate[:, a : a + w] for i, (a, w) in per.items()} for kind, per in lanes.items()}


def _add_ngram(x: Tensor, x_ng: Tensor, gate: Tensor) -> Tensor:
    """x [T, D] with x_ng [T, n] * gate [T, 1] added into its first n channels."""
    n = x_ng.shape[1]
    if n == x.shape[1]:
        return x + x_ng * gate
    return torch.cat([x[:, :n] + x_ng * gate, x[:, n:]], dim=1)


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
        # uint8 [vocab_padded, vocab_padded / 8] (model/canonical_mask.py) while the final validation runs,
        # else None: an attribute, not a buffer, so no checkpoint or state_dict carries it.
        self.canonical_mask: Tensor | None = None
        device = torch.device(device)
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
        if cfg.ngram.enabled:
            # Not a parameter: the table itself is sharded (model/ngram.py NgramTable, attach_ngram); the pool
            # is a fixed draw, saved with the model.
            self.register_buffer(
                "ngram_sign_pool",
                torch.zeros(cfg.ngram.sign_pool_rows, cfg.ngram.dim, dtype=bf16, device=build),
            )
        self.ngram_table: NgramTable | None = None

        # Rotary state per window kind (0 short, 1 long): frequencies and softmax scale, rescaled by YaRN when
        # a training forward sees a window change; the windows (tokens) they were fitted to, -1 = none yet.
        self.register_buffer("rope_freq", rope_base_frequencies(cfg.rotary_dim).repeat(2, 1).to(build))
        self.register_buffer(
            "rope_attn_scale", torch.tensor([cfg.attn_scale_short, cfg.attn_scale_long], device=build)
        )
        self.register_buffer("rope_windows", torch.full((2,), -1, dtype=torch.int64, device=build))
        self.register_buffer("embed_is_split", torch.zeros((), dtype=torch.bool, device=build))
        if cfg.prefix_targets:  # derived from GPT-2's vocabulary, not trained: never in a checkpoint
            table = torch.empty(vp, dtype=torch.int64, device="meta") if build == "meta" else prefix_table(vp)
            self.register_buffer("prefix_table", table, persistent=False)
        self._rope_windows = [-1, -1]  # host mirror of rope_windows (no device sync per forward)
        self._embed_split = False
        self.register_load_state_dict_post_hook(GPT._sync_host_state)
        # FP8 weight copies and scales: derived state outside the state dict (model/fp8.py).
        self._fp8 = FP8State(cfg.fp8) if cfg.fp8.any else None
        # The sampled softmax's candidate sets, built outside a compiled forward (model/sampled_softmax.py).
        self.candidate_sets = CandidateSets(self.topo.vocab_padded)

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
            b[0, 11] = cfg.ngram.gate_init / s  # n-gram lambda (upstream's init, read only with the table)
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
                for a, w in lanes["ngram"].values():
                    b[block, a : a + w] = cfg.ngram.gate_init / s
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
        if cfg.ngram.enabled:  # drawn last, so the other weights are those of a model without the table
            self.ngram_sign_pool.copy_(new_sign_pool(cfg.ngram))

    # -- the n-gram table --

    def attach_ngram(self, table: NgramTable | None) -> None:
        """The table the forward reads its n-gram rows from (this rank's shard and cache); None detaches."""
        if table is not None and (not self.cfg.ngram.enabled or table.cfg.dim != self.cfg.ngram.dim):
            raise ModelConfigError(
                "attach_ngram: the table's model.ngram config does not match this model's (enabled, "
                "dim); build both from one config."
            )
        self.ngram_table = table

    def ngram_indices(self, inputs: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """(row ids [2T], sign rows [2T]) of a batch as the forward hashes it: what a cycle's pull fetches."""
        t = inputs.numel()
        start = lookback_starts(document_starts(cu_seqlens, t), self.cfg.cross_document_lookback)
        return ngram_indices(inputs, start, self.cfg.ngram)

    def ngram_rows(self, rows: Tensor, signs: Tensor) -> tuple[NgramRows, Tensor]:
        """(the looked-up rows, sign rows [2T]) of a batch's :meth:`ngram_indices`, for :meth:`forward`'s
        ``ngram``: the cache lookup (a search and data-dependent checks a compiler cannot trace) runs here,
        outside a compiled forward, and the gradient still lands on the table's sink."""
        return self._attached_table().lookup(rows, check=self.cfg.check_inputs), signs

    def _attached_table(self) -> NgramTable:
        if self.ngram_table is None:
            raise ModelConfigError(
                "model.ngram.enabled=true but no n-gram table is attached: build an NgramTable and call "
                "model.attach_ngram(table), then pull the batch's rows (or set model.ngram.enabled=false)."
            )
        return self.ngram_table

    @torch.compiler.disable
    def _ngram(self, tokens: Tensor, doc_start: Tensor) -> Tensor:
        """The n-gram embedding [T, ngram.dim] of a batch (the table's dtype), read through the cache (the
        path of a forward given no ``ngram``: validation, tests; a graph break if compiled)."""
        rows, signs = ngram_indices(tokens, doc_start, self.cfg.ngram)
        looked_up = self._attached_table().lookup(rows, check=self.cfg.check_inputs)
        return ngram_embed(looked_up, self.ngram_sign_pool, signs, self.cfg.ngram.embed_impl)

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

    # -- FP8 weight copies --

    @torch.compiler.disable
    @torch.no_grad()
    def refresh_fp8(self) -> None:
        """Requantise the FP8 weight copies (model.fp8) from the weights: after every optimizer update, and
        after the weights were built or loaded. A no-op with every FP8 path off."""
        f = self._fp8
        if f is None:
            return
        cfg = self.cfg.fp8
        qkv = None
        if cfg.qkv:
            qkv = {layer: torch.cat((qk_w, v_w)) for layer, (qk_w, v_w, _) in self._attn_weights().items()}
        f.refresh(self.mlp_bank if cfg.mlp else None, qkv, self.lm_head if cfg.lm_head else None)

    def rearm_fp8(self) -> None:
        """After the weights were reset (the warmup's restore): delayed scales restart, then refresh."""
        if self._fp8 is not None:
            self._fp8.rearm()
            self.refresh_fp8()

    def _fp8_now(self) -> FP8State | None:
        """The FP8 state when this forward trains with FP8 (evaluation forwards never do)."""
        if self._fp8 is None or not (self.training and torch.is_grad_enabled()):
            return None
        if not self._fp8.ready:
            self.refresh_fp8()
        return self._fp8

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

    def check_inputs(
        self, inputs: Tensor, targets: Tensor | None, cu_seqlens: Tensor, windows, mtp_weights
    ) -> None:
        """Raise ModelConfigError naming the bad argument, before any compute (model/inputs.py)."""
        check_inputs(self, inputs, targets, cu_seqlens, windows, mtp_weights)

    # -- forward --

    def forward(
        self,
        inputs: Tensor,
        targets: Tensor,
        cu_seqlens: Tensor,
        windows,
        mtp_weights: list[float] | Tensor | None = None,
        prefix_weight: float | Tensor | None = None,
        candidates: Tensor | None = None,
        ngram: tuple[NgramRows, Tensor] | None = None,
    ) -> Tensor:
        """Summed multi-token softcapped CE over the T tokens (fp32 0-D); mtp_weights None = [1.0] (plain CE).

        inputs int32/int64 [T] of whole documents, targets int64 [T], cu_seqlens int32 [n_docs + 1] (it may
        end in repeated T entries: empty documents, so that its length stays fixed), windows (short, long) in
        blocks of block_size tokens (two ints, or an int [2] tensor on the model's device: a compiled model
        then takes every stage's windows with one graph; a training forward leaves the rotary state to the
        caller's ``follow_windows``, which the input checks verify), mtp_weights: weight of predicting t+1,
        t+2, ... (a list, or an fp32 [K] tensor on the model's device: a compiled model then takes new
        weights without a new graph), ngram: the batch's n-gram rows and sign rows as :meth:`ngram_rows` reads
        them outside the forward (a compiled model then calls the n-gram embedding's custom op instead of
        breaking its graph on the lookup), or None to read them here.

        Training forwards only (an evaluation forward ignores them): prefix_weight, the prefix-token target's
        weight (a float, or an fp32 tensor on the model's device: no new graph when it changes; needs
        ``prefix_targets``; None: no term); candidates, the sampled softmax's candidate set as
        ``candidate_sets.build`` makes it (None: the full softmax).
        """
        mtp = [1.0] if mtp_weights is None else mtp_weights
        if self.cfg.check_inputs:
            listed = mtp.tolist() if isinstance(mtp, Tensor) else [float(w) for w in mtp]
            self.check_inputs(inputs, targets, cu_seqlens, windows, listed)
        if self.training and torch.is_grad_enabled() and not isinstance(windows, Tensor):
            self.follow_windows(windows)  # a training step, not an evaluation (a tensor: the caller's job)
        hidden = self.hidden(inputs, cu_seqlens, windows, ngram)
        cfg, fp8 = self.cfg, self._fp8_now()
        # An evaluation forward scores its logits with upstream's validation numerics (softcap in the compute
        # dtype, then fp32 CE); a training forward with the chunked fused loss (fp32 softcap).
        evaluation = not (self.training and torch.is_grad_enabled())
        loss = softcapped_cross_entropy_eval_sum if evaluation else softcapped_cross_entropy_sum
        args = (cfg.logit_cap, cfg.logit_shift, cfg.logit_temperature, cfg.loss_chunk_rows)
        if evaluation:  # validation never samples and scores next tokens only
            if self.canonical_mask is not None:
                return loss(hidden, self.lm_head, targets, mtp, *args, self.canonical_mask, inputs.long())
            return loss(hidden, self.lm_head, targets, mtp, *args)
        lm_fp8 = (
            (fp8.lm_head_input(hidden), fp8.lm_col) if fp8 is not None and cfg.fp8.lm_head else (None, None)
        )
        extra = self._loss_targets(targets, prefix_weight, candidates)
        return loss(hidden, self.lm_head, targets, mtp, *args, cfg.loss_impl, *lm_fp8, **extra)

    def _loss_targets(self, targets: Tensor, prefix_weight, candidates: Tensor | None) -> dict:
        """The training loss's prefix targets and candidate set, as keyword arguments of the loss."""
        extra: dict = {}
        if prefix_weight is not None:
            if not self.cfg.prefix_targets:
                raise ValueError(
                    "a prefix weight was given, but the model has no prefix table: set "
                    "model.prefix_targets=true."
                )
            extra.update(prefix_targets=self.prefix_table[targets], prefix_weight=prefix_weight)
        if candidates is not None:
            extra["candidates"] = candidates
        return extra

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

    def hidden(
        self, inputs: Tensor, cu_seqlens: Tensor, windows, ngram: tuple[NgramRows, Tensor] | None = None
    ) -> Tensor:
        """The final normed hidden states [T, D] (compute dtype) of one packed batch; ``ngram`` as
        :meth:`forward`'s."""
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
            cu_seqlens.to(torch.int32) if cfg.attention_impl == "fa4" else None,
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
        lanes: dict[str, dict[int, Tensor]] = {k: {} for k in topo.pre_lanes}
        if cfg.mudd_gates:
            lanes = _unpack_lanes(self._gate(x0, 0), topo.pre_lanes)
        x_ng = None
        if cfg.ngram.enabled:
            if ngram is None:
                x_ng = self._ngram(tokens, doc_start).to(cd)
            else:  # one custom op: materialised once, its gathers never recomputed in its consumers
                x_ng = ngram_embed(ngram[0], self.ngram_sign_pool, ngram[1], cfg.ngram.embed_impl).to(cd)
            if 0 in lanes["ngram"]:  # layer 0's injection comes before the loop: it is part of cache[0]
                x = _add_ngram(x, x_ng, lanes["ngram"][0])

        cache = {0: x}
        late_in = None  # norm(cache[late_input_layer]), shared by every later attention layer
        attn_w = self._attn_weights()
        mlp = self.mlp_bank.unbind(0)
        fp8 = self._fp8_now()
        fp8_mlp = fp8 if fp8 is not None and cfg.fp8.mlp else None
        fp8_qkv = fp8 if fp8 is not None and cfg.fp8.qkv else None

        def mlp_out(inp: Tensor, slot: int) -> Tensor:
            if fp8_mlp is not None:
                return fp8_mlp.mlp_forward(inp, slot, mlp[slot][0], mlp[slot][1])
            if cfg.mlp_impl == "triton":
                return fused_relu2_mlp(inp, mlp[slot][0], mlp[slot][1])
            return relu2_mlp(inp, mlp[slot][0], mlp[slot][1])

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
                if i in lanes["ngram"] and i:
                    x = _add_ngram(x, x_ng, lanes["ngram"][i])
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
                    qkv_fp8=fp8_qkv.qkv_forward(i) if fp8_qkv is not None else None,
                )
                if mu is not None:
                    x = mu[:, 8:9] * x + mu[:, 9:10] * out + mu[:, 10:11] * cache[0]
                    if x_ng is not None:
                        x = _add_ngram(x, x_ng, mu[:, 11:12])
                else:
                    x = x * resid[i, 0] + out
                    if i in lanes["x0"]:
                        x = x + x0 * lanes["x0"][i]
                    if i in lanes["ngram"] and i:
                        x = _add_ngram(x, x_ng, lanes["ngram"][i])
            # MLP sublayer
            if i in cfg.no_mlp_layers:
                x = x * resid[i, 1]
            else:
                mlp_in = norm(x)
                out = mlp_out(mlp_in, i)
                post_mlp = mu[:, 13:14] if mu is not None else post[i, 1]
                if i == cfg.parallel_mlp_layer:
                    p = L  # the parallel MLP's bank slot
                    out = out + mlp_out(mlp_in, p)
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


def param_inventory(cfg: ModelConfig) -> dict[str, tuple[dict, tuple[int, ...], torch.dtype]]:
    """label -> (param-table entry, shape, dtype) of the GPT that ``cfg`` builds, read from a model on the
    meta device (no memory, no init): the one source of the table for benchmarks and tests."""
    model = GPT(cfg, device="meta")
    table = model.param_table()
    return {label: (table[label], tuple(p.shape), p.dtype) for label, p in model.label_parameters().items()}
