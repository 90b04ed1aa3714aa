"""Routers: which pattern each KV head (or layer) runs, per input (learned) or per model (static selection).

* :func:`boundary_pool` (pooling): a sequence's first and last P real tokens, per head; in two steps,
  :func:`boundary_positions` (a :class:`Boundary`, from the mask alone: once per forward) and :func:`gather_pool`.
* :class:`HeadRouter` (Elastic Attention) and :class:`LayerRouter` (Flux Attention): logits from pooled states;
  ``router.route(...)`` gives a :class:`Routing` whose ``modes()`` HybridAttention takes per call (at inference
  on CUDA: one fused Triton launch, :mod:`flexsparse.kernels.router_infer`).
* relaxation: Gumbel-softmax with straight-through hard decisions, temperature schedules.
* constraint: MSR / ESR per sequence and the Lagrangian sparsity regulariser with per-task targets.
* mixing: the training path (full and sparse outputs mixed by the straight-through weights).
* selection: static selectors (HSA discrepancy, retrieval score, layer entropy).

These are model-free building blocks. Routers inside a converted transformers model (``flexsparse.convert(model,
..., router="head")``), their training contexts and :class:`~flexsparse.integrations.RouterTrainer` live in
:mod:`flexsparse.integrations`.
"""

from flexsparse.routers.base import Router, Routing, registered_routers, router_class
from flexsparse.routers.constraint import (
    ROBUST_TARGET,
    SENSITIVE_TARGET,
    SparsityConstraint,
    attended_pairs,
    causal_pairs,
    esr,
    msr,
)
from flexsparse.routers.head_router import HeadRouter
from flexsparse.routers.layer_router import LayerRouter
from flexsparse.routers.mixing import mix_full_sparse, routed_attention
from flexsparse.routers.pooling import (
    DEFAULT_POOL_SIZE,
    Boundary,
    boundary_pool,
    boundary_positions,
    gather_pool,
)
from flexsparse.routers.relaxation import (
    CosineAnneal,
    ExponentialDecay,
    decisions,
    gumbel_noise,
    relaxed_decisions,
    schedule_from_dict,
)
from flexsparse.routers.selection import (
    entropy_selection,
    hsa_discrepancy,
    hsa_selection,
    layer_entropy,
    retrieval_scores,
    retrieval_selection,
    select_modes,
)

__all__ = [
    "DEFAULT_POOL_SIZE",
    "ROBUST_TARGET",
    "SENSITIVE_TARGET",
    "Boundary",
    "CosineAnneal",
    "ExponentialDecay",
    "HeadRouter",
    "LayerRouter",
    "Router",
    "Routing",
    "SparsityConstraint",
    "attended_pairs",
    "boundary_pool",
    "boundary_positions",
    "causal_pairs",
    "decisions",
    "entropy_selection",
    "esr",
    "gather_pool",
    "gumbel_noise",
    "hsa_discrepancy",
    "hsa_selection",
    "layer_entropy",
    "mix_full_sparse",
    "msr",
    "registered_routers",
    "relaxed_decisions",
    "retrieval_scores",
    "retrieval_selection",
    "routed_attention",
    "router_class",
    "schedule_from_dict",
    "select_modes",
]
