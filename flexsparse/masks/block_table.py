"""A static block selection over token positions, as a pattern: what XAttention resolves to for one input."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import MaskMod, Pattern
from flexsparse.masks.geometry import Geometry, classify
from flexsparse.validation import as_int


class BlockTable(Pattern):
    """The query at position i attends the key at position k <= i when ``table[b, h, i // tb, k // tb]``.

    ``table`` bool ``[B', H', P, P]`` over blocks of ``table_block`` positions (B' and H' may be 1); it must cover
    every position of the geometries it is used with (``P >= ceil(span / table_block)``).
    """

    name = "block_table"

    def __init__(self, table: Tensor, table_block: int) -> None:
        if not isinstance(table, Tensor) or table.dtype != torch.bool or table.dim() != 4:
            got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, Tensor) else type(table).__name__
            raise TypeError(f"table must be a bool tensor [B, H, P, P], got {got}")
        if table.shape[-1] != table.shape[-2]:
            raise ValueError(f"table must be square over position blocks, got {tuple(table.shape)}")
        self.table = table
        self.table_block = as_int("table_block", table_block, minimum=1)

    def __repr__(self) -> str:
        return f"BlockTable(shape={tuple(self.table.shape)}, table_block={self.table_block})"

    @property
    def required_heads(self) -> int | None:
        return self.table.shape[1] if self.table.shape[1] > 1 else None

    def _table_for(self, geo: Geometry) -> Tensor:
        needed = -(-geo.span // self.table_block)
        if self.table.shape[-1] < needed:
            raise ValueError(f"table covers {self.table.shape[-1]} blocks of {self.table_block} positions, "
                             f"the geometry needs {needed}")
        if self.table.shape[1] not in (1, geo.num_heads):
            raise ValueError(f"table has {self.table.shape[1]} heads, geometry has {geo.num_heads}")
        if self.table.shape[0] not in (1, geo.batch) and not geo.is_contiguous:
            raise ValueError(f"table has batch {self.table.shape[0]}, the positions have {geo.batch}")
        return self.table.to(geo.device)

    def _block_of(self, positions: Tensor, table: Tensor) -> Tensor:
        """Table row/column of positions (padding positions clamped in range: causality masks them)."""
        return torch.clamp(positions // self.table_block, 0, table.shape[-1] - 1)

    def _lookup(self, table: Tensor, q_blocks: Tensor, kv_blocks: Tensor) -> Tensor:
        """``table[b, h, q_blocks, kv_blocks]`` with index tensors ``[B'', 1, Q', K']`` broadcast over heads."""
        batch = max(table.shape[0], q_blocks.shape[0], kv_blocks.shape[0])
        b = torch.arange(batch, device=table.device)[:, None, None, None]
        b = b if table.shape[0] > 1 else torch.zeros_like(b)
        h = torch.arange(table.shape[1], device=table.device)[None, :, None, None]
        return table[b, h, q_blocks, kv_blocks]

    def mask_mod(self, geo: Geometry) -> MaskMod:
        table, tb = self._table_for(geo), self.table_block
        per_batch, per_head, last = table.shape[0] > 1, table.shape[1] > 1, table.shape[-1] - 1
        q_pos, kv_pos = geo.position_mods()

        def block_table_mask(b, h, q_idx, kv_idx):
            i, k = q_pos(b, q_idx), kv_pos(b, kv_idx)
            rows, cols = torch.clamp(i // tb, 0, last), torch.clamp(k // tb, 0, last)
            kept = table[b if per_batch else 0, h if per_head else 0, rows, cols]
            return kept & (i >= k)

        return block_table_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        """A tile's positions span a range of table blocks: it is full when every block of that range is kept
        and the tile is below the diagonal, empty when none is (range counts from a 2-D prefix sum)."""
        table = self._table_for(geo)
        prefix = torch.nn.functional.pad(table.int().cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        r0, r1 = self._block_of(q_first, table), self._block_of(q_last, table) + 1
        c0, c1 = self._block_of(kv_first, table), self._block_of(kv_last, table) + 1
        kept = (self._lookup(prefix, r1, c1) - self._lookup(prefix, r0, c1) - self._lookup(prefix, r1, c0)
                + self._lookup(prefix, r0, c0))
        full = (kept == (r1 - r0) * (c1 - c0)) & (kv_last <= q_first)
        return classify(full=full, empty=(kept == 0) | (kv_first > q_last))

    def dense(self, geo: Geometry) -> Tensor:
        table = self._table_for(geo)
        q, kv = geo.dense_grid(table.shape[1])
        return self._lookup(table, self._block_of(q, table), self._block_of(kv, table)) & (kv <= q)

    def attended(self, geo: Geometry) -> Tensor:
        """Closed form: kept blocks before the query's own count whole (all their keys precede it), its own
        block up to the query, later blocks not at all."""
        table, tb = self._table_for(geo), self.table_block
        blocks = torch.arange(table.shape[-1], device=geo.device)
        before = (table & (blocks[None, :] < blocks[:, None])).sum(-1) * tb  # [B', H', P]
        own = table.diagonal(dim1=-2, dim2=-1).long()  # [B', H', P]
        i = geo.q_positions()[:, None, :]  # [B'', 1, Q]
        rows = self._block_of(i, table).expand(-1, table.shape[1], -1)
        batch = max(rows.shape[0], table.shape[0])
        rows = rows.expand(batch, -1, -1)
        before, own = (t.expand(batch, -1, -1).gather(-1, rows) for t in (before, own))
        return torch.where(i >= 0, before + own * (i % tb + 1), 0)
