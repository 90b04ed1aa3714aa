"""What a converted attention module carries: its HybridAttention, its modes, and how a sparse KV cache groups its
heads.

A KV head's pattern decides what the cache keeps for it and how a one-token decode step reads it
(:class:`CacheGroup`); the layer's executors say which (:meth:`~flexsparse.runtime.executors.Executor.cache_kind`,
the first executor in preference order that names one):

* ``"full"`` (SDPA's): heads whose decode query attends every earlier key: full causal patterns, XAttention (it
  decodes as full attention) and TriangleMix (a decode query is in its last-queries band). They keep every key and
  decode over the filled slots without a mask (SDPA, the ranged decode kernel);
* an executor's own name, e.g. ``"esa"`` (one group per mode): heads that keep every key and decode through the
  executor's ``decode_step`` (ESA's gather, its Triton kernel on CUDA, reads the ``attn_length`` keys of the new
  token only);
* ``"keep"`` (flex's and dense's): other patterns that read arbitrary history (combinations, SinkWindow with
  ``unit > 1``, PerHead, ...) keep every key and run every call through the layer's plan (compiled flex under the
  flex backends);
* ``"ring"`` (SDPA's): token-exact :class:`~flexsparse.masks.SinkWindow` heads keep only the sink and the last
  ``window`` keys, in a ring buffer (one group per SinkWindow mode).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from flexsparse.attention import HybridAttention
from flexsparse.heads import query_heads
from flexsparse.masks import Pattern, SinkWindow
from flexsparse.routers import Boundary, Router, Routing
from flexsparse.runtime.executors import Executor

GroupKind = Literal["full", "keep", "ring"] | str
""""full", "keep", "ring", or the name of the executor that decodes the group's heads itself."""


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
    """KV heads of a layer that share a cache buffer, and the executor that decodes them. ``pattern``: the one
    SinkWindow of a ring group, the one pattern of a group its executor decodes itself (None for the other kinds)."""

    kind: GroupKind
    kv_heads: tuple[int, ...]
    executor: Executor
    pattern: Pattern | None = None

    @property
    def window(self) -> SinkWindow | None:
        """The SinkWindow of a ring group (None for the other kinds)."""
        return self.pattern if self.kind == "ring" else None

    def q_heads(self, group_size: int) -> list[int]:
        """The query heads of these KV heads (GQA groups of ``group_size``)."""
        return query_heads(self.kv_heads, group_size)


_KIND_ORDER = {"full": 0, "keep": 2, "ring": 3}  # an executor's own kind between full and keep


def cache_groups(patterns: Sequence[Pattern], modes: Sequence[int], executors: Sequence[Executor]) -> list[CacheGroup]:
    """Groups of the KV heads by what the cache keeps for them and how they decode, as the first of ``executors``
    (preference order) that names a kind for the head's pattern says: full, one group per mode for executors that
    decode heads themselves, keep, then one ring per SinkWindow mode."""
    kinds: dict[tuple, list[int]] = {}
    owners: dict[tuple, Executor] = {}
    for head, mode in enumerate(modes):
        pattern = patterns[mode]
        kind, executor = next(((e.cache_kind(pattern), e) for e in executors if e.cache_kind(pattern) is not None),
                              (None, None))
        if kind is None:
            raise ValueError(f"no executor keeps and decodes pattern {pattern!r} in a sparse KV cache; executors: "
                             f"{[e.name for e in executors]}")
        key = (kind, -1) if kind in ("full", "keep") else (kind, mode)
        kinds.setdefault(key, []).append(head)
        owners.setdefault(key, executor)
    order = sorted(kinds, key=lambda key: (_KIND_ORDER.get(key[0], 1), key[0] if key[0] not in _KIND_ORDER else "",
                                           key[1]))
    return [CacheGroup(kind, tuple(kinds[(kind, mode)]), owners[(kind, mode)], None if mode < 0 else patterns[mode])
            for kind, mode in order]


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
