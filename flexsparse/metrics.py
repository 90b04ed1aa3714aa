"""Sparsity ratios of Elastic Attention (seed 000, Eq. 4-5), over whatever heads/layers are passed in."""

from __future__ import annotations

from torch import Tensor


def model_sparsity_ratio(is_sparse: Tensor) -> Tensor:
    """MSR: the fraction of heads in a sparse mode. ``is_sparse`` bool, any shape (e.g. [L, B, H_kv])."""
    return is_sparse.float().mean()


def effective_sparsity_ratio(attended_pairs: Tensor, causal_pairs: Tensor | int) -> Tensor:
    """ESR: the mean over heads of the pruned fraction ``1 - attended / causal`` of (query, key) pairs.

    ``attended_pairs``: pairs each head attends (any shape); ``causal_pairs``: pairs full causal attention has.
    Full heads contribute 0.
    """
    return (1.0 - attended_pairs.double() / causal_pairs).mean().float()
