"""TriangleMix (TA, seed 003): sink + window for every query, full causal attention for the last queries.

The last ``last_q`` positions of each sequence (position ``end - last_q`` onwards, ``end`` being one past the
sequence's last real key, e.g. the question at the end of a long prompt) attend everything before them; all other
queries attend the sink and the window. In decode the new token is the last position, so it attends everything
(TA decodes as full attention). In chunked prefill ``end`` is the end of the keys passed so far: each chunk's last
``last_q`` queries attend fully.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import DecodeReads, MaskMod, Pattern
from flexsparse.masks.geometry import EMPTY, FULL, Geometry, classify
from flexsparse.masks.window import Causal, SinkWindow
from flexsparse.validation import as_int


class TriangleMix(Pattern):
    """Sink + window below, a full-attention band for the last ``last_q`` queries."""

    name = "triangle_mix"
    decode_reads = DecodeReads.EVERY_EARLIER_KEY  # the new token is the last position, inside the full band

    def __init__(self, sink: int = 128, window: int = 2048, last_q: int = 128) -> None:
        self.local = SinkWindow(sink=sink, window=window)
        self.last_q = as_int("last_q", last_q, minimum=1)
        self.full = Causal()

    def __repr__(self) -> str:
        return f"TriangleMix(sink={self.local.sink}, window={self.local.window}, last_q={self.last_q})"

    def _first_full_query(self, geo: Geometry) -> Tensor:
        """Position where the full band starts, per batch element: int64 ``[B', 1, 1, 1]``."""
        return (geo.sequence_ends() - self.last_q)[:, None, None, None]

    def mask_mod(self, geo: Geometry) -> MaskMod:
        local, full = self.local.mask_mod(geo), self.full.mask_mod(geo)
        q_pos, _ = geo.position_mods()
        if geo.is_contiguous:
            first_full = geo.kv_len - self.last_q
            band_start = lambda b: first_full
        else:
            band_start = geo.per_batch_mod(self._first_full_query(geo).flatten())

        def triangle_mix_mask(b, h, q_idx, kv_idx):
            in_band = q_pos(b, q_idx) >= band_start(b)
            return torch.where(in_band, full(b, h, q_idx, kv_idx), local(b, h, q_idx, kv_idx))

        return triangle_mix_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        local, full = self.local.block_classes(geo), self.full.block_classes(geo)
        q_first, q_last = geo.q_tile_bounds()
        first_full = self._first_full_query(geo)
        band = q_first >= first_full  # every query of the tile in the full band
        outside = q_last < first_full  # no query of the tile in it
        mixed = classify(full=(local == FULL) & (full == FULL), empty=(local == EMPTY) & (full == EMPTY))
        return torch.where(band, full, torch.where(outside, local, mixed))

    def dense(self, geo: Geometry) -> Tensor:
        rows = geo.q_positions()[:, None, :, None] >= self._first_full_query(geo)
        return torch.where(rows, self.full.dense(geo), self.local.dense(geo))

    def attended(self, geo: Geometry) -> Tensor:
        rows = geo.q_positions()[:, None] >= self._first_full_query(geo)[..., 0]
        return torch.where(rows, self.full.attended(geo), self.local.attended(geo))

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        first, last = self.local.key_runs(geo, positions)  # [2, 1, P]
        in_band = positions >= geo.kv_len - self.last_q
        first = torch.stack([torch.where(in_band, 0, first[0, 0]), torch.where(in_band, 1, first[1, 0])])
        last = torch.stack([torch.where(in_band, positions, last[0, 0]), torch.where(in_band, 0, last[1, 0])])
        return first[:, None], last[:, None]
