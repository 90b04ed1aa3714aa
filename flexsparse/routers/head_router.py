"""Elastic Attention's head-wise Attention Router (seed 000, Section 3.1, Appendix E.1).

One router per layer reads the layer's key states before RoPE (after any key norm, as the authors' Qwen3 code
does), pools each KV head's boundary tokens, and gives every KV head of every sequence its own decision. The task
MLP (d -> 4d -> d) and the router MLP (d -> 4d -> d -> 2), SiLU between layers, are shared by all heads: 263,682
parameters at d = 128 (the paper's "0.27M"). As in the authors' code, the task MLP's output feeds the router MLP
directly (no activation between the two).
"""

from __future__ import annotations

from torch import Tensor

from flexsparse.routers.base import DEFAULT_INIT_STD, Router, mlp
from flexsparse.routers.pooling import DEFAULT_POOL_SIZE, Boundary


class HeadRouter(Router):
    """Per-(sequence, KV head) routing logits from key states.

    ``forward(key_states, key_padding_mask=None, *, boundary=None)``: key states ``[B, S, H_kv, d]`` before RoPE
    and an optional ``[B, S]`` mask (True = real token), or a precomputed
    :class:`~flexsparse.routers.pooling.Boundary` -> logits ``[B, H_kv, 2]`` (channel 0 full, channel 1 sparse). See
    :class:`~flexsparse.routers.base.Router` for the constructor and :meth:`~Router.route`.
    """

    kind = "head"

    def __init__(self, head_dim: int, pool_size: int = DEFAULT_POOL_SIZE, *, full_mode: int = 0,
                 sparse_mode: int = 1, init_std: float = DEFAULT_INIT_STD, check_finite: bool = False) -> None:
        super().__init__(head_dim, pool_size, full_mode=full_mode, sparse_mode=sparse_mode, init_std=init_std,
                         check_finite=check_finite)
        d = self.head_dim
        self.task_mlp = mlp([d, 4 * d, d])
        self.router_mlp = mlp([d, 4 * d, d, 2])
        self.reset_parameters()

    def forward(self, key_states: Tensor, key_padding_mask: Tensor | None = None, *,
                boundary: Boundary | None = None) -> Tensor:
        pooled = self.pool(key_states, key_padding_mask, boundary, "key_states")  # [B, H_kv, d]
        weight = self.task_mlp[0].weight
        return self.router_mlp(self.task_mlp(pooled.to(weight.dtype)))
