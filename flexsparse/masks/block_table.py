"""A static block selection over token positions, as a pattern: what XAttention resolves to for one input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from flexsparse.masks.base import MaskMod, Pattern
from flexsparse.masks.geometry import Geometry, classify
from flexsparse.validation import as_int


class BlockTable(Pattern):
    """The query at position i attends the key at position k <= i when ``table[b, h, row(i), k // tb]``, with
    ``row(i) = (i - q_start) // tb``.

    ``table`` bool ``[B', H', QB, KB]`` over blocks of ``table_block`` positions (B' and H' may be 1). Rows are
    query blocks starting at position ``q_start`` (0 for a prefill; the first query of a chunk of a chunked
    prefill), columns key blocks from position 0. The table must cover every position of the geometries it is
    used with.
    """

    name = "block_table"

    def __init__(self, table: Tensor, table_block: int, q_start: int = 0) -> None:
        if not isinstance(table, Tensor) or table.dtype != torch.bool or table.dim() != 4:
            got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, Tensor) else type(table).__name__
            raise TypeError(f"table must be a bool tensor [B, H, QB, KB], got {got}")
        self.table = table
        self.table_block = as_int("table_block", table_block, minimum=1)
        self.q_start = as_int("q_start", q_start, minimum=0)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BlockTable:
        """As :meth:`Pattern.from_config`; the table comes back from nested lists of bools."""
        if isinstance(config, Mapping) and isinstance(config.get("table"), list):
            config = {**config, "table": torch.tensor(config["table"])}
        return super().from_config(config)

    def __repr__(self) -> str:
        start = f", q_start={self.q_start}" if self.q_start else ""
        return f"BlockTable(shape={tuple(self.table.shape)}, table_block={self.table_block}{start})"

    @property
    def required_heads(self) -> int | None:
        return self.table.shape[1] if self.table.shape[1] > 1 else None

    def _table_for(self, geo: Geometry) -> Tensor:
        columns = -(-geo.span // self.table_block)
        if self.table.shape[-1] < columns:
            raise ValueError(f"table covers {self.table.shape[-1]} key blocks of {self.table_block} positions, "
                             f"the geometry needs {columns}")
        if geo.is_contiguous:
            rows = -(-(geo.kv_len - self.q_start) // self.table_block)
            if geo.offset < self.q_start or self.table.shape[-2] < rows:
                raise ValueError(f"table rows cover queries from position {self.q_start} for "
                                 f"{self.table.shape[-2]} blocks; the geometry's queries are at {geo.offset}.."
                                 f"{geo.kv_len - 1}")
        if self.table.shape[1] not in (1, geo.num_heads):
            raise ValueError(f"table has {self.table.shape[1]} heads, geometry has {geo.num_heads}")
        if self.table.shape[0] not in (1, geo.batch) and geo.batch != 1:
            raise ValueError(f"table has batch {self.table.shape[0]}, the positions have {geo.batch}")
        return self.table.to(geo.device)

    def _row_of(self, positions: Tensor, table: Tensor) -> Tensor:
        """Table row of query positions (padding queries clamped in range: causality masks them)."""
        return torch.clamp((positions - self.q_start) // self.table_block, 0, table.shape[-2] - 1)

    def _column_of(self, positions: Tensor, table: Tensor) -> Tensor:
        """Table column of key positions (padding keys clamped in range: causality masks them)."""
        return torch.clamp(positions // self.table_block, 0, table.shape[-1] - 1)

    @staticmethod
    def _lookup(table: Tensor, rows: Tensor, columns: Tensor) -> Tensor:
        """``table[b, h, rows, columns]`` with index tensors ``[B'', 1, Q', K']`` broadcast over heads."""
        batch = max(table.shape[0], rows.shape[0], columns.shape[0])
        b = torch.arange(batch, device=table.device)[:, None, None, None]
        b = b if table.shape[0] > 1 else torch.zeros_like(b)
        h = torch.arange(table.shape[1], device=table.device)[None, :, None, None]
        return table[b, h, rows, columns]

    def mask_mod(self, geo: Geometry) -> MaskMod:
        table, tb, start = self._table_for(geo), self.table_block, self.q_start
        per_batch, per_head = table.shape[0] > 1, table.shape[1] > 1
        last_row, last_column = table.shape[-2] - 1, table.shape[-1] - 1
        q_pos, kv_pos = geo.position_mods()

        def block_table_mask(b, h, q_idx, kv_idx):
            i, k = q_pos(b, q_idx), kv_pos(b, kv_idx)
            rows, columns = torch.clamp((i - start) // tb, 0, last_row), torch.clamp(k // tb, 0, last_column)
            kept = table[b if per_batch else 0, h if per_head else 0, rows, columns]
            return kept & (i >= k)

        return block_table_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        """A tile's positions span a range of table cells: it is full when every cell of that range is kept and
        the tile is below the diagonal, empty when none is (range counts from a 2-D prefix sum)."""
        table = self._table_for(geo)
        prefix = torch.nn.functional.pad(table.int().cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        r0, r1 = self._row_of(q_first, table), self._row_of(q_last, table) + 1
        c0, c1 = self._column_of(kv_first, table), self._column_of(kv_last, table) + 1
        kept = (self._lookup(prefix, r1, c1) - self._lookup(prefix, r0, c1) - self._lookup(prefix, r1, c0)
                + self._lookup(prefix, r0, c0))
        full = (kept == (r1 - r0) * (c1 - c0)) & (kv_last <= q_first)
        return classify(full=full, empty=(kept == 0) | (kv_first > q_last))

    def dense(self, geo: Geometry) -> Tensor:
        table = self._table_for(geo)
        q, kv = geo.dense_grid(table.shape[1])
        return self._lookup(table, self._row_of(q, table), self._column_of(kv, table)) & (kv <= q)

    def attended(self, geo: Geometry) -> Tensor:
        """Closed form: the kept key blocks of the query's row before its own block count whole (all their keys
        precede it), its own block up to the query, later blocks not at all."""
        table, tb = self._table_for(geo), self.table_block
        before = torch.nn.functional.pad(table.long().cumsum(-1), (1, 0))  # [B', H', QB, KB + 1]: kept blocks < K
        i = geo.q_positions()[:, None, :, None]  # [B'', 1, Q, 1]
        rows, own = self._row_of(i, table), self._column_of(i, table)
        whole = self._lookup(before, rows, own)[..., 0]
        partial = self._lookup(table, rows, own)[..., 0] * (i[..., 0] % tb + 1)
        return torch.where(i[..., 0] >= 0, whole * tb + partial, 0)
