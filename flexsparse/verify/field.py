"""Receptive-field ("attention hole") verifier: exact connected sets, computed query by query in order.

Information flows from key k to query q in a layer when any head lets q attend k; every position also keeps its
own state (the residual path). After layers 1..l, query q is *connected* to the set C_l(q) of input positions:
``C_0(p) = {p}`` and ``C_l(q) = union of C_{l-1}(k) over k in A_l(q) + {q}``. A stack is hole-free when
``C_L(q) = [0, q]`` for every q; the first hole is the smallest query q with ``C_L(q) != [0, q]`` and its smallest
missing key.

Causality makes C_l(q) depend only on positions <= q, so positions are computed in increasing order, a chunk
at a time through every layer (each layer held as :class:`~flexsparse.verify.layer_state.LayerState`). The first
incomplete position of the last layer is the first hole, found before anything past it is needed. That matters
beyond the hole horizon, where connected sets fragment into thousands of intervals (ESA's paper stack from about
200,000 tokens on): the verifier stops there once the answer is certain and the cost of the complete report
(coverage per layer) passes ``work_limit``, and says so in the report. Chunks shrink where the work per
position grows, so little is computed past the hole. A layer in which some head attends every earlier key
completes every set, so such a stack is hole-free whatever the layers before it do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexsparse.masks.base import Geometry
from flexsparse.validation import as_int
from flexsparse.verify.layer_state import LayerState
from flexsparse.verify.layer_step import extend_layer
from flexsparse.verify.layers import check_seq_len, stack_patterns
from flexsparse.verify.report import ReceptiveFieldReport
from flexsparse.verify.sources import attends_every_earlier_key

DEFAULT_WORK_LIMIT = 1 << 24
"""Intervals of fragmented sets (merged by the general path) allowed for the rest of the complete report once
the answer is certain: about 10 s on a 2-core CPU. The verifier stops as soon as the work so far, extrapolated
over the positions left, exceeds it."""

FIRST_CHUNK, MIN_CHUNK, MAX_CHUNK = 8192, 64, 1 << 16  # positions per round through every layer
STEP_WORK = 1 << 20
"""General-path intervals per layer and round: a layer stops there, so that fragmenting sets are computed only
a little ahead of the last layer (and of the first hole); rounds shrink where the work per position grows."""


def receptive_field(
    layers,
    seq_len: int,
    *,
    device: str | torch.device | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop_at_first_hole: bool = False,
    work_limit: int | None = DEFAULT_WORK_LIMIT,
) -> ReceptiveFieldReport:
    """Exact receptive field of a stack of layers over ``seq_len`` positions.

    ``layers``: a sequence whose items are Patterns (one per layer, union over heads), per-head lists of
    Patterns, HybridAttention modules (their default modes) or (HybridAttention, modes) pairs; or a PerLayer.
    ``hole_free`` and ``first_hole`` are always exact. ``stop_at_first_hole``: stop as soon as they are certain
    (the fastest answer; coverage is then not computed). ``work_limit``: once they are certain, stop when the
    complete report would merge more than this many intervals of fragmented sets (None: no limit). Memory stays
    bounded either way: intervals are merged in batches of at most ``layer_step.INTERVALS_PER_BATCH``.
    ``progress(done, total)`` is called after each chunk with the positions done in every layer.
    """
    seq_len = check_seq_len(seq_len)
    if work_limit is not None:
        work_limit = as_int("work_limit", work_limit, minimum=0)
    patterns = stack_patterns(layers)
    num_layers = len(patterns)
    device = torch.device(device or "cpu")
    full_layer = next((depth for depth, p in enumerate(patterns, 1) if attends_every_earlier_key(p)), None)
    exact_layers = num_layers if full_layer is None else full_layer - 1  # layers after full_layer are complete
    states = [LayerState(device) for _ in range(exact_layers + 1)]
    geometries = [Geometry(p.required_heads or 1, seq_len, device=device) for p in patterns[:exact_layers]]

    hole, certain, stopped, work, chunk = None, full_layer is not None, None, 0, FIRST_CHUNK
    if certain and stop_at_first_hole and exact_layers > 0:
        stopped = f"layer {full_layer} attends every earlier key, so every set is complete after it"
    while stopped is None and exact_layers > 0 and states[-1].size < seq_len:
        done_before = states[-1].size
        target = min(seq_len, done_before + chunk)
        if states[0].size < target:
            states[0].append_identity(target - states[0].size)
        round_work = 0
        for depth in range(1, exact_layers + 1):
            stop = min(states[depth - 1].size, target)
            if stop <= states[depth].size:
                continue
            cap = STEP_WORK
            if certain and work_limit is not None:
                cap = min(cap, max(work_limit - work, 0))
                if cap == 0:
                    stopped = (f"the complete report would merge more than work_limit={work_limit:,} intervals of "
                               f"fragmented sets")
                    break
            step_work = extend_layer(states[depth - 1], states[depth], patterns[depth - 1],
                                     geometries[depth - 1], stop, max(cap, 1))
            round_work += step_work
            work += step_work if certain else 0
        if full_layer is None and hole is None:
            hole = _first_incomplete(states[-1], done_before)
            if hole is not None:
                certain = True
                if stop_at_first_hole and states[-1].size < seq_len:
                    stopped = "stop_at_first_hole"
        advanced, left = states[-1].size - done_before, seq_len - states[-1].size
        if stopped is None and certain and work_limit is not None and advanced and left:
            projected = work + round_work * left // advanced  # work per position only grows past a hole
            if projected > work_limit:
                stopped = (f"the complete report would merge about {projected:,} intervals of fragmented sets, "
                           f"more than work_limit={work_limit:,}")
        if round_work > STEP_WORK:
            chunk = max(MIN_CHUNK, chunk // 2)
        elif round_work < STEP_WORK // 8:
            chunk = min(MAX_CHUNK, chunk * 2)
        if progress:
            progress(states[-1].size, seq_len)

    return _report(states, seq_len, num_layers, full_layer, hole, stopped)


def _first_incomplete(state: LayerState, start: int) -> tuple[int, int] | None:
    """(query, smallest missing key) of the first incomplete position from ``start`` on, or None."""
    incomplete = torch.nonzero(state.lo.view()[start:] != 0).flatten()
    if incomplete.numel() == 0:
        return None
    query = start + int(incomplete[0])
    return query, int(state.pre.view()[query])  # [0, pre) is connected, pre is not (0 when key 0 is not)


def _report(states: list[LayerState], seq_len: int, num_layers: int, full_layer: int | None,
            hole: tuple[int, int] | None, stopped: str | None) -> ReceptiveFieldReport:
    exact = states[1:]
    if stopped is not None:
        done = states[-1].size if exact else seq_len
        return ReceptiveFieldReport(seq_len, num_layers, hole is None, hole, None, None, done, stopped)
    causal_pairs = seq_len * (seq_len + 1) / 2
    coverage = [state.connected_pairs / causal_pairs for state in exact]
    coverage += [1.0] * (num_layers - len(exact))
    complete_depth = next((depth for depth, s in enumerate(exact, 1) if s.incomplete == 0), full_layer)
    return ReceptiveFieldReport(seq_len, num_layers, hole is None, hole, coverage, complete_depth)
