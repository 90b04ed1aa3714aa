"""The ESA forward kernel (16 or more queries per sequence): O and the log-sum-exp of BM position-ordered queries
of one query head per program, one warp.

For one head and one slot j, the key ``b_j(p)`` of query position p is non-decreasing in p and, when ``num_heads``
is even (``num_heads - 1`` odd: no rounding ties in the head mix) or 1, grows by at most one per position (tests
check both claims; an odd ``num_heads`` can step by two). So BM consecutive positions read, per slot, a contiguous
range of at most BM keys: the program loads it as a [BM, d] tile (rows through ``key_slots`` where given), computes
the [BM, BM] score tile on tensor cores and keeps, per query, the one column that holds its key (online softmax over
the w slots). When a block's real rows are not consecutive positions (padding in the middle, gaps) or keys can step
by two, it visits as many tiles per slot as its keys need. The heads of a KV group take neighbouring programs.

16-bit inputs: scores accumulate in fp32; P is rounded to 16 bits once for P @ V, as dense bf16 attention does
(``KERNEL_CONFIG["forward_split"]`` of :mod:`flexsparse.kernels.esa_launch` splits it too, slower on the H100:
docs/notes/esa-kernel.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.esa_index_triton import head_key, slot_base, start_and_window
from flexsparse.kernels.esa_shared import BIG, dot_fp32_lhs, key_slots, position_span, query_rows, row_offsets


@triton.jit
def _key_range_tile(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span,
                    BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                    SAME_KV_STRIDE: tl.constexpr):
    """One head's K and V tiles [BM, D] of key positions lo + c (c < BM, rows past hi skipped; lo, hi scalars) and
    the selection [BM queries, BM columns]: column c holds query r's key."""
    cols = tl.arange(0, BM)
    dims = tl.arange(0, D)
    kpos = lo + cols
    slot, present = key_slots(kpos, kpos <= hi, SLOTS_B, kv_len, span, HAS_SLOTS)
    row_k, row_v = row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
    k = tl.load(K_B + row_k[:, None] + dims[None, :], mask=present[:, None], other=0.0)
    v = tl.load(V_B + row_v[:, None] + dims[None, :], mask=present[:, None], other=0.0)
    select = ((key - lo)[:, None] == cols[None, :]) & ok[:, None]
    if HAS_SLOTS:  # without key slots a real row's key, in [lo, hi] and < S_kv, is always present
        select = select & present[None, :]
    return k, v, select


