"""Ranged decode attention (flash-decoding) over a per-head-group KV cache, in Triton.

Each sequence b has one query per head and attends the contiguous cache slots ``lo[b] <= slot < hi[b]`` of a
buffer of capacity C. The bounds are read on the device, so a decode step never syncs the host and one compiled
kernel serves every step (the launch depends only on shapes).

* Split-K: the grid is ``(B * Hkv, splits)``. Program (b, kv head, s) takes the s-th of ``splits`` equal chunks
  of ``[lo[b], hi[b])`` (a multiple of BLOCK_N slots, split on the device from the live range, so a short range
  in a large buffer still spreads over the splits; chunks past ``hi`` are empty and contribute nothing). The
  number of splits comes from host ints only (C, B, Hkv, the SM count): enough programs to fill every SM when
  B * Hkv is small (B=1, Hkv=2 at 131,072 slots), no more splits than C holds chunks of ``min_blocks_per_split``
  tiles.
* GQA sharing: a program handles all G query heads of its KV head, so K and V are read from HBM once per group:
  scores are a ``[G_PAD, d] x [d, BLOCK_N]`` tl.dot (G padded to >= 16 rows, the tensor-core minimum, padding
  rows masked), then an online softmax in fp32 and ``P @ V`` into an fp32 accumulator.
* Combine: each program writes its partial (row max, row sum, unnormalised accumulator) into an fp32 workspace;
  a second small kernel merges the splits of each (b, head) and writes the output (an empty range gives zeros).
  With one split the first kernel normalises and writes the output itself (one launch).

What bounds it: for long ranges HBM bandwidth (every K and V byte of the range is read once; the workspace is
~``B * Hq * splits * d * 4`` bytes, small beside them); for short ranges (a sink + window ring of a few thousand
slots) the launch latency of the two kernels and one program's serial latency over its chunk.

fp32 inputs use exact (ieee) dots; 16-bit inputs use the tensor cores with fp32 accumulation and P rounded to the
input dtype for ``P @ V`` (as FlashAttention). Also here: :func:`ranged_decode_reference`, the same function in
plain PyTorch, for tests and CPU use.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from flexsparse.validation import as_float, as_int

KERNEL_CONFIG = {
    "programs_per_sm": 2,  # target split-kernel programs per SM when B * Hkv alone cannot fill the GPU
    "min_blocks_per_split": 2,  # a split spans at least this many BLOCK_N tiles of the capacity
    "tile_bytes": 16384,  # BLOCK_N * d * element size of one K (or V) tile, BLOCK_N clamped to [16, 128]
    "num_warps": 4,
    "num_stages": 3,  # K/V tiles in flight per program (software pipelining of the slot loop)
    "combine_elements": 8192,  # workspace elements (splits x d) the combine kernel reads per step
    "combine_warps": 4,
}
"""Launch settings of :func:`ranged_decode_attention` (read at every call, so a benchmark can sweep them)."""

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K, V, LO, HI, O, WS,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_od, stride_lo, stride_hi,
    capacity, stats_offset, scale_log2,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk of one sequence's range for the GROUP query heads of one KV head: O [B, Hq, D] when DIRECT
    (one split), else the partial (acc [D], max, sum) of each head into WS."""
    batch = tl.program_id(0) // KV_HEADS
    kv_head = tl.program_id(0) % KV_HEADS
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    batch64 = batch.to(tl.int64)
    lo = tl.minimum(tl.maximum(tl.load(LO + batch64 * stride_lo), 0), capacity).to(tl.int32)
    hi = tl.minimum(tl.maximum(tl.load(HI + batch64 * stride_hi), 0), capacity).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    real = rows < GROUP  # padding rows (G < G_PAD) compute with q = 0 and are never stored
    head64 = (kv_head * GROUP + rows).to(tl.int64)
    q = tl.load(Q + batch64 * stride_qb + head64[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=real[:, None], other=0.0)
    first = start.to(tl.int64) + cols[:, None]
    k_ptrs = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + first * stride_ks + dims[None, :]
    v_ptrs = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + first * stride_vs + dims[None, :]

    m_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        inside = n + cols < end
        k = tl.load(k_ptrs, mask=inside[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_max, tl.max(scores, axis=1))  # finite: every tile holds a slot of the range
        alpha = tl.math.exp2(m_max - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_max = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs

    if DIRECT:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an empty range: acc = 0, a zero row
        tl.store(O + batch64 * stride_ob + head64[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=real[:, None])
    else:
        row = (batch64 * (KV_HEADS * GROUP) + head64) * splits + split  # [G_PAD] partial rows
        tl.store(WS + row[:, None] * D + dims[None, :], acc, mask=real[:, None])
        tl.store(WS + stats_offset + 2 * row, m_max, mask=real)  # -inf for an empty chunk
        tl.store(WS + stats_offset + 2 * row + 1, l_sum, mask=real)


@triton.jit
def _decode_combine_kernel(
    WS, O, stride_ob, stride_oh, stride_od, splits, stats_offset,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """O[b, h] from the ``splits`` partials of (b, h): sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    pair = tl.program_id(0)
    batch64 = (pair // HEADS).to(tl.int64)
    head64 = (pair % HEADS).to(tl.int64)
    first = pair.to(tl.int64) * splits
    offs = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    m_seen = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        m = tl.load(WS + stats_offset + 2 * (first + s0 + offs), mask=s0 + offs < splits, other=float("-inf"))
        m_seen = tl.maximum(m_seen, m)
    m_top = tl.max(m_seen, axis=0)
    m_top = tl.where(m_top > float("-inf"), m_top, 0.0)  # all splits empty: every weight below is 0
    l_seen = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        row = first + s0 + offs
        ok = s0 + offs < splits
        weight = tl.math.exp2(tl.load(WS + stats_offset + 2 * row, mask=ok, other=float("-inf")) - m_top)
        l_seen += weight * tl.load(WS + stats_offset + 2 * row + 1, mask=ok, other=0.0)
        part = tl.load(WS + row[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(weight[:, None] * part, axis=0)
    total = tl.sum(l_seen, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(O + batch64 * stride_ob + head64 * stride_oh + dims * stride_od, out.to(O.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration and argument checks.


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_n(dim: int, dtype: torch.dtype) -> int:
    """Slots per K/V tile: ``KERNEL_CONFIG["tile_bytes"]`` per tile, a power of two in [16, 128]."""
    slots = KERNEL_CONFIG["tile_bytes"] // (dim * dtype.itemsize)
    return max(16, min(128, triton.next_power_of_2(max(slots, 1))))


def _num_splits(batch: int, kv_heads: int, capacity: int, block_n: int, device: torch.device) -> int:
    """Splits per (sequence, KV head), from host ints only: ``programs_per_sm`` programs per SM over the
    B * Hkv pairs, at most as many as C holds chunks of ``min_blocks_per_split`` tiles, at least one."""
    target = KERNEL_CONFIG["programs_per_sm"] * _sm_count(device)
    by_capacity = triton.cdiv(capacity, KERNEL_CONFIG["min_blocks_per_split"] * block_n)
    return max(1, min(triton.cdiv(target, batch * kv_heads), by_capacity))


def _check_tensor(name: str, t: object, dims: int, dtypes: tuple) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {', '.join(str(d)[6:] for d in dtypes)}, got {t.dtype}")


def _check_args(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor, dtypes: tuple) -> None:
    """Shapes [B, Hq, d], [B, Hkv, C, d] x 2, [B] x 2; one dtype for q/keys/values; one device for all."""
    _check_tensor("q", q, 3, dtypes)
    _check_tensor("keys", keys, 4, dtypes)
    _check_tensor("values", values, 4, dtypes)
    _check_tensor("lo", lo, 1, _INDEX_DTYPES)
    _check_tensor("hi", hi, 1, _INDEX_DTYPES)
    if keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"keys and values must have q's dtype {q.dtype}, got {keys.dtype} and {values.dtype}")
    for name, t in (("keys", keys), ("values", values), ("lo", lo), ("hi", hi)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if keys.shape != values.shape:
        raise ValueError(f"keys and values must have the same shape, got {list(keys.shape)} and "
                         f"{list(values.shape)}")
    batch, heads, dim = q.shape
    if keys.shape[0] != batch or keys.shape[3] != dim:
        raise ValueError(f"keys/values [B, Hkv, C, d] must match q's batch {batch} and head dim {dim}, got "
                         f"{list(keys.shape)}")
    if keys.shape[1] == 0 or heads % keys.shape[1]:
        raise ValueError(f"q's heads ({heads}) must be a multiple of keys' heads ({keys.shape[1]})")
    for name, t in (("lo", lo), ("hi", hi)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have shape [{batch}] (q's batch), got {list(t.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def ranged_decode_attention(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor,
                            scale: float | None = None, out: Tensor | None = None, *, splits: int | None = None,
                            block_n: int | None = None) -> Tensor:
    """Decode attention of one query per sequence and head over the cache slots ``lo[b] <= slot < hi[b]``.

    q ``[B, Hq, d]`` (any strides, e.g. a view of ``[B, Hq, 1, d]`` or a slice of heads); keys/values
    ``[B, Hkv, C, d]`` (any strides with a contiguous last dim; C = the buffer's capacity), ``Hq = G * Hkv``
    (query head h reads KV head ``h // G``); one dtype among float32/bfloat16/float16; d a power of two in
    [16, 256]. lo/hi int32 or int64 ``[B]`` on q's device (any stride): the range is clamped to ``[0, C]``; an
    empty range gives a zero row. ``scale`` defaults to ``d ** -0.5``.

    Returns ``[B, Hq, d]`` in q's dtype, written into ``out`` when given (any strides, e.g. a head slice of a
    larger buffer). ``splits`` / ``block_n`` override the split count per (sequence, KV head) and the slots per
    tile (a power of two >= 16); by default they follow from the shapes and ``KERNEL_CONFIG``. Never syncs the
    host: every launch parameter is a shape.
    """
    _check_args(q, keys, values, lo, hi, _SUPPORTED_DTYPES)
    batch, heads, dim = q.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    if dim < 16 or dim > 256 or dim & (dim - 1):
        raise ValueError(f"q's head dim must be a power of two in [16, 256], got {dim}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values must have a contiguous last dimension (stride(-1) == 1)")
    if capacity >= 2**31:
        raise ValueError(f"keys' capacity ({capacity}) must fit int32")
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        _check_tensor("out", out, 3, (q.dtype,))
        if out.shape != q.shape or out.device != q.device:
            raise ValueError(f"out must have q's shape {list(q.shape)} on {q.device}, got {list(out.shape)} on "
                             f"{out.device}")
    block_n = _block_n(dim, q.dtype) if block_n is None else as_int("block_n", block_n, minimum=16)
    if block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    if splits is not None:
        splits = as_int("splits", splits, minimum=1, maximum=65535)  # the grid's second dimension
    if q.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"ranged_decode_attention needs CUDA tensors (q is on {q.device}); on CPU use "
                         "ranged_decode_reference, or set TRITON_INTERPRET=1 before importing triton")
    if batch == 0 or heads == 0:
        return out
    if capacity == 0:  # no slot: every range is empty
        return out.zero_()
    if splits is None:
        splits = _num_splits(batch, kv_heads, capacity, block_n, q.device)

    group = heads // kv_heads
    pairs = batch * heads
    workspace = out if splits == 1 else torch.empty(pairs * splits * (dim + 2), dtype=torch.float32,
                                                    device=q.device)
    stats_offset = pairs * splits * dim  # (max, sum) pairs follow the accumulators
    _decode_split_kernel[(batch * kv_heads, splits)](
        q, keys, values, lo, hi, out, workspace, *q.stride(), *keys.stride()[:3], *values.stride()[:3],
        *out.stride(), lo.stride(0), hi.stride(0), capacity, stats_offset, scale * _LOG2E,
        KV_HEADS=kv_heads, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        DIRECT=splits == 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=KERNEL_CONFIG["num_warps"], num_stages=KERNEL_CONFIG["num_stages"])
    if splits > 1:
        block_s = min(triton.next_power_of_2(splits), max(1, KERNEL_CONFIG["combine_elements"] // dim))
        _decode_combine_kernel[(pairs,)](
            workspace, out, *out.stride(), splits, stats_offset, HEADS=heads, D=dim, BLOCK_S=block_s,
            num_warps=KERNEL_CONFIG["combine_warps"])
    return out


def ranged_decode_reference(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor,
                            scale: float | None = None) -> Tensor:
    """The same function as :func:`ranged_decode_attention` in plain PyTorch (any device, any strides).

    Computes in float64 for float64 inputs (accepted here, for a high-precision reference), else in float32;
    returns ``[B, Hq, d]`` in q's dtype. O(B Hq C d) time, O(B Hq C) memory for the scores.
    """
    _check_args(q, keys, values, lo, hi, _SUPPORTED_DTYPES + (torch.float64,))
    batch, heads, dim = q.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    grouped = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,bkcd->bkgc", grouped, keys.to(dtype)) * scale
    slot = torch.arange(capacity, device=q.device)
    inside = (slot >= lo.clamp(0, capacity)[:, None]) & (slot < hi.clamp(0, capacity)[:, None])  # [B, C]
    scores = scores.masked_fill(~inside[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty range: all -inf, a zero row
    out = torch.einsum("bkgc,bkcd->bkgd", weights, values.to(dtype))
    return out.reshape(batch, heads, dim).to(q.dtype)
