"""BlockMasks from block classes, and per-head composition of several BlockMasks by a mode tensor.

Composition never rescans (q, kv) pairs: each mode's BlockMask is built once per geometry, its index tensors
(including the transposed ones the backward pass needs) are stacked, and a per-call mode tensor picks rows with
one gather. Every head's rows are independent, so gathering whole rows keeps all eight index tensors consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexsparse.masks.geometry import FULL, PARTIAL, Geometry

_INDEX_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _rows_to_indices(selected: Tensor) -> tuple[Tensor, Tensor]:
    """Boolean ``[..., N]`` -> (count int32 ``[...]``, indices int32 ``[..., N]`` with selected ones first, in order)."""
    count = selected.sum(-1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, order


def block_mask_from_classes(classes: Tensor, geo: Geometry, mask_mod) -> BlockMask:
    """BlockMask from int8 block classes ``[B', H', QB, KB]``; full blocks go to the full-block tensors."""
    if classes.shape[-2:] != (geo.num_q_blocks, geo.num_kv_blocks):
        raise ValueError(
            f"block classes of shape {tuple(classes.shape)} do not match "
            f"{geo.num_q_blocks} query blocks x {geo.num_kv_blocks} key blocks"
        )
    kv_num, kv_idx = _rows_to_indices(classes == PARTIAL)
    full_num, full_idx = _rows_to_indices(classes == FULL)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=geo.block_size,
        mask_mod=mask_mod,
        seq_lengths=(geo.q_len, geo.kv_len),
    )


@dataclass
class BlockMaskStack:
    """The index tensors of M BlockMasks of one geometry, stacked to ``[M, B', H, ...]`` for per-head selection."""

    tensors: dict[str, Tensor]
    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]

    @classmethod
    def from_masks(cls, masks: list[BlockMask], num_heads: int) -> BlockMaskStack:
        """Stack masks whose index tensors are ``[B', 1 or num_heads, ...]`` (B' equal, or 1)."""
        batch = max(m.kv_num_blocks.shape[0] for m in masks)
        tensors = {}
        for name in _INDEX_FIELDS:
            parts = []
            for m in masks:
                t = getattr(m, name)
                parts.append(t.expand(batch, num_heads, *t.shape[2:]))
            tensors[name] = torch.stack(parts).contiguous()
        return cls(tensors, tuple(masks[0].seq_lengths), tuple(masks[0].BLOCK_SIZE))

    def select(self, modes: Tensor, mask_mod, heads: Tensor | None = None,
               with_backward: bool = True) -> BlockMask:
        """BlockMask whose row (b, h) is row (b, heads[h]) of mask ``modes[b, h]``.

        ``modes`` int ``[B or 1, H_sel]``; ``heads`` the selected heads (default: all, in order). Without
        ``with_backward`` only the kv-side tensors are gathered (the transposed ones serve the backward pass
        only), which halves the traffic of a mode switch.
        """
        stacked_batch = self.tensors["kv_num_blocks"].shape[1]
        n_heads = modes.shape[1]
        batch = max(modes.shape[0], stacked_batch)
        modes = modes.expand(batch, n_heads)
        b_index = torch.arange(batch, device=modes.device)[:, None]
        if stacked_batch == 1:
            b_index = torch.zeros_like(b_index)
        h_index = (torch.arange(n_heads, device=modes.device) if heads is None else heads)[None, :]
        fields = _INDEX_FIELDS if with_backward else _INDEX_FIELDS[:4]
        picked = {name: self.tensors[name][modes, b_index, h_index] for name in fields}
        picked.update({name: None for name in _INDEX_FIELDS if name not in picked})
        return BlockMask(
            seq_lengths=self.seq_lengths,
            BLOCK_SIZE=self.block_size,
            mask_mod=mask_mod,
            **picked,
        )


def block_density(mask: BlockMask, geo: Geometry) -> Tensor:
    """Fraction of the causal (query tile, key tile) pairs holding real tokens that the mask computes;
    float32 scalar tensor (the mean over batch elements that hold such a pair: a row of padding only counts as
    nothing; NaN when no row holds one)."""
    computed = (mask.kv_num_blocks.sum(dim=(1, 2), dtype=torch.float32)
                + mask.full_kv_num_blocks.sum(dim=(1, 2), dtype=torch.float32))  # [B]
    _, q_last = geo.q_tile_bounds()
    kv_first, _ = geo.kv_tile_bounds()
    causal = geo.restrict(torch.where(kv_first <= q_last, PARTIAL, 0).to(torch.int8)) != 0
    causal_tiles = causal.sum(dim=(1, 2, 3), dtype=torch.float32)  # [B']
    density, counted = torch.broadcast_tensors(computed / (causal_tiles.clamp(min=1) * mask.kv_num_blocks.shape[1]),
                                               causal_tiles > 0)
    return torch.where(counted, density, 0.0).sum() / counted.sum()
