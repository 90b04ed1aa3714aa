"""Running a routed layer: the training path that mixes full and sparse outputs, and the inference path.

The straight-through estimator needs, for every routed (sequence, KV head), both the full and the sparse output:
the forward pass keeps the one the hard weight selects, the backward pass sends ``out_sparse - out_full`` times
the upstream gradient to the sparse weight. Both come from two HybridAttention calls with per-call modes, one with
every head in the full pattern and one with every head in the sparse pattern (no loop over heads); on CPU they run
through HybridAttention's dense backend (flex has no CPU backward), on GPU through flex, forward and backward.
The mix ``(1 - w) * out_full + w * out_sparse`` with ``w`` exactly 0 or 1 returns the selected output
bit for bit (Elastic's training and the authors' Flux code); with soft weights it is Flux's convex combination
(paper Eq. 5). ``attn`` may also be a tensor-parallel rank's
:class:`~flexsparse.distributed.RankAttention`: the routing then decides the rank's KV heads.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from flexsparse.attention import HybridAttention
from flexsparse.heads import per_query_head
from flexsparse.routers.base import Routing


def _check(attn: HybridAttention, routing: Routing, q: Tensor) -> None:
    # a tensor-parallel rank's RankAttention exists only once its module is imported (it needs transformers)
    rank_attention = getattr(sys.modules.get("flexsparse.integrations.tensor_parallel"), "RankAttention", ())
    if not isinstance(attn, (HybridAttention, rank_attention)):
        raise TypeError(f"attn must be a flexsparse.HybridAttention (or a tensor-parallel rank's RankAttention), "
                        f"got {type(attn).__name__}")
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a flexsparse.routers.Routing, got {type(routing).__name__}")
    batch, groups = routing.weights.shape[:2]
    if batch != q.shape[0]:
        raise ValueError(f"routing has batch {batch}, q has batch {q.shape[0]}")
    if groups not in (1, attn.num_kv_heads):
        raise ValueError(f"routing decides {groups} KV heads, attn has num_kv_heads={attn.num_kv_heads}")
    for name in ("full_mode", "sparse_mode"):
        mode = getattr(routing, name)
        if mode >= len(attn.patterns):
            raise ValueError(f"routing.{name} = {mode} but attn has {len(attn.patterns)} patterns "
                             f"({attn.pattern_names})")


def mix_full_sparse(attn: HybridAttention, q: Tensor, k: Tensor, v: Tensor, routing: Routing,
                    **attn_kwargs) -> Tensor:
    """Training path: ``(1 - w) * full + w * sparse`` per (sequence, KV head group), ``[B, H, S_q, d]``.

    ``q`` ``[B, H, S_q, d]``, ``k``/``v`` ``[B, H_kv, S_kv, d]`` as for HybridAttention; ``routing`` from a head
    router (one weight per KV head, shared by its query heads) or a layer router (one per sequence).
    ``attn_kwargs`` (``key_padding_mask``, ``positions``, ``scale``) go to both calls.
    """
    _check(attn, routing, q)
    batch = q.shape[0]
    full = attn(q, k, v, modes=routing.full_mode, **attn_kwargs)  # one mode for every head: planned on the host
    sparse = attn(q, k, v, modes=routing.sparse_mode, **attn_kwargs)
    weight = routing.sparse_weight.to(full.dtype)  # [B, G]
    weight = per_query_head(weight.expand(batch, attn.num_kv_heads), attn.num_heads // attn.num_kv_heads, dim=1)
    weight = weight[:, :, None, None]
    return (1 - weight) * full + weight * sparse


def routed_attention(attn: HybridAttention, q: Tensor, k: Tensor, v: Tensor, routing: Routing,
                     **attn_kwargs) -> Tensor:
    """The routed layer's output: :func:`mix_full_sparse` when the routing weights carry a gradient (training),
    else one HybridAttention call with the routing's per-call modes ``[B, H_kv]``."""
    _check(attn, routing, q)
    if torch.is_grad_enabled() and routing.weights.requires_grad:
        return mix_full_sparse(attn, q, k, v, routing, **attn_kwargs)
    return attn(q, k, v, modes=routing.modes(attn.num_kv_heads), **attn_kwargs)
