"""One layer's connected sets for the next positions, from the previous layer's.

``C_l(q) = C_{l-1}(q) + union of C_{l-1}(k) over the keys k of q``. Keys come as ascending runs per source
(:func:`~flexsparse.verify.sources.key_sources`); a run ``a..b`` contributes ``[min lo(a..b), b]`` (its
positions' last intervals chain together), ``[0, max pre(a..b))``, and the middles of its positions that start
below ``min lo(a..b)`` (the others lie inside ``[min lo, b]``). Gaps between a source's runs come from a suffix
minimum over its slots (:func:`union_of_runs`).

Fast path (almost every query): no middle is involved and every interval either touches the query's own last
interval or starts inside the prefix ``[0, P)``; then ``C_l(q) = [0, P') + [top, q]`` elementwise. Other queries
(the general path) gather every interval and merge them by sorting; the number of intervals they merge is the
step's *work*, bounded per batch, so memory stays bounded however much the sets fragment.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, Pattern
from flexsparse.masks.esa import ESA
from flexsparse.verify.esa_chain import esa_chain
from flexsparse.verify.intervals import merge_intervals
from flexsparse.verify.layer_state import BIG, LayerState
from flexsparse.verify.sources import KeySource, key_sources

QUERIES_PER_BATCH = 1 << 16  # positions per batch
RUN_SLOTS_PER_BATCH = 1 << 21  # run slots (runs x queries) per chunk of exact runs: bounds their memory
INTERVALS_PER_BATCH = 1 << 22  # intervals the general path merges per batch: bounds its memory


def _group_intervals(first: Tensor, last: Tensor, lo_min: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Union of intervals [lo_min_i, last_i] per row for ascending runs ``[G, P, R]``.

    Returns (row mask of emitted intervals, their first, their last), all ``[G, P, R]``.
    """
    valid = first <= last
    lo_min = torch.where(valid, lo_min, BIG)
    suffix_min = lo_min.flip(-1).cummin(-1).values.flip(-1)
    next_min = torch.cat([suffix_min[..., 1:], torch.full_like(suffix_min[..., :1], BIG)], -1)
    group_last = valid & (next_min > last + 1)
    prev_last = torch.cat([torch.ones_like(group_last[..., :1]), group_last[..., :-1]], -1)
    group_first = valid & prev_last
    slots = torch.arange(first.shape[-1], device=first.device).expand_as(first)
    first_slot = torch.where(group_first, slots, -1).cummax(-1).values.clamp(min=0)
    return group_last, suffix_min.gather(-1, first_slot), last


def union_of_runs(first: Tensor, last: Tensor, lo_min: Tensor, monotone: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Intervals of the union of [lo_min_i, last_i] over each row's ascending runs, slot-major ``[R, N]``.

    Returns (row in 0..N-1, first, last) of the emitted intervals, and each row's largest key. Rows whose union is one interval (the common
    case) are finished in one reverse pass over the slots; only rows with a gap are grouped run by run.
    ``monotone``: lo_min never decreases along valid runs, so each suffix minimum is the run's own lo_min and
    every pass is elementwise.
    """
    valid = first <= last
    suffix_min = torch.where(valid, lo_min, BIG)
    top = last.masked_fill(~valid, -1).amax(0)
    if monotone:
        # valid runs come first, so a valid run after a slot means that slot is valid too
        has_gap = (valid[1:] & (suffix_min[1:] > last[:-1] + 1)).any(0)
    else:
        has_gap = torch.zeros_like(valid[0])
        for slot in range(suffix_min.shape[0] - 2, -1, -1):  # in place, slot-major: fast and flip-free
            has_gap |= valid[slot + 1] & (suffix_min[slot + 1] > last[slot] + 1)
            torch.minimum(suffix_min[slot], suffix_min[slot + 1], out=suffix_min[slot])
    row_ids = torch.arange(valid.shape[1], device=first.device)
    one = valid[0] & ~has_gap
    out_rows, out_first, out_last = [row_ids[one]], [suffix_min[0][one]], [top[one]]
    if bool(has_gap.any()):
        rows_t = lambda t: t[:, has_gap].T
        emitted, e_first, e_last = _group_intervals(rows_t(first), rows_t(last), rows_t(lo_min))
        owner = row_ids[has_gap][:, None].expand_as(emitted)
        out_rows.append(owner[emitted])
        out_first.append(e_first[emitted])
        out_last.append(e_last[emitted])
    return torch.cat(out_rows), torch.cat(out_first), torch.cat(out_last), top


def _check_causal(pattern: Pattern, rows: Tensor, top: Tensor) -> None:
    """Raise when a query's largest key ``top`` lies after it."""
    late = top > rows
    if bool(late.any()):
        col = int(torch.nonzero(late)[0])
        raise ValueError(f"{pattern!r} lets query {int(rows[col])} attend key {int(top[col])} after it: the "
                         f"receptive field is defined for causal patterns (check causal())")


