"""Sparsity statistics of a call (MSR, ESR, block density), computed when read from the patterns it used."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.masks.base import Pattern
from flexsparse.masks.blocks import BlockMaskStack, block_density
from flexsparse.masks.combine import gather_heads
from flexsparse.masks.geometry import Geometry
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio


@dataclass
class AttentionStats:
    """Sparsity of the last call. Tensors (no host sync until read); ``as_dict`` gives floats. Batch rows without
    a real query (padding only) count as nothing; a call without any real query gives NaN."""

    msr: Tensor
    """Model sparsity ratio (Elastic Attention Eq. 4): fraction of (batch, kv head) rows in a sparse mode."""
    esr: Tensor
    """Effective sparsity ratio (Eq. 5): mean over heads of the fraction of causal (q, k) pairs pruned."""
    block_density: Tensor
    """Fraction of causal tiles the kernel computes."""

    def as_dict(self) -> dict[str, float]:
        return {"msr": float(self.msr), "esr": float(self.esr), "block_density": float(self.block_density)}


def call_stats(geo: Geometry, patterns: Sequence[Pattern | None], q_modes: Tensor,
               q_heads: Tensor) -> AttentionStats:
    """Statistics of a call at ``geo`` whose query heads ``q_heads`` (the layer's ids, ascending) ran modes
    ``q_modes`` ``[B or 1, len(q_heads)]`` over ``patterns`` (None: a mode no head used)."""
    used = next(p for p in patterns if p is not None)
    patterns = [used if p is None else p for p in patterns]  # unused modes are never selected
    rows = lambda t: t if t.shape[1] == 1 else t[:, q_heads]  # the call's heads of per-head patterns
    masks = [p.block_mask(geo) for p in patterns]
    composed = BlockMaskStack.from_masks(masks, geo.num_heads).select(q_modes, masks[0].mask_mod, heads=q_heads)
    sparse = torch.tensor([not p.is_full for p in patterns], device=q_modes.device)
    attended = gather_heads([rows(p.attended(geo)).sum(-1, keepdim=True) for p in patterns], q_modes)[..., 0]
    causal_pairs = (geo.q_positions() + 1).clamp(min=0).sum(-1, keepdim=True)  # [B', 1]; 0: padding only
    return AttentionStats(
        msr=model_sparsity_ratio(sparse[q_modes], counted=causal_pairs > 0),
        esr=effective_sparsity_ratio(attended, causal_pairs),
        block_density=block_density(composed, geo),
    )
