"""Where a sparse KV cache's tokens go: buffer capacities (the growth grid) and ring slots.

A buffer that keeps every key holds token ``t`` in slot ``t`` and grows through :func:`grown_capacity`. A
sink + window ring of ``sink + window`` slots holds position ``p < sink`` in slot ``p`` and a later one in slot
``sink + (p - sink) % window`` (:func:`ring_slot_of`), per sequence, so a left-padded sequence's sink is its first
real tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.validation import as_int

GROWTH_STEPS = 16
"""Capacities a buffer grows through per power of two (see :func:`grown_capacity`)."""
GROWTH_MIN_STEP = 16
"""The smallest growth step in slots (and the multiple every grown capacity is)."""


def grown_capacity(tokens: int) -> int:
    """The capacity a buffer grows to for holding ``tokens``: the next multiple of ``max(16, 2^e / 32)`` slots,
    for ``2^(e-1) < tokens <= 2^e``, i.e. one of 16 steps per power of two. Past 256 tokens it exceeds ``tokens``
    by less than 1/16 (6.25%); a generation from ``n`` to ``2n`` tokens crosses at most 17 capacities."""
    tokens = as_int("tokens", tokens, minimum=1)
    step = max(GROWTH_MIN_STEP, (1 << (tokens - 1).bit_length()) // (2 * GROWTH_STEPS))
    return -(-tokens // step) * step


def ring_slot_of(positions: Tensor, sink: int, window: int) -> Tensor:
    """Ring slot of each position (any int tensor): ``p`` in the sink, ``sink + (p - sink) % window`` after."""
    return torch.where(positions < sink, positions, sink + torch.remainder(positions - sink, window))


def ring_slot_on_host(position: int, sink: int, window: int) -> int:
    """:func:`ring_slot_of` of one position known on the host."""
    return position if position < sink else sink + (position - sink) % window


def ring_slot_positions(counts: Tensor, sink: int, window: int, capacity: int, span: int) -> Tensor:
    """Position held by each ring slot once ``counts`` (int64 ``[B']``) real tokens were written, int32
    ``[B', capacity]``; ``span`` marks an empty slot. A window slot holds the latest position of its residue."""
    slot = torch.arange(capacity, device=counts.device)[None]
    last = counts[:, None] - 1
    in_sink = torch.where(slot < counts[:, None], slot, span)
    offset = slot - sink
    latest = sink + offset + torch.div(last - sink - offset, window, rounding_mode="floor") * window
    in_window = torch.where(last >= sink + offset, latest, span)
    return torch.where(slot < sink, in_sink, in_window).to(torch.int32)
