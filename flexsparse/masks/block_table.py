"""A static block selection as a pattern: what XAttention resolves to for one input."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.base import Geometry, MaskMod, Pattern, classify


class BlockTable(Pattern):
    """A static block selection: query i attends key k <= i when ``table[b, h, i // tb, k // tb]``.

    ``table`` bool ``[B', H', QB, KB]`` at ``table_block`` tokens per block (B' and H' may be 1).
    """

    name = "block_table"

    def __init__(self, table: Tensor, table_block: int) -> None:
        if table.dtype != torch.bool or table.dim() != 4:
            raise TypeError(f"table must be a bool tensor [B, H, QB, KB], got {table.dtype} {tuple(table.shape)}")
        self.table, self.table_block = table, table_block

    def __repr__(self) -> str:
        return f"BlockTable(shape={tuple(self.table.shape)}, table_block={self.table_block})"

    @property
    def required_heads(self) -> int | None:
        return self.table.shape[1] if self.table.shape[1] > 1 else None

    def _table_for(self, geo: Geometry) -> Tensor:
        if geo.q_len != geo.kv_len:
            raise ValueError("a BlockTable covers prefill: q_len must equal kv_len")
        expected = (-(-geo.q_len // self.table_block), -(-geo.kv_len // self.table_block))
        if tuple(self.table.shape[-2:]) != expected:
            raise ValueError(f"table covers {tuple(self.table.shape[-2:])} blocks, geometry needs {expected}")
        if self.table.shape[1] not in (1, geo.num_heads):
            raise ValueError(f"table has {self.table.shape[1]} heads, geometry has {geo.num_heads}")
        return self.table.to(geo.device)

    def mask_mod(self, geo: Geometry) -> MaskMod:
        table, tb = self._table_for(geo), self.table_block
        per_batch, per_head = table.shape[0] > 1, table.shape[1] > 1

        def block_table_mask(b, h, q_idx, kv_idx):
            kept = table[b if per_batch else 0, h if per_head else 0, q_idx // tb, kv_idx // tb]
            return kept & (q_idx >= kv_idx)

        return block_table_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        table = self._table_for(geo)
        if self.table_block % geo.block_size:
            raise ValueError(f"table_block ({self.table_block}) must be a multiple of block_size ({geo.block_size})")
        ratio = self.table_block // geo.block_size
        tiles = table.repeat_interleave(ratio, -2).repeat_interleave(ratio, -1)
        tiles = tiles[..., : geo.num_q_blocks, : geo.num_kv_blocks]
        q_lo, q_hi = geo.q_block_bounds()
        kv_lo, kv_hi = geo.kv_block_bounds()
        return classify(full=tiles & (kv_hi - 1 <= q_lo), empty=~tiles | (kv_lo > q_hi - 1))

    def dense(self, geo: Geometry) -> Tensor:
        geo.dense_grid()
        table, tb = self._table_for(geo), self.table_block
        tokens = table.repeat_interleave(tb, -2).repeat_interleave(tb, -1)[..., : geo.q_len, : geo.kv_len]
        return tokens & torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device).tril()

    def attended(self, geo: Geometry) -> Tensor:
        """Closed form: kept blocks before the diagonal count whole (all their keys precede the query), the
        diagonal block up to the query, later blocks not at all."""
        table, tb = self._table_for(geo), self.table_block
        blocks = torch.arange(table.shape[-1], device=geo.device)
        before_diagonal = (table & (blocks[None, :] < blocks[:, None])).sum(-1) * tb  # [B', H', QB]
        diagonal = table.diagonal(dim1=-2, dim2=-1)  # [B', H', QB]
        i = torch.arange(geo.q_len, device=geo.device)
        return before_diagonal[..., i // tb] + diagonal[..., i // tb] * (i % tb + 1)
