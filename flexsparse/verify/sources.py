"""What the verifier knows about pattern types: key runs per layer, prefix consistency, full heads.

A layer's information flow is the union over its heads. :func:`key_sources` gives it as a few *sources*, each
giving ascending runs ``[R, P]`` (first and last keys non-decreasing along R, empty runs last), whose union is
the layer's keys. A per-head layer becomes one source per pattern it uses instead of one
sort over every head's runs: heads that share a pattern share its runs, and ESA's runs of any subset of its
heads are already ascending (head h's slot-j key lies in ``[base_j, base_{j+1} - 1]`` and grows with h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, Intersection, Pattern, Union, normalize_runs
from flexsparse.masks.combine import PerHead
from flexsparse.masks.esa import ESA
from flexsparse.masks.window import Causal, SinkWindow

Runs = tuple[Tensor, Tensor]

PREFIX_CONSISTENT_TYPES = (Causal, SinkWindow, ESA)
"""Patterns whose keys for a query depend only on the query's absolute position, never on the sequence length:
Causal and SinkWindow by their rule; ESA because its start, window and every index are functions of
``n = max(w, i + 1)`` alone (seed 004's rule as :class:`~flexsparse.masks.ESA` implements it). TriangleMix is not
(its full band is the *last* ``last_q`` queries), nor are BlockTable (a table for one length) and XAttention
(content-dependent)."""


def used_patterns(per_head: PerHead) -> dict[int, list[int]]:
    """Pattern index -> the heads that follow that pattern object (per-head modes ``[H]`` only); a pattern
    listed for several modes (a per-head list repeating one object) is one entry."""
    if per_head.modes.shape[0] != 1:
        raise ValueError("the verifier takes per-head modes [H], not per-batch modes [B, H]: verify one batch "
                         "element at a time")
    first_mode = {}
    for mode, pattern in enumerate(per_head.patterns):
        first_mode.setdefault(id(pattern), mode)
    heads: dict[int, list[int]] = {}
    for head, mode in enumerate(per_head.modes[0].tolist()):
        heads.setdefault(first_mode[id(per_head.patterns[mode])], []).append(head)
    return heads


@dataclass(frozen=True)
class KeySource:
    """Some heads of a pattern (all of them when ``heads`` is None), whose keys come as ascending runs."""

    pattern: Pattern
    heads: tuple[int, ...] | None = None

    def runs(self, geo: Geometry, positions: Tensor) -> Runs:
        """Ascending key runs ``[R, P]`` of the given absolute positions."""
        if self.heads is None:
            return self.pattern.union_key_runs(geo, positions)
        first, last = self.pattern.key_runs(geo, positions)  # [R, H', P]
        if first.shape[1] > 1:
            index = torch.tensor(self.heads, device=first.device)
            first, last = first[:, index], last[:, index]
        if type(self.pattern) is ESA:  # ascending in (slot, head) order for any subset of heads
            return first.reshape(-1, positions.numel()), last.reshape(-1, positions.numel())
        first, last = (t.reshape(-1, positions.numel()).T for t in (first, last))
        first, last = normalize_runs(first, last)
        return first.T, last.T


def key_sources(pattern: Pattern, num_heads: int) -> list[KeySource]:
    """Sources whose union is what ``pattern`` lets a query attend (``num_heads`` query heads)."""
    if type(pattern) is Union:
        return [source for part in pattern.parts for source in key_sources(part, num_heads)]
    if type(pattern) is PerHead:
        sources = []
        for mode, heads in used_patterns(pattern).items():
            part = pattern.patterns[mode]
            if part.required_heads is None or len(heads) == num_heads:
                sources.extend(key_sources(part, num_heads))
            else:
                sources.append(KeySource(part, tuple(heads)))
        return sources
    return [KeySource(pattern)]


def attends_every_earlier_key(pattern: Pattern) -> bool:
    """Some head of the layer attends every key up to its query (full causal attention): the layer completes
    every connected set, whatever came before."""
    if type(pattern) is Union:
        return any(attends_every_earlier_key(part) for part in pattern.parts)
    if type(pattern) is PerHead:
        return any(attends_every_earlier_key(pattern.patterns[mode]) for mode in used_patterns(pattern))
    if type(pattern) is Intersection:
        return all(attends_every_earlier_key(part) for part in pattern.parts)
    return type(pattern) is Causal


def prefix_consistency_problem(pattern: Pattern) -> str | None:
    """None when the keys of every query depend only on its own position (then the connected set of a query is
    the same at every sequence length that holds it); else which part breaks that."""
    if type(pattern) in (Union, Intersection):
        return next(filter(None, map(prefix_consistency_problem, pattern.parts)), None)
    if type(pattern) is PerHead:
        parts = [pattern.patterns[mode] for mode in used_patterns(pattern)]
        return next(filter(None, map(prefix_consistency_problem, parts)), None)
    if type(pattern) in PREFIX_CONSISTENT_TYPES:
        return None
    return (f"{pattern!r}: its keys may depend on the sequence length or content (supported: Causal, SinkWindow, "
            f"ESA, and their unions, intersections and per-head mixes)")
