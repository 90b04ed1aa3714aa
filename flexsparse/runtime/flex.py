"""The flex executors: any mix of patterns over a group of heads in one flex_attention launch.

Each pattern's BlockMask is built once per geometry (cached here for the contiguous layout, kept in the state of
the call's :class:`~flexsparse.masks.geometry.Positions` otherwise, once per forward). Per-head
modes select index rows with one gather (:class:`~flexsparse.masks.blocks.BlockMaskStack`) and one dispatching
mask_mod captures the mode tensor: new modes and new positions are new tensor values, never a recompile.

Compiled calls run at the shapes of :mod:`flexsparse.runtime.buckets`: lengths off the key grid padded to
their bucket (padding rows and slots hold padding positions; contiguous prefill as ``PREFILL_POLICY`` says),
the batch in power-of-two parts, one launch each on views of q/k/v. So any mix of prompt lengths, batch sizes
and padding widths compiles a bounded number of variants.

**Backend of a compiled launch** (``kernel_options``), in order of precedence:

1. a layer built with ``kernel_options`` (a non-empty dict) passes them to every launch as they are:
   flexsparse chooses nothing (``{"BACKEND": "FLASH"}`` asks for FlashAttention-4's kernels,
   ``{"BACKEND": "TRITON"}`` pins torch's Triton kernels);
2. otherwise a launch runs FLASH (``{"BACKEND": "FLASH"}``) where the device's measured table
   (:mod:`flexsparse.runtime.flex_backend_table`) has FLASH faster than Triton for its pattern, pass and
   length, and the launch is one FLASH is known to run: one of the layer's static patterns on every head of
   the launch (its own BlockMask, no mode dispatch), a contiguous prefill that runs as it is (as many queries
   as keys, a length on the key grid, no position tables: its mask_mod captures no tensor), on CUDA in the
   table's dtype (bf16 or fp16), head dim and block size, with FlashAttention-4 importable (the ``fast``
   extra), outside a caller's ``torch.compile``, and not a training call under
   ``torch.use_deterministic_algorithms`` (FLASH's block-sparse backward has no deterministic form before
   SM100);
3. everywhere else torch's default (Triton; ``kernel_options=None``).

The choice reads host values only (no sync), and each choice is a compiled variant of its own, built once.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexsparse.masks.base import Pattern
from flexsparse.masks.blocks import BlockMaskStack
from flexsparse.masks.combine import dispatch_mask_mod
from flexsparse.masks.geometry import Geometry, Positions
from flexsparse.runtime import buckets
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.compiled import run_flex
from flexsparse.runtime.cost import (
    DENSE_FLOPS_PER_S,
    FLEX_FULL_SPEED,
    FLEX_PARTIAL_TILE_COST,
    attention_flops,
    causal_pairs,
    causal_tile_pairs,
)
from flexsparse.runtime.executors import Executor
from flexsparse.runtime.fa4_executor import fa4_runs_on
from flexsparse.runtime.flex_backend_table import flash_time_ratio

_CONTIGUOUS_CACHE_SIZE = 8
CPU_COMPILED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes compiled flex_attention runs on a CPU (inductor refuses float64 there)."""
FLASH_OPTIONS = {"BACKEND": "FLASH"}
"""The kernel options of a launch flexsparse runs on FLASH (see the module docstring)."""


def as_kernel_options(name: str, value: object) -> dict | None:
    """``value`` as flex_attention's kernel options: a dict copy of a mapping with string keys, or None;
    TypeError naming ``name`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise TypeError(f"{name} must be a dict of flex_attention kernel options (e.g. {FLASH_OPTIONS}) or "
                        f"None, got {type(value).__name__} {value!r}")
    return dict(value)


class _MaskSet:
    """What one geometry needs for a layer's static patterns, built on first use: the geometry the call runs
    at (bucketed when compiled), mask_mods, BlockMasks, their stack, and composed BlockMasks by (host modes,
    heads)."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.mask_mods: dict[int, object] = {}
        self.block_masks: dict[int, BlockMask] = {}
        self.stack: BlockMaskStack | None = None
        self.composed: dict[tuple, BlockMask] = {}


