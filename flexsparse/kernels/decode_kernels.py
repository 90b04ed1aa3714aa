"""The decode Triton kernels (flash-decoding over per-head-group KV caches): the split kernel over one or two cache
groups, and the combine kernel that merges its partials.

* Split-K: the grid is ``(B * Hkv, splits)``. Program (b, kv head, s) takes the s-th of its group's ``S_g`` equal
  chunks of ``[lo[b], hi[b])`` (a multiple of BLOCK_N slots, split on the device from the live range, so a short
  range in a large buffer still spreads over the splits; chunks past ``hi`` are empty and contribute nothing).
  The grid's second dimension is the largest ``S_g``; the programs past their group's count do nothing.
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
  the combine kernel merges the splits of each (b, query head) and writes the output (an empty range gives
  zeros). With one split the split kernel normalises and writes the output itself (one launch).

fp32 inputs use exact (ieee) dots; 16-bit inputs use the tensor cores with fp32 accumulation and P rounded to the
input dtype for ``P @ V`` (as FlashAttention).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def decode_split_kernel(
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
def decode_combine_kernel(
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
