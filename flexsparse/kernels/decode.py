"""Decode attention (flash-decoding) over per-head-group KV caches, through Triton: the entry points.

Two entry points share one split kernel and one combine kernel (:mod:`flexsparse.kernels.decode_kernels`):

* :func:`ranged_decode_attention`: one query per sequence and head attends the contiguous slots
  ``lo[b] <= slot < hi[b]`` of one K/V buffer of capacity C.
* :func:`decode_step_attention`: a layer's whole decode step in one call. The layer's KV heads are split among one
  or two cache groups (:class:`DecodeGroup`: e.g. a buffer of every token for the full heads and a sink + window
  ring for the others, capacities differing), each with its own slot range per sequence. The call writes the new
  token's key and value into each group's ``slot[b]`` and attends ``[lo[b], hi[b])`` with the new token there.

The bounds are read on the device, so a decode step never syncs the host and one compiled kernel serves every step
(the launch depends only on shapes).

Host path: the launch plan (:mod:`flexsparse.kernels.decode_launch`) is cached per call signature (shapes,
strides, dtypes, devices, scale, ``KERNEL_CONFIG``); the full argument checks run when a plan is built. A call
builds its signature, looks it up and launches the compiled kernels directly: no allocation but the output (none
with ``out=``), no host sync. :class:`DecodeStep` skips the signature too, for a loop of steps over one layer's
buffers (the KV cache's path).

What bounds it: for long ranges HBM bandwidth (every K and V byte of the range is read once; the workspace is
~``B * Hq * splits * d * 4`` bytes, small beside them); for short ranges (a sink + window ring of a few thousand
slots) the launch latency of the two kernels and one program's serial latency over its chunk; at batch 1 the host
(a model's Python around the step, the two launches, the output allocation): on an H100 the step's GPU time at
131K slots is about its host time (docs/notes/transformers.md).

The same functions in plain PyTorch, :func:`~flexsparse.kernels.decode_reference.ranged_decode_reference` and
:func:`~flexsparse.kernels.decode_reference.decode_step_reference`, live in
:mod:`flexsparse.kernels.decode_reference` with the argument checks and :class:`DecodeGroup` (no triton there: the
sparse KV cache imports this module only where the kernels run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.decode_launch import (  # noqa: F401  (KERNEL_CONFIG: tuned from here by tests, benchmarks)
    KERNEL_CONFIG,
    Plan,
    build_plan,
    config_signature,
    contiguous_strides,
    group_signature,
    run_plan,
    stride_args,
)
from flexsparse.kernels.decode_reference import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    DecodeGroup,
    check_decode_step_args,
    check_ranged_args,
    check_tensor,
)
from flexsparse.validation import as_float, as_int

_PLANS: dict[tuple, Plan] = {}
"""The launch plan of each call signature seen."""


def _check_kernel_args(q: Tensor, out: object, scale: object, splits: object, block_n: object) -> tuple:
    """What the kernels need beyond the shapes: the head dim, out, the device; returns (scale, splits, block_n)
    checked."""
    dim = q.shape[2]
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be in [1, {MAX_HEAD_DIM}], got {dim}")
    if out is not None:
        check_tensor("out", out, 3, (q.dtype,))
        if out.shape != q.shape or out.device != q.device:
            raise ValueError(f"out must have q's shape {list(q.shape)} on {q.device}, got {list(out.shape)} on "
                             f"{out.device}")
    scale = None if scale is None else as_float("scale", scale, positive=True)
    if block_n is not None:
        block_n = as_int("block_n", block_n, minimum=16)
        if block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two, got {block_n}")
    if splits is not None:
        splits = as_int("splits", splits, minimum=1, maximum=65535)  # the grid's second dimension
    reason = kernel_unavailable(q.device)
    if reason is not None:
        raise ValueError(f"the decode kernels need CUDA tensors or the Triton interpreter (q is on {q.device}: "
                         f"{reason}); elsewhere use the references in flexsparse.kernels.decode_reference")
    return scale, splits, block_n


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def ranged_decode_attention(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor,
                            scale: float | None = None, out: Tensor | None = None, *, splits: int | None = None,
                            block_n: int | None = None) -> Tensor:
    """Decode attention of one query per sequence and head over the cache slots ``lo[b] <= slot < hi[b]``.

    q ``[B, Hq, d]`` (any strides, e.g. a view of ``[B, Hq, 1, d]`` or a slice of heads); keys/values
    ``[B, Hkv, C, d]`` (any strides with a contiguous last dim; C = the buffer's capacity), ``Hq = G * Hkv``
    (query head h reads KV head ``h // G``); one dtype among float32/bfloat16/float16; d in [1, 256] (padded
    to a power of two >= 16 in registers). lo/hi int32 or int64 ``[B]`` on q's device (any stride): the range
    is clamped to ``[0, C]``; an empty range gives a zero row. ``scale`` defaults to ``d ** -0.5``.

    Returns ``[B, Hq, d]`` in q's dtype, written into ``out`` when given (any strides, e.g. a head slice of a
    larger buffer). ``splits`` / ``block_n`` override the split count per (sequence, KV head) and the slots per
    tile (a power of two >= 16); by default they follow from the shapes and ``KERNEL_CONFIG``. Never syncs the
    host: every launch parameter is a shape. The arguments are checked in full the first time a signature
    (shapes, strides, dtypes, devices, scale, overrides) is seen; later calls only look up its plan.
    """
    try:
        group = DecodeGroup(keys, values, 0, lo, hi, lo)  # lo stands in for the unused slot
        strides = stride_args(q, contiguous_strides(q.shape) if out is None else out.stride(), q, q, group, group)
        signature = ("ranged", q.shape, q.dtype, q.device, keys.shape, keys.dtype, keys.device, values.shape,
                     values.dtype, values.device, lo.shape, lo.dtype, lo.device, hi.shape, hi.dtype, hi.device,
                     None if out is None else (out.shape, out.dtype, out.device), scale, splits, block_n,
                     config_signature(), strides)
    except (AttributeError, TypeError, IndexError, RuntimeError):  # malformed arguments: the checks name them
        check_ranged_args(q, keys, values, lo, hi, SUPPORTED_DTYPES, kernel=True)
        _check_kernel_args(q, out, scale, splits, block_n)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        check_ranged_args(q, keys, values, lo, hi, SUPPORTED_DTYPES, kernel=True)
        checked_scale, checked_splits, checked_block_n = _check_kernel_args(q, out, scale, splits, block_n)
        plan = _PLANS[signature] = build_plan(q, keys.shape[1], [(keys.shape[1], keys.shape[2])], False,
                                               checked_scale, checked_splits, checked_block_n, strides)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.split is None:
        return out
    if keys.shape[2] == 0:  # no slot: every range is empty
        return out.zero_()
    run_plan(plan, q, out, q, q, group, group)  # q stands in for the unused new key and value
    return out


def decode_step_attention(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup],
                          scale: float | None = None, out: Tensor | None = None, *, splits: int | None = None,
                          block_n: int | None = None) -> Tensor:
    """One layer's decode step: write the new token into each group's cache, attend each group's slot ranges.

    q ``[B, Hq, d]``, k_new/v_new ``[B, Hkv, d]`` (any strides, e.g. views of ``[B, H, 1, d]``), ``Hq = G * Hkv``,
    one dtype among float32/bfloat16/float16, d in [1, 256]. ``groups``: one or two
    :class:`DecodeGroup` (any order) whose KV heads cover ``0 .. Hkv - 1`` exactly once; query head h belongs to
    KV head ``h // G``. For each group, sequence b and KV head: ``keys[b, head, slot[b]] = k_new[b, kv_start +
    head]`` (values alike), then each of the head's G queries attends slots ``lo[b] <= s < hi[b]`` of the updated
    buffer. ``scale`` defaults to ``d ** -0.5``.

    Returns ``[B, Hq, d]`` in q's dtype, written into ``out`` when given (any strides). ``splits`` / ``block_n``
    override the split count per (sequence, KV head) of every group and the slots per tile. One split-kernel
    launch (all groups) and, with several splits, one combine launch; no host sync. The arguments are checked in
    full the first time a signature (shapes, strides, dtypes, devices, scale, overrides) is seen; later calls
    only look up its plan. A loop of steps over the same buffers can skip the look-up: see :class:`DecodeStep`.
    """
    plan, first, second = _step_plan(q, k_new, v_new, groups, scale, out, splits, block_n)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.split is not None:
        run_plan(plan, q, out, k_new, v_new, first, second)
    return out


def _step_plan(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup], scale: float | None,
               out: Tensor | None, splits: int | None, block_n: int | None) -> tuple[Plan, DecodeGroup, DecodeGroup]:
    """The plan of a :func:`decode_step_attention` call (checked and built on the first call of its signature),
    and its groups in the kernel's order (the group holding KV head 0 first; twice for one group)."""
    try:
        first, second = groups[0], groups[-1]
        if first.kv_start:  # the kernel takes the group holding KV head 0 first
            first, second = second, first
        strides = stride_args(q, contiguous_strides(q.shape) if out is None else out.stride(), k_new, v_new, first,
                               second)
        signature = ("step", q.shape, q.dtype, q.device, k_new.shape, k_new.dtype, k_new.device, v_new.shape,
                     v_new.dtype, v_new.device, None if out is None else (out.shape, out.dtype, out.device),
                     len(groups), scale, splits, block_n, config_signature(), strides,
                     *group_signature(first), *(group_signature(second) if second is not first else ()))
    except (AttributeError, TypeError, IndexError, KeyError, RuntimeError):  # malformed: the checks name them
        check_decode_step_args(q, k_new, v_new, groups)
        _check_kernel_args(q, out, scale, splits, block_n)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        ordered = check_decode_step_args(q, k_new, v_new, groups)
        checked_scale, checked_splits, checked_block_n = _check_kernel_args(q, out, scale, splits, block_n)
        plan = _PLANS[signature] = build_plan(q, k_new.shape[1], [g.keys.shape[1:3] for g in ordered], True,
                                               checked_scale, checked_splits, checked_block_n, strides)
    return plan, first, second


