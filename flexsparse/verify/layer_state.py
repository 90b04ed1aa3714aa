"""Connected sets after one layer, for the positions computed so far (a growing prefix of the sequence).

Position p's set C(p) is held as ``[0, pre) + middles + [lo, p]``: an optional prefix interval from key 0
(``pre`` = 0 when key 0 is not connected, or when the set is complete), the last interval ``[lo, p]``, and
"middle" intervals strictly between them, sorted, disjoint and non-adjacent (CSR over positions; most sets have
none). The set is complete (``[0, p]``) exactly when ``lo == 0``. Positions are appended in increasing order.

For a run of keys ``a..b`` the verifier asks: the smallest ``lo`` in the run (the union of the runs' last
intervals is ``[min lo, b]``: each ``[lo(k), k]`` ends at its own k), the largest ``pre``, whether any position of
the run has a middle below that smallest ``lo`` (otherwise the middles lie inside ``[min lo, b]``), and those
middles. Range minima are plain lookups while ``lo`` is non-decreasing (the common case), and sparse tables
(:class:`RangeExtremum`) from the first position where it is not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.verify.growing import GrowingVector, RangeExtremum
from flexsparse.verify.middles import Middles

BIG = 2**31 - 1  # "no middle" in the lowest-middle array; positions are < 2**30


class LayerState:
    """``C(p)`` after one layer for positions ``0 .. size - 1``, with range queries over runs of keys."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lo = GrowingVector(torch.int32, device)
        self.pre = GrowingVector(torch.int32, device)
        self.middles = Middles(device)
        self.lo_monotone, self.pre_monotone, self.any_pre = True, True, False
        self._lo_min: RangeExtremum | None = None
        self._pre_max: RangeExtremum | None = None
        self._mid_min: RangeExtremum | None = None  # lowest middle's first key per position (BIG if none)
        self._width_min: RangeExtremum | None = None  # p - lo(p), BIG when complete; built on first use
        self.incomplete = 0  # positions whose set is not [0, p]
        self.connected_pairs = 0  # sum of |C(p)|

    @property
    def size(self) -> int:
        return self.lo.size

    @property
    def num_middles(self) -> int:
        return self.middles.total

    # ----- appending ---------------------------------------------------------------------------------------

    def append(self, lo: Tensor, pre: Tensor, mid_counts: Tensor, mid_first: Tensor, mid_last: Tensor) -> None:
        """Sets of the next ``len(lo)`` positions; their middles in position order (``mid_counts`` per position)."""
        start = self.size
        positions = torch.arange(start, start + lo.numel(), device=self.device)
        lo, pre = lo.to(torch.int32), pre.to(torch.int32)
        old_lo = self.lo.view()
        if self.lo_monotone and not _non_decreasing(old_lo[-1:], lo):
            self.lo_monotone = False
            self._lo_min = RangeExtremum("min", self.device)
            self._lo_min.append(old_lo)
        if (pre > 0).any():
            self.any_pre = True
        if self.pre_monotone and not _non_decreasing(self.pre.view()[-1:], pre):
            self.pre_monotone = False
            self._pre_max = RangeExtremum("max", self.device)
            self._pre_max.append(self.pre.view())
        lowest_middle = torch.full_like(lo, BIG)
        has_middles = mid_counts > 0
        if bool(has_middles.any()):
            first_of_each = torch.cumsum(mid_counts, 0) - mid_counts
            lowest_middle[has_middles] = mid_first[first_of_each[has_middles]].to(torch.int32)
            if self._mid_min is None:
                self._mid_min = RangeExtremum("min", self.device)
                self._mid_min.append(torch.full((start,), BIG, dtype=torch.int32, device=self.device))
        self.lo.append(lo)
        self.pre.append(pre)
        for table, values in ((self._lo_min, lo), (self._pre_max, pre), (self._mid_min, lowest_middle),
                              (self._width_min, _widths(positions, lo))):
            if table is not None:
                table.append(values)
        self.middles.append(mid_counts, mid_first, mid_last)
        complete = lo == 0
        self.incomplete += int((~complete).sum())
        sizes = torch.where(complete, positions + 1, pre.long() + positions - lo.long() + 1)
        self.connected_pairs += int(sizes.sum()) + int((mid_last.long() - mid_first.long() + 1).sum())

    def append_identity(self, count: int) -> None:
        """Layer 0: every position is connected to itself only."""
        positions = torch.arange(self.size, self.size + count, device=self.device, dtype=torch.int32)
        zeros = torch.zeros(count, dtype=torch.int32, device=self.device)
        empty = zeros[:0]
        self.append(positions, zeros, zeros, empty, empty)

    # ----- queries over runs of keys (first <= last, all < size) ------------------------------------------------

    def run_min_lo(self, first: Tensor, last: Tensor) -> Tensor:
        if self.lo_monotone:
            return self.lo.view()[first]
        return self._lo_min.query(first, last)

    def run_max_pre(self, first: Tensor, last: Tensor) -> Tensor | None:
        """Largest ``pre`` in each run, or None when every ``pre`` is 0."""
        if not self.any_pre:
            return None
        if self.pre_monotone:
            return self.pre.view()[last]
        return self._pre_max.query(first, last)

    def run_has_low_middle(self, first: Tensor, last: Tensor, min_lo: Tensor) -> Tensor | None:
        """Whether some position of each run has a middle starting below ``min_lo``; None when no middles."""
        if self._mid_min is None:
            return None
        return self._mid_min.query(first, last) < min_lo

    def run_min_middle(self, first: Tensor, last: Tensor) -> Tensor:
        """The lowest first key of a middle held by a position of each run (BIG when none)."""
        if self._mid_min is None:
            return torch.full_like(first, BIG, dtype=torch.int32)
        return self._mid_min.query(first, last)

    def run_min_width(self, first: Tensor, last: Tensor) -> Tensor:
        """Smallest ``p - lo(p)`` (how far a last interval reaches back; BIG for complete sets) over each run."""
        if self._width_min is None:
            self._width_min = RangeExtremum("min", self.device)
            self._width_min.append(_widths(torch.arange(self.size, device=self.device), self.lo.view()))
        return self._width_min.query(first, last)


def _widths(positions: Tensor, lo: Tensor) -> Tensor:
    return torch.where(lo == 0, BIG, positions.to(torch.int32) - lo)


def _non_decreasing(previous_last: Tensor, values: Tensor) -> bool:
    joined = torch.cat([previous_last, values])
    return bool((joined[1:] >= joined[:-1]).all())
