"""Flow matching on continuous targets (latents): rectified flow as SD3 / BAGEL train it.

Batch fields it reads (built by the data pipeline or the family's prepare_batch, on the host):
  * ``latents``     [B, S, C] float: the clean target x0 at latent positions (any value elsewhere; not read there);
  * ``latent_mask`` [B, S] bool: the positions whose latent is a target;
  * ``noise_unit``  [B, S] int: the id of the noise unit (a latent segment / one image) a position belongs to,
    -1 elsewhere; the positions of one unit share one t. Units are (row, id) pairs: ids need only be unique
    within a row (0 .. U-1). A latent position of unit -1 is a clean condition (Wan2.2 TI2V's first frame, the
    image): the model sees its x0 at t = 0, and it is no target.

``prepare`` (host, per micro-batch, noise from a CPU generator seeded by (training.seed, step, global micro-batch
slot), so the draws are the same for any dp world and bitwise on resume) adds:
  * ``noisy_latents`` [B, S, C] (latents' dtype): x_t = (1 - t) x0 + t eps at target positions, x0 at clean
    conditions, 0 elsewhere, with eps ~ N(0, 1) per element;
  * ``timesteps``     [B, S] fp32: the t of each position's unit, 0 elsewhere;
  * ``flow_target``   [B, S, C] fp32 (or the latents' dtype when wider): the velocity eps - x0 (0 elsewhere);
  * ``flow_weight``   [B, S] fp32: the per-unit loss weight w(t) (``weighting``; 1 with "none"), 0 elsewhere;
  * ``num_latent_elements`` []: latent positions x C, this term's normalizer share.

The model gets ``noisy_latents``, ``timesteps`` and ``latent_mask`` as forward keywords (besides input_ids and the
family's own keys); ``latents``, ``noise_unit``, ``flow_target``, ``flow_weight`` and the count stay with the loss.
It is asked for one thing, through the family hook

    model.predict_velocity(out, batch) -> [B, S, C]    # the prediction at every position (read at latent ones)

called inside the forward (``out`` is the family's ModelOutput with ``hidden``, ``batch`` the device batch).
Loss term ``"mse"``: sum over latent positions and channels of w * (pred - (eps - x0))^2, divided by the global
count of latent elements (every micro-batch of every dp rank): the mean squared error.

t samplers (``sampler``), per unit, then the timestep shift t' = shift * t / (1 + (shift - 1) * t) (``shift``; 1:
none), as diffusers' FlowMatchEulerDiscreteScheduler(shift=...) shifts its sigmas:
  * "uniform":      t = u, u ~ U[0, 1) (with ``shift``: Wan's training, the continuous form of diffusers' scheduler
    table, whose 1000 training sigmas are the shifted i / 1000);
  * "logit_normal": t = sigmoid(mean + std * n), n ~ N(0, 1) (SD3; with ``shift``, SD3's shifted schedule);
  * "shifted":      t = sigmoid(n), then the shift (BAGEL's name: "logit_normal" with mean 0, std 1).
With ``t_range`` = (lo, hi) other than (0, 1), t is drawn from the same distribution restricted to [lo, hi] (a
Wan2.2 A14B expert trains on its side of the pipeline's boundary): each sampler's t is a monotone function of
u ~ U[0, 1) (the logit-normal's through the normal's inverse CDF), so u is drawn uniformly between the preimages of
lo and hi.
Weightings (``weighting``), per unit: "none" (1), "cosmap" (SD3's 2 / (pi (1 - 2t + 2t^2))), "sigma_sqrt"
(diffusers' compute_loss_weighting_for_sd3: 1 / t^2; large near t = 0) or "bell" (DiffSynth-Studio's Wan training
weight: exp(-2 (t - 1/2)^2) less its minimum over its scheduler's 1000 training sigmas, linspace(1, 0.003 / 1.002)
shifted by ``shift``, and scaled to mean 1 over them).

Context parallelism cuts the keys ``prepare`` adds on S (``seq_keys``, with their trailing dims); the batch fields
are the family's to declare in its BatchSchema (``latents`` with trailing ("C",)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_mm.nn.attention import KINDS
from titan_mm.nn.flow import time_shift
from titan_mm.objectives.base import Objective, noise_generator
from titan_mm.registry import SeqKey

SAMPLERS = ("uniform", "logit_normal", "shifted")


def _bell(t: torch.Tensor, shift: float) -> torch.Tensor:
    """DiffSynth's bell-shaped, mean-normalized weight of t over its shifted training sigmas (module docstring)."""
    grid = torch.linspace(1.0, 0.003 / 1.002, 1000, dtype=torch.float64)
    y = torch.exp(-2.0 * (time_shift(grid, shift) - 0.5) ** 2)
    low, mean = y.min(), (y - y.min()).mean()
    return ((torch.exp(-2.0 * (t.double() - 0.5) ** 2) - low) / mean).to(t.dtype)


