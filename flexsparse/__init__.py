"""flexsparse: hybrid sparse attention for long-context transformers on PyTorch FlexAttention."""

from flexsparse import masks, reference, routers
from flexsparse.attention import AttentionStats, HybridAttention
from flexsparse.masks import (
    ESA,
    BlockTable,
    Causal,
    Geometry,
    Intersection,
    Pattern,
    PerHead,
    PerLayer,
    Positions,
    SinkWindow,
    TriangleMix,
    Union,
    XAttention,
)
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio
from flexsparse.runtime.compiled import RecompileLimitError

__version__ = "0.1.0"

__all__ = [
    "AttentionStats",
    "BlockTable",
    "Causal",
    "ESA",
    "Geometry",
    "HybridAttention",
    "Intersection",
    "Pattern",
    "PerHead",
    "PerLayer",
    "Positions",
    "RecompileLimitError",
    "SinkWindow",
    "TriangleMix",
    "Union",
    "XAttention",
    "effective_sparsity_ratio",
    "masks",
    "model_sparsity_ratio",
    "reference",
    "routers",
]
