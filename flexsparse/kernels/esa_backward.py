"""The ESA backward kernels: dQ (query-major, also writes delta = rowsum(dO * O)), then dK/dV (key-major).

* dQ: a program takes BM position-ordered queries of the G query heads of one KV head (one warp per head) and, per
  slot, loads each head's contiguous key range as a [BM, d] tile, as the forward does
  (:mod:`flexsparse.kernels.esa_forward`);
* dK/dV (no atomics, so every path is deterministic): a program owns BN key positions of one KV head and, for each
  head of the group and each slot, binary-searches the contiguous range of position-ordered queries whose slot-j
  key falls in it, then accumulates ``P^T dO`` and ``dS^T Q`` in fp32.

16-bit inputs: gradients accumulate in fp32, and the fp32 left operands of the dS @ K, P^T @ dO and dS^T @ Q dots
enter as two 16-bit parts (hi + lo), so bf16 gradients stay at the rounding level of a dense path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.esa_index_triton import head_key, slot_base, start_and_window
from flexsparse.kernels.esa_shared import (
    BIG,
    dot_fp32_lhs,
    key_range_tiles,
    key_slots,
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
    """dQ [B, H, S_q, D] and DELTA [B, H, S_q] for BM position-ordered queries x HEADS heads."""
    batch, kv_head, head, head_ok = program_heads(tl.program_id(1), NUM_HEADS, GROUP, HEADS)
    r = tl.program_id(0) * BM + tl.arange(0, BM)
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

    first_real, last_real, consecutive = position_span(pos, real, first_pos + tl.program_id(0) * BM, BM,
                                                        HAS_POSITIONS)
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


@triton.jit
def _row_keys(r, j, head, batch, q_len, span, first_pos, layer_weight, SORTED_POS, stride_pos_b,
              NUM_HEADS: tl.constexpr, W: tl.constexpr, LAYER_DEN: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """Slot-j key of position-ordered rows r for one head, made monotone in r over padding: -1 below, BIG above."""
    if HAS_POSITIONS:
        raw = tl.load(SORTED_POS + batch.to(tl.int64) * stride_pos_b + r, mask=r < q_len, other=-1)
    else:
        raw = first_pos + r
    real = (r < q_len) & (raw >= 0) & (raw < span)
    start, window = start_and_window(tl.where(real, raw, 0), layer_weight, W, LAYER_DEN)
    key = head_key(slot_base(start, window, j, W), slot_base(start, window, j + 1, W), head, NUM_HEADS)
    return tl.where(real, key, tl.where(raw < 0, -1, BIG))


@triton.jit
def _first_row_with_key_at_least(target, j, head, batch, q_len, span, first_pos, layer_weight, search_steps,
                                 SORTED_POS, stride_pos_b, NUM_HEADS: tl.constexpr, W: tl.constexpr,
                                 LAYER_DEN: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """Binary search for each element of (target, j, head) (broadcast): the first position-ordered row whose
    slot-j key for that head is >= target (q_len if none)."""
    lo = tl.zeros_like(target + j + head)
    hi = lo + q_len
    step = 0
    while step < search_steps:  # a while loop: the interpreter cannot range() over a runtime int
        mid = (lo + hi) // 2
        searching = lo < hi
        key = _row_keys(mid, j, head, batch, q_len, span, first_pos, layer_weight, SORTED_POS, stride_pos_b,
                        NUM_HEADS, W, LAYER_DEN, HAS_POSITIONS)
        below = key < target
        lo = tl.where(searching & below, mid + 1, lo)
        hi = tl.where(searching & ~below, mid, hi)
        step += 1
    return lo


@triton.jit
def esa_backward_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, SORTED_POS, ORDER, KEY_SLOTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_pos_b, stride_slots_b,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset, sm_scale, search_steps,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr,
    W_POW2: tl.constexpr, GROUP_POW2: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """dK, dV of BN key positions of one KV head, summed over the group's heads and slots, in fp32."""
    kv_heads = NUM_HEADS // GROUP
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    batch64 = batch.to(tl.int64)
    first_key = tl.program_id(0) * BN
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    kpos = first_key + cols
    slot, present = key_slots(kpos, kpos < span, KEY_SLOTS + batch64 * stride_slots_b, kv_len, span, HAS_SLOTS)
    slot = slot.to(tl.int64)
    kv_offset = batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    k = tl.load(K + kv_offset + slot[:, None] * stride_ks + dims[None, :], mask=present[:, None], other=0.0)
    v = tl.load(V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + slot[:, None] * stride_vs
                + dims[None, :], mask=present[:, None], other=0.0)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    slots = tl.arange(0, W_POW2)
    for g in range(GROUP):
        head = kv_head * GROUP + g  # in the tensors; the pattern's head is head + head_offset
        head64 = head.to(tl.int64)
        pattern_head = head + head_offset
        Q_H = Q + batch64 * stride_qb + head64 * stride_qh
        DO_H = DO + batch64 * stride_dob + head64 * stride_doh
        STAT_H = (batch64 * NUM_HEADS + head64) * q_len
        # per slot, the rows whose key lies in this block: [first_rows[j], end_rows[j]) (binary searches)
        first_rows = _first_row_with_key_at_least(first_key, slots, pattern_head, batch, q_len, span, first_pos,
                                                  layer_weight, search_steps, SORTED_POS, stride_pos_b, PATTERN_HEADS,
                                                  W, LAYER_DEN, HAS_POSITIONS)
        end_rows = _first_row_with_key_at_least(first_key + BN, slots, pattern_head, batch, q_len, span, first_pos,
                                                layer_weight, search_steps, SORTED_POS, stride_pos_b, PATTERN_HEADS, W,
                                                LAYER_DEN, HAS_POSITIONS)
        for j in range(W):
            at_j = tl.full([1], j, tl.int32)
            r0 = tl.max(tl.gather(first_rows, at_j, 0), axis=0)
            r_end = tl.max(tl.gather(end_rows, at_j, 0), axis=0)
            while r0 < r_end:  # these rows' slot-j keys all lie in this block
                r = r0 + tl.arange(0, BQ)
                row, pos, real = query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b,
                                             HAS_POSITIONS)
                start, window = start_and_window(pos, layer_weight, W, LAYER_DEN)
                key = head_key(slot_base(start, window, j, W), slot_base(start, window, j + 1, W), pattern_head,
                                PATTERN_HEADS)
                ok = real & (r < r_end) & (key <= pos)
                select = ((key[None, :] - first_key) == cols[:, None]) & ok[None, :] & present[:, None]
                if WIDE:
                    row = row.to(tl.int64)
                q = tl.load(Q_H + row[:, None] * stride_qs + dims[None, :], mask=ok[:, None], other=0.0)
                do = tl.load(DO_H + row[:, None] * stride_dos + dims[None, :], mask=ok[:, None], other=0.0)
                lse = tl.load(LSE + STAT_H + row, mask=ok, other=float("inf"))
                delta = tl.load(DELTA + STAT_H + row, mask=ok, other=0.0)
                scores = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BN, BQ]
                p = tl.where(select, tl.math.exp2(scores * scale_log2 - lse[None, :]), 0.0)
                dv = dot_fp32_lhs(p, do, dv, PRECISION, SPLIT)
                dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds = p * (dp - delta[None, :])
                dk = dot_fp32_lhs(ds, q, dk, PRECISION, SPLIT)
                r0 += BQ

    tl.store(DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + slot[:, None] * stride_dks
             + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=present[:, None])
    tl.store(DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + slot[:, None] * stride_dvs
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=present[:, None])
