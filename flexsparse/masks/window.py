"""Full causal attention (FA) and sink + sliding window (SSA, streaming heads)."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, MaskMod, Pattern, classify


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class Causal(Pattern):
    """FA: query at position i attends every key k <= i."""

    name = "causal"
    is_full = True

    def mask_mod(self, geo: Geometry) -> MaskMod:
        offset = geo.offset

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        return causal_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        q_lo, q_hi = geo.q_block_bounds()
        kv_lo, kv_hi = geo.kv_block_bounds()
        return classify(full=kv_hi - 1 <= q_lo, empty=kv_lo > q_hi - 1)[None, None]

    def dense(self, geo: Geometry) -> Tensor:
        geo.dense_grid()  # size check
        ones = torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device)
        return ones.tril(diagonal=geo.offset)[None, None]

    def attended(self, geo: Geometry) -> Tensor:
        return (geo.q_positions() + 1)[None, None]

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(positions)[None, None], positions[None, None]


class SinkWindow(Pattern):
    """SSA: query i attends keys k <= i with k < ``sink`` or i - k < ``window``.

    ``unit=1`` is token-exact. ``unit=u > 1`` is block-granular like Block-Sparse-Attention's streaming heads:
    positions are grouped in units of u tokens, a query attends the first ``sink // u`` units and the
    ``window // u`` most recent units (its own included), causal inside its own unit. ``sink`` and ``window``
    must then be multiples of ``unit``.
    """

    name = "sink_window"

    def __init__(self, sink: int = 128, window: int = 2048, unit: int = 1) -> None:
        self.sink = _check_int("sink", sink, 0)
        self.window = _check_int("window", window, 1)
        self.unit = _check_int("unit", unit, 1)
        if sink % unit or window % unit:
            raise ValueError(f"sink ({sink}) and window ({window}) must be multiples of unit ({unit})")

    def __repr__(self) -> str:
        unit = f", unit={self.unit}" if self.unit > 1 else ""
        return f"SinkWindow(sink={self.sink}, window={self.window}{unit})"

    def mask_mod(self, geo: Geometry) -> MaskMod:
        offset, sink, unit, window_units = geo.offset, self.sink, self.unit, self.window // self.unit

        def sink_window_mask(b, h, q_idx, kv_idx):
            q_pos = q_idx + offset
            in_window = q_pos // unit - kv_idx // unit < window_units
            return (q_pos >= kv_idx) & ((kv_idx < sink) | in_window)

        return sink_window_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        unit, sink, window_units = self.unit, self.sink, self.window // self.unit
        q_lo, q_hi = geo.q_block_bounds()
        kv_lo, kv_hi = geo.kv_block_bounds()
        q_last, kv_last = q_hi - 1, kv_hi - 1
        causal_full = kv_last <= q_lo
        causal_empty = kv_lo > q_last
        # Every key of the block at or past the sink must be inside the window of every query of the block.
        first_non_sink = torch.maximum(kv_lo, torch.full_like(kv_lo, sink))
        all_sink = first_non_sink > kv_last
        window_covers = q_last // unit - first_non_sink // unit < window_units
        full = causal_full & (all_sink | window_covers)
        # No pair attends: outside the causal triangle, or no sink key and even the closest pair is too far.
        touches_sink = kv_lo < sink
        nearest_too_far = q_lo // unit - kv_last // unit >= window_units
        empty = causal_empty | (~touches_sink & nearest_too_far)
        return classify(full=full, empty=empty)[None, None]

    def dense(self, geo: Geometry) -> Tensor:
        q_pos, kv_pos = geo.dense_grid()
        causal = torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device).tril(geo.offset)
        # Window and sink built at unit level as bands of a unit matrix, then expanded to tokens.
        n_q_units = (geo.kv_len + self.unit - 1) // self.unit
        units = torch.ones(n_q_units, n_q_units, dtype=torch.bool, device=geo.device)
        band = units.tril() & ~units.tril(-(self.window // self.unit))
        band[:, : self.sink // self.unit] = True
        tokens = band.repeat_interleave(self.unit, 0).repeat_interleave(self.unit, 1)
        tokens = tokens[geo.offset : geo.offset + geo.q_len, : geo.kv_len]
        return (tokens & causal)[None, None]

    def _window_start(self, positions: Tensor) -> Tensor:
        return torch.clamp((positions // self.unit - self.window // self.unit + 1) * self.unit, min=0)

    def attended(self, geo: Geometry) -> Tensor:
        i = geo.q_positions()
        window_start = self._window_start(i)
        sink_before_window = torch.clamp(window_start, max=self.sink)
        return (i + 1 - window_start + sink_before_window)[None, None]

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Two runs: the sink keys before the window (when any), then the window."""
        window_start = self._window_start(positions)
        sink_last = torch.minimum(window_start, torch.full_like(window_start, self.sink)) - 1
        has_sink = sink_last >= 0
        first = torch.stack([torch.where(has_sink, 0, window_start), torch.where(has_sink, window_start, 1)])
        last = torch.stack([torch.where(has_sink, sink_last, positions), torch.where(has_sink, positions, 0)])
        return first[:, None], last[:, None]
