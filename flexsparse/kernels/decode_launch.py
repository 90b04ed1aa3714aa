"""Launch plans of the decode kernels (:mod:`flexsparse.kernels.decode_kernels`): the tuned settings, split
counts and tile size, and each kernel as a :class:`~flexsparse.kernels.launch.CompiledLaunch` with its integers
and constexprs fixed, so a call launches them with no host work but the tensors.

Split counts come from host ints only (B, the groups' heads and capacities, the SM count): chunks of about equal
capacity so that all groups together give ``programs_per_sm`` programs per SM, none shorter than
``min_blocks_per_split`` tiles (on an H100 at B = 1: 126 splits per head of a 131K-slot group, 3 of a 2K-slot
ring). A plan's fp32 workspace is reused by every call of that plan: calls on one stream are ordered, so that is
safe; concurrent calls of one plan on two streams are not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from flexsparse.kernels.decode_kernels import decode_combine_kernel, decode_split_kernel
from flexsparse.kernels.decode_reference import DecodeGroup
from flexsparse.kernels.launch import CompiledLaunch

KERNEL_CONFIG = {
    "programs_per_sm": 2,  # target split-kernel programs per SM, all groups together
    "min_blocks_per_split": 2,  # a split spans at least this many BLOCK_N tiles of the capacity
    "tile_bytes": 16384,  # BLOCK_N * d * element size of one K (or V) tile, BLOCK_N clamped to [16, 128]
    "num_warps": 4,
    "num_stages": 3,  # K/V tiles in flight per program (software pipelining of the slot loop)
    "combine_elements": 8192,  # workspace elements (splits x d) the combine kernel reads per step
    "combine_warps": 4,
}
"""Launch settings of both entry points (part of the plan signature, so a benchmark can sweep them)."""

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call signature launches (built once by :func:`build_plan`); None launches: nothing to compute
    (B or Hq is 0)."""

    split: CompiledLaunch | None  # the split kernel over both groups, its integers (strides, ...) fixed
    workspace: Tensor | None  # fp32 partials; None with one split (the split kernel writes the output)
    combine: CompiledLaunch | None  # the combine kernel (None with one split)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _padded_dim(dim: int) -> int:
    """The head dim as the kernels hold it: the next power of two, at least 16 (the tensor-core minimum)."""
    return max(16, triton.next_power_of_2(dim))


def _block_n(dim: int, dtype: torch.dtype) -> int:
    """Slots per K/V tile: ``KERNEL_CONFIG["tile_bytes"]`` per tile, a power of two in [16, 128]."""
    slots = KERNEL_CONFIG["tile_bytes"] // (_padded_dim(dim) * dtype.itemsize)
    return max(16, min(128, triton.next_power_of_2(max(slots, 1))))


def _split_counts(batch: int, groups: list[tuple[int, int]], block_n: int, device: torch.device) -> list[int]:
    """Splits per (sequence, KV head) of each group of (KV heads, capacity), from host ints only: chunks of equal
    capacity, as many as give ``programs_per_sm`` programs per SM over all groups, none shorter than
    ``min_blocks_per_split`` tiles; at least one per group."""
    target = KERNEL_CONFIG["programs_per_sm"] * _sm_count(device)
    slots = batch * sum(heads * capacity for heads, capacity in groups)
    chunk = max(KERNEL_CONFIG["min_blocks_per_split"] * block_n, triton.cdiv(slots, target))
    return [max(1, triton.cdiv(capacity, chunk)) for _, capacity in groups]


