"""flexsparse: hybrid sparse attention for long-context transformers on PyTorch FlexAttention."""

from flexsparse import masks, reference
from flexsparse.attention import AttentionStats, HybridAttention
from flexsparse.masks import (
    ESA,
    Causal,
    Geometry,
    Intersection,
    Pattern,
    PerHead,
    PerLayer,
    SinkWindow,
    TriangleMix,
    Union,
    XAttention,
)
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio

__version__ = "0.1.0"

__all__ = [
    "AttentionStats",
    "Causal",
    "ESA",
    "Geometry",
    "HybridAttention",
    "Intersection",
    "Pattern",
    "PerHead",
    "PerLayer",
    "SinkWindow",
    "TriangleMix",
    "Union",
    "XAttention",
    "effective_sparsity_ratio",
    "masks",
    "model_sparsity_ratio",
    "reference",
]
