"""TriangleMix (TA, seed 003): sink + window for every query, full causal attention for the last queries.

The last ``last_q`` positions of the sequence (``kv_len - last_q`` onwards, e.g. the question at the end of a
long prompt) attend everything before them; all other queries attend the sink and the window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, MaskMod, Pattern, classify
from flexsparse.masks.window import Causal, SinkWindow, _check_int


class TriangleMix(Pattern):
    """Sink + window below, a full-attention band for the last ``last_q`` queries."""

    name = "triangle_mix"

    def __init__(self, sink: int = 128, window: int = 2048, last_q: int = 128) -> None:
        self.local = SinkWindow(sink=sink, window=window)
        self.last_q = _check_int("last_q", last_q, 1)
        self.full = Causal()

    def __repr__(self) -> str:
        return f"TriangleMix(sink={self.local.sink}, window={self.local.window}, last_q={self.last_q})"

    def _first_full_query(self, geo: Geometry) -> int:
        return geo.kv_len - self.last_q  # absolute position

    def mask_mod(self, geo: Geometry) -> MaskMod:
        local, full, offset, first_full = self.local.mask_mod(geo), self.full.mask_mod(geo), geo.offset, \
            self._first_full_query(geo)

        def triangle_mix_mask(b, h, q_idx, kv_idx):
            in_band = q_idx + offset >= first_full
            return torch.where(in_band, full(b, h, q_idx, kv_idx), local(b, h, q_idx, kv_idx))

        return triangle_mix_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        local, full = self.local.block_classes(geo), self.full.block_classes(geo)
        q_lo, q_hi = geo.q_block_bounds()
        first_full = self._first_full_query(geo)
        band = q_lo >= first_full  # whole query block in the full band
        outside = q_hi - 1 < first_full  # no query of the block in it
        straddles = ~band & ~outside
        both_full = (local == 2) & (full == 2)
        both_empty = (local == 0) & (full == 0)
        mixed = classify(full=both_full, empty=both_empty)
        return torch.where(band, full, torch.where(outside, local, torch.where(straddles, mixed, local)))

    def dense(self, geo: Geometry) -> Tensor:
        rows = (geo.q_positions() >= self._first_full_query(geo))[:, None]
        return torch.where(rows, self.full.dense(geo), self.local.dense(geo))

    def attended(self, geo: Geometry) -> Tensor:
        rows = geo.q_positions() >= self._first_full_query(geo)
        return torch.where(rows, self.full.attended(geo), self.local.attended(geo))

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        first, last = self.local.key_runs(geo, positions)  # [2, 1, P]
        in_band = positions >= self._first_full_query(geo)
        first = torch.stack([torch.where(in_band, 0, first[0, 0]), torch.where(in_band, 1, first[1, 0])])
        last = torch.stack([torch.where(in_band, positions, last[0, 0]), torch.where(in_band, 0, last[1, 0])])
        return first[:, None], last[:, None]
