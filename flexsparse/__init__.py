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

# name -> the subpackage it is imported from on first use
_LAZY = {
    "RouterTrainer": "integrations", "SparseKVCache": "integrations", "convert": "integrations",
    "check_config": "integrations", "load_config": "integrations", "revert": "integrations", "save_config": "integrations",
    "calibrate": "eval",
}


def __getattr__(name: str):
    """The transformers drop-in (``flexsparse.convert`` ...) and calibration (``flexsparse.calibrate``),
    imported on first use: flexsparse itself does not need transformers."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"flexsparse.{_LAZY[name]}"), name)
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
    "check_config",
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
