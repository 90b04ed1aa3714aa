"""flexsparse inside model libraries. ``transformers``: convert / revert a causal LM, a sparse KV cache for
``generate()`` (decode steps replayed from CUDA graphs with ``convert(..., decode_graphs=True)``), routers inside
a converted model and their trainer, and its saved configuration (needs the ``hf`` extra: ``pip install
flexsparse[hf]``). Calibration and router fitting on real text: the ``eval`` package.
"""

from flexsparse.integrations.graph_decode import GraphDecoder
from flexsparse.integrations.kv_cache import SparseKVCache, kv_memory_formula
from flexsparse.integrations.router_trainer import RouterTrainer
from flexsparse.integrations.routing import (
    fused_routers,
    last_routings,
    pooling_mask,
    routed_layers,
    router_parameters,
    training,
)
from flexsparse.integrations.serialization import check_config, load_config, save_config
from flexsparse.integrations.transformers import (
    ATTENTION_NAME,
    cache_argument,
    convert,
    is_converted,
    layer_modes,
    revert,
    sparse_generate_cache,
)

__all__ = [
    "ATTENTION_NAME",
    "GraphDecoder",
    "RouterTrainer",
    "SparseKVCache",
    "cache_argument",
    "check_config",
    "convert",
    "fused_routers",
    "is_converted",
    "kv_memory_formula",
    "last_routings",
    "layer_modes",
    "load_config",
    "pooling_mask",
    "revert",
    "routed_layers",
    "router_parameters",
    "save_config",
    "sparse_generate_cache",
    "training",
]
