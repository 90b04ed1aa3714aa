"""What the verifier knows about pattern types: key runs per layer, prefix consistency, full heads.

A layer's information flow is the union over its heads. :func:`key_run_sources` gives it as a few *sources*,
each a pair (first, last) of ascending runs ``[R, P]`` (first and last keys non-decreasing along R, empty runs
last), whose union is the layer's keys. A per-head layer becomes one source per pattern it uses instead of one
sort over every head's runs: heads that share a pattern share its runs, and ESA's runs of any subset of its
heads are already ascending (head h's slot-j key lies in ``[base_j, base_{j+1} - 1]`` and grows with h).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, Pattern, normalize_runs
from flexsparse.masks.combine import Intersection, PerHead, Union
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
    """Pattern index -> the heads that follow it (per-head modes ``[H]`` only)."""
    if per_head.modes.shape[0] != 1:
        raise ValueError("the verifier takes per-head modes [H], not per-batch modes [B, H]: verify one batch "
                         "element at a time")
    heads: dict[int, list[int]] = {}
    for head, mode in enumerate(per_head.modes[0].tolist()):
        heads.setdefault(mode, []).append(head)
    return heads


def key_run_sources(pattern: Pattern, geo: Geometry, positions: Tensor) -> list[Runs]:
    """Ascending key runs whose union over sources is what ``pattern`` lets the given positions attend."""
    if type(pattern) is Union:
        return [source for part in pattern.parts for source in key_run_sources(part, geo, positions)]
    if type(pattern) is PerHead:
        sources = []
        for mode, heads in used_patterns(pattern).items():
            part = pattern.patterns[mode]
            if part.required_heads is None or len(heads) == geo.num_heads:
                sources.extend(key_run_sources(part, geo, positions))
            else:
                sources.append(_head_subset_runs(part, geo, positions, heads))
        return sources
    return [pattern.union_key_runs(geo, positions)]


def _head_subset_runs(pattern: Pattern, geo: Geometry, positions: Tensor, heads: list[int]) -> Runs:
    """Union of some heads' runs: ESA's are ascending in (slot, head) order; others are sorted and merged."""
    first, last = pattern.key_runs(geo, positions)  # [R, H', P]
    if first.shape[1] > 1:
        index = torch.tensor(heads, device=first.device)
        first, last = first[:, index], last[:, index]
    if type(pattern) is ESA:
        return first.reshape(-1, positions.numel()), last.reshape(-1, positions.numel())
    first, last = (t.reshape(-1, positions.numel()).T for t in (first, last))
    first, last = normalize_runs(first, last)
    return first.T, last.T


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
