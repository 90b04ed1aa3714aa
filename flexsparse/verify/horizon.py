"""The hole horizon: the longest sequence length a stack of layers covers without an attention hole.

For patterns whose keys depend only on the query's own position (prefix-consistent: Causal, SinkWindow, ESA and
their unions, intersections and per-head mixes), a query's connected set is the same at every sequence length
that holds it: C_l(q) depends only on the keys of positions <= q, and those do not change with the length.
Hence, if the first hole at some length M is at query q*, every length N > q* has its first hole at q* too, and
every length N <= q* is hole-free. One in-order run at ``limit`` that stops at the first hole answers the question
for every length up to ``limit``: the answer is q*, or ``limit`` when there is no hole below it.

Patterns whose keys depend on the sequence length (TriangleMix's full band is the last queries) or on content
(XAttention, BlockTable) are refused: hole-freeness need not even be monotone in the length for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flexsparse.verify.field import receptive_field
from flexsparse.verify.layers import check_seq_len, stack_patterns
from flexsparse.verify.sources import attends_every_earlier_key, prefix_consistency_problem

DEFAULT_LIMIT = 1 << 22


@dataclass(frozen=True)
class HoleFreeLength:
    """The longest hole-free sequence length of a stack, searched up to ``limit`` tokens."""

    length: int
    """Every sequence length <= ``length`` is hole-free; when ``first_hole`` is None, ``length == limit`` and
    longer lengths were not examined (unless ``every_length``)."""
    limit: int
    first_hole: tuple[int, int] | None
    """(query, key) of the hole that every length > ``length`` has; None when there is none below ``limit``."""
    every_length: bool = False
    """Some layer attends every earlier key: the stack is hole-free at every length, not only up to ``limit``."""

    @property
    def reached_limit(self) -> bool:
        """No hole below ``limit``: ``length`` is a lower bound (unless ``every_length``)."""
        return self.first_hole is None

    def __int__(self) -> int:
        return self.length

    def __str__(self) -> str:
        if self.every_length:
            return "hole-free at every length (a layer attends every earlier key)"
        if self.first_hole is None:
            return f"hole-free up to the limit of {self.limit:,} tokens (longer lengths not examined)"
        query, key = self.first_hole
        return (f"hole-free up to {self.length:,} tokens; from {self.length + 1:,} tokens on, query {query} "
                f"cannot reach key {key}")


def max_hole_free_length(
    layers,
    *,
    limit: int = DEFAULT_LIMIT,
    device: str | torch.device | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> HoleFreeLength:
    """The longest sequence length with no attention hole, exactly, searched up to ``limit`` tokens (default
    2**22). One run that stops at the first hole: time and memory follow the hole horizon, not ``limit``.

    ``layers`` as for :func:`~flexsparse.verify.receptive_field`; every layer must be prefix-consistent (keys
    depend only on the query's own position), else ValueError.
    """
    limit = check_seq_len(limit, "limit")
    patterns = stack_patterns(layers)
    for depth, pattern in enumerate(patterns, 1):
        problem = prefix_consistency_problem(pattern)
        if problem is not None:
            raise ValueError(f"max_hole_free_length needs layers whose keys depend only on the query's position; "
                             f"layer {depth}: {problem}. Use receptive_field(layers, seq_len) at the length you need")
    if any(attends_every_earlier_key(p) for p in patterns):
        return HoleFreeLength(limit, limit, None, every_length=True)
    report = receptive_field(patterns, limit, device=device, progress=progress, stop_at_first_hole=True)
    if report.first_hole is None:
        return HoleFreeLength(limit, limit, None)
    return HoleFreeLength(report.first_hole[0], limit, report.first_hole)
