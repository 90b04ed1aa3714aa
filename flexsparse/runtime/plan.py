"""Plans: a layer's KV heads grouped by the executor that runs their pattern at the lowest cost, for one kind of call.

The planner knows no executor by name: it asks each (in preference order) whether it accepts a pattern for the call
and what running a head of it would cost (:meth:`~flexsparse.runtime.executors.Executor.cost`, estimated seconds).
``fused``: every head in one launch of the first executor that ``fuses`` and accepts every pattern (flex, or dense).
``split``: each head to the cheapest executor that accepts its pattern (an earlier one keeps it unless a later one
saves more than a launch). ``auto``: split on
CUDA where :func:`split_pays` (contiguous calls; decode and chunks always split), fused elsewhere. Modes that only
the device knows (a per-call mode tensor) always run fused: grouping them would need a host sync.

Plans are cached by what they depend on: the modes and the call's sizes, layout, device, dtype and grad mode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, HeadSelection
from flexsparse.runtime.cost import LAUNCH_S, assembly_seconds
from flexsparse.runtime.executors import Executor

PlanKind = Literal["auto", "fused", "split"]
PLAN_KINDS = ("auto", "fused", "split")
_PLAN_CACHE_SIZE = 16


@dataclass(frozen=True, eq=False)
class HeadGroup:
    """Heads of a layer that one executor runs, and their modes as the host knows them (None: device only)."""

    executor: Executor
    heads: HeadSelection
    host_modes: tuple[int, ...] | None


def split_pays(call: AttentionCall, groups: Sequence[tuple[Executor, Sequence[Pattern]]], fused: Executor) -> bool:
    """Whether running ``groups`` (executor, the patterns of its KV heads) costs less than every head in one
    launch of ``fused``: the groups' own costs, one launch per extra group and writing them into one output."""
    split = sum(executor.cost(patterns, call) for executor, patterns in groups)
    split += (len(groups) - 1) * LAUNCH_S + (assembly_seconds(call) if len(groups) > 1 else 0.0)
    return split < fused.cost([p for _, patterns in groups for p in patterns], call)


class Planner:
    """Groups a layer's heads by executor; ``executors`` in preference order (``names``: the patterns' names, for
    errors)."""

    def __init__(self, kind: PlanKind, patterns: Sequence[Pattern], num_kv_heads: int,
                 executors: Sequence[Executor], names: Sequence[str] | None = None) -> None:
        if not executors or not all(isinstance(e, Executor) for e in executors):
            raise TypeError(f"executors must be a non-empty sequence of Executor instances, got {executors!r}")
        self.kind, self.patterns, self.num_kv_heads = kind, list(patterns), num_kv_heads
        self.executors = list(executors)
        self.names = list(names) if names is not None else [f"mode {i}" for i in range(len(self.patterns))]
        self._cache: OrderedDict[tuple, list[HeadGroup]] = OrderedDict()

    def groups(self, call: AttentionCall, host_modes: tuple[int, ...] | None) -> list[HeadGroup]:
        """Groups over the call's KV heads; ``host_modes`` gives their modes when the host knows them."""
        geo, q = call.geometry, call.q
        key = (host_modes, call.kv_heads, geo.is_contiguous, geo.batch, geo.q_len, geo.kv_len, q.device, q.shape[0],
               q.dtype, call.needs_grad)
        groups = self._cache.get(key)
        if groups is None:
            groups = self._cache[key] = self._plan(call, host_modes)
            if len(self._cache) > _PLAN_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return groups

    def _plan(self, call: AttentionCall, host_modes: tuple[int, ...] | None) -> list[HeadGroup]:
        if host_modes is None:  # modes on the device: any head may run any pattern
            return self._fused_plan(call, None, range(len(self.patterns)), required=True)
        if self.kind == "fused":
            return self._fused_plan(call, host_modes, set(host_modes), required=True)
        if self.kind == "auto" and call.q.device.type != "cuda":
            fused = self._fused_plan(call, host_modes, set(host_modes), required=False)
            if fused is not None:
                return fused
        owner = {mode: self._cheapest(mode, call) for mode in dict.fromkeys(host_modes)}
        groups = []
        for executor in dict.fromkeys(owner[m] for m in host_modes):  # in order of first appearance
            kv_heads = tuple(h for h, m in enumerate(host_modes) if owner[m] is executor)
            groups.append(HeadGroup(executor, HeadSelection.of(kv_heads, call, self.num_kv_heads),
                                    tuple(host_modes[h] for h in kv_heads)))
        if self.kind == "auto" and len(groups) > 1 and call.geometry.is_contiguous:
            fused = self._fuser(call, set(host_modes))
            priced = [(g.executor, [self.patterns[m] for m in g.host_modes]) for g in groups]
            if fused is not None and not split_pays(call, priced, fused):
                return self._fused_plan(call, host_modes, set(host_modes), required=True)
        return groups

    def _cheapest(self, mode: int, call: AttentionCall) -> Executor:
        """The executor that runs a head of ``mode`` at the lowest estimated cost. A later executor takes the head
        from an earlier one only when it saves more than one launch (:data:`LAUNCH_S`): estimates closer than
        that do not rank (short calls are launch-bound), so there the preference order decides."""
        pattern = self.patterns[mode]
        accepting = [e for e in self.executors if e.accepts(pattern, call)]
        if not accepting:
            raise ValueError(f"no executor accepts pattern {self.names[mode]!r} ({pattern!r}) for this call "
                             f"({self._describe(call)}); executors: {[e.name for e in self.executors]}")
        best, best_cost = accepting[0], None
        for executor in accepting[1:]:
            if best_cost is None:
                best_cost = best.cost([pattern], call)
            cost = executor.cost([pattern], call)
            if cost < best_cost - LAUNCH_S:
                best, best_cost = executor, cost
        return best

    def _fuser(self, call: AttentionCall, modes) -> Executor | None:
        """The first executor that runs any mix of these modes' patterns in one launch."""
        return next((e for e in self.executors
                     if e.fuses and all(e.accepts(self.patterns[m], call) for m in modes)), None)

    def _fused_plan(self, call: AttentionCall, host_modes, modes, required: bool) -> list[HeadGroup] | None:
        fused = self._fuser(call, modes)
        if fused is None:
            if not required:
                return None
            names = [self.names[m] for m in sorted(modes)]
            raise ValueError(f"no executor runs patterns {names} in one launch for this call ({self._describe(call)}),"
                             f" as a fused plan or per-call mode tensors need; executors: "
                             f"{[e.name for e in self.executors]} (one with fuses=True must accept them all)")
        heads = HeadSelection.of(tuple(range(len(call.kv_heads))), call, self.num_kv_heads)
        return [HeadGroup(fused, heads, host_modes)]

    @staticmethod
    def _describe(call: AttentionCall) -> str:
        geo = call.geometry
        return (f"q_len {geo.q_len}, kv_len {geo.kv_len}, head_dim {call.q.shape[-1]}, {call.q.device.type}, "
                f"{call.q.dtype}, needs_grad={call.needs_grad}")