def build_plan(q: Tensor, kv_heads: int, groups: list[tuple[int, int]], has_new: bool, scale: float | None,
                splits: int | None, block_n: int | None, strides: tuple[int, ...]) -> Plan:
    """The launches of one call signature: groups (KV heads, capacity) in KV-head order, arguments checked,
    ``strides`` the split kernel's stride arguments (:func:`stride_args`)."""
    batch, heads, dim = q.shape
    if not batch * heads:
        return Plan(None, None, None)
    scale = dim**-0.5 if scale is None else scale
    block_n = _block_n(dim, q.dtype) if block_n is None else block_n
    counts = [splits] * len(groups) if splits is not None else _split_counts(batch, groups, block_n, q.device)
    (first_heads, first_capacity), (_, second_capacity) = groups[0], groups[-1]
    first_splits, second_splits = counts[0], counts[-1]
    row_splits = max(counts)
    pairs = batch * heads
    stats_offset = pairs * row_splits * dim  # (max, sum) pairs follow the accumulators
    group_size = heads // kv_heads
    split = CompiledLaunch(
        decode_split_kernel, (batch * kv_heads, row_splits),
        strides + (first_capacity, first_splits, second_capacity, second_splits, stats_offset, scale * _LOG2E),
        dict(KV_HEADS=kv_heads, FIRST_KV_HEADS=first_heads, HAS_SECOND=len(groups) == 2, GROUP=group_size,
             G_PAD=max(16, triton.next_power_of_2(group_size)), D=dim, D_PAD=_padded_dim(dim), BLOCK_N=block_n,
             HAS_NEW=has_new, DIRECT=row_splits == 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32"),
        dict(num_warps=KERNEL_CONFIG["num_warps"], num_stages=KERNEL_CONFIG["num_stages"]))
    if row_splits == 1:
        return Plan(split, None, None)
    workspace = torch.empty(pairs * row_splits * (dim + 2), dtype=torch.float32, device=q.device)
    block_s = min(triton.next_power_of_2(row_splits), max(1, KERNEL_CONFIG["combine_elements"] // _padded_dim(dim)))
    combine = CompiledLaunch(
        decode_combine_kernel, (pairs,), strides[3:6] + (first_splits, second_splits, row_splits, stats_offset),
        dict(HEADS=heads, FIRST_HEADS=first_heads * group_size, D=dim, D_PAD=_padded_dim(dim), BLOCK_S=block_s),
        dict(num_warps=KERNEL_CONFIG["combine_warps"]))
    return Plan(split, workspace, combine)


def stride_args(q: Tensor, out_strides: tuple[int, ...], k_new: Tensor, v_new: Tensor, first: DecodeGroup,
                 second: DecodeGroup) -> tuple[int, ...]:
    """The split kernel's stride arguments, in its order (q, out, k_new, v_new, then each group's)."""
    k1, v1, k2, v2 = first.keys.stride(), first.values.stride(), second.keys.stride(), second.values.stride()
    return (*q.stride(), *out_strides, *k_new.stride(), *v_new.stride(),
            k1[0], k1[1], k1[2], v1[0], v1[1], v1[2], first.lo.stride(0), first.hi.stride(0), first.slot.stride(0),
            k2[0], k2[1], k2[2], v2[0], v2[1], v2[2], second.lo.stride(0), second.hi.stride(0), second.slot.stride(0))


def contiguous_strides(shape: torch.Size) -> tuple[int, int, int]:
    """Strides of a new contiguous ``[B, H, d]`` tensor (the output when no ``out`` is given)."""
    return (shape[1] * shape[2], shape[2], 1)


def run_plan(plan: Plan, q: Tensor, out: Tensor, k_new: Tensor, v_new: Tensor, first: DecodeGroup,
            second: DecodeGroup) -> None:
    """The split kernel over both groups (``second is first`` for one group), then the combine (with splits)."""
    workspace = out if plan.workspace is None else plan.workspace
    plan.split(q, out, workspace, k_new, v_new, first.keys, first.values, first.lo, first.hi, first.slot,
               second.keys, second.values, second.lo, second.hi, second.slot)
    if plan.combine is not None:
        plan.combine(workspace, out)


def config_signature() -> tuple:
    return tuple(KERNEL_CONFIG.values())


def group_signature(group: DecodeGroup) -> tuple:
    """What a plan depends on in a group: its heads, and the shapes, strides, dtypes and devices of its tensors."""
    keys, values, lo, hi, slot = group.keys, group.values, group.lo, group.hi, group.slot
    return (group.kv_start, keys.shape, keys.stride(), keys.dtype, keys.device, values.shape, values.stride(),
            values.dtype, values.device, lo.shape, lo.dtype, lo.device, hi.shape, hi.dtype, hi.device, slot.shape,
            slot.dtype, slot.device)