WEIGHTINGS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {  # (t, shift) -> w(t)
    "none": lambda t, shift: torch.ones_like(t),
    "cosmap": lambda t, shift: 2.0 / (math.pi * (1.0 - 2.0 * t + 2.0 * t * t)),
    "sigma_sqrt": lambda t, shift: t.pow(-2.0),
    "bell": _bell,
}


@dataclass(frozen=True)
class FlowMatching(Objective):
    """Velocity MSE on the latents the batch marks as targets (module docstring)."""

    sampler: str = "logit_normal"
    shift: float = 1.0
    """The timestep shift applied after any sampler (BAGEL's timestep_shift, diffusers' scheduler shift)."""
    mean: float = 0.0
    """"logit_normal": the normal's mean."""
    std: float = 1.0
    """"logit_normal": the normal's standard deviation."""
    weighting: str = "none"
    seed: int = 0
    t_range: tuple[float, float] = (0.0, 1.0)
    """The t it trains on: the sampler's distribution restricted to [lo, hi] (module docstring)."""
    mask: str | None = None
    """The attention mask kind it trains with (titan_mm.nn.attention KINDS: a video DiT's "bidirectional"); None: the
    family's segment description decides."""

    terms = ("mse",)
    fields = ("latents", "latent_mask", "noise_unit")
    loss_keys = ("latents", "noise_unit", "flow_target", "flow_weight", "num_latent_elements")
    host_keys = ("num_latent_elements",)
    seq_keys = (SeqKey("noisy_latents", ("C",), "float32"), SeqKey("timesteps", dtype="float32"),
                SeqKey("flow_target", ("C",), "float32"), SeqKey("flow_weight", dtype="float32"))

    @property
    def mask_kind(self) -> str | None:
        return self.mask

    def __post_init__(self):
        if self.mask is not None and self.mask not in KINDS:
            raise ValueError(f"flow matching mask {self.mask!r} is unknown; use one of {KINDS}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"flow matching sampler {self.sampler!r} is unknown; use one of {SAMPLERS}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"flow matching weighting {self.weighting!r} is unknown; use one of {sorted(WEIGHTINGS)}")
        lo, hi = self.t_range
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"flow matching t_range {tuple(self.t_range)} needs 0 <= lo < hi <= 1")
        if self.shift <= 0 or self.std <= 0:
            raise ValueError(f"flow matching needs shift > 0 and std > 0, got shift {self.shift}, std {self.std}")

    def sample_t(self, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        """t [shape] fp32 in [0, 1] from the sampler, shifted (and restricted to t_range)."""
        if tuple(self.t_range) != (0.0, 1.0):
            a, b = (self._u_of_t(t) for t in self.t_range)
            return self._t_of_u(a + (b - a) * torch.rand(shape, generator=g, dtype=torch.float64)).float()
        if self.sampler == "uniform":
            s = torch.rand(shape, generator=g, dtype=torch.float32)
        else:
            n = torch.randn(shape, generator=g, dtype=torch.float32)
            s = torch.sigmoid(n if self.sampler == "shifted" else self.mean + self.std * n)
        return s if self.shift == 1.0 else time_shift(s, self.shift)

    def _t_of_u(self, u: torch.Tensor) -> torch.Tensor:
        """The sampler's t as the monotone function of u ~ U[0, 1) (fp64), shifted."""
        s = u if self.sampler == "uniform" else torch.sigmoid(
            (0.0 if self.sampler == "shifted" else self.mean) + (1.0 if self.sampler == "shifted" else self.std)
            * math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0))
        return time_shift(s, self.shift)

    def _u_of_t(self, t: float) -> float:
        """The inverse of :meth:`_t_of_u` (its u at a bound t in [0, 1])."""
        s = t / (self.shift - (self.shift - 1.0) * t)  # the shift's inverse
        if self.sampler == "uniform" or s in (0.0, 1.0):
            return s
        mean, std = (0.0, 1.0) if self.sampler == "shifted" else (self.mean, self.std)
        return 0.5 * (1.0 + math.erf((math.log(s / (1.0 - s)) - mean) / (std * math.sqrt(2.0))))

    def noise(self, batch: dict[str, Any], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(t [B, U] per (row, unit), eps [B, S, C]) for ``batch``, drawn in this order from ``g``."""
        x0 = batch["latents"]
        units = int(batch["noise_unit"].max()) + 1 if batch["noise_unit"].numel() else 0
        t_BU = self.sample_t((x0.shape[0], max(units, 1)), g)
        eps = torch.randn(tuple(x0.shape), generator=g, dtype=torch.float32)
        return t_BU, eps

    def corrupt(self, batch: dict[str, Any], t_BU: torch.Tensor, eps_BSC: torch.Tensor) -> dict[str, Any]:
        """The micro-batch the model trains on, for per-unit times ``t_BU`` and noise ``eps_BSC``."""
        x0 = batch["latents"]
        dt = torch.promote_types(x0.dtype, torch.float32)  # bf16 latents mix in fp32; fp64 ones stay fp64
        latent = batch["latent_mask"].bool()
        mask = latent & (batch["noise_unit"] >= 0)
        t_BS = torch.where(mask, t_BU.gather(1, batch["noise_unit"].clamp(min=0).long()), 0.0)
        x0f, eps, t3, m3 = x0.to(dt), eps_BSC.to(dt), t_BS[..., None].to(dt), mask[..., None]
        clean = (latent & ~mask)[..., None]  # clean conditions (unit -1): x0 as it is, t = 0, no loss
        out = dict(batch)
        noisy, target = (1.0 - t3) * x0f + t3 * eps, eps - x0f
        if not bool(mask.all()):  # else every position is a target: the wheres below would copy (host time a step)
            noisy, target = torch.where(m3, noisy, torch.where(clean, x0f, 0.0)), torch.where(m3, target, 0.0)
        out["noisy_latents"] = noisy.to(x0.dtype)
        out["timesteps"] = t_BS
        out["flow_target"] = target
        out["flow_weight"] = torch.where(mask, WEIGHTINGS[self.weighting](t_BS, self.shift), 0.0)
        out["num_latent_elements"] = torch.tensor(int(mask.sum()) * x0.shape[-1], dtype=torch.int64)
        return out

    def prepare(self, micro_batches: list[dict], step: int, dp_rank: int = 0) -> list[dict]:
        n = len(micro_batches)
        out = []
        for i, mb in enumerate(micro_batches):
            self.check_batch(mb)
            g = noise_generator(self.seed, step, dp_rank * n + i, "/flow_matching")
            out.append(self.corrupt(mb, *self.noise(mb, g)))
        return out

    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        return {"mse": int(batch["num_latent_elements"])}

    def loss_sums(self, model, out, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        pred = model.predict_velocity(out, batch)
        target = batch["flow_target"]
        err = (pred.to(torch.promote_types(pred.dtype, target.dtype)) - target).square().sum(-1)  # [B, S]
        # where, not a product: a prediction outside the latents is never read, whatever it holds
        return {"mse": torch.where(batch["flow_weight"] != 0, err * batch["flow_weight"], 0.0).sum()}
