"""Full causal attention (FA) and sink + sliding window (SSA, streaming heads)."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import DecodeReads, MaskMod, Pattern
from flexsparse.masks.geometry import Geometry, classify
from flexsparse.validation import as_int


class Causal(Pattern):
    """FA: the query at position i attends every key at position k <= i."""

    name = "causal"
    is_full = True

    def mask_mod(self, geo: Geometry) -> MaskMod:
        q_pos, kv_pos = geo.position_mods()

        def causal_mask(b, h, q_idx, kv_idx):
            return q_pos(b, q_idx) >= kv_pos(b, kv_idx)

        return causal_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        return classify(full=kv_last <= q_first, empty=kv_first > q_last)

    def dense(self, geo: Geometry) -> Tensor:
        if geo.is_contiguous:
            geo.check_dense()
            ones = torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device)
            return ones.tril(diagonal=geo.offset)[None, None]
        q, kv = geo.dense_grid()
        return kv <= q

    def attended(self, geo: Geometry) -> Tensor:
        return (geo.q_positions() + 1)[:, None]  # padding queries (-1) attend 0 keys

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(positions)[None, None], positions[None, None]


class SinkWindow(Pattern):
    """SSA: the query at position i attends keys k <= i with k < ``sink`` or i - k < ``window``.

    ``unit=1`` is token-exact. ``unit=u > 1`` is block-granular like Block-Sparse-Attention's streaming heads:
    positions are grouped in units of u tokens, a query attends the first ``sink // u`` units and the
    ``window // u`` most recent units (its own included), causal inside its own unit. ``sink`` and ``window``
    must then be multiples of ``unit``.
    """

    name = "sink_window"

    def __init__(self, sink: int = 128, window: int = 2048, unit: int = 1) -> None:
        self.sink = as_int("sink", sink, minimum=0)
        self.window = as_int("window", window, minimum=1)
        self.unit = as_int("unit", unit, minimum=1)
        if self.sink % self.unit or self.window % self.unit:
            raise ValueError(f"sink ({sink}) and window ({window}) must be multiples of unit ({unit})")

    @property
    def decode_reads(self) -> DecodeReads:
        """Token-exact (``unit == 1``): exactly the sink and the window; block-granular: its own pattern."""
        return DecodeReads.SINK_AND_WINDOW if self.unit == 1 else DecodeReads.OWN_PATTERN

    def __repr__(self) -> str:
        unit = f", unit={self.unit}" if self.unit > 1 else ""
        return f"SinkWindow(sink={self.sink}, window={self.window}{unit})"

    def mask_mod(self, geo: Geometry) -> MaskMod:
        q_pos, kv_pos = geo.position_mods()
        sink, unit, window_units = self.sink, self.unit, self.window // self.unit

        def sink_window_mask(b, h, q_idx, kv_idx):
            i, k = q_pos(b, q_idx), kv_pos(b, kv_idx)
            in_window = i // unit - k // unit < window_units
            return (i >= k) & ((k < sink) | in_window)

        return sink_window_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        unit, sink, window_units = self.unit, self.sink, self.window // self.unit
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        causal_full = kv_last <= q_first
        causal_empty = kv_first > q_last
        # Every key of the tile at or past the sink must be inside the window of every query of the tile.
        first_non_sink = torch.clamp(kv_first, min=sink)
        all_sink = first_non_sink > kv_last
        window_covers = q_last // unit - first_non_sink // unit < window_units
        full = causal_full & (all_sink | window_covers)
        # No pair attends: outside the causal triangle, or no sink key and even the closest pair is too far.
        touches_sink = kv_first < sink
        nearest_too_far = q_first // unit - kv_last // unit >= window_units
        empty = causal_empty | (~touches_sink & nearest_too_far)
        return classify(full=full, empty=empty)

    def window_start(self, positions: Tensor) -> Tensor:
        """First key of each query position's window (the unit of the query, minus ``window`` units)."""
        return torch.clamp((positions // self.unit - self.window // self.unit + 1) * self.unit, min=0)

    def dense(self, geo: Geometry) -> Tensor:
        """The window and sink as two key ranges per query, O(Q x KV)."""
        q, kv = geo.dense_grid()
        return (kv <= q) & ((kv >= self.window_start(q)) | (kv < self.sink))

    def attended(self, geo: Geometry) -> Tensor:
        i = geo.q_positions()
        start = self.window_start(i)
        sink_before_window = torch.clamp(start, max=self.sink)
        return torch.where(i >= 0, i + 1 - start + sink_before_window, 0)[:, None]

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Two runs: the sink keys before the window (when any), then the window."""
        start = self.window_start(positions)
        sink_last = torch.clamp(start, max=self.sink) - 1
        has_sink = sink_last >= 0
        first = torch.stack([torch.where(has_sink, 0, start), torch.where(has_sink, start, 1)])
        last = torch.stack([torch.where(has_sink, sink_last, positions), torch.where(has_sink, positions, 0)])
        return first[:, None], last[:, None]