@triton.jit
def _forward_chunk(q, acc, l_sum, m_max, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span,
                   scale_log2, BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                   SAME_KV_STRIDE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """Online-softmax step over one key tile: each query row gains at most one key."""
    k, v, select = _key_range_tile(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span, BM, D,
                                   HAS_SLOTS, WIDE, SAME_KV_STRIDE)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    score = tl.max(tl.where(select, scores, float("-inf")), axis=1) * scale_log2  # [BM], -inf: no key
    m_new = tl.maximum(m_max, score)
    alpha = tl.math.exp2(m_max - m_new)  # every step: a conditional rescale measured slower on the H100
    p = tl.math.exp2(score - m_new)
    acc = dot_fp32_lhs(tl.where(select, p[:, None], 0.0), v, acc * alpha[:, None], PRECISION, SPLIT)
    return acc, l_sum * alpha + p, m_new


@triton.jit
def _forward_slots(q, pos, real, head, first_real, last_real, K_B, V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span,
                   layer_weight, scale_log2, NUM_HEADS: tl.constexpr, W: tl.constexpr, LAYER_DEN: tl.constexpr,
                   BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                   SAME_KV_STRIDE: tl.constexpr, ONE_TILE: tl.constexpr, PRECISION: tl.constexpr,
                   SPLIT: tl.constexpr):
    """Online softmax of one head over the w slots: (acc [BM, D], row sums, row maxima).

    ONE_TILE: the real rows hold consecutive positions first_real..last_real and keys step by <= 1, so one tile per
    slot, from the key of first_real to that of last_real (scalars, no reductions), holds every row's key.
    Otherwise the tiles that hold some row's key are visited in increasing order.
    """
    acc = tl.zeros([BM, D], dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    m_max = tl.full([BM], -1.0e30, dtype=tl.float32)
    start, window = start_and_window(pos, layer_weight, W, LAYER_DEN)
    start_first, window_first = start_and_window(first_real, layer_weight, W, LAYER_DEN)
    start_last, window_last = start_and_window(last_real, layer_weight, W, LAYER_DEN)
    base, base_first, base_last = start, start_first, start_last
    for j in range(W):
        next_base = slot_base(start, window, j + 1, W)
        key = head_key(base, next_base, head, NUM_HEADS)  # [BM]
        ok = real & (key <= pos)
        if ONE_TILE:
            next_first = slot_base(start_first, window_first, j + 1, W)
            next_last = slot_base(start_last, window_last, j + 1, W)
            lo = head_key(base_first, next_first, head, NUM_HEADS)
            hi = head_key(base_last, next_last, head, NUM_HEADS)
            acc, l_sum, m_max = _forward_chunk(q, acc, l_sum, m_max, key, ok, lo, hi, K_B, V_B, SLOTS_B,
                                               stride_ks, stride_vs, kv_len, span, scale_log2, BM, D, HAS_SLOTS,
                                               WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
            base_first, base_last = next_first, next_last
        else:
            pending = tl.where(ok, key, BIG)
            lo = tl.min(pending, axis=0)
            hi = tl.max(tl.where(ok, key, -1), axis=0)
            while lo < BIG:
                acc, l_sum, m_max = _forward_chunk(q, acc, l_sum, m_max, key, ok, lo, hi, K_B, V_B, SLOTS_B,
                                                   stride_ks, stride_vs, kv_len, span, scale_log2, BM, D,
                                                   HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
                lo = tl.min(tl.where(pending >= lo + BM, pending, BIG), axis=0)
        base = next_base
    return acc, l_sum, m_max


@triton.jit
def esa_forward_kernel(
    Q, K, V, O, LSE, SORTED_POS, ORDER, KEY_SLOTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_pos_b, stride_slots_b,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr, STEP_ONE: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """O [B, H, S_q, D] and LSE [B, H, S_q] (log2 units) for BM position-ordered queries of one head.

    Grid (query blocks x GROUP, B x KV heads): the heads of a group take neighbouring programs, so they run together
    and read the group's K/V rows while they are in L2."""
    block = tl.program_id(0) // GROUP
    batch = tl.program_id(1) // (NUM_HEADS // GROUP)
    kv_head = tl.program_id(1) % (NUM_HEADS // GROUP)
    head = kv_head * GROUP + tl.program_id(0) % GROUP
    r = block * BM + tl.arange(0, BM)
    row, pos, real = query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
    dims = tl.arange(0, D)
    row64, batch64, head64 = row.to(tl.int64), batch.to(tl.int64), head.to(tl.int64)
    q = tl.load(Q + batch64 * stride_qb + head64 * stride_qh + row64[:, None] * stride_qs + dims[None, :],
                mask=real[:, None], other=0.0)
    K_B = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_B = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    SLOTS_B = KEY_SLOTS + batch64 * stride_slots_b

    first_real, last_real, consecutive = position_span(pos, real, first_pos + block * BM, BM, HAS_POSITIONS)
    one_tile = False
    if STEP_ONE:
        one_tile = consecutive  # a run-time choice per block with q_positions (padding, gaps)
    if one_tile:
        acc, l_sum, m_max = _forward_slots(q, pos, real, head + head_offset, first_real, last_real, K_B, V_B,
                                           SLOTS_B, stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2,
                                           PATTERN_HEADS, W, LAYER_DEN, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE,
                                           True, PRECISION, SPLIT)
    else:
        acc, l_sum, m_max = _forward_slots(q, pos, real, head + head_offset, first_real, last_real, K_B, V_B,
                                           SLOTS_B, stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2,
                                           PATTERN_HEADS, W, LAYER_DEN, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE,
                                           False, PRECISION, SPLIT)

    has_keys = l_sum > 0
    l_safe = tl.where(has_keys, l_sum, 1.0)
    store = r < q_len
    tl.store(O + batch64 * stride_ob + head64 * stride_oh + row64[:, None] * stride_os + dims[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=store[:, None])
    lse = tl.where(has_keys, m_max + tl.math.log2(l_safe), float("inf"))
    tl.store(LSE + (batch64 * NUM_HEADS + head64) * q_len + row64, lse, mask=store)
