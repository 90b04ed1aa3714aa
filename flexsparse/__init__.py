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

_INTEGRATION = ("RouterTrainer", "SparseKVCache", "calibrate", "convert", "load_config", "revert",
                "save_config")


def __getattr__(name: str):
    """The transformers drop-in (``flexsparse.convert`` ...), imported on first use: flexsparse itself does not
    need transformers."""
    if name in _INTEGRATION:
        from flexsparse import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module 'flexsparse' has no attribute {name!r}")

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
    "SparseKVCache",
    "SinkWindow",
    "TriangleMix",
    "Union",
    "XAttention",
    "calibrate",
    "convert",
    "effective_sparsity_ratio",
    "load_config",
    "masks",
    "model_sparsity_ratio",
    "reference",
    "revert",
    "routers",
    "save_config",
]
