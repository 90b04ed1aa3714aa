"""Decode attention (flash-decoding) over per-head-group KV caches, in Triton.

Two entry points share one split kernel and one combine kernel:

* :func:`ranged_decode_attention`: one query per sequence and head attends the contiguous slots
  ``lo[b] <= slot < hi[b]`` of one K/V buffer of capacity C.
* :func:`decode_step_attention`: a layer's whole decode step in one call. The layer's KV heads are split among one
  or two cache groups (:class:`DecodeGroup`: e.g. a buffer of every token for the full heads and a sink + window
  ring for the others, capacities differing), each with its own slot range per sequence. The call writes the new
  token's key and value into each group's ``slot[b]`` and attends ``[lo[b], hi[b])`` with the new token there.

The bounds are read on the device, so a decode step never syncs the host and one compiled kernel serves every step
(the launch depends only on shapes).

* Split-K: the grid is ``(B * Hkv, splits)``. Program (b, kv head, s) takes the s-th of its group's ``S_g`` equal
  chunks of ``[lo[b], hi[b])`` (a multiple of BLOCK_N slots, split on the device from the live range, so a short
  range in a large buffer still spreads over the splits; chunks past ``hi`` are empty and contribute nothing).
  ``S_g`` comes from host ints only (B, the groups' heads and capacities, the SM count): chunks of about equal
  capacity so that all groups together give ``programs_per_sm`` programs per SM, none shorter than
  ``min_blocks_per_split`` tiles. The grid's second dimension is the largest ``S_g``; the programs past their
  group's count do nothing (on an H100 at B = 1: 126 splits per head of a 131K-slot group, 3 of a 2K-slot ring).
* Two groups in one launch: the group holding KV head 0 comes first; a program picks its group by comparing its
  KV head with the first group's head count (constexpr ``HAS_SECOND``), then runs the same code on that group's
  pointers, strides, capacity and bounds.
* The new token without a race: every program masks ``slot[b]`` out of its cache reads; the split-0 program of
  each (sequence, KV head) stores k_new/v_new there and starts its online softmax from the new key (one score
  per query row from registers, ``1 * v_new`` in the accumulator). No program reads what another writes.
* GQA sharing: a program handles all G query heads of its KV head, so K and V are read from HBM once per group:
  scores are a ``[G_PAD, d] x [d, BLOCK_N]`` tl.dot (G padded to >= 16 rows, the tensor-core minimum, padding
  rows masked), then an online softmax in fp32 and ``P @ V`` into an fp32 accumulator.
* Combine: each program writes its partial (row max, row sum, unnormalised accumulator) into an fp32 workspace;
  a second small kernel merges the splits of each (b, query head) and writes the output (an empty range gives
  zeros). With one split the first kernel normalises and writes the output itself (one launch).
* Host path: the launch plan (split counts, tile size, grid, an fp32 workspace reused by every call of that plan,
  and each kernel as a :class:`~flexsparse.kernels.launch.CompiledLaunch` with its integers and constexprs fixed)
  is cached per call signature (shapes, strides, dtypes, devices, scale, ``KERNEL_CONFIG``); the full argument
  checks run when a plan is built. A call builds its signature, looks it up and launches the compiled kernels
  directly: no allocation but the output (none with ``out=``), no host sync. :class:`DecodeStep` skips the
  signature too, for a loop of steps over one layer's buffers (the KV cache's path). Calls on one stream are
  ordered, so reusing the workspace is safe; concurrent calls of one signature on two streams are not.

What bounds it: for long ranges HBM bandwidth (every K and V byte of the range is read once; the workspace is
~``B * Hq * splits * d * 4`` bytes, small beside them); for short ranges (a sink + window ring of a few thousand
slots) the launch latency of the two kernels and one program's serial latency over its chunk; at batch 1 the host
(a model's Python around the step, the two launches, the output allocation): on an H100 the step's GPU time at
131K slots, 0.060 ms, is about its host time.

fp32 inputs use exact (ieee) dots; 16-bit inputs use the tensor cores with fp32 accumulation and P rounded to the
input dtype for ``P @ V`` (as FlashAttention). The same functions in plain PyTorch,
:func:`~flexsparse.kernels.decode_reference.ranged_decode_reference` and
:func:`~flexsparse.kernels.decode_reference.decode_step_reference`, live beside this module in
:mod:`flexsparse.kernels.decode_reference` with the argument checks and :class:`DecodeGroup` (no triton there: the
sparse KV cache imports this module only where the kernels run).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.decode_reference import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    DecodeGroup,
    check_decode_step_args,
    check_ranged_args,
    check_tensor,
)
from flexsparse.kernels.launch import CompiledLaunch
from flexsparse.validation import as_float, as_int

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


@triton.jit
def _dim_mask(dims, D: tl.constexpr, D_PAD: tl.constexpr):
    """Which of the D_PAD lanes ``dims`` hold one of the head's D dims: a constant all-true mask when D is a power
    of two (the compiler then drops the masks it is combined into)."""
    if D_PAD == D:
        return tl.full([D_PAD], 1, tl.int1)
    else:
        return dims < D


@triton.jit
def _attend_chunk(
    Q, O, WS, KN, VN, K, V, LO, HI, SLOT,
    batch64, kv_head, local_head, split, row_splits,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od,
    stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_lo, stride_hi, stride_slot,
    capacity, splits, stats_offset, scale_log2,
    HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_NEW: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Chunk ``split`` of ``splits`` of [LO[b], HI[b]) of one group's buffers K/V (head ``local_head``) for the
    GROUP query heads of the layer's KV head ``kv_head``: O [B, HEADS, D] when DIRECT, else partials into WS rows
    ``(b * HEADS + head) * row_splits + split``. With HAS_NEW, slot SLOT[b] is masked out of the reads and split 0
    stores KN/VN [B, Hkv, D] there and attends them from registers."""
    if split < splits:
        lo = tl.minimum(tl.maximum(tl.load(LO + batch64 * stride_lo), 0), capacity).to(tl.int32)
        hi = tl.minimum(tl.maximum(tl.load(HI + batch64 * stride_hi), 0), capacity).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), splits), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)

        rows = tl.arange(0, G_PAD)
        dims = tl.arange(0, D_PAD)  # lanes past D (a head dim that is not a power of two) load 0, store nothing
        in_dim = _dim_mask(dims, D, D_PAD)
        cols = tl.arange(0, BLOCK_N)
        real = rows < GROUP  # padding rows (G < G_PAD) compute with q = 0 and are never stored
        head64 = (kv_head * GROUP + rows).to(tl.int64)
        q_real = real[:, None] & in_dim[None, :]
        q = tl.load(Q + batch64 * stride_qb + head64[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=q_real, other=0.0)
        k_head = K + batch64 * stride_kb + local_head.to(tl.int64) * stride_kh
        v_head = V + batch64 * stride_vb + local_head.to(tl.int64) * stride_vh
        first = start.to(tl.int64) + cols[:, None]
        k_ptrs = k_head + first * stride_ks + dims[None, :]
        v_ptrs = v_head + first * stride_vs + dims[None, :]

        if HAS_NEW:
            slot = tl.load(SLOT + batch64 * stride_slot).to(tl.int32)
            kv64 = kv_head.to(tl.int64)
            k_new = tl.load(KN + batch64 * stride_knb + kv64 * stride_knh + dims * stride_knd, mask=in_dim, other=0.0)
            v_new = tl.load(VN + batch64 * stride_vnb + kv64 * stride_vnh + dims * stride_vnd, mask=in_dim, other=0.0)
            owner = split == 0
            if owner & (slot >= 0) & (slot < capacity):
                tl.store(k_head + slot.to(tl.int64) * stride_ks + dims, k_new, mask=in_dim)
                tl.store(v_head + slot.to(tl.int64) * stride_vs + dims, v_new, mask=in_dim)
            new_score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
            m_max = tl.where(owner, new_score, float("-inf"))  # the softmax state of the new key alone
            l_sum = tl.zeros([G_PAD], dtype=tl.float32) + tl.where(owner, 1.0, 0.0)
            acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32) + tl.where(owner, v_new.to(tl.float32)[None, :], 0.0)
        else:
            m_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
            l_sum = tl.zeros([G_PAD], dtype=tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for n in range(start, end, BLOCK_N):
            inside = n + cols < end
            if HAS_NEW:
                inside = inside & (n + cols != slot)  # its old content; the new key is in the state already
            k = tl.load(k_ptrs, mask=inside[:, None] & in_dim[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=inside[:, None] & in_dim[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_max, tl.max(scores, axis=1))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # -inf: nothing seen yet (a tile of the slot alone)
            alpha = tl.math.exp2(m_max - m_ref)
            p = tl.math.exp2(scores - m_ref[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_max = m_new
            k_ptrs += BLOCK_N * stride_ks
            v_ptrs += BLOCK_N * stride_vs

        if DIRECT:
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an empty range: acc = 0, a zero row
            tl.store(O + batch64 * stride_ob + head64[:, None] * stride_oh + dims[None, :] * stride_od,
                     out.to(O.dtype.element_ty), mask=q_real)
        else:
            row = (batch64 * HEADS + head64) * row_splits + split  # [G_PAD] partial rows
            tl.store(WS + row[:, None] * D + dims[None, :], acc, mask=q_real)
            tl.store(WS + stats_offset + 2 * row, m_max, mask=real)  # -inf for an empty chunk
            tl.store(WS + stats_offset + 2 * row + 1, l_sum, mask=real)


@triton.jit(do_not_specialize_on_alignment=["LO1", "HI1", "SLOT1", "LO2", "HI2", "SLOT2"])
def _decode_split_kernel(
    Q, O, WS, KN, VN, K1, V1, LO1, HI1, SLOT1, K2, V2, LO2, HI2, SLOT2,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od,
    stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
    stride_k1b, stride_k1h, stride_k1s, stride_v1b, stride_v1h, stride_v1s, stride_lo1, stride_hi1, stride_slot1,
    stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h, stride_v2s, stride_lo2, stride_hi2, stride_slot2,
    capacity1, splits1, capacity2, splits2, stats_offset, scale_log2,
    KV_HEADS: tl.constexpr, FIRST_KV_HEADS: tl.constexpr, HAS_SECOND: tl.constexpr, GROUP: tl.constexpr,
    G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_NEW: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (b * KV_HEADS + kv head, split): KV heads below FIRST_KV_HEADS read group 1 (K1, V1, ...), the
    others (with HAS_SECOND) group 2 as its heads ``kv head - FIRST_KV_HEADS``. See :func:`_attend_chunk`."""
    batch64 = (tl.program_id(0) // KV_HEADS).to(tl.int64)
    kv_head = tl.program_id(0) % KV_HEADS
    split = tl.program_id(1)
    row_splits = tl.num_programs(1)
    if HAS_SECOND:
        in_second = kv_head >= FIRST_KV_HEADS
    else:
        in_second = False
    if in_second:
        _attend_chunk(
            Q, O, WS, KN, VN, K2, V2, LO2, HI2, SLOT2, batch64, kv_head, kv_head - FIRST_KV_HEADS, split,
            row_splits, stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od,
            stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
            stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h, stride_v2s, stride_lo2, stride_hi2,
            stride_slot2, capacity2, splits2, stats_offset, scale_log2,
            KV_HEADS * GROUP, GROUP, G_PAD, D, D_PAD, BLOCK_N, HAS_NEW, DIRECT, PRECISION)
    else:
        _attend_chunk(
            Q, O, WS, KN, VN, K1, V1, LO1, HI1, SLOT1, batch64, kv_head, kv_head, split,
            row_splits, stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od,
            stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
            stride_k1b, stride_k1h, stride_k1s, stride_v1b, stride_v1h, stride_v1s, stride_lo1, stride_hi1,
            stride_slot1, capacity1, splits1, stats_offset, scale_log2,
            KV_HEADS * GROUP, GROUP, G_PAD, D, D_PAD, BLOCK_N, HAS_NEW, DIRECT, PRECISION)


@triton.jit
def _decode_combine_kernel(
    WS, O, stride_ob, stride_oh, stride_od, splits1, splits2, row_splits, stats_offset,
    HEADS: tl.constexpr, FIRST_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """O[b, h] from the partials of (b, h) (``splits1`` of them for heads below FIRST_HEADS, else ``splits2``):
    sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    pair = tl.program_id(0)
    batch64 = (pair // HEADS).to(tl.int64)
    head = pair % HEADS
    splits = tl.where(head < FIRST_HEADS, splits1, splits2)
    first = pair.to(tl.int64) * row_splits
    offs = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D_PAD)
    in_dim = _dim_mask(dims, D, D_PAD)
    m_seen = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        m = tl.load(WS + stats_offset + 2 * (first + s0 + offs), mask=s0 + offs < splits, other=float("-inf"))
        m_seen = tl.maximum(m_seen, m)
    m_top = tl.max(m_seen, axis=0)
    m_top = tl.where(m_top > float("-inf"), m_top, 0.0)  # all splits empty: every weight below is 0
    l_seen = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        row = first + s0 + offs
        ok = s0 + offs < splits
        weight = tl.math.exp2(tl.load(WS + stats_offset + 2 * row, mask=ok, other=float("-inf")) - m_top)
        l_seen += weight * tl.load(WS + stats_offset + 2 * row + 1, mask=ok, other=0.0)
        part = tl.load(WS + row[:, None] * D + dims[None, :], mask=ok[:, None] & in_dim[None, :], other=0.0)
        acc += tl.sum(weight[:, None] * part, axis=0)
    total = tl.sum(l_seen, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(O + batch64 * stride_ob + head.to(tl.int64) * stride_oh + dims * stride_od,
             out.to(O.dtype.element_ty), mask=in_dim)


# ---------------------------------------------------------------------------------------------------------------
# Launch plans and argument checks.


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one call signature launches (built once by :func:`_build_plan`); None launches: nothing to compute
    (B or Hq is 0)."""

    split: CompiledLaunch | None  # the split kernel over both groups, its integers (strides, ...) fixed
    workspace: Tensor | None  # fp32 partials; None with one split (the split kernel writes the output)
    combine: CompiledLaunch | None  # the combine kernel (None with one split)


_PLANS: dict[tuple, _Plan] = {}


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


def _build_plan(q: Tensor, kv_heads: int, groups: list[tuple[int, int]], has_new: bool, scale: float | None,
                splits: int | None, block_n: int | None, strides: tuple[int, ...]) -> _Plan:
    """The launches of one call signature: groups (KV heads, capacity) in KV-head order, arguments checked,
    ``strides`` the split kernel's stride arguments (:func:`_stride_args`)."""
    batch, heads, dim = q.shape
    if not batch * heads:
        return _Plan(None, None, None)
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
        _decode_split_kernel, (batch * kv_heads, row_splits),
        strides + (first_capacity, first_splits, second_capacity, second_splits, stats_offset, scale * _LOG2E),
        dict(KV_HEADS=kv_heads, FIRST_KV_HEADS=first_heads, HAS_SECOND=len(groups) == 2, GROUP=group_size,
             G_PAD=max(16, triton.next_power_of_2(group_size)), D=dim, D_PAD=_padded_dim(dim), BLOCK_N=block_n,
             HAS_NEW=has_new, DIRECT=row_splits == 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32"),
        dict(num_warps=KERNEL_CONFIG["num_warps"], num_stages=KERNEL_CONFIG["num_stages"]))
    if row_splits == 1:
        return _Plan(split, None, None)
    workspace = torch.empty(pairs * row_splits * (dim + 2), dtype=torch.float32, device=q.device)
    block_s = min(triton.next_power_of_2(row_splits), max(1, KERNEL_CONFIG["combine_elements"] // _padded_dim(dim)))
    combine = CompiledLaunch(
        _decode_combine_kernel, (pairs,), strides[3:6] + (first_splits, second_splits, row_splits, stats_offset),
        dict(HEADS=heads, FIRST_HEADS=first_heads * group_size, D=dim, D_PAD=_padded_dim(dim), BLOCK_S=block_s),
        dict(num_warps=KERNEL_CONFIG["combine_warps"]))
    return _Plan(split, workspace, combine)


def _stride_args(q: Tensor, out_strides: tuple[int, ...], k_new: Tensor, v_new: Tensor, first: DecodeGroup,
                 second: DecodeGroup) -> tuple[int, ...]:
    """The split kernel's stride arguments, in its order (q, out, k_new, v_new, then each group's)."""
    k1, v1, k2, v2 = first.keys.stride(), first.values.stride(), second.keys.stride(), second.values.stride()
    return (*q.stride(), *out_strides, *k_new.stride(), *v_new.stride(),
            k1[0], k1[1], k1[2], v1[0], v1[1], v1[2], first.lo.stride(0), first.hi.stride(0), first.slot.stride(0),
            k2[0], k2[1], k2[2], v2[0], v2[1], v2[2], second.lo.stride(0), second.hi.stride(0), second.slot.stride(0))


def _contiguous_strides(shape: torch.Size) -> tuple[int, int, int]:
    """Strides of a new contiguous ``[B, H, d]`` tensor (the output when no ``out`` is given)."""
    return (shape[1] * shape[2], shape[2], 1)


def _launch(plan: _Plan, q: Tensor, out: Tensor, k_new: Tensor, v_new: Tensor, first: DecodeGroup,
            second: DecodeGroup) -> None:
    """The split kernel over both groups (``second is first`` for one group), then the combine (with splits)."""
    workspace = out if plan.workspace is None else plan.workspace
    plan.split(q, out, workspace, k_new, v_new, first.keys, first.values, first.lo, first.hi, first.slot,
               second.keys, second.values, second.lo, second.hi, second.slot)
    if plan.combine is not None:
        plan.combine(workspace, out)


def _config_signature() -> tuple:
    return tuple(KERNEL_CONFIG.values())


def _group_signature(group: DecodeGroup) -> tuple:
    """What a plan depends on in a group: its heads, and the shapes, strides, dtypes and devices of its tensors."""
    keys, values, lo, hi, slot = group.keys, group.values, group.lo, group.hi, group.slot
    return (group.kv_start, keys.shape, keys.stride(), keys.dtype, keys.device, values.shape, values.stride(),
            values.dtype, values.device, lo.shape, lo.dtype, lo.device, hi.shape, hi.dtype, hi.device, slot.shape,
            slot.dtype, slot.device)


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
        strides = _stride_args(q, _contiguous_strides(q.shape) if out is None else out.stride(), q, q, group, group)
        signature = ("ranged", q.shape, q.dtype, q.device, keys.shape, keys.dtype, keys.device, values.shape,
                     values.dtype, values.device, lo.shape, lo.dtype, lo.device, hi.shape, hi.dtype, hi.device,
                     None if out is None else (out.shape, out.dtype, out.device), scale, splits, block_n,
                     _config_signature(), strides)
    except (AttributeError, TypeError, IndexError, RuntimeError):  # malformed arguments: the checks name them
        check_ranged_args(q, keys, values, lo, hi, SUPPORTED_DTYPES, kernel=True)
        _check_kernel_args(q, out, scale, splits, block_n)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        check_ranged_args(q, keys, values, lo, hi, SUPPORTED_DTYPES, kernel=True)
        checked_scale, checked_splits, checked_block_n = _check_kernel_args(q, out, scale, splits, block_n)
        plan = _PLANS[signature] = _build_plan(q, keys.shape[1], [(keys.shape[1], keys.shape[2])], False,
                                               checked_scale, checked_splits, checked_block_n, strides)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.split is None:
        return out
    if keys.shape[2] == 0:  # no slot: every range is empty
        return out.zero_()
    _launch(plan, q, out, q, q, group, group)  # q stands in for the unused new key and value
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
        _launch(plan, q, out, k_new, v_new, first, second)
    return out


def _step_plan(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup], scale: float | None,
               out: Tensor | None, splits: int | None, block_n: int | None) -> tuple[_Plan, DecodeGroup, DecodeGroup]:
    """The plan of a :func:`decode_step_attention` call (checked and built on the first call of its signature),
    and its groups in the kernel's order (the group holding KV head 0 first; twice for one group)."""
    try:
        first, second = groups[0], groups[-1]
        if first.kv_start:  # the kernel takes the group holding KV head 0 first
            first, second = second, first
        strides = _stride_args(q, _contiguous_strides(q.shape) if out is None else out.stride(), k_new, v_new, first,
                               second)
        signature = ("step", q.shape, q.dtype, q.device, k_new.shape, k_new.dtype, k_new.device, v_new.shape,
                     v_new.dtype, v_new.device, None if out is None else (out.shape, out.dtype, out.device),
                     len(groups), scale, splits, block_n, _config_signature(), strides,
                     *_group_signature(first), *(_group_signature(second) if second is not first else ()))
    except (AttributeError, TypeError, IndexError, KeyError, RuntimeError):  # malformed: the checks name them
        check_decode_step_args(q, k_new, v_new, groups)
        _check_kernel_args(q, out, scale, splits, block_n)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        ordered = check_decode_step_args(q, k_new, v_new, groups)
        checked_scale, checked_splits, checked_block_n = _check_kernel_args(q, out, scale, splits, block_n)
        plan = _PLANS[signature] = _build_plan(q, k_new.shape[1], [g.keys.shape[1:3] for g in ordered], True,
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
            _launch(self._plan, q, out, k_new, v_new, groups[self._first], groups[-1 - self._first])
        return out


def _step_layout(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup]) -> tuple:
    """What a :class:`DecodeStep` depends on in a step's arguments, besides the group buffers themselves."""
    return (q.shape, q.stride(), q.dtype, q.device, k_new.shape, k_new.stride(), k_new.dtype, v_new.shape,
            v_new.stride(), v_new.dtype,
            *((g.kv_start, g.lo.shape, g.lo.stride(), g.lo.dtype, g.hi.shape, g.hi.stride(), g.hi.dtype, g.slot.shape,
               g.slot.stride(), g.slot.dtype) for g in groups))
