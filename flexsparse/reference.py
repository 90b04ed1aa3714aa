"""Dense reference attention: explicit softmax over an explicit boolean mask, for tests.

It materialises the full score matrix in float64, so it is for small sizes only. Rows whose mask is all False
give zeros, as FlexAttention does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.heads import per_query_head


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Masked softmax attention.

    q ``[B, Hq, Q, D]``, k/v ``[B, Hkv, KV, D]`` (Hq a multiple of Hkv, GQA), mask bool broadcastable to
    ``[B, Hq, Q, KV]``. Returns ``[B, Hq, Q, D]`` in q's dtype; computed in float64 and differentiable.
    """
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k64 = per_query_head(k.double(), groups, dim=1)
    v64 = per_query_head(v.double(), groups, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k64) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v64).to(q.dtype)
