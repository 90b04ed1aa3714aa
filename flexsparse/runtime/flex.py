"""The flex executors: any mix of patterns over a group of heads in one flex_attention launch.

Each pattern's BlockMask is built once per geometry (cached here for the contiguous layout, memoised on the call's
:class:`~flexsparse.masks.geometry.Positions` otherwise, so every layer of one model forward shares it). Per-head
modes select index rows with one gather (:class:`~flexsparse.masks.blocks.BlockMaskStack`) and one dispatching
mask_mod captures the mode tensor: new modes and new positions are new tensor values, never a recompile.
Compiled calls with position tables run at bucketed lengths (:mod:`flexsparse.runtime.buckets`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexsparse.masks.base import Pattern
from flexsparse.masks.blocks import BlockMaskStack
from flexsparse.masks.combine import dispatch_mask_mod
from flexsparse.masks.geometry import Geometry
from flexsparse.runtime.buckets import kv_bucket, q_bucket
from flexsparse.runtime.call import GroupModes, HeadSelection
from flexsparse.runtime.compiled import run_flex
from flexsparse.runtime.executors import Executor

_CONTIGUOUS_CACHE_SIZE = 8


class _MaskSet:
    """What one geometry needs for a layer's static patterns, built on first use: mask_mods, BlockMasks, their
    stack, and composed BlockMasks by (host modes, heads)."""

    def __init__(self) -> None:
        self.mask_mods: dict[int, object] = {}
        self.block_masks: dict[int, BlockMask] = {}
        self.stack: BlockMaskStack | None = None
        self.composed: dict[tuple, BlockMask] = {}


class FlexExecutor(Executor):
    """flex_attention for any patterns; ``compiled=False`` runs it eagerly (O(S^2) memory: small sizes only).

    ``layer_patterns`` are the layer's own patterns: their masks are cached; patterns resolved per call
    (content-dependent ones) are built per call.
    """

    def __init__(self, layer_patterns: Sequence[Pattern], compiled: bool = True, kernel_options: dict | None = None):
        self.layer_patterns = list(layer_patterns)
        self.compiled = compiled
        self.kernel_options = dict(kernel_options or {})
        self.name = "flex" if compiled else "flex_eager"
        self._contiguous: OrderedDict[tuple, _MaskSet] = OrderedDict()

    def __repr__(self) -> str:
        return f"FlexExecutor(compiled={self.compiled})"

    def run(self, call, patterns, modes, heads):
        q, k, v = heads.pick(call)
        geo, q_len = call.geometry, call.geometry.q_len
        if self.compiled and not geo.is_contiguous:
            q, k, v, geo = _bucketed(q, k, v, geo)
        block_mask = self._block_mask(geo, patterns, modes, heads, call.needs_grad)
        if self.compiled:
            out = run_flex(q, k, v, block_mask, call.scale, self.kernel_options)
        else:
            with warnings.catch_warnings():  # chosen explicitly and bounded by max_dense_len
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                out = flex_attention(q, k, v, block_mask=block_mask, scale=call.scale,
                                     enable_gqa=q.shape[1] != k.shape[1])
        return out if out.shape[2] == q_len else out[:, :, :q_len]

    # ----- masks ---------------------------------------------------------------------------------------------

    def _mask_set(self, geo: Geometry) -> _MaskSet:
        """The cache for this geometry: per layer for the contiguous layout, on the positions otherwise."""
        key = (geo.num_heads, geo.q_len, geo.kv_len, geo.block_size, geo.device)
        if geo.is_contiguous:
            found = self._contiguous.get(key)
            if found is None:
                found = self._contiguous[key] = _MaskSet()
                if len(self._contiguous) > _CONTIGUOUS_CACHE_SIZE:
                    self._contiguous.popitem(last=False)
            self._contiguous.move_to_end(key)
            return found
        return geo.positions.memo.setdefault(("flex masks", id(self)) + key, _MaskSet())

    def _parts(self, geo: Geometry, patterns: Sequence[Pattern | None]):
        """(mask_mods, block masks, cacheable) per mode; unused modes borrow a used mode's (never selected)."""
        cache = self._mask_set(geo)
        filler = next(i for i, p in enumerate(patterns) if p is not None)
        mods, masks, cacheable = [], [], True
        for index, pattern in enumerate(patterns):
            if pattern is None:
                pattern, index = patterns[filler], filler
            if index < len(self.layer_patterns) and pattern is self.layer_patterns[index]:
                if index not in cache.block_masks:
                    cache.mask_mods[index] = pattern.mask_mod(geo)
                    cache.block_masks[index] = pattern.block_mask(geo)
                mods.append(cache.mask_mods[index])
                masks.append(cache.block_masks[index])
            else:  # resolved for this call only
                cacheable = False
                mods.append(pattern.mask_mod(geo))
                masks.append(pattern.block_mask(geo))
        return cache, mods, masks, cacheable

    def _block_mask(self, geo: Geometry, patterns, modes: GroupModes, heads: HeadSelection,
                    needs_grad: bool) -> BlockMask:
        cache, mods, masks, cacheable = self._parts(geo, patterns)
        uniform = modes.uniform
        if uniform is not None and (heads.is_all or masks[uniform].kv_num_blocks.shape[1] == 1):
            return masks[uniform]  # one pattern for every selected head: its own mask, no dispatch
        key = (modes.host, heads.kv_heads)
        if cacheable and modes.host is not None and key in cache.composed:
            return cache.composed[key]
        if cacheable:
            if cache.stack is None:
                cache.stack = BlockMaskStack.from_masks(masks, geo.num_heads)
            stack = cache.stack
        else:
            stack = BlockMaskStack.from_masks(masks, geo.num_heads)
        per_head = modes.per_head
        subset = None if heads.is_all else heads.q_heads
        composed = stack.select(per_head, dispatch_mask_mod(mods, per_head, subset), heads=subset,
                                with_backward=needs_grad or modes.host is not None)
        if cacheable and modes.host is not None:
            cache.composed[key] = composed
        return composed


def _canonical(t: Tensor) -> Tensor:
    """``t`` with contiguous strides (compiled kernels specialise on strides, size-1 dimensions included)."""
    return t if t.stride() == torch.empty(t.shape, device="meta").stride() else t.clone(
        memory_format=torch.contiguous_format)


def _bucketed(q: Tensor, k: Tensor, v: Tensor, geo: Geometry) -> tuple[Tensor, Tensor, Tensor, Geometry]:
    """q/k/v and geometry padded to bucket lengths (padding rows and slots hold padding positions), with
    contiguous strides, so that every call of a bucket runs the same compiled variant. Inputs that already have
    bucket lengths and contiguous strides (a KV cache's buffers) are not copied."""
    kv_len = kv_bucket(geo.kv_len, geo.block_size)
    q_len = min(q_bucket(geo.q_len, geo.block_size), kv_len)
    if (q_len, kv_len) == (geo.q_len, geo.kv_len):
        return _canonical(q), _canonical(k), _canonical(v), geo
    memo_key = ("padded", q_len, kv_len)
    positions = geo.positions.memo.get(memo_key)
    if positions is None:
        positions = geo.positions.memo[memo_key] = geo.positions.padded(q_len, kv_len)
    pad = lambda t, length: F.pad(t, (0, 0, 0, length - t.shape[2]))
    return (pad(q, q_len), pad(k, kv_len), pad(v, kv_len),
            Geometry(geo.num_heads, q_len, kv_len, geo.block_size, geo.device, positions))
