"""What a converted attention module carries: its HybridAttention, its modes, and how a sparse KV cache groups its
heads.

A KV head's pattern decides what the cache keeps for it (:func:`~flexsparse.cache.stores.store_kind`: a sink + window
ring, or every key) and the layer's executors say who decodes it (:meth:`~flexsparse.runtime.executors.Executor.
decodes`, the first in preference order). :func:`cache_groups` groups the heads so that each group is one store and
one decoder call per step:

* heads whose decode reads every earlier key (full causal, XAttention, TriangleMix), one group per decoder;
* heads of one pattern that an executor decodes from its own keys (ESA's gather), one group per mode;
* heads that no executor decodes (combinations, SinkWindow with ``unit > 1``, PerHead, ...): one group whose
  store the layer's plan reads whole (compiled flex under the flex backends);
* sink + window heads: one ring per (sink, window).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
import torch
from torch import Tensor, nn

from flexsparse.attention import HybridAttention
from flexsparse.cache.stores import StoreKind, store_kind
from flexsparse.heads import query_heads
from flexsparse.masks import DecodeReads, Pattern
from flexsparse.routers import Boundary, Router, Routing
from flexsparse.runtime.executors import Executor

@dataclass
class RouterSettings:
    """How a converted model's routers run, shared by its routed layers (set by
    :func:`flexsparse.integrations.training`, :func:`flexsparse.integrations.pooling_mask` and
    :func:`flexsparse.integrations.fused_routers`).

    ``tau``: Gumbel-softmax temperature in training; ``hard``: straight-through hard weights (False: soft);
    ``pool_mask``: bool ``[B, S]``, the tokens the routers pool in the next forwards (None: the padding mask);
    ``generator``: for the Gumbel noise; ``fused``: inference through the fused Triton kernel (None: on CUDA where
    it can run; True: always, raising where it cannot; False: never).
    """

    tau: float = 1.0
    hard: bool = True
    pool_mask: Tensor | None = None
    generator: torch.Generator | None = field(default=None, repr=False)
    fused: bool | None = None


@dataclass(frozen=True)
class CacheGroup:
    """KV heads of a layer that share a cache store, and who decodes them. ``pattern``: the heads' pattern for
    their decoder (for every-key heads the first head's: they all read every earlier key); None for heads no
    executor decodes (several patterns; the layer's plan reads their store whole). ``decoder``: the first executor
    that :meth:`~flexsparse.runtime.executors.Executor.decodes` the pattern (None: the plan)."""

    kv_heads: tuple[int, ...]
    pattern: Pattern | None
    decoder: Executor | None

    @property
    def store_kind(self) -> StoreKind:
        return StoreKind.EVERY_KEY if self.pattern is None else store_kind(self.pattern)

    def q_heads(self, group_size: int) -> list[int]:
        """The query heads of these KV heads (GQA groups of ``group_size``)."""
        return query_heads(self.kv_heads, group_size)


def _group_key(pattern: Pattern, mode: int, decoder: Executor | None) -> tuple[int, Hashable]:
    """(order, identity) of a head's group: every-key heads first, then own-pattern decoders, the plan, rings."""
    reads = pattern.decode_reads
    if decoder is None:
        return 2, "plan"
    if reads is DecodeReads.EVERY_EARLIER_KEY:
        return 0, id(decoder)
    if reads is DecodeReads.SINK_AND_WINDOW:
        return 3, (pattern.sink, pattern.window, id(decoder))
    return 1, mode


def cache_groups(patterns: Sequence[Pattern], modes: Sequence[int], executors: Sequence[Executor]) -> list[CacheGroup]:
    """The KV heads grouped by store and decoder (see the module docstring); ``executors`` in preference order.
    ValueError when a head's pattern has no decoder and no executor runs a plan over a whole store (one that
    ``fuses``: flex or dense)."""
    members: dict[tuple[int, Hashable], list[int]] = {}
    owners: dict[tuple[int, Hashable], tuple[Pattern, Executor | None]] = {}
    for head, mode in enumerate(modes):
        pattern = patterns[mode]
        decoder = next((e for e in executors if e.decodes(pattern)), None)
        if decoder is None and not any(e.fuses for e in executors):
            raise ValueError(f"no executor decodes pattern {pattern!r} in a sparse KV cache, and none runs a plan "
                             f"over its store (flex or dense); executors: {[e.name for e in executors]}")
        key = _group_key(pattern, mode, decoder)
        members.setdefault(key, []).append(head)
        owners.setdefault(key, (pattern, decoder))
    return [CacheGroup(tuple(members[key]), None if owners[key][1] is None else owners[key][0], owners[key][1])
            for key in sorted(members, key=lambda key: (key[0], members[key][0]))]


class SparseAttentionLayer(nn.Module):
    """flexsparse's state on one converted attention module (registered on it as ``module.flexsparse``).

    ``attention`` runs the layer; ``patterns`` and ``modes`` are the user's (names and per-KV-head indices);
    ``groups`` is the sparse KV cache's head grouping for these modes. Between a cache's ``update`` and the
    attention function, the layer holds the update (:meth:`stage`, :meth:`take_staged`).

    A routed layer also carries its ``router`` (a submodule: its weights are the state's learned tensors), the
    model's shared :class:`RouterSettings`, the states its capture hook recorded for the running forward
    (``captured``, ``[B, S, H, d]``), the last prefill's :class:`~flexsparse.routers.Routing` (``routing``) and
    its per-sequence modes ``prefill_modes`` (int64 ``[B, H_kv]``), which decode steps reuse.
    """

    first_kv_head = 0
    """The layer's index of ``groups``' KV head 0 (a tensor-parallel rank's first head; ESA's shifts use it)."""

    def __init__(self, layer_idx: int, path: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 patterns: Mapping[str, Pattern], modes: Sequence[int], *, block_size: int, backend: str,
                 plan: str, router: Router | None = None, kernel_options: dict | None = None) -> None:
        super().__init__()
        self.router = router
        self.settings = RouterSettings()
        self.captured: Tensor | None = None
        self.routing: Routing | None = None
        self.prefill_modes: Tensor | None = None
        self.hooks: list = []
        self.layer_idx, self.path = layer_idx, path
        self.patterns = OrderedDict(patterns)
        self.modes = tuple(modes)
        self.options = {"block_size": block_size, "backend": backend, "plan": plan}
        self.attention = HybridAttention(num_heads, num_kv_heads, head_dim, self.patterns, list(self.modes),
                                         block_size=block_size, backend=backend, plan=plan,
                                         kernel_options=kernel_options)
        self.groups = cache_groups(list(self.patterns.values()), self.modes, self.attention.executors)
        self.attached = True
        """False once convert or revert replaced this state: caches filled through it refuse further use."""
        self._staged: list[tuple | None] = [None]  # a holder: nn.Module's __setattr__ is slow per step

    @property
    def where(self) -> str:
        """How errors name this layer: ``layer i (module path)``."""
        return f"layer {self.layer_idx} ({self.path})"

    @property
    def mode_names(self) -> list[str]:
        names = list(self.patterns)
        return [names[m] for m in self.modes]

    @property
    def group_size(self) -> int:
        return self.attention.num_heads // self.attention.num_kv_heads

    def stage(self, cache_layer: object, key: Tensor, value: Tensor) -> None:
        """Record a cache update of this layer until the attention function takes it."""
        if self._staged[0] is not None:
            raise ValueError(f"{self.where}: the sparse KV cache was updated twice without "
                             "an attention call between; the model must call transformers' attention function "
                             "right after each cache update")
        self._staged[0] = (cache_layer, key, value)

    def take_staged(self, key: Tensor, value: Tensor) -> object | None:
        """The cache layer whose update produced ``key``/``value`` (None when no cache update is pending)."""
        staged, self._staged[0] = self._staged[0], None
        if staged is None:
            return None
        cache_layer, staged_key, staged_value = staged
        if staged_key is not key or staged_value is not value:
            raise ValueError(f"{self.where}: the attention function received other keys or "
                             "values than the sparse KV cache's update returned (the model transforms them after "
                             "the update); flexsparse's cache cannot serve this model, pass use_cache=False or a "
                             "DynamicCache")
        return cache_layer

    def router_states(self, states: Tensor, boundary: Boundary) -> tuple[Tensor, Boundary]:
        """The states ``[B, S, H, d]`` and boundary the router reads, from the captured ones: these (a
        tensor-parallel rank's layer gathers what its router needs from the other ranks)."""
        return states, boundary

    def remove_hooks(self) -> None:
        """Remove the router's capture hooks from the attention module."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, modes={self.mode_names}"


def sparse_layers(model: nn.Module) -> list[SparseAttentionLayer]:
    """The converted layers of ``model`` in layer order (empty when it is not converted)."""
    found = [m for m in model.modules() if isinstance(m, SparseAttentionLayer)]
    return sorted(found, key=lambda layer: layer.layer_idx)