class FlexExecutor(Executor):
    """flex_attention for any patterns; ``compiled=False`` runs it eagerly (O(S^2) memory: small sizes only).

    ``layer_patterns`` are the layer's own patterns: their masks are cached; patterns resolved per call
    (content-dependent ones) are built per call. Compiled, a call runs at the shapes of
    :mod:`flexsparse.runtime.buckets`: lengths padded to their bucket, the batch in power-of-two parts, each
    part with its rows of the positions and modes (a content-dependent pattern is resolved again on the part).
    """

    fuses = True

    def __init__(self, layer_patterns: Sequence[Pattern], compiled: bool = True, kernel_options: dict | None = None,
                 max_len: int | None = None):
        self.layer_patterns = list(layer_patterns)
        self.compiled = compiled
        self.kernel_options = as_kernel_options("kernel_options", kernel_options) or {}
        """The user's options for every compiled launch; empty: each launch's backend as the module docstring
        says."""
        self.max_len = max_len
        """The longest q_len/kv_len accepted (None: any); eager flex is O(S^2) in memory."""
        self.name = "flex" if compiled else "flex_eager"
        self._contiguous: OrderedDict[tuple, _MaskSet] = OrderedDict()

    def __repr__(self) -> str:
        return f"FlexExecutor(compiled={self.compiled})"

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        """Any pattern, except where flex cannot run the call: a CPU backward (flex is forward-only there), a
        dtype compiled flex does not take on the CPU, or a length past ``max_len``."""
        geo, on_cpu = call.geometry, call.q.device.type == "cpu"
        if on_cpu and (call.needs_grad or (self.compiled and call.q.dtype not in CPU_COMPILED_DTYPES)):
            return False
        return self.max_len is None or max(geo.q_len, geo.kv_len) <= self.max_len

    def cost(self, patterns, call):
        """Full heads: their causal pairs at flex's speed on full tiles. Other heads: every causal tile, each at
        the cost of a partial one (their density is not known on the host before the mask is built: an upper
        estimate). A launch that runs on FLASH (the module docstring) costs that times FLASH's measured time
        over Triton's."""
        full = sum(p.is_full for p in patterns)
        work = attention_flops(call, full, causal_pairs(call))
        if full < len(patterns):
            work += FLEX_PARTIAL_TILE_COST * attention_flops(call, len(patterns) - full, causal_tile_pairs(call))
        seconds = work / (DENSE_FLOPS_PER_S * FLEX_FULL_SPEED)
        one = patterns[0] if patterns and all(p is patterns[0] for p in patterns) else None
        ratio = self._flash_ratio(one, call.geometry, _runs_as_is(call.geometry), call.q, call.needs_grad)
        return seconds if ratio is None else seconds * ratio

    def run(self, call, patterns, modes, heads):
        q, k, v = heads.pick(call)
        parts = buckets.batch_parts(q.shape[0]) if self.compiled else [(0, q.shape[0])]
        if len(parts) == 1:
            return self._run_part(call.geometry, q, k, v, patterns, modes, heads, call.scale, call.needs_grad)
        outputs = []
        for start, size in parts:  # each part a call of its own rows: positions, modes, resolved patterns
            rows = slice(start, start + size)
            geo = _batch_rows(call.geometry, start, size)
            part_patterns = [self._part_pattern(i, p, call, rows, geo) for i, p in enumerate(patterns)]
            part_modes = GroupModes(modes.q_modes[rows] if modes.q_modes.shape[0] > 1 else modes.q_modes,
                                    modes.host)
            outputs.append(self._run_part(geo, q[rows], k[rows], v[rows], part_patterns, part_modes, heads,
                                          call.scale, call.needs_grad))
        return torch.cat(outputs)

    def _part_pattern(self, index: int, pattern: Pattern | None, call, rows: slice,
                      geo: Geometry) -> Pattern | None:
        """Mode ``index``'s pattern for a batch part: a content-dependent layer pattern resolved on the part's
        rows (its resolution for the whole call holds data of every batch element), any other as it is."""
        layer = self.layer_patterns[index] if index < len(self.layer_patterns) else None
        if pattern is None or layer is None or pattern is layer or not layer.is_dynamic:
            return pattern
        return layer.resolve(call.q[rows], call.k[rows], geo, query_heads=call.subset_query_heads())

    def _run_part(self, geo: Geometry, q: Tensor, k: Tensor, v: Tensor, patterns, modes: GroupModes,
                  heads: HeadSelection, scale: float, needs_grad: bool) -> Tensor:
        """One launch: q/k/v of one batch part (the whole batch when it is a power of two) at the geometry's
        compiled shape, output cut back to the geometry's queries."""
        cache = self._mask_set(geo)
        run_geo = cache.geometry
        if self.compiled and not run_geo.is_contiguous:  # bucket lengths, contiguous strides: one variant
            q = _padded(q, run_geo.q_len)
            k, v = _padded(k, run_geo.kv_len), _padded(v, run_geo.kv_len)
        block_mask, own = self._block_mask(cache, patterns, modes, heads, needs_grad)
        if self.compiled:
            options = self.kernel_options or None
            if options is None and self._flash_ratio(own, geo, run_geo.is_contiguous, q, needs_grad) is not None:
                options = FLASH_OPTIONS
            out = run_flex(q, k, v, block_mask, scale, options)
        else:
            with warnings.catch_warnings():  # chosen explicitly and bounded by max_dense_len
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                out = flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                     enable_gqa=q.shape[1] != k.shape[1])
        return out if out.shape[2] == geo.q_len else out[:, :, :geo.q_len]

    def _flash_ratio(self, pattern: Pattern | None, geo: Geometry, as_is: bool, q: Tensor,
                     grad: bool) -> float | None:
        """FLASH's measured time over Triton's (below 1) for a launch of ``pattern``'s own mask over ``geo``
        (``as_is``: it runs without position tables), or None where flexsparse runs the launch on Triton (the
        module docstring)."""
        if (pattern is None or not self.compiled or self.kernel_options or not as_is
                or geo.q_len != geo.kv_len or not buckets.is_kv_bucket(geo.kv_len, geo.block_size)
                or not any(pattern is p for p in self.layer_patterns) or pattern.is_dynamic
                or torch.compiler.is_compiling() or (grad and torch.are_deterministic_algorithms_enabled())
                or not fa4_runs_on(q.device)):
            return None
        ratio = flash_time_ratio(pattern.name, q.device, q.dtype, q.shape[-1], geo.block_size, geo.kv_len,
                                 grad)
        return None if ratio is None or ratio >= 1 else ratio

    # ----- masks ---------------------------------------------------------------------------------------------

    def _mask_set(self, geo: Geometry) -> _MaskSet:
        """The cache for a call's geometry: per layer for the contiguous layout (with the geometry the layer
        runs it at), on the positions of the geometry it runs at otherwise."""
        run_at = buckets.compiled_geometry if self.compiled else lambda g: g
        if geo.is_contiguous:
            key = (geo.num_heads, geo.q_len, geo.kv_len, geo.block_size, geo.device, buckets.PREFILL_POLICY)
            found = self._contiguous.get(key)
            if found is None:
                found = self._contiguous[key] = _MaskSet(run_at(geo))
                if len(self._contiguous) > _CONTIGUOUS_CACHE_SIZE:
                    self._contiguous.popitem(last=False)
            self._contiguous.move_to_end(key)
            return found
        run_geo = run_at(geo)
        return run_geo.positions.state.flex_masks(self, geo.num_heads, run_geo.q_len, run_geo.kv_len, geo.block_size,
                                                  lambda: _MaskSet(run_geo))

    def _parts(self, cache: _MaskSet, patterns: Sequence[Pattern | None]):
        """(mask_mods, block masks, cacheable) per mode; unused modes borrow a used mode's (never selected)."""
        geo = cache.geometry
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
        return mods, masks, cacheable

    def _block_mask(self, cache: _MaskSet, patterns, modes: GroupModes, heads: HeadSelection,
                    needs_grad: bool) -> tuple[BlockMask, Pattern | None]:
        """The launch's BlockMask, and the pattern whose own mask it is (None: a mask composed per head, whose
        mask_mod dispatches on the mode tensor)."""
        mods, masks, cacheable = self._parts(cache, patterns)
        geo = cache.geometry
        uniform = modes.uniform
        if uniform is not None and (heads.is_all or masks[uniform].kv_num_blocks.shape[1] == 1):
            return masks[uniform], patterns[uniform]  # one pattern for every selected head: its own mask
        key = (modes.host, heads.kv_heads)
        if cacheable and modes.host is not None and key in cache.composed:
            return cache.composed[key], None
        if cacheable:
            if cache.stack is None:
                cache.stack = BlockMaskStack.from_masks(masks, geo.num_heads)
            stack = cache.stack
        else:
            stack = BlockMaskStack.from_masks(masks, geo.num_heads)
        q_modes = modes.q_modes
        subset = None if heads.is_all else heads.q_heads
        composed = stack.select(q_modes, dispatch_mask_mod(mods, q_modes, subset), heads=subset,
                                with_backward=needs_grad or modes.host is not None)
        if cacheable and modes.host is not None:
            cache.composed[key] = composed
        return composed, None


