"""Tail averaging: the run ends on a blend of late-training averages of the weights, not the last iterate.

Four fp32 accumulators follow the last few hundred steps, each rank over its own optimizer shard (the dim-0
rows AnvilAndAdam updates there; every tail label is sharded). After the last step, on the clock and before
the final validation, each is shipped into its weights in the order below, the shipped weights are
all-gathered, and embed, lm_head, mlp_bank, qk_bank and vo_bank are rescaled to the Frobenius norms they had
before the ship (averaging shrinks norms; the model was trained at the un-averaged scale).

  accumulator      labels             ticks (steps s of n, s >= n - window)          ship
  tail-ema         lm_head, embed     s = n - window, then Adam steps; rate          lerp(w, ema, ema_blend)
                                      1 - (1 - r)^adam_every, r = 2 / (window + 1),
                                      r itself on the last step
  tail-avg         vo_bank, mlp_bank  (n - 1 - s) % avg_period == 0; rate avg_rate   the average
  value-embed-avg  value_embeds       the steps whose update writes it; avg_rate     the average
  bank-blend       qk, vo, mlp banks  s % period == 1 or s >= n - 2;                 lerp(w, ema, b)
                                      rate 2 / (window // period + 1)

The first tick of each accumulator copies the weights (seeds). bank-blend ships last, so on vo/mlp it lerps
from the tail average, by ``bank_blend - richardson_w``: a seeded EMA lags the last iterate, and
(1 - B) A + B X + w (A - X) = lerp(A, X, B - w). qk_bank blends by ``bank_blend``.

Upstream: ``track_1_short/tail_average.py`` of KellerJordan/modded-nanogpt (record #360 of ANVIL2: +20.2
millinats of val loss, +0.52 s of wall time), its constants the defaults here. Beyond upstream: the
accumulators are part of the checkpoint (gathered whole, so they reshard to any world size) and the windows
are config; a window longer than the run is refused (:func:`check_tail`), never clipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from track_1_short.optim.anvil import value_embed_cadence

NORM_LABELS = ("embed", "lm_head", "mlp_bank", "qk_bank", "vo_bank")
SHIP_ORDER = ("tail-ema", "tail-avg", "value-embed-avg", "bank-blend")


@dataclass
class TailConfig:
    """The end-of-run weight averaging (Hydra group ``tail``); upstream's constants by default."""

    enabled: bool = False
    """Ship the averaged weights before the final validation (record: true); false = the last iterate."""
    ema_window: int = 298
    """Steps of the lm_head/embed EMA (its rate 2 / (window + 1))."""
    ema_blend: float = 0.65
    """lm_head and embed become lerp(last, ema, ema_blend)."""
    avg_window: int = 250
    """Steps of the vo/mlp tail average."""
    avg_period: int = 4
    """It ticks every this many steps, counted back from the last step."""
    avg_rate: float = 4.0 / 53.0
    """Its lerp rate per tick (upstream's tuned value, not derived from the window)."""
    value_embed_window: int = 250
    """Steps of the value_embeds average; it ticks on value_embeds' update steps at ``avg_rate``."""
    bank_blend_window: int = 298
    """Steps of the bank EMA (qk, vo, mlp)."""
    bank_blend_period: int = 4
    """It ticks on steps s % period == 1 and on the last two steps; rate 2 / (window // period + 1)."""
    bank_blend: float = 0.55
    """qk_bank becomes lerp(w, ema, bank_blend); vo/mlp lerp by bank_blend - richardson_w."""
    richardson_w: float = 0.2007
    """Upstream's Richardson correction on vo/mlp's blend."""


def check_tail(cfg: TailConfig, total_steps: int, adam_every: int) -> None:
    """Raise ValueError naming the ``tail.*`` field and the fix (only when enabled)."""
    if not cfg.enabled:
        return
    for name in ("ema_window", "avg_window", "value_embed_window", "bank_blend_window"):
        w = getattr(cfg, name)
        if not 1 <= w <= total_steps:
            raise ValueError(
                f"tail.{name}={w} must lie in [1, {total_steps}] (the run's steps): windows are not clipped. "
                f"Scale it to the schedule (e.g. upstream's x {total_steps}/1194) or set tail.enabled=false."
            )
    for name in ("avg_period", "bank_blend_period"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"tail.{name}={getattr(cfg, name)} must be >= 1.")
    for name in ("ema_blend", "avg_rate", "bank_blend", "richardson_w"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"tail.{name}={v} must lie in [0, 1].")
    if cfg.richardson_w > cfg.bank_blend:
        raise ValueError(
            f"tail.richardson_w={cfg.richardson_w} must not exceed tail.bank_blend={cfg.bank_blend}."
        )


