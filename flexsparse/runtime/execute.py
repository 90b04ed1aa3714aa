"""Running a plan: each group once, their results written into one output."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, GroupModes
from flexsparse.runtime.plan import HeadGroup


def execute(groups: Sequence[HeadGroup], call: AttentionCall, patterns: Sequence[Pattern | None],
            q_modes: Tensor) -> Tensor:
    """Output ``[B, H, S_q, d]`` of the call's query heads; ``q_modes`` ``[B or 1, H]`` per query head."""
    if len(groups) == 1:
        group = groups[0]
        return group.executor.run(call, patterns, GroupModes(q_modes, group.host_modes), group.heads)
    results = [(group, group.executor.run(call, patterns, GroupModes(q_modes[:, group.heads.q_index],
                                                                      group.host_modes), group.heads))
               for group in groups]
    return assemble(results, call.q.shape[1])


def assemble(results: list[tuple[HeadGroup, Tensor]], num_heads: int) -> Tensor:
    """The groups' results ``[B, h_g, S_q, d]`` written into one ``[B, H, S_q, d]`` output at their query heads.

    The buffer takes the memory layout (dimension order) of the largest result, so that the largest copy is a
    straight copy, not a transpose. The copies go into the buffer itself, not into a permuted view of it: autograd
    rejects an ``index_copy_`` into a view after a slice assignment into it."""
    largest = max((r for _, r in results), key=lambda r: r.shape[1])
    order = sorted(range(4), key=lambda dim: -largest.stride(dim))  # outermost dimension first
    shape = list(largest.shape)
    shape[1] = num_heads
    buffer = largest.new_empty([shape[dim] for dim in order])
    head_dim = order.index(1)
    for group, result in results:
        result = result.permute(order)
        where = group.heads.q_index
        if isinstance(where, slice):
            buffer.narrow(head_dim, where.start, where.stop - where.start).copy_(result)
        else:
            buffer.index_copy_(head_dim, where, result)
    return buffer.permute([order.index(dim) for dim in range(4)])
