"""Per-head and per-layer selection of patterns (union and intersection live in base.py).

Each per-head selection is itself a :class:`Pattern`, so selections nest and keep all the capabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexsparse.masks.base import MaskMod, Pattern, check_patterns
from flexsparse.masks.blocks import BlockMaskStack
from flexsparse.masks.geometry import Geometry
from flexsparse.validation import as_int_list


def dispatch_mask_mod(mask_mods: Sequence[MaskMod], modes: Tensor, heads: Tensor | None = None) -> MaskMod:
    """One mask_mod that runs ``mask_mods[modes[b, h]]`` for row (b, h); ``modes`` int ``[B, H]`` (B may be 1).

    With ``heads``, row h stands for head ``heads[h]`` of the patterns (a subset of heads in one call).
    ``modes`` (and ``heads``) are captured as tensors: new values of the same shape do not recompile.
    """
    per_batch = modes.shape[0] > 1
    mods = tuple(mask_mods)

    def per_head_mask(b, h, q_idx, kv_idx):
        mode = modes[b, h] if per_batch else modes[0, h]
        head = h if heads is None else heads[h]
        result = mods[0](b, head, q_idx, kv_idx)
        for index in range(1, len(mods)):
            result = torch.where(mode == index, mods[index](b, head, q_idx, kv_idx), result)
        return result

    return per_head_mask


def gather_heads(per_pattern: list[Tensor], modes: Tensor) -> Tensor:
    """Row (b, h) of ``per_pattern[modes[b, h]]``; each entry ``[B', H', ...]``, result ``[B, H, ...]``."""
    batch, heads = modes.shape
    b_max = max(max(t.shape[0] for t in per_pattern), batch)
    stacked = torch.stack([t.expand(b_max, heads, *t.shape[2:]) for t in per_pattern])
    b_index = torch.arange(b_max, device=modes.device)[:, None]
    return stacked[modes.expand(b_max, heads), b_index, torch.arange(heads, device=modes.device)]


class PerHead(Pattern):
    """Head h (of batch element b) follows ``patterns[modes[h]]`` (or ``modes[b, h]``)."""

    name = "per_head"

    def __init__(self, patterns: Sequence[Pattern], modes: Sequence[int] | Tensor) -> None:
        self.patterns = check_patterns(patterns, "PerHead")
        if not isinstance(modes, Tensor):
            modes = torch.tensor(as_int_list("modes", modes), dtype=torch.long)
        if modes.dtype.is_floating_point or modes.dtype.is_complex or modes.dtype == torch.bool:
            raise TypeError(f"modes must be integers, got {modes.dtype}")
        if modes.numel() == 0:
            raise ValueError("modes must give one pattern index per head, got none")
        if modes.dim() == 1:
            modes = modes[None]
        if modes.dim() != 2:
            raise ValueError(f"modes must be [H] or [B, H], got shape {tuple(modes.shape)}")
        if modes.numel() and (modes.min() < 0 or modes.max() >= len(self.patterns)):
            raise ValueError(f"modes must index the {len(self.patterns)} patterns, got values {modes.unique().tolist()}")
        self.modes = modes.long()
        self.is_full = all(self.patterns[i].is_full for i in self.modes.unique().tolist())

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PerHead:
        """As :meth:`Pattern.from_config`; modes given per batch element and head (nested lists) become a tensor."""
        modes = config.get("modes") if isinstance(config, Mapping) else None
        if isinstance(modes, list) and modes and isinstance(modes[0], list):
            config = {**config, "modes": torch.tensor(modes)}
        return super().from_config(config)

    def __repr__(self) -> str:
        return f"PerHead({list(self.patterns)!r}, modes={self.modes.tolist()})"

    def _modes_for(self, geo: Geometry) -> Tensor:
        if self.modes.shape[1] != geo.num_heads:
            raise ValueError(f"PerHead has modes for {self.modes.shape[1]} heads, geometry has {geo.num_heads}")
        return self.modes.to(geo.device)

    def mask_mod(self, geo: Geometry) -> MaskMod:
        return dispatch_mask_mod([p.mask_mod(geo) for p in self.patterns], self._modes_for(geo))

    def block_classes(self, geo: Geometry) -> Tensor:
        return gather_heads([p.block_classes(geo) for p in self.patterns], self._modes_for(geo))

    def block_mask(self, geo: Geometry) -> BlockMask:
        stack = BlockMaskStack.from_masks([p.block_mask(geo) for p in self.patterns], geo.num_heads)
        return stack.select(self._modes_for(geo), self.mask_mod(geo))

    def dense(self, geo: Geometry) -> Tensor:
        return gather_heads([p.dense(geo) for p in self.patterns], self._modes_for(geo))

    def attended(self, geo: Geometry) -> Tensor:
        return gather_heads([p.attended(geo) for p in self.patterns], self._modes_for(geo))

    @property
    def required_heads(self) -> int:
        return self.modes.shape[1]

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.modes.shape[0] != 1:
            raise ValueError("key_runs of PerHead needs per-head modes [H], not per-batch modes [B, H]")
        runs = [p.key_runs(geo, positions) for p in self.patterns]
        width = max(f.shape[0] for f, _ in runs)
        # [R, H', P] -> [1, H', P, R] padded to a common R, so that heads can be gathered
        as_rows = lambda t, fill: torch.nn.functional.pad(t.permute(1, 2, 0), (0, width - t.shape[0]), value=fill)[None]
        first = gather_heads([as_rows(f, 1) for f, _ in runs], self._modes_for(geo))[0]
        last = gather_heads([as_rows(l, 0) for _, l in runs], self._modes_for(geo))[0]
        return first.permute(2, 0, 1), last.permute(2, 0, 1)


class PerLayer(Sequence):
    """Layer l of a stack follows ``patterns[modes[l]]``; indexing gives that layer's pattern."""

    def __init__(self, patterns: Sequence[Pattern], modes: Sequence[int]) -> None:
        self.patterns = check_patterns(patterns, "PerLayer")
        self.modes = as_int_list("modes", modes)
        if not self.modes:
            raise ValueError("PerLayer needs at least one layer mode")
        bad = [m for m in self.modes if not 0 <= m < len(self.patterns)]
        if bad:
            raise ValueError(f"layer modes must index the {len(self.patterns)} patterns, got {bad}")

    def __len__(self) -> int:
        return len(self.modes)

    def __getitem__(self, layer: int) -> Pattern:
        return self.patterns[self.modes[layer]]

    def __repr__(self) -> str:
        return f"PerLayer({list(self.patterns)!r}, modes={self.modes})"
