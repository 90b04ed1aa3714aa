"""XAttention's block selection: from estimated block masses to the kept (query block, key block) pairs."""

from __future__ import annotations

import torch
from torch import Tensor


def select_blocks(mass: Tensor, threshold: Tensor) -> Tensor:
    """Boolean ``[B, H, QB, KB]``: sink + diagonal + the fewest other causal blocks, heaviest first, whose
    mass with the forced ones reaches ``threshold`` (``[H]``) of the row."""
    qb = torch.arange(mass.shape[2], device=mass.device)[:, None]
    kb = torch.arange(mass.shape[3], device=mass.device)[None, :]
    causal = kb <= qb
    forced = (kb == 0) | (kb == qb)
    mass = mass.masked_fill(~causal, 0.0)
    required = mass.sum(-1, keepdim=True) * threshold.to(mass.dtype).view(1, -1, 1, 1)
    rank_key = torch.where(forced, float("inf"), torch.where(causal, mass, float("-inf")))
    order = torch.argsort(rank_key, dim=-1, descending=True, stable=True)
    ordered = mass.gather(-1, order)
    before = ordered.cumsum(-1) - ordered  # mass kept before each block in selection order
    keep_sorted = before < required
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    everything = (threshold >= 1).view(1, -1, 1, 1)
    return (keep | forced | everything) & causal
