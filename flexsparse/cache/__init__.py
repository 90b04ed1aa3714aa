"""A sparse KV cache's storage, independent of any model library: per head group a store (every key, or a
sink + window ring; :mod:`~flexsparse.cache.stores`), how one step's query sees each store
(:mod:`~flexsparse.cache.views`), where tokens go (:mod:`~flexsparse.cache.capacity`) and the device-side step
state of graphed decode (:mod:`~flexsparse.cache.device_steps`). Executors attend the stores
(:mod:`flexsparse.runtime.decode`); transformers' ``Cache`` around them is
:class:`flexsparse.integrations.SparseKVCache`."""

from flexsparse.cache.capacity import GROWTH_STEPS, grown_capacity, ring_slot_of, ring_slot_positions
from flexsparse.cache.device_steps import DeviceSteps
from flexsparse.cache.stores import HeadIndex, KVStore, RingStore, StoreKind, make_store, store_kind
from flexsparse.cache.views import PaddingLayout, StepView, StepViews

__all__ = [
    "GROWTH_STEPS",
    "DeviceSteps",
    "HeadIndex",
    "KVStore",
    "PaddingLayout",
    "RingStore",
    "StepView",
    "StepViews",
    "StoreKind",
    "grown_capacity",
    "make_store",
    "ring_slot_of",
    "ring_slot_positions",
    "store_kind",
]