class DecodeStep:
    """:func:`decode_step_attention` prepared for one layer's cache buffers, for a loop of decode steps.

    Built from a first step's arguments (checked in full, the launch plan made); a call runs one step like
    ``decode_step_attention(q, k_new, v_new, groups, scale)`` with no signature to build or look up: its host work
    is the output's allocation and the launches. q, k_new and v_new may also be ``[B, H, 1, d]`` (a model's
    one-token projections, as views need host time too); the output then is ``[B, Hq, 1, d]``. A step's
    arguments must be what :meth:`accepts` takes: the same group buffers (the same tensors: a cache that
    reallocates them builds a new DecodeStep), q, k_new, v_new and the groups' lo/hi/slot of the same shapes,
    strides and dtypes on q's device, the same ``kv_start`` and scale.
    """

    __slots__ = ("scale", "_plan", "_buffers", "_layout", "_first")

    def __init__(self, q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup],
                 scale: float | None = None, *, splits: int | None = None, block_n: int | None = None) -> None:
        views = [q, k_new, v_new]
        for i, (name, t) in enumerate(zip(("q", "k_new", "v_new"), views)):
            if isinstance(t, Tensor) and t.dim() == 4:
                if t.shape[2] != 1:
                    raise ValueError(f"{name} [B, H, 1, d] must hold one token, got shape {list(t.shape)}")
                views[i] = t[:, :, 0]
        self._plan = _step_plan(*views, groups, scale, None, splits, block_n)[0]
        self._first = -1 if groups[0].kv_start else 0  # the group the kernel takes first (the one of KV head 0)
        self.scale = scale
        self._buffers = tuple((group.keys, group.values) for group in groups)
        self._layout = _step_layout(q, k_new, v_new, groups)

    def accepts(self, q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup],
                scale: float | None = None) -> bool:
        """Whether a step's arguments fit this preparation (see the class docstring)."""
        return (scale == self.scale and len(groups) == len(self._buffers)
                and all(g.keys is keys and g.values is values for g, (keys, values) in zip(groups, self._buffers))
                and _step_layout(q, k_new, v_new, groups) == self._layout)

    def __call__(self, q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup]) -> Tensor:
        """One step: ``[B, Hq, d]`` (``[B, Hq, 1, d]`` for 4-D q) in q's dtype; the arguments must be ones
        :meth:`accepts` takes (not re-checked)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # its [B, Hq, d] strides are the plan's
        if self._plan.split is not None:  # a [B, H, 1, d] tensor passes the pointer of its [B, H, d] view
            run_plan(self._plan, q, out, k_new, v_new, groups[self._first], groups[-1 - self._first])
        return out


def _step_layout(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup]) -> tuple:
    """What a :class:`DecodeStep` depends on in a step's arguments, besides the group buffers themselves."""
    return (q.shape, q.stride(), q.dtype, q.device, k_new.shape, k_new.stride(), k_new.dtype, v_new.shape,
            v_new.stride(), v_new.dtype,
            *((g.kv_start, g.lo.shape, g.lo.stride(), g.lo.dtype, g.hi.shape, g.hi.stride(), g.hi.dtype, g.slot.shape,
               g.slot.stride(), g.slot.dtype) for g in groups))
