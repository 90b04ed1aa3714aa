"""The ESA dQ kernel (query-major; also writes delta = rowsum(dO * O), which the dK/dV kernel of
:mod:`flexsparse.kernels.esa_dkdv` reads).

A program takes BM position-ordered queries of the G query heads of one KV head (one warp per head) and, per slot,
loads each head's contiguous key range as a [BM, d] tile, as the forward does (:mod:`flexsparse.kernels.esa_forward`).

16-bit inputs: gradients accumulate in fp32, and the fp32 left operand of the dS @ K dot enters as two 16-bit
parts (hi + lo) when ``SPLIT``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.esa_index_triton import head_key, slot_base, start_and_window
from flexsparse.kernels.esa_shared import (
    BIG,
    dot_fp32_lhs,
    key_range_tiles,
    position_span,
    program_heads,
    query_rows,
)


@triton.jit
def _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span,
              scale_log2, BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
              SAME_KV_STRIDE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """dQ step over one key tile per head: dS = P (dP - delta) at each row's one key, dQ += dS K."""
    k, v, select = key_range_tiles(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span, BM,
                                    D, HAS_SLOTS, WIDE, SAME_KV_STRIDE)
    scores = tl.dot(q, tl.trans(k, 0, 2, 1), input_precision=PRECISION)
    score = tl.max(tl.where(select, scores, float("-inf")), axis=2) * scale_log2
    p = tl.math.exp2(score - lse)
    dp = tl.dot(do, tl.trans(v, 0, 2, 1), input_precision=PRECISION)
    dp_row = tl.sum(tl.where(select, dp, 0.0), axis=2)
    ds = p * (dp_row - delta)
    return dot_fp32_lhs(tl.where(select, ds[:, :, None], 0.0), k, dq, PRECISION, SPLIT)


@triton.jit
def _dq_slots(q, do, lse, delta, pos, rows_ok, head, head_ok, first_real, last_real, K_B, V_B, SLOTS_B,
              stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2, NUM_HEADS: tl.constexpr,
              HEADS: tl.constexpr, W: tl.constexpr, LAYER_DEN: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
              HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr, ONE_TILE: tl.constexpr,
              PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """dQ [HEADS, BM, D] (unscaled) summed over the w slots; tiles as in :func:`_forward_slots`."""
    dq = tl.zeros([HEADS, BM, D], dtype=tl.float32)
    start, window = start_and_window(pos, layer_weight, W, LAYER_DEN)
    start_first, window_first = start_and_window(first_real, layer_weight, W, LAYER_DEN)
    start_last, window_last = start_and_window(last_real, layer_weight, W, LAYER_DEN)
    base, base_first, base_last = start, start_first, start_last
    for j in range(W):
        next_base = slot_base(start, window, j + 1, W)
        key = head_key(base[None, :], next_base[None, :], head[:, None], NUM_HEADS)
        ok = rows_ok & (key <= pos[None, :])
        if ONE_TILE:
            next_first = slot_base(start_first, window_first, j + 1, W)
            next_last = slot_base(start_last, window_last, j + 1, W)
            lo = head_key(base_first, next_first, head, NUM_HEADS)
            hi = tl.where(head_ok, head_key(base_last, next_last, head, NUM_HEADS), -1)
            dq = _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs,
                           kv_len, span, scale_log2, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
            base_first, base_last = next_first, next_last
        else:
            pending = tl.where(ok, key, BIG)
            lo = tl.min(pending, axis=1)
            hi = tl.max(tl.where(ok, key, -1), axis=1)
            while tl.min(lo, axis=0) < BIG:
                dq = _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs,
                               kv_len, span, scale_log2, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
                lo = tl.min(tl.where(pending >= lo[:, None] + BM, pending, BIG), axis=1)
        base = next_base
    return dq


@triton.jit
def esa_backward_dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, SORTED_POS, ORDER, KEY_SLOTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    stride_pos_b, stride_slots_b,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset, sm_scale,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr, STEP_ONE: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """dQ [B, H, S_q, D] and DELTA [B, H, S_q] for BM position-ordered queries x HEADS heads.

    Grid (query blocks x programs per KV group, B x KV heads): the programs of a group take neighbouring ids, so
    they run together and read the group's K/V rows while they are in L2 (as the forward's)."""
    per_group: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    block = tl.program_id(0) // per_group
    batch, kv_head, head, head_ok = program_heads(tl.program_id(1) * per_group + tl.program_id(0) % per_group,
                                                  NUM_HEADS, GROUP, HEADS)
    r = block * BM + tl.arange(0, BM)
    row, pos, real = query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
    dims = tl.arange(0, D)
    head64, row64, batch64 = head.to(tl.int64), row.to(tl.int64), batch.to(tl.int64)
    rows_ok = head_ok[:, None] & real[None, :]
    at_head, at_row, at_dim = head64[:, None, None], row64[None, :, None], dims[None, None, :]
    q = tl.load(Q + batch64 * stride_qb + at_head * stride_qh + at_row * stride_qs + at_dim,
                mask=rows_ok[:, :, None], other=0.0)
    do = tl.load(DO + batch64 * stride_dob + at_head * stride_doh + at_row * stride_dos + at_dim,
                 mask=rows_ok[:, :, None], other=0.0)
    o = tl.load(O + batch64 * stride_ob + at_head * stride_oh + at_row * stride_os + at_dim,
                mask=rows_ok[:, :, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=2)
    stat = (batch64 * NUM_HEADS + head64[:, None]) * q_len + row64[None, :]
    store = head_ok[:, None] & (r < q_len)[None, :]
    tl.store(DELTA + stat, delta, mask=store)
    lse = tl.load(LSE + stat, mask=rows_ok, other=float("inf"))
    K_B = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_B = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    SLOTS_B = KEY_SLOTS + batch64 * stride_slots_b

    first_real, last_real, consecutive = position_span(pos, real, first_pos + block * BM, BM, HAS_POSITIONS)
    one_tile = False
    if STEP_ONE:
        one_tile = consecutive
    if one_tile:
        dq = _dq_slots(q, do, lse, delta, pos, rows_ok, head + head_offset, head_ok, first_real, last_real, K_B,
                       V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2, PATTERN_HEADS,
                       HEADS, W, LAYER_DEN,
                       BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, True, PRECISION, SPLIT)
    else:
        dq = _dq_slots(q, do, lse, delta, pos, rows_ok, head + head_offset, head_ok, first_real, last_real, K_B,
                       V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2, PATTERN_HEADS,
                       HEADS, W, LAYER_DEN,
                       BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, False, PRECISION, SPLIT)

    tl.store(DQ + batch64 * stride_dqb + at_head * stride_dqh + at_row * stride_dqs + at_dim,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=store[:, :, None])
