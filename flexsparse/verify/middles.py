"""Middle intervals per position, and their unions over aligned blocks of positions.

Level 0 holds each position's middles (CSR over positions). Level j holds, for every aligned block of
``FANOUT**j`` positions, the merged union of its positions' middles, built from the ``FANOUT`` blocks below it
once the block is complete. A run of positions ``a..b`` splits into at most ``2 (FANOUT - 1)`` whole blocks per
level (and whole top-level blocks), so the union of a long run's middles comes from a few merged lists instead
of every position's own: where sets fragment, neighbouring positions' middles overlap almost entirely (a
sliding window over ESA-fragmented sets would otherwise gather ~100 middles from each of its 2,048 keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.verify.growing import GrowingVector
from flexsparse.verify.intervals import merge_intervals, ranks

FANOUT = 8
LEVELS = 7  # blocks of 1, 8, ..., 8**6 = 262,144 positions


class _Level:
    """Intervals of consecutive blocks, CSR: block b holds ``first/last[ptr[b] : ptr[b + 1]]``."""

    def __init__(self, device: torch.device) -> None:
        self.ptr = GrowingVector(torch.int64, device)
        self.ptr.append(torch.zeros(1, dtype=torch.int64, device=device))
        self.first = GrowingVector(torch.int32, device)
        self.last = GrowingVector(torch.int32, device)

    @property
    def blocks(self) -> int:
        return self.ptr.size - 1

    def append(self, counts: Tensor, first: Tensor, last: Tensor) -> None:
        self.ptr.append(self.ptr.view()[-1] + torch.cumsum(counts.long(), 0))
        self.first.append(first.to(torch.int32))
        self.last.append(last.to(torch.int32))

    def sizes(self, block: Tensor) -> Tensor:
        ptr = self.ptr.view()
        return ptr[block + 1] - ptr[block]

    def gather(self, owner: Tensor, block: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        count = self.sizes(block)
        which = torch.repeat_interleave(torch.arange(block.numel(), device=block.device), count)
        index = self.ptr.view()[block][which] + ranks(count)
        return owner[which], self.first.view()[index], self.last.view()[index]


class Middles:
    """Middles of positions ``0 .. size - 1`` (appended in order) and their unions over aligned blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.levels = [_Level(device) for _ in range(LEVELS)]
        self.size = 0

    @property
    def total(self) -> int:
        """Middles held by the positions themselves (level 0)."""
        return self.levels[0].first.size

    def append(self, counts: Tensor, first: Tensor, last: Tensor) -> None:
        """Middles of the next ``len(counts)`` positions, in position order."""
        self.levels[0].append(counts, first, last)
        self.size += counts.numel()
        for depth in range(1, LEVELS):
            level, below = self.levels[depth], self.levels[depth - 1]
            done, complete = level.blocks, self.size // FANOUT**depth
            if complete == done:
                break  # no block completes here, nor above
            child_blocks = torch.arange(done * FANOUT, complete * FANOUT, device=self.device)
            child_counts = below.sizes(child_blocks)
            begin, end = (int(below.ptr.view()[i]) for i in (done * FANOUT, complete * FANOUT))
            row = torch.repeat_interleave(child_blocks // FANOUT - done, child_counts)
            _, merged_first, merged_last, counts_per_block = merge_intervals(
                row, below.first.view()[begin:end].long(), below.last.view()[begin:end].long(), complete - done)
            level.append(counts_per_block, merged_first, merged_last)

    def own_counts(self, positions: Tensor) -> Tensor:
        """Number of middles each position holds itself."""
        return self.levels[0].sizes(positions)

    def own(self, owner: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(owner, first, last) of the positions' own middles."""
        return self.levels[0].gather(owner, positions)

    def pieces(self, first: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Split runs ``first..last`` (int64, within 0..size-1) into whole aligned blocks.

        Returns (run index, level, block, number of merged middles) per block.
        """
        a, end = first.clone(), last + 1
        runs = torch.arange(first.numel(), device=first.device)
        out = []

        def emit(level: int, start: Tensor, count: Tensor) -> None:
            count = torch.clamp(count, min=0)
            run = torch.repeat_interleave(runs, count)
            out.append((run, torch.full_like(run, level), start.div(FANOUT**level, rounding_mode="floor")[run]
                        + ranks(count)))

        for level in range(LEVELS - 1):  # a and end are multiples of this level's block (or a == end)
            size, parent = FANOUT**level, FANOUT ** (level + 1)
            stop = torch.minimum((a + parent - 1) // parent * parent, end)
            count = torch.clamp((stop - a) // size, min=0)
            emit(level, a, count)
            a = a + count * size
            start = torch.maximum(end // parent * parent, a)
            count = torch.clamp((end - start) // size, min=0)
            emit(level, start, count)
            end = end - count * size
        emit(LEVELS - 1, a, (end - a) // FANOUT ** (LEVELS - 1))
        run, level, block = (torch.cat(parts) for parts in zip(*out))
        sizes = torch.empty_like(block)
        for depth in range(LEVELS):
            at = level == depth
            sizes[at] = self.levels[depth].sizes(block[at])
        keep = sizes > 0
        return run[keep], level[keep], block[keep], sizes[keep]

    def gather(self, owner: Tensor, level: Tensor, block: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(owner, first, last) of the merged middles of the given blocks."""
        parts = [self.levels[depth].gather(owner[level == depth], block[level == depth]) for depth in range(LEVELS)]
        return tuple(torch.cat(p) for p in zip(*parts))
