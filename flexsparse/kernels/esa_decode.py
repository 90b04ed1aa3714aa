"""The ESA decode kernel (fewer than 16 queries per sequence): one program per query row gathers its w keys for the
heads of a KV group, SLOTS slots at a time, with fp32 dot products."""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.esa_index_triton import head_key, slot_base, start_and_window
from flexsparse.kernels.esa_shared import key_slots, program_heads, query_rows, row_offsets


@triton.jit
def esa_decode_kernel(
    Q, K, V, O, LSE, SORTED_POS, ORDER, KEY_SLOTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_pos_b, stride_slots_b,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr,
):
    """One query row x HEADS heads: gather the w keys, SLOTS slots at a time, fp32 dot products."""
    batch, kv_head, head, head_ok = program_heads(tl.program_id(1), NUM_HEADS, GROUP, HEADS)
    r = tl.program_id(0)
    row, pos, real = query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
    dims = tl.arange(0, D)
    head64, row64, batch64 = head.to(tl.int64), row.to(tl.int64), batch.to(tl.int64)
    live = tl.where(real, head_ok, False)  # [HEADS]; scalar-bool & vector-bool is int32 in triton>=3.9's interpreter
    q = tl.load(Q + batch64 * stride_qb + head64[:, None] * stride_qh + row64 * stride_qs + dims[None, :],
                mask=live[:, None], other=0.0).to(tl.float32)
    K_B = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_B = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    SLOTS_B = KEY_SLOTS + batch64 * stride_slots_b

    acc = tl.zeros([HEADS, D], dtype=tl.float32)
    l_sum = tl.zeros([HEADS], dtype=tl.float32)
    m_max = tl.full([HEADS], -1.0e30, dtype=tl.float32)
    start, window = start_and_window(pos, layer_weight, W, LAYER_DEN)
    for j0 in range(0, W, SLOTS):
        j = j0 + tl.arange(0, SLOTS)
        key = head_key(slot_base(start, window, j, W)[None, :], slot_base(start, window, j + 1, W)[None, :],
                        (head + head_offset)[:, None], PATTERN_HEADS)  # [HEADS, SLOTS]
        ok = live[:, None] & (j < W)[None, :] & (key <= pos)
        slot, present = key_slots(key, ok, SLOTS_B, kv_len, span, HAS_SLOTS)
        row_k, row_v = row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
        k = tl.load(K_B + row_k[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
        score = tl.sum(q[:, None, :] * k.to(tl.float32), axis=2) * scale_log2
        score = tl.where(present, score, float("-inf"))
        m_new = tl.maximum(m_max, tl.max(score, axis=1))
        alpha = tl.math.exp2(m_max - m_new)
        p = tl.math.exp2(score - m_new[:, None])
        v = tl.load(V_B + row_v[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), axis=1)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m_max = m_new

    has_keys = l_sum > 0
    l_safe = tl.where(has_keys, l_sum, 1.0)
    store = tl.where(r < q_len, head_ok, False)
    tl.store(O + batch64 * stride_ob + head64[:, None] * stride_oh + row64 * stride_os + dims[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=store[:, None])
    lse = tl.where(has_keys, m_max + tl.math.log2(l_safe), float("inf"))
    tl.store(LSE + (batch64 * NUM_HEADS + head64) * q_len + row64, lse, mask=store)
