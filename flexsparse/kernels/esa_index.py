"""ESA's index rule as the kernels take it: :class:`EsaIndexRule`, the four integers that fix which keys each query
attends, and the same rule in PyTorch (:meth:`EsaIndexRule.indices`, for the reference). Imports no triton and
nothing of :mod:`flexsparse.masks`: a caller builds the rule from an ``ESA`` pattern's public attributes,
``EsaIndexRule(p.layer_idx, p.num_layers, p.attn_length, p.num_heads)``.

For layer l of L and query position i (``n = max(w, i + 1)``, every round half to even, exactly in integers): start
``s = round((n - w)(L - 1 - l) / (L - 1))``, bases ``base_j = s + round(j (n - s) / w)`` for j = 0..w, and head h
of H attends ``round((base_j (H - 1 - h) + (base_{j+1} - 1) h) / (H - 1))`` for each slot j < w (``base_j`` when
H = 1); :class:`flexsparse.masks.ESA` documents the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.validation import as_int


def _round_half_even_div(num: Tensor, den: int) -> Tensor:
    """``round(num / den)`` of an integer tensor, ties to even: ``floor((2 num + den) / (2 den))``, one less where
    that is an exact tie rounded up to an odd quotient (never for an odd den)."""
    twice = 2 * num + den
    quotient = torch.div(twice, 2 * den, rounding_mode="floor")
    return quotient - ((quotient * (2 * den) == twice) & (quotient % 2 == 1)).to(quotient.dtype)


@dataclass(frozen=True)
class EsaIndexRule:
    """ESA's index parameters: layer ``layer_idx`` of ``num_layers``, ``attn_length`` keys per query,
    ``num_heads`` query heads (each its own shift); the argument order of ``flexsparse.masks.ESA``."""

    layer_idx: int
    num_layers: int
    attn_length: int
    num_heads: int

    def __post_init__(self) -> None:
        for name, minimum in (("layer_idx", 0), ("num_layers", 1), ("attn_length", 1), ("num_heads", 1)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=minimum))
        if self.layer_idx >= self.num_layers:
            raise ValueError(f"layer_idx must be in [0, num_layers={self.num_layers}), got {self.layer_idx}")

    @property
    def layer_den(self) -> int:
        """The denominator of the layer's weight: ``max(L - 1, 1)``."""
        return max(self.num_layers - 1, 1)

    @property
    def layer_weight(self) -> int:
        """The numerator of the start's weight ``(L - 1 - l) / (L - 1)``: ``layer_den - layer_idx``."""
        return self.layer_den - self.layer_idx

    def indices(self, positions: Tensor) -> Tensor:
        """Key indices ``[H, P, w]`` of absolute query positions ``[P]`` (an integer tensor; the result has its
        dtype), before the causal mask."""
        w, heads = self.attn_length, self.num_heads
        n = torch.clamp(positions + 1, min=w)
        start = _round_half_even_div((n - w) * self.layer_weight, self.layer_den)
        slots = torch.arange(w + 1, device=positions.device, dtype=positions.dtype)[:, None]
        bases = start + _round_half_even_div(slots * (n - start), w)  # [w + 1, P]
        base, last = bases[:w], bases[1:] - 1
        if heads == 1:
            return base.T[None]
        head = torch.arange(heads, device=positions.device, dtype=positions.dtype)[:, None, None]
        return _round_half_even_div(base * (heads - 1 - head) + last * head, heads - 1).transpose(1, 2)
