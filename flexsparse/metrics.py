"""Sparsity ratios of Elastic Attention (seed 000, Eq. 4-5), over whatever heads/layers are passed in."""

from __future__ import annotations

import torch
from torch import Tensor


def model_sparsity_ratio(is_sparse: Tensor, counted: Tensor | None = None) -> Tensor:
    """MSR: the fraction of heads in a sparse mode. ``is_sparse`` bool, any shape (e.g. [L, B, H_kv]).

    ``counted``: bool, broadcastable with ``is_sparse``: the entries that count (e.g. the batch rows that hold a real
    query); the others count as nothing. NaN when nothing counts.
    """
    if counted is None:
        return is_sparse.float().mean()
    is_sparse, counted = torch.broadcast_tensors(is_sparse.bool(), counted.bool())
    return (is_sparse & counted).sum().float() / counted.sum().float()


def effective_sparsity_ratio(attended_pairs: Tensor, causal_pairs: Tensor | int) -> Tensor:
    """ESR: the mean over heads of the pruned fraction ``1 - attended / causal`` of (query, key) pairs.

    ``attended_pairs``: pairs each head attends (any shape); ``causal_pairs``: pairs full causal attention has
    (broadcastable). Full heads contribute 0; entries without a causal pair (e.g. a batch row of padding only)
    count as nothing. NaN when no entry has a causal pair.
    """
    causal = torch.as_tensor(causal_pairs, device=attended_pairs.device)
    attended, causal = torch.broadcast_tensors(attended_pairs.double(), causal.double())
    counted = causal > 0
    pruned = torch.where(counted, 1.0 - attended / causal.clamp(min=1), 0.0)
    return (pruned.sum() / counted.sum()).float()
