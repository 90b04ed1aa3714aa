"""Decode steps as executor calls: a layer's one-token step over its sparse KV cache's stores.

A :class:`DecodeCall` holds the layer's query, the new token's key and value, and one :class:`GroupStep` per
head group: its store (:mod:`flexsparse.cache.stores`), the step's view of it (:class:`~flexsparse.cache.views.
StepView`) and its pattern. :func:`plan_decode` asks the executors, in preference order, which accept what
(:meth:`~flexsparse.runtime.executors.Executor.accepts_decode`) and at what cost
(:meth:`~flexsparse.runtime.executors.Executor.decode_cost`): an executor that ``fuses_decode`` takes the whole
step in one call when that costs less than the groups' cheapest decoders plus their extra launches. A group that
no executor decodes is left to the caller (its heads run the layer's plan over the whole store).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.cache.stores import HeadIndex, KVStore
from flexsparse.cache.views import StepView
from flexsparse.masks import Pattern
from flexsparse.runtime.cost import HBM_BYTES_PER_S, LAUNCH_S
from flexsparse.runtime.executors import Executor


@dataclass(frozen=True, slots=True, eq=False)
class GroupStep:
    """One head group of a decode step. ``q_heads``: its query heads (:meth:`DecodeCall.query` picks them);
    ``store``: its buffers;
    ``view``: how the step's query sees them; ``pattern``: the heads' pattern (one per group; None for a group of
    several patterns, which only a plan over the store decodes); ``layer_kv_heads``: its KV heads in the layer's
    numbering (a tensor-parallel rank's first head added)."""

    q_heads: HeadIndex
    store: KVStore
    view: StepView
    pattern: Pattern | None
    layer_kv_heads: tuple[int, ...]

    def read_bytes(self) -> int:
        """Bytes of keys and values the step reads at most (every filled slot)."""
        keys = self.store.keys
        batch, heads, _, dim = keys.shape
        return 2 * batch * heads * self.view.filled * dim * keys.element_size()


@dataclass(frozen=True, slots=True, eq=False)
class DecodeCall:
    """A layer's one-token decode step: ``q`` ``[B, H, 1, d]``, ``key``/``value`` ``[B, H_kv, 1, d]`` (the new
    token, the layer's heads), ``groups`` and ``scale``; ``fused``: the cache's ``one_launch_decode`` setting
    (None: where the kernels are preferred; True: wherever they run; False: never one launch)."""

    q: Tensor
    key: Tensor
    value: Tensor
    groups: tuple[GroupStep, ...]
    scale: float | None
    fused: bool | None = None

    def query(self, index: int = 0) -> Tensor:
        """The query heads of group ``index``, ``[B, H_g, 1, d]`` (a view when they are consecutive)."""
        return self.groups[index].q_heads.pick(self.q)

    def only(self, index: int) -> DecodeCall:
        """The call of one group."""
        return DecodeCall(self.q, self.key, self.value, (self.groups[index],), self.scale, self.fused)

    def read_seconds(self) -> float:
        """The step's cost when it reads every filled slot once at the device's bandwidth."""
        return sum(group.read_bytes() for group in self.groups) / HBM_BYTES_PER_S


@dataclass(frozen=True)
class DecodePlan:
    """Who decodes a step: ``fused`` (one executor for every group) or ``per_group`` (an executor per group,
    None for a group no executor decodes)."""

    fused: Executor | None
    per_group: tuple[Executor | None, ...]


def plan_decode(executors: Sequence[Executor], call: DecodeCall) -> DecodePlan:
    """The cheapest way to decode ``call`` (``executors`` in preference order: a tie goes to the earlier one)."""
    per_group: list[Executor | None] = []
    split = 0.0
    for index in range(len(call.groups)):
        one = call.only(index)
        best, best_cost = None, None
        for executor in executors:
            if executor.accepts_decode(one):
                cost = executor.decode_cost(one)
                if best is None or cost < best_cost:
                    best, best_cost = executor, cost
        per_group.append(best)
        split += LAUNCH_S if best is None else best_cost + LAUNCH_S
    for executor in executors:
        if executor.fuses_decode and executor.accepts_decode(call):
            if executor.decode_cost(call) + LAUNCH_S <= split:
                return DecodePlan(executor, tuple(per_group))
    return DecodePlan(None, tuple(per_group))


def assemble_heads(results: Sequence[Tensor], q_heads: Sequence[HeadIndex], in_order: bool,
                   num_heads: int) -> Tensor:
    """Group outputs ``[B, h_g, L, d]`` as one ``[B, num_heads, L, d]`` (``q_heads``: each group's query heads;
    ``in_order``: they are consecutive ranges in order, so one cat does it)."""
    if len(results) == 1:
        return results[0]
    if in_order:
        return torch.cat(list(results), 1)
    first = results[0]
    out = first.new_empty((first.shape[0], num_heads, *first.shape[2:]))
    for result, heads in zip(results, q_heads):
        if heads.slice is not None:
            out[:, heads.slice] = result
        else:
            out.index_copy_(1, heads.tensor(out.device), result)
    return out
