"""Vectorised helpers over lists of integer intervals grouped by row."""

from __future__ import annotations

import torch
from torch import Tensor


def ranks(counts: Tensor) -> Tensor:
    """0..c-1 for each count c, concatenated."""
    total = int(counts.sum())
    return torch.arange(total, device=counts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)


def merge_intervals(row: Tensor, first: Tensor, last: Tensor, num_rows: int):
    """Merge int64 intervals by row (0..num_rows-1) into sorted, disjoint, non-adjacent ones.

    Returns (row, first, last) of the merged intervals, sorted by (row, first), and the count per row.
    """
    if row.numel() == 0:
        return row, first, last, torch.zeros(num_rows, dtype=torch.long, device=row.device)
    span = 2**60 // max(num_rows, 1)
    order = torch.argsort(row * span + first)
    row, first, last = row[order], first[order], last[order]
    reach = (row * span + last).cummax(0).values
    opens = torch.ones_like(row, dtype=torch.bool)
    opens[1:] = (row[1:] != row[:-1]) | (row[1:] * span + first[1:] > reach[:-1] + 1)
    group = opens.cumsum(0) - 1
    out_last = torch.full((int(group[-1]) + 1,), -1, dtype=last.dtype, device=last.device).scatter_reduce(
        0, group, last, "amax", include_self=True)
    out_row = row[opens]
    return out_row, first[opens], out_last, torch.bincount(out_row, minlength=num_rows)
