"""From router logits to decisions: 2-way Gumbel-softmax, the straight-through hard decision, and temperature
schedules (seed 000, Section 3.2 and Appendix E; seed 003, Section 3.1).

Channel 0 of the last dimension is full attention (FA), channel 1 sparse attention (SA), as in Elastic Attention's
Eq. 6 (r_hard = 0: FA, r_hard = 1: SA). The authors' code numbers them the other way round; only the convention
differs.

Choices:

* Two logits and two independent Gumbel samples (Section 3.2 of both papers; the authors' code with
  ``use_softmax``), not the single-logit Gumbel-sigmoid of Elastic's Appendix E.2.
* The straight-through decision is ``one_hot(argmax) + soft - soft.detach()``: the forward value is exactly 0 or 1
  and the backward is the gradient of the soft probabilities (Elastic's Eq. 7 prints ``soft + [soft - detach]``,
  a typo for this). Training uses it for both routers, as both authors' codes do; Flux's paper mixes the outputs
  with the soft weight instead (``hard=False`` here).
* Inference (``noise=False``): the argmax of the logits, no noise, deterministic; a tie goes to full attention.
* Gumbel noise is ``-log(-log(u))`` with ``u`` uniform, clamped away from 0 and 1 in float32 (the paper adds an
  epsilon inside both logs instead; the two agree to float precision).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flexsparse.validation import as_float, as_int

FULL, SPARSE = 0, 1
"""Channels of the last logit dimension."""


def gumbel_noise(shape: torch.Size | tuple[int, ...], *, device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
    """Independent Gumbel(0, 1) samples, float32 ``shape``."""
    tiny = torch.finfo(torch.float32).tiny
    u = torch.rand(shape, device=device, generator=generator, dtype=torch.float32)
    u = u.clamp(min=tiny, max=1.0 - torch.finfo(torch.float32).eps)
    return -torch.log(-torch.log(u))


def relaxed_decisions(logits: Tensor, tau: float | Tensor = 1.0, *, hard: bool = True, noise: bool = True,
                      gumbel: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Routing weights ``[..., 2]`` (full, sparse) from logits ``[..., 2]``.

    Args:
        logits: ``[..., 2]`` router logits (channel 0 full, channel 1 sparse).
        tau: temperature > 0 (a float or a 0-d tensor).
        hard: forward exactly one-hot (straight-through: gradient of the soft probabilities); False: the soft
            probabilities themselves.
        noise: add Gumbel noise (training); False: no noise (with ``hard``: the deterministic argmax).
        gumbel: the noise to add, ``[..., 2]`` (for reproducible checks); sampled when None.
        generator: for sampling the noise.

    Returns:
        ``[..., 2]`` weights (float32, or float64 for float64 logits) summing to 1 over the last dimension, differentiable in ``logits``.
    """
    if not isinstance(logits, Tensor) or logits.dim() < 1 or logits.shape[-1] != 2:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a tensor [..., 2] (full, sparse), got {shape}")
    if not isinstance(tau, Tensor):
        tau = as_float("tau", tau, positive=True)
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if noise:
        if gumbel is None:
            gumbel = gumbel_noise(scores.shape, device=scores.device, generator=generator)
        elif gumbel.shape != scores.shape:
            raise ValueError(f"gumbel must have the logits' shape {tuple(scores.shape)}, got {tuple(gumbel.shape)}")
        scores = scores + gumbel
    soft = F.softmax(scores / tau, dim=-1)
    if not hard:
        return soft
    channels = torch.arange(2, device=soft.device)
    one_hot = (soft.argmax(-1, keepdim=True) == channels).to(soft.dtype)  # F.one_hot syncs on CUDA to check
    return one_hot + (soft - soft.detach())


def decisions(logits: Tensor) -> Tensor:
    """Deterministic inference decision: True where sparse attention wins, bool ``[...]`` from ``[..., 2]``.

    A tie goes to full attention."""
    if not isinstance(logits, Tensor) or logits.dim() < 1 or logits.shape[-1] != 2:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a tensor [..., 2] (full, sparse), got {shape}")
    return logits[..., SPARSE] > logits[..., FULL]


# ----- temperature schedules ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CosineAnneal:
    """Temperature of the authors' code (both papers): from ``start`` down to ``end`` along half a cosine over the
    first ``fraction`` of ``total_steps`` (``ceil``), then ``end``. Defaults: 1.5 -> 1.0 over 60% of training.

    ``schedule(step) -> float``; ``schedule.as_dict()`` is its plain config.
    """

    total_steps: int
    start: float = 1.5
    end: float = 1.0
    fraction: float = 0.6

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_steps", as_int("total_steps", self.total_steps, minimum=1))
        object.__setattr__(self, "start", as_float("start", self.start, positive=True))
        object.__setattr__(self, "end", as_float("end", self.end, positive=True))
        object.__setattr__(self, "fraction", as_float("fraction", self.fraction, minimum=0.0, maximum=1.0))

    @property
    def anneal_steps(self) -> int:
        return math.ceil(self.total_steps * self.fraction)

    def __call__(self, step: int) -> float:
        step = as_int("step", step, minimum=0)
        if step >= self.anneal_steps:
            return self.end
        return self.end + 0.5 * (self.start - self.end) * (1.0 + math.cos(math.pi * step / self.anneal_steps))

    def as_dict(self) -> dict:
        return {"kind": "cosine", **asdict(self)}


@dataclass(frozen=True)
class ExponentialDecay:
    """Elastic Attention's Eq. 14: ``max(minimum, initial * exp(-rate * step / step_scale))``, rate 0.6.

    The paper counts ``p`` in training steps (``step_scale=1``): at rate 0.6 the temperature reaches its floor
    within a few steps. ``step_scale=total_steps`` spreads the same curve over the whole run. The paper gives
    neither the initial nor the floor temperature; the defaults are those of the cosine schedule.
    """

    initial: float = 1.5
    minimum: float = 1.0
    rate: float = 0.6
    step_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial", as_float("initial", self.initial, positive=True))
        object.__setattr__(self, "minimum", as_float("minimum", self.minimum, positive=True))
        object.__setattr__(self, "rate", as_float("rate", self.rate, minimum=0.0))
        object.__setattr__(self, "step_scale", as_float("step_scale", self.step_scale, positive=True))

    def __call__(self, step: int) -> float:
        step = as_int("step", step, minimum=0)
        return max(self.minimum, self.initial * math.exp(-self.rate * step / self.step_scale))

    def as_dict(self) -> dict:
        return {"kind": "exponential", **asdict(self)}


TemperatureSchedule = CosineAnneal | ExponentialDecay
_SCHEDULES = {"cosine": CosineAnneal, "exponential": ExponentialDecay}


def schedule_from_dict(config: dict) -> TemperatureSchedule:
    """A schedule from its :meth:`as_dict` config."""
    if not isinstance(config, dict) or config.get("kind") not in _SCHEDULES:
        raise ValueError(f"config must be a dict with kind in {sorted(_SCHEDULES)}, got {config!r}")
    fields = {k: v for k, v in config.items() if k != "kind"}
    return _SCHEDULES[config["kind"]](**fields)
