"""Plans: a layer's KV heads grouped by the executor that runs their pattern best, for one kind of call.

``fused``: every head in one launch of the sparse executor (flex). ``split``: each head goes to the first
specialised executor that accepts its pattern (SDPA for full causal heads, and the kernels of later issues), the
rest to the sparse executor. ``auto``: split on CUDA when the cost model says it pays. Modes that only the device
knows (a per-call mode tensor) always run fused: grouping them would need a host sync.

Plans are cached by what they depend on: the default modes and the call's sizes and layout.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, HeadSelection
from flexsparse.runtime.executors import Executor

PlanKind = Literal["auto", "fused", "split"]
PLAN_KINDS = ("auto", "fused", "split")

# Cost model for plan="auto" (measured on an H100, torch 2.11, bf16; see the README's benchmark table): flex runs
# the tiles of full causal heads at about 0.7x SDPA's throughput, so sending full heads to SDPA saves 0.43x their
# SDPA time, at the price of one more launch and writing the groups' outputs into one tensor.
_SDPA_FLOPS_PER_S = 600e12
_FLEX_FULL_SPEED = 0.7
_EXTRA_LAUNCH_S = 50e-6
_HBM_BYTES_PER_S = 3e12
_PLAN_CACHE_SIZE = 16


@dataclass(frozen=True, eq=False)
class HeadGroup:
    """Heads of a layer that one executor runs, and their modes as the host knows them (None: device only)."""

    executor: Executor
    heads: HeadSelection
    host_modes: tuple[int, ...] | None


def split_pays(call: AttentionCall, full_kv_heads: int) -> bool:
    """Cost model: the full heads' time saved by SDPA against one more launch and the output copy."""
    geo = call.geometry
    batch, _, q_len, dim = call.q.shape
    full_q_heads = full_kv_heads * call.group_size
    causal_flops = 4 * batch * full_q_heads * dim * q_len * (geo.kv_len - q_len + (q_len + 1) / 2)
    saved = causal_flops / _SDPA_FLOPS_PER_S * (1 / _FLEX_FULL_SPEED - 1)
    output_bytes = call.q.numel() * call.q.element_size()
    return saved > _EXTRA_LAUNCH_S + 2 * output_bytes / _HBM_BYTES_PER_S


class Planner:
    """Groups heads by executor. ``specialised`` executors are tried in order before ``sparse`` takes the rest."""

    def __init__(self, kind: PlanKind, patterns: Sequence[Pattern], num_kv_heads: int,
                 specialised: Sequence[Executor], sparse: Executor) -> None:
        self.kind, self.patterns, self.num_kv_heads = kind, list(patterns), num_kv_heads
        self.specialised, self.sparse = list(specialised), sparse
        self._cache: OrderedDict[tuple, list[HeadGroup]] = OrderedDict()

    def groups(self, call: AttentionCall, host_modes: tuple[int, ...] | None) -> list[HeadGroup]:
        """Groups over the call's KV heads; ``host_modes`` gives their modes when the host knows them."""
        geo = call.geometry
        key = (host_modes, call.kv_heads, geo.is_contiguous, geo.batch, geo.q_len, geo.kv_len, call.q.device,
               call.q.shape[0])
        groups = self._cache.get(key)
        if groups is None:
            groups = self._cache[key] = self._plan(call, host_modes)
            if len(self._cache) > _PLAN_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return groups

    def _all_heads(self, call: AttentionCall, host_modes) -> list[HeadGroup]:
        heads = HeadSelection.of(tuple(range(len(call.kv_heads))), call, self.num_kv_heads)
        return [HeadGroup(self.sparse, heads, host_modes)]

    def _plan(self, call: AttentionCall, host_modes) -> list[HeadGroup]:
        if host_modes is None or self.kind == "fused" or not self.specialised:
            return self._all_heads(call, host_modes)
        if self.kind == "auto" and call.q.device.type != "cuda":
            return self._all_heads(call, host_modes)
        owner = []
        for mode in host_modes:
            pattern = self.patterns[mode]
            owner.append(next((e for e in self.specialised if e.accepts(pattern, call)), self.sparse))
        if self.kind == "auto":
            moved = sum(e is not self.sparse for e in owner)
            if moved and moved < len(owner) and call.geometry.is_contiguous and not split_pays(call, moved):
                owner = [self.sparse] * len(owner)
        groups = []
        for executor in dict.fromkeys(owner):  # in order of first appearance
            kv_heads = tuple(h for h, e in enumerate(owner) if e is executor)
            heads = HeadSelection.of(kv_heads, call, self.num_kv_heads)
            groups.append(HeadGroup(executor, heads, tuple(host_modes[h] for h in kv_heads)))
        return groups
