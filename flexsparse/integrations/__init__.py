"""flexsparse inside model libraries. ``transformers``: convert / revert a causal LM, a sparse KV cache for
``generate()``, and its saved configuration (needs the ``hf`` extra: ``pip install flexsparse[hf]``)."""

from flexsparse.integrations.kv_cache import SparseKVCache, kv_memory_formula
from flexsparse.integrations.serialization import load_config, save_config
from flexsparse.integrations.transformers import ATTENTION_NAME, convert, is_converted, layer_modes, revert

__all__ = [
    "ATTENTION_NAME",
    "SparseKVCache",
    "convert",
    "is_converted",
    "kv_memory_formula",
    "layer_modes",
    "load_config",
    "revert",
    "save_config",
]