class _Keys:
    """Everything the keys of a batch of queries contribute, over the layer's sources: intervals (row, first,
    last), the prefix P per row, and the runs whose middles must be gathered (with their counts per row).

    ESA sources first try the closed form (:func:`esa_chain`); the other queries' runs are computed in chunks of
    ``RUN_SLOTS_PER_BATCH`` slots, as int32 ``[R, n]`` arrays indexed by masks only where middles or an unsorted
    ``lo`` need it.
    """

    def __init__(self, prev: LayerState, sources: list[KeySource], geo: Geometry, rows: Tensor,
                 budget: int) -> None:
        n, device = rows.numel(), rows.device
        self.prefix = torch.zeros(n, dtype=torch.long, device=device)  # P: [0, P) is connected through keys
        self.gather_count = torch.zeros(n, dtype=torch.long, device=device)  # middles to gather per query
        self.rows_done = n  # rows past a budget of run intervals are left for the next batch
        self._rows, self._firsts, self._lasts, self._flagged = [], [], [], []
        local = torch.arange(n, device=device)
        for source in sources:
            exact = local
            if type(source.pattern) is ESA:
                ok, first, last = esa_chain(source.pattern, source.heads, prev, rows)
                self._add(local[ok], first[ok], last[ok])
                exact = local[~ok]
            if exact.numel():
                slots = source.runs(geo, rows[:1].to(torch.int32))[0].shape[0]
                chunk = max(1, RUN_SLOTS_PER_BATCH // max(slots, 1))
                for begin in range(0, exact.numel(), chunk):
                    if begin and (int(exact[begin]) >= self.rows_done or
                                  sum(r.numel() for r in self._rows) > budget):
                        self.rows_done = min(self.rows_done, int(exact[begin]))
                        break
                    self._add_runs(prev, source, geo, rows, exact[begin : begin + chunk])
        row, first, last = torch.cat(self._rows), torch.cat(self._firsts), torch.cat(self._lasts)
        kept = row < self.rows_done
        self.row, self.first, self.last = row[kept], first[kept], last[kept]
        from_zero = self.first == 0
        self.prefix.scatter_reduce_(0, self.row[from_zero], self.last[from_zero] + 1, "amax")
        self.flagged = None
        if self._flagged:  # middle blocks to gather: (owner, level, block)
            owner, level, block = (torch.cat(parts) for parts in zip(*self._flagged))
            kept = owner < self.rows_done
            self.flagged = [owner[kept], level[kept], block[kept]]

    def _add(self, row: Tensor, first: Tensor, last: Tensor) -> None:
        self._rows.append(row), self._firsts.append(first.long()), self._lasts.append(last.long())

    def _add_runs(self, prev: LayerState, source: KeySource, geo: Geometry, rows: Tensor, which: Tensor) -> None:
        """Intervals, prefixes and flagged runs from the key runs of queries ``rows[which]``."""
        queries = rows[which]
        first, last = (t.to(torch.int32) for t in source.runs(geo, queries.to(torch.int32)))
        valid = first <= last
        try:
            lo_min = prev.lo.view()[torch.where(valid, first, 0)]  # exact for single keys, and all runs if monotone
        except IndexError:  # a key past every position computed so far: not causal
            _check_causal(source.pattern, queries, last.masked_fill(~valid, -1).amax(0))
            raise
        if not prev.lo_monotone:
            longer = valid & (last > first)
            if bool(longer.any()):
                lo_min[longer] = prev.run_min_lo(first[longer], last[longer])
        row, i_first, i_last, top = union_of_runs(first, last, lo_min, prev.lo_monotone)
        _check_causal(source.pattern, queries, top)
        self._add(which[row], i_first, i_last)
        if prev.any_pre:
            if prev.pre_monotone:
                run_pre = prev.pre.view()[torch.where(valid, last, 0)].masked_fill(~valid, 0)
            else:
                run_pre = torch.zeros_like(first)
                run_pre[valid] = prev.run_max_pre(first[valid], last[valid])
            self.prefix[which] = torch.maximum(self.prefix[which], run_pre.amax(0).long())
        if prev.num_middles:
            owner = which.expand_as(first)[valid]
            run_first, run_last = first[valid].long(), last[valid].long()
            low_middle = prev.run_has_low_middle(run_first, run_last, lo_min[valid])
            if bool(low_middle.any()):
                run, level, block, sizes = prev.middles.pieces(run_first[low_middle], run_last[low_middle])
                piece_owner = owner[low_middle][run]
                self.gather_count.index_add_(0, piece_owner, sizes)
                self._flagged.append((piece_owner, level, block))


def extend_layer(prev: LayerState, cur: LayerState, pattern: Pattern, geo: Geometry, stop: int,
                 work_cap: int) -> int:
    """Append ``cur``'s sets for positions ``cur.size .. stop - 1`` (all < ``prev.size``), in batches.

    Stops early, after at least one position, near ``work_cap`` intervals through the general path (batches
    are cut there). Returns the work done.
    """
    sources = key_sources(pattern, geo.num_heads)
    work = 0
    while cur.size < stop and work < work_cap:
        start = cur.size
        positions = torch.arange(start, min(stop, start + QUERIES_PER_BATCH), device=cur.device)
        work += _extend_batch(prev, cur, sources, geo, positions, min(INTERVALS_PER_BATCH, work_cap - work))
    return work


def _extend_batch(prev: LayerState, cur: LayerState, sources: list[KeySource], geo: Geometry, positions: Tensor,
                  budget: int) -> int:
    """Sets of a prefix of ``positions``: all of them, unless the general path's intervals would exceed
    ``budget`` (then up to the query where they do, and at least one)."""
    device = positions.device
    prev_lo = prev.lo.view()[positions].long()
    rows = positions[prev_lo != 0]  # complete positions stay complete
    n = rows.numel()
    own_lo, own_pre = prev.lo.view()[rows].long(), prev.pre.view()[rows].long()
    own_middles = prev.middles.own_counts(rows)
    keys = _Keys(prev, sources, geo, rows, budget) if n else None
    if keys is None:
        cur.append(torch.zeros_like(prev_lo), torch.zeros_like(prev_lo), torch.zeros_like(prev_lo),
                   prev_lo[:0], prev_lo[:0])
        return 0
    prefix = torch.maximum(keys.prefix, own_pre)
    touches = keys.last >= own_lo[keys.row] - 1
    absorbed = keys.first <= prefix[keys.row]
    intervals = torch.bincount(keys.row, minlength=n)
    general = (torch.bincount(keys.row[~(touches | absorbed)], minlength=n) > 0) | (own_middles > 0) \
        | (keys.gather_count > 0)
    # Cut the batch where the general path's intervals would exceed the budget (keep at least one query).
    estimate = torch.where(general, intervals + 2 + own_middles + keys.gather_count, 0)
    over = torch.nonzero(torch.cumsum(estimate, 0) > budget).flatten()
    n_kept = min(n if over.numel() == 0 else max(int(over[0]), 1), keys.rows_done)
    end = int(rows[n_kept]) if n_kept < n else int(positions[-1]) + 1
    keep = torch.arange(n, device=device) < n_kept
    general &= keep

    # Fast path: [0, P) + [top, q].
    top = own_lo.scatter_reduce(0, keys.row[touches], keys.first[touches], "amin")
    reach = prefix.scatter_reduce(0, keys.row[absorbed], keys.last[absorbed] + 1, "amax")
    new_lo = torch.where(reach >= top, 0, top)
    new_pre = torch.where(reach >= top, 0, reach)
    mid_counts = torch.zeros(n, dtype=torch.long, device=device)
    mid_first = mid_last = rows[:0]
    work = 0
    if bool(general.any()):
        local = torch.arange(n, device=device)
        pick = general[keys.row]
        parts = [(keys.row[pick], keys.first[pick], keys.last[pick]),
                 (local[general], own_lo[general], rows[general])]
        with_prefix = general & (prefix > 0)
        parts.append((local[with_prefix], torch.zeros_like(rows[with_prefix]), prefix[with_prefix] - 1))
        with_own = general & (own_middles > 0)
        if bool(with_own.any()):
            parts.append(prev.middles.own(local[with_own], rows[with_own]))
        if keys.flagged is not None:
            owner, level, block = keys.flagged
            sel = general[owner]
            parts.append(prev.middles.gather(owner[sel], level[sel], block[sel]))
        row, first, last = (torch.cat([p[i].long() for p in parts]) for i in range(3))
        work = row.numel()
        out_row, out_first, out_last, counts = merge_intervals(row, first, last, n)
        ends = torch.cumsum(counts, 0)
        starts = ends - counts
        g = local[general]
        first_first = out_first[starts[g]]
        has_prefix = (first_first == 0) & (counts[g] > 1)
        new_lo[g] = out_first[ends[g] - 1]
        new_pre[g] = torch.where(has_prefix, out_last[starts[g]] + 1, 0)
        is_middle = torch.ones_like(out_row, dtype=torch.bool)
        is_middle[ends[g] - 1] = False
        is_middle[starts[g][has_prefix]] = False
        mid_first, mid_last = out_first[is_middle], out_last[is_middle]
        mid_counts = torch.bincount(out_row[is_middle], minlength=n)

    # Scatter the active queries' results over the batch's positions up to the cut.
    span = end - int(positions[0])
    offset = rows[:n_kept] - int(positions[0])
    lo_all = torch.zeros(span, dtype=torch.long, device=device)
    pre_all = torch.zeros_like(lo_all)
    counts_all = torch.zeros_like(lo_all)
    lo_all[offset], pre_all[offset], counts_all[offset] = new_lo[:n_kept], new_pre[:n_kept], mid_counts[:n_kept]
    cur.append(lo_all, pre_all, counts_all, mid_first, mid_last)
    return work
