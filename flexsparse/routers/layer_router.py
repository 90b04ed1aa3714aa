"""Flux Attention's Layer Router (seed 003, Section 3.1).

One router per layer reads the layer's query states before RoPE, pools each query head's boundary tokens, averages
the pooled vectors over heads, and makes one decision per (sequence, layer): every head of the layer runs full or
every head runs sparse. Context encoder (task MLP) d -> 8d -> 2d, router head 2d -> 4d -> d -> 2, SiLU between
layers: 592,002 parameters at d = 128, the widths of the authors' code. The head average comes after pooling, as
in their code (pooling is linear, so it equals pooling the head-mean states).
"""

from __future__ import annotations

from torch import Tensor

from flexsparse.routers.base import DEFAULT_INIT_STD, Router, mlp
from flexsparse.routers.pooling import DEFAULT_POOL_SIZE, Boundary


class LayerRouter(Router):
    """Per-sequence routing logits for a whole layer from query states.

    ``forward(query_states, key_padding_mask=None, *, boundary=None)``: query states ``[B, S, H_q, d]`` before
    RoPE and an optional ``[B, S]`` mask (True = real token), or a precomputed
    :class:`~flexsparse.routers.pooling.Boundary` -> logits ``[B, 2]`` (channel 0 full, channel 1 sparse). Its
    :class:`~flexsparse.routers.base.Routing` has G = 1; ``routing.modes(num_kv_heads)`` gives every KV head the
    layer's decision.
    """

    kind = "layer"
    average_heads = True

    def __init__(self, head_dim: int, pool_size: int = DEFAULT_POOL_SIZE, *, full_mode: int = 0,
                 sparse_mode: int = 1, init_std: float = DEFAULT_INIT_STD, check_finite: bool = False) -> None:
        super().__init__(head_dim, pool_size, full_mode=full_mode, sparse_mode=sparse_mode, init_std=init_std,
                         check_finite=check_finite)
        d = self.head_dim
        self.task_mlp = mlp([d, 8 * d, 2 * d])
        self.router_mlp = mlp([2 * d, 4 * d, d, 2])
        self.reset_parameters()

    def forward(self, query_states: Tensor, key_padding_mask: Tensor | None = None, *,
                boundary: Boundary | None = None) -> Tensor:
        pooled = self.pool(query_states, key_padding_mask, boundary, "query_states").mean(1)  # [B, d]
        weight = self.task_mlp[0].weight
        return self.router_mlp(self.task_mlp(pooled.to(weight.dtype)))