def _runs_as_is(geo: Geometry) -> bool:
    """Whether a compiled call of ``geo`` runs at its own lengths without position tables (what
    :func:`~flexsparse.runtime.buckets.compiled_geometry` keeps as it is: a contiguous prefill on the grid, or
    any contiguous call under ``PREFILL_POLICY = "exact"``), so its mask_mods capture no tensor."""
    if not geo.is_contiguous:
        return False
    lengths = buckets.compiled_lengths(geo.q_len, geo.kv_len, geo.block_size)
    return buckets.PREFILL_POLICY == "exact" or (buckets.PREFILL_POLICY == "grid"
                                                 and lengths == (geo.q_len, geo.kv_len))


def _canonical(t: Tensor) -> Tensor:
    """``t`` with contiguous strides (compiled kernels specialise on strides, size-1 dimensions included)."""
    return t if t.stride() == torch.empty(t.shape, device="meta").stride() else t.clone(
        memory_format=torch.contiguous_format)


def _padded(t: Tensor, length: int) -> Tensor:
    """``t`` ``[B, H, L, d]`` with zero rows appended up to ``length``, contiguous (so every call of a bucket
    runs the same compiled variant); inputs that already have the length and contiguous strides are not
    copied."""
    if t.shape[2] == length:
        return _canonical(t)
    return F.pad(t, (0, 0, 0, length - t.shape[2]))


def _batch_rows(geo: Geometry, start: int, size: int) -> Geometry:
    """The geometry of batch elements ``start .. start + size``: ``geo`` itself when its positions are
    shared by the batch, else one with those rows of the position tables (kept in the positions' state, so every
    layer of a forward shares the part's tables and the masks kept in theirs)."""
    positions = geo.positions
    if positions is None or positions.batch == 1:
        return geo
    rows = lambda table: table if table.shape[0] == 1 else table[start:start + size]
    part = positions.state.batch_rows(start, size,
                                      lambda: Positions(rows(positions.q), rows(positions.kv), positions.span))
    return Geometry(geo.num_heads, geo.q_len, geo.kv_len, geo.block_size, geo.device, part)
