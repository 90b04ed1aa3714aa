"""Append-only integer vectors, and range minimum / maximum over them, for the in-order verifier.

The verifier computes positions in increasing order, so every per-position array only ever grows at its end.
:class:`GrowingVector` doubles its capacity as needed. :class:`RangeExtremum` answers ``min`` (or ``max``) over
index ranges ``[first, last]`` in O(1) per range: a sparse table of ``FINE_LEVELS`` levels covers ranges up to
``2 * BLOCK`` long, longer ranges split into two short ends and a run of whole blocks, answered by a child
table over the block values (recursively). Appending m values costs O(m * FINE_LEVELS); memory is about
``(FINE_LEVELS + 1) * 4`` bytes per position (int32).
"""

from __future__ import annotations

import torch
from torch import Tensor

FINE_LEVELS = 5
BLOCK = 1 << FINE_LEVELS  # positions per block of the child table


class GrowingVector:
    """A 1-D tensor that grows at its end (capacity doubling); :meth:`view` is the filled part."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024) -> None:
        self._data = torch.empty(max(capacity, 1), dtype=dtype, device=device)
        self.size = 0

    def append(self, values: Tensor) -> None:
        needed = self.size + values.numel()
        if needed > self._data.numel():
            grown = torch.empty(max(needed, 2 * self._data.numel()), dtype=self._data.dtype, device=self._data.device)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : needed] = values
        self.size = needed

    def view(self) -> Tensor:
        return self._data[: self.size]


class RangeExtremum:
    """``reduce`` ("min" or "max") of a growing int vector over index ranges, vectorised over many ranges."""

    def __init__(self, reduce: str, device: torch.device) -> None:
        if reduce not in ("min", "max"):
            raise ValueError(f"reduce must be 'min' or 'max', got {reduce!r}")
        self._op = torch.minimum if reduce == "min" else torch.maximum
        self._reduce, self._device = reduce, device
        self._table = torch.empty(FINE_LEVELS + 1, 0, dtype=torch.int32, device=device)  # [level, position]
        self.size = 0
        self._child: RangeExtremum | None = None

    def append(self, values: Tensor) -> None:
        """Values for positions ``size .. size + len(values) - 1``."""
        old, new = self.size, self.size + values.numel()
        if new > self._table.shape[1]:
            grown = torch.empty(FINE_LEVELS + 1, max(new, 2 * self._table.shape[1], 1024), dtype=torch.int32,
                                device=self._device)
            grown[:, :old] = self._table[:, :old]
            self._table = grown
        table = self._table
        table[0, old:new] = values
        for level in range(1, FINE_LEVELS + 1):  # entry i covers [i, i + 2**level - 1] once that is filled
            half = 1 << (level - 1)
            lo, hi = max(old - 2 * half + 1, 0), new - 2 * half + 1
            if hi > lo:
                self._op(table[level - 1, lo:hi], table[level - 1, lo + half : hi + half], out=table[level, lo:hi])
        self.size = new
        blocks_done = new // BLOCK
        if blocks_done > (old // BLOCK):
            if self._child is None:
                self._child = RangeExtremum(self._reduce, self._device)
            first_block = self._child.size
            self._child.append(table[FINE_LEVELS, first_block * BLOCK : blocks_done * BLOCK : BLOCK])

    def _short(self, first: Tensor, last: Tensor) -> Tensor:
        """Ranges of length 1 .. 2 * BLOCK: two overlapping windows of the largest fitting fine level."""
        length = last - first + 1
        level = torch.clamp(torch.floor(torch.log2(length.double())).long(), max=FINE_LEVELS)
        flat = self._table.view(-1) if self._table.is_contiguous() else self._table.reshape(-1)
        width = self._table.shape[1]
        left = flat[level * width + first]
        right = flat[level * width + last - (1 << level) + 1]
        return self._op(left, right)

    def query(self, first: Tensor, last: Tensor) -> Tensor:
        """Elementwise extremum of ``values[first .. last]`` (int64 tensors, 0 <= first <= last < size)."""
        first, last = first.long(), last.long()
        result = torch.empty(first.shape, dtype=torch.int32, device=first.device)
        long_range = (last - first + 1) > 2 * BLOCK
        short = ~long_range
        result[short] = self._short(first[short], last[short])
        if bool(long_range.any()):
            a, b = first[long_range], last[long_range]
            block_first = (a + BLOCK - 1) // BLOCK  # first whole block
            block_last = (b + 1) // BLOCK - 1  # last whole block (>= block_first: the range spans > 2 blocks)
            inner = self._child.query(block_first, block_last)
            head_last = block_first * BLOCK - 1
            tail_first = (block_last + 1) * BLOCK
            has_head, has_tail = a <= head_last, tail_first <= b
            head = self._short(torch.where(has_head, a, block_first * BLOCK), torch.where(has_head, head_last,
                                                                                          block_first * BLOCK))
            tail = self._short(torch.where(has_tail, tail_first, b), b)
            result[long_range] = self._op(self._op(inner, head), tail)
        return result