class TailAverages:
    """The accumulators over this rank's shards: :meth:`tick` after every step, :meth:`ship` at the end."""

    def __init__(self, cfg: TailConfig, optimizer, total_steps: int) -> None:
        self.cfg, self.opt, self.n = cfg, optimizer, total_steps
        self.adam_every = optimizer.cfg.adam_every
        ema_r = 2.0 / (cfg.ema_window + 1)
        bank_r = 2.0 / (cfg.bank_blend_window // cfg.bank_blend_period + 1)
        low = cfg.bank_blend - cfg.richardson_w
        present = set(optimizer.params)
        # tag -> (labels, window, rate(step) or None, blend per label: None = replaced by the average)
        specs = {
            "tail-ema": (("lm_head", "embed"), cfg.ema_window, self._ema_rate(ema_r), cfg.ema_blend),
            "tail-avg": (("vo_bank", "mlp_bank"), cfg.avg_window, self._avg_rate, None),
            "value-embed-avg": (("value_embeds",), cfg.value_embed_window, self._value_embed_rate, None),
            "bank-blend": (
                ("qk_bank", "vo_bank", "mlp_bank"),
                cfg.bank_blend_window,
                lambda s: bank_r if s % cfg.bank_blend_period == 1 or s >= self.n - 2 else None,
                {"qk_bank": cfg.bank_blend, "vo_bank": low, "mlp_bank": low},
            ),
        }
        self.labels: dict[str, tuple[str, ...]] = {}
        self.windows: dict[str, int] = {}
        self.rates: dict[str, object] = {}
        self.blends: dict[str, dict[str, float | None]] = {}
        # Allocated now, not at the first tick: that would be on the clock.
        self.bufs: dict[str, dict[str, torch.Tensor]] = {}
        self.seeded: dict[str, dict[str, bool]] = {}
        for tag, (labels, window, rate, blend) in specs.items():
            labels = tuple(label for label in labels if label in present)
            self.labels[tag], self.windows[tag], self.rates[tag] = labels, window, rate
            self.blends[tag] = {
                label: (blend.get(label) if isinstance(blend, dict) else blend) for label in labels
            }
            self.bufs[tag] = {
                label: torch.zeros_like(self._shard(label), dtype=torch.float32) for label in labels
            }
            self.seeded[tag] = dict.fromkeys(labels, False)
        self.norm_labels = tuple(label for label in NORM_LABELS if label in present)

    # -- cadences --
    def _ema_rate(self, r: float):
        ae = self.adam_every
        compounded = -math.expm1(ae * math.log1p(-r))  # ae per-step EMA updates of an unchanged weight

        def rate(s: int) -> float | None:
            if s == self.n - self.cfg.ema_window or s == self.n - 1:
                return r
            return compounded if s % ae == ae - 1 else None

        return rate

    def _avg_rate(self, s: int) -> float | None:
        return self.cfg.avg_rate if (self.n - 1 - s) % self.cfg.avg_period == 0 else None

    def _value_embed_rate(self, s: int) -> float | None:
        ae = self.adam_every
        if s % ae != ae - 1 or not value_embed_cadence(self.opt.cfg, s, (0.0, 0.0), 1.0)[0]:
            return None  # value_embeds did not change: a tick would count the same weights twice
        return self.cfg.avg_rate

    # -- this rank's rows --
    def _shard(self, label: str) -> torch.Tensor:
        """This rank's real rows of the parameter, as the optimizer shards it (banks as [n, rows, cols])."""
        sh = self.opt.shards[label]
        return self.opt._sharded_view(label)[sh.start : sh.real_stop]

    # -- the timed loop --
    @torch.no_grad()
    def tick(self, step: int) -> None:
        """Fold the weights after ``step``'s update into each accumulator whose window and cadence hold it."""
        for tag, labels in self.labels.items():
            if step < self.n - self.windows[tag]:
                continue
            rate = self.rates[tag](step)
            if rate is None:
                continue
            for label in labels:
                buf, w = self.bufs[tag][label], self._shard(label)
                if not self.seeded[tag][label]:
                    buf.copy_(w)
                    self.seeded[tag][label] = True
                else:
                    buf.lerp_(w.float(), rate)

    @torch.no_grad()
    def ship(self) -> dict[str, float]:
        """Write the accumulators into the weights (SHIP_ORDER), gather them, restore the norms; returns
        each rescaled label's norm ratio (before / after the ship)."""
        before = self.norms()
        self.write_and_gather()
        return self.restore_norms(before)

    def norms(self) -> dict[str, float]:
        # Every rank holds the whole weights here (the optimizer gathered them): the same norms everywhere. In
        # fp64: an fp32 sum of millions of squares is good to ~1e-6, which the restored norm would inherit.
        return {
            label: torch.linalg.vector_norm(self.opt.params[label].data, dtype=torch.float64).item()
            for label in self.norm_labels
        }

    @torch.no_grad()
    def write_and_gather(self) -> None:
        shipped: list[str] = []
        for tag in SHIP_ORDER:
            for label in self.labels[tag]:
                if not self.seeded[tag][label]:
                    raise RuntimeError(f"tail averaging: {tag} never ticked {label} (its window is empty).")
                w, avg, b = self._shard(label), self.bufs[tag][label], self.blends[tag][label]
                w.copy_(avg if b is None else torch.lerp(w.float(), avg, b))
                if label not in shipped:
                    shipped.append(label)
        for label in shipped:  # one gather per shipped weight, in a fixed order on every rank
            sh = self.opt.shards[label]
            full = self.opt._sharded_view(label)
            full.copy_(sh.gather_rows(sh.take_rows(full)))

    @torch.no_grad()
    def restore_norms(self, before: Mapping[str, float]) -> dict[str, float]:
        ratios = {}
        after = self.norms()
        for label in self.norm_labels:
            ratios[label] = before[label] / after[label] if after[label] > 0 else 1.0
            # A Python float: the product is rounded to the weight's dtype once, on the store.
            self.opt.params[label].data.mul_(ratios[label])
        return ratios

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Label-keyed, every accumulator gathered whole on the CPU: loads at any world size. A collective."""
        out = {}
        for tag, labels in self.labels.items():
            for label in labels:
                sh, buf = self.opt.shards[label], self.bufs[tag][label]
                chunk = torch.zeros((sh.chunk, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
                chunk[: sh.n_real] = buf
                whole = sh.gather_rows(chunk).to("cpu", copy=True)
                out[f"{tag}/{label}"] = {"buf": whole, "seeded": self.seeded[tag][label]}
        return out

    def check_state_dict(self, sd: object) -> None:
        """Raise ValueError unless ``sd`` holds exactly this run's accumulators, shaped as here."""
        want = {f"{tag}/{label}" for tag, labels in self.labels.items() for label in labels}
        if not isinstance(sd, Mapping) or set(sd) != want:
            got = sorted(sd) if isinstance(sd, Mapping) else type(sd).__name__
            raise ValueError(
                f"the checkpoint's tail accumulators ({got}) are not this run's ({sorted(want)}): resume "
                "with the tail config it was written with."
            )
        for key in sorted(want):
            label = key.split("/")[1]
            shape, buf = self.opt.shards[label].full_shape, sd[key].get("buf")
            if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != shape or buf.dtype != torch.float32:
                raise ValueError(
                    f"tail accumulator {key} is not float32 {shape}: resume with the model it was written "
                    "with."
                )

    def load_state_dict(self, sd: Mapping) -> None:
        """Copy this rank's rows of a checked state dict (:meth:`check_state_dict`) in place."""
        self.check_state_dict(sd)
        for tag, labels in self.labels.items():
            for label in labels:
                sh, entry = self.opt.shards[label], sd[f"{tag}/{label}"]
                self.bufs[tag][label].copy_(entry["buf"][sh.start : sh.real_stop])
                self.seeded[tag][label] = bool(entry["seeded"])
