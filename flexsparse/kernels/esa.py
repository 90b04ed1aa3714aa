"""ESA (Elastic Sparse Attention, seed 004) as Triton gather kernels: forward, backward and decode in O(S * w).

Each query attends exactly ``w = attn_length`` keys per head, chosen by the integer rule of
:class:`flexsparse.masks.ESA` (recomputed inside the kernels: no index table is read). The structure the kernels
exploit: for one head and one slot j, the key ``b_j(p)`` of query position p is non-decreasing in p and, when
``num_heads`` is even (``num_heads - 1`` odd: no rounding ties in the head mix) or 1, grows by at most one per
position (tests check both claims; an odd ``num_heads`` can step by two). So BM consecutive positions read, per
(head, slot), a contiguous range of at most BM keys:

* forward and dQ (query-major): a program takes BM position-ordered queries of one query head (forward: one warp;
  the heads of a KV group take neighbouring programs) or of the G query heads of one KV head (dQ: one warp per
  head) and, for each slot, loads each head's key range as a [BM, d] tile (rows through ``key_slots`` where
  given), computes the [BM, BM] score tile on tensor cores and keeps, per query, the one column that holds its key
  (online softmax over the w slots). When a block's real rows are not consecutive positions (padding in the
  middle, gaps) or keys can step by two, it visits as many tiles per slot as its keys need;
* dK/dV (key-major, no atomics, so every path is deterministic): a program owns BN key positions of one KV head
  and, for each head of the group and each slot, binary-searches the contiguous range of position-ordered queries
  whose slot-j key falls in it, then accumulates ``P^T dO`` and ``dS^T Q`` in fp32;
* decode (fewer than 16 queries): one program per query row gathers its w keys for the G heads of a group.

16-bit inputs: scores and gradients accumulate in fp32, and the fp32 left operands of the dS @ K, P^T @ dO and
dS^T @ Q dots enter as two 16-bit parts (hi + lo), so bf16 gradients stay at the rounding level of a dense path;
the forward rounds P to 16 bits once for P @ V, as dense bf16 attention does (``KERNEL_CONFIG["forward_split"]``
splits it too, ~10% slower on the H100).

Positions: query row i sits at ``S_kv - S_q + i`` unless ``q_positions`` says otherwise (-1 = padding; queries are
processed in position order, a stable sort of the rows); key position p lives in slot ``key_slots[b, p]`` (slot p
without ``key_slots``). A key position whose slot is outside ``[0, S_kv)`` (or beyond ``key_slots``) is absent:
it takes no part in the softmax. A query position outside ``[0, span)`` (``span`` = key_slots' length, or S_kv)
is padding.

The same function in plain PyTorch, :func:`esa_attention_reference`, and the argument checks both share live in
:mod:`flexsparse.kernels.esa_reference` (no triton import).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.esa_reference import (  # noqa: F401  (the reference and head dims: also imported from here)
    check_esa_inputs,
    check_position_tensor,
    esa_attention_reference,
    supports_head_dim,
)
from flexsparse.masks.esa import ESA
from flexsparse.validation import as_float

BLOCK_QUERIES = 16
"""Queries per forward/dQ program (the tensor-core minimum); also the key tile, so one tile holds a range."""
BLOCK_KEYS = 16
"""Key positions per dK/dV program."""
DECODE_MAX_QUERIES = BLOCK_QUERIES - 1
"""Up to this many queries per sequence, the per-row gather kernel runs instead of the tile kernel."""
KERNEL_CONFIG = {
    "forward_stages": 2,  # cp.async stages of the forward's key tiles (one warp per program)
    "forward_split": False,  # P enters P @ V as two 16-bit parts (False: rounded once, as dense bf16 attention)
    "dkdv_warps": 2,  # 2: no spills in the loop, fewest instructions per query block (SASS)
    "dkdv_queries": 16,
    "decode_warps": 4,
}
"""Launch settings, chosen by H100 measurements and the compiler's SASS: docs/notes/esa-kernel.md."""

_LOG2E = 1.4426950408889634
_BIG = tl.constexpr(1 << 30)


# ---------------------------------------------------------------------------------------------------------------
# The index rule of flexsparse.masks.ESA, in Triton (int32, exact: the launcher checks the range).


@triton.jit
def _round_div(num, DEN: tl.constexpr):
    """round(num / DEN) with ties to even, for int32 tensors 0 <= num < 2**31, in unsigned arithmetic: a shift for
    a power of two DEN, a multiply-high for an odd one."""
    n = num.to(tl.uint32)
    if DEN % 2 == 1:  # never a tie
        quotient = (n + DEN // 2) // DEN
    elif (DEN & (DEN - 1)) == 0:  # a tie (remainder DEN / 2) rounds up only from an odd quotient
        quotient = (n + (DEN // 2 - 1) + ((n // DEN) & 1)) // DEN
    else:
        twice = 2 * n + DEN
        quotient = twice // (2 * DEN)
        quotient = quotient - ((quotient * (2 * DEN) == twice) & (quotient % 2 == 1)).to(tl.uint32)
    return quotient.to(tl.int32)


@triton.jit
def _start_and_window(pos, layer_weight, W: tl.constexpr, LAYER_DEN: tl.constexpr):
    """Start s and window n - s of query positions pos (n = max(w, pos + 1))."""
    n = tl.maximum(pos + 1, W)
    start = _round_div((n - W) * layer_weight, LAYER_DEN)
    return start, n - start


@triton.jit
def _slot_base(start, window, j, W: tl.constexpr):
    """base_j = s + round(j * window / w)."""
    return start + _round_div(j * window, W)


@triton.jit
def _head_key(base, next_base, head, NUM_HEADS: tl.constexpr):
    """Key of a slot for a head: round((base_j (H - 1 - h) + (base_{j+1} - 1) h) / (H - 1)) (broadcasts)."""
    if NUM_HEADS == 1:
        return base + 0 * head
    else:
        return _round_div(base * (NUM_HEADS - 1 - head) + (next_base - 1) * head, NUM_HEADS - 1)


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces of the kernels: which heads a program owns, query rows and positions, key slots.


@triton.jit
def _program_heads(pid, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr):
    """(batch, KV head, query heads [HEADS], which of them exist) of program ``pid``; HEADS heads of one group."""
    blocks_per_group = (GROUP + HEADS - 1) // HEADS
    kv_heads = NUM_HEADS // GROUP
    batch = pid // (kv_heads * blocks_per_group)
    rest = pid % (kv_heads * blocks_per_group)
    kv_head = rest // blocks_per_group
    member = (rest % blocks_per_group) * HEADS + tl.arange(0, HEADS)
    # padding heads (GROUP not a power of two) compute with the group's last head and are masked out
    return batch, kv_head, kv_head * GROUP + tl.minimum(member, GROUP - 1), member < GROUP


@triton.jit
def _query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS: tl.constexpr):
    """For position-ordered rows r: (tensor row, position clamped to >= 0, row holds a real query)."""
    in_range = r < q_len
    if HAS_POSITIONS:
        offset = batch.to(tl.int64) * stride_pos_b + r
        row = tl.load(ORDER + offset, mask=in_range, other=0)
        pos = tl.load(SORTED_POS + offset, mask=in_range, other=-1)
    else:
        row = r
        pos = first_pos + r
    real = in_range & (pos >= 0) & (pos < span)
    return row, tl.where(real, pos, 0), real


@triton.jit
def _key_slots(kpos, needed, SLOTS_B, kv_len, span, HAS_SLOTS: tl.constexpr):
    """Slots (int32, 0 where absent) and presence of key positions kpos."""
    if HAS_SLOTS:
        slot = tl.load(SLOTS_B + kpos, mask=needed & (kpos < span), other=-1)
    else:
        slot = kpos
    present = needed & (slot >= 0) & (slot < kv_len)
    return tl.where(present, slot, 0), present


@triton.jit
def _row_offsets(slot, stride_ks, stride_vs, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr):
    """Element offsets of key rows in K and in V: int32 unless the launcher found that they may overflow it."""
    if WIDE:
        slot = slot.to(tl.int64)
    row_k = slot * stride_ks
    if SAME_KV_STRIDE:
        row_v = row_k
    else:
        row_v = slot * stride_vs
    return row_k, row_v


@triton.jit
def _key_range_tiles(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span,
                     BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                     SAME_KV_STRIDE: tl.constexpr):
    """K and V tiles [HEADS, BM, D] of key positions lo + c (c < BM, each head its own lo, rows past hi skipped)
    and the selection [HEADS, BM queries, BM columns]: column c holds query r's key."""
    cols = tl.arange(0, BM)
    dims = tl.arange(0, D)
    kpos = lo[:, None] + cols[None, :]
    slot, present = _key_slots(kpos, kpos <= hi[:, None], SLOTS_B, kv_len, span, HAS_SLOTS)
    row_k, row_v = _row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
    k = tl.load(K_B + row_k[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
    v = tl.load(V_B + row_v[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
    select = ((key - lo[:, None])[:, :, None] == cols[None, None, :]) & ok[:, :, None]
    if HAS_SLOTS:  # without key slots a real row's key, in [lo, hi] and < S_kv, is always present
        select = select & present[:, None, :]
    return k, v, select


@triton.jit
def _dot_fp32_lhs(a, b, acc, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """acc + a @ b for an fp32 a and a 16-bit b: a is rounded to b's dtype, and with SPLIT its rounding error is
    multiplied in by a second dot, so a keeps ~16 bits instead of 8 (bf16)."""
    high = a.to(b.dtype)
    acc = tl.dot(high, b, acc, input_precision=PRECISION)
    if SPLIT:
        acc = tl.dot((a - high.to(tl.float32)).to(b.dtype), b, acc, input_precision=PRECISION)
    return acc


# ---------------------------------------------------------------------------------------------------------------
# Forward.


@triton.jit
def _key_range_tile(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span,
                    BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                    SAME_KV_STRIDE: tl.constexpr):
    """One head's K and V tiles [BM, D] of key positions lo + c (c < BM, rows past hi skipped; lo, hi scalars) and
    the selection [BM queries, BM columns]: column c holds query r's key."""
    cols = tl.arange(0, BM)
    dims = tl.arange(0, D)
    kpos = lo + cols
    slot, present = _key_slots(kpos, kpos <= hi, SLOTS_B, kv_len, span, HAS_SLOTS)
    row_k, row_v = _row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
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
    acc = _dot_fp32_lhs(tl.where(select, p[:, None], 0.0), v, acc * alpha[:, None], PRECISION, SPLIT)
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
    start, window = _start_and_window(pos, layer_weight, W, LAYER_DEN)
    start_first, window_first = _start_and_window(first_real, layer_weight, W, LAYER_DEN)
    start_last, window_last = _start_and_window(last_real, layer_weight, W, LAYER_DEN)
    base, base_first, base_last = start, start_first, start_last
    for j in range(W):
        next_base = _slot_base(start, window, j + 1, W)
        key = _head_key(base, next_base, head, NUM_HEADS)  # [BM]
        ok = real & (key <= pos)
        if ONE_TILE:
            next_first = _slot_base(start_first, window_first, j + 1, W)
            next_last = _slot_base(start_last, window_last, j + 1, W)
            lo = _head_key(base_first, next_first, head, NUM_HEADS)
            hi = _head_key(base_last, next_last, head, NUM_HEADS)
            acc, l_sum, m_max = _forward_chunk(q, acc, l_sum, m_max, key, ok, lo, hi, K_B, V_B, SLOTS_B,
                                               stride_ks, stride_vs, kv_len, span, scale_log2, BM, D, HAS_SLOTS,
                                               WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
            base_first, base_last = next_first, next_last
        else:
            pending = tl.where(ok, key, _BIG)
            lo = tl.min(pending, axis=0)
            hi = tl.max(tl.where(ok, key, -1), axis=0)
            while lo < _BIG:
                acc, l_sum, m_max = _forward_chunk(q, acc, l_sum, m_max, key, ok, lo, hi, K_B, V_B, SLOTS_B,
                                                   stride_ks, stride_vs, kv_len, span, scale_log2, BM, D,
                                                   HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
                lo = tl.min(tl.where(pending >= lo + BM, pending, _BIG), axis=0)
        base = next_base
    return acc, l_sum, m_max


@triton.jit
def _position_span(pos, real, first_row_pos, BM: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """(first, last) position of a block's real rows and whether they are consecutive (then one tile per slot
    suffices when keys step by <= 1). Without q_positions the rows are consecutive by construction."""
    if HAS_POSITIONS:
        first = tl.min(tl.where(real, pos, _BIG), axis=0)
        last = tl.max(tl.where(real, pos, -1), axis=0)
        count = tl.sum(real.to(tl.int32), axis=0)
        return tl.minimum(first, last), last, (count > 0) & (last - first == count - 1)
    else:
        return first_row_pos, first_row_pos + BM - 1, True


@triton.jit
def _esa_forward_kernel(
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
    row, pos, real = _query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
    dims = tl.arange(0, D)
    row64, batch64, head64 = row.to(tl.int64), batch.to(tl.int64), head.to(tl.int64)
    q = tl.load(Q + batch64 * stride_qb + head64 * stride_qh + row64[:, None] * stride_qs + dims[None, :],
                mask=real[:, None], other=0.0)
    K_B = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_B = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    SLOTS_B = KEY_SLOTS + batch64 * stride_slots_b

    first_real, last_real, consecutive = _position_span(pos, real, first_pos + block * BM, BM, HAS_POSITIONS)
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


@triton.jit
def _esa_decode_kernel(
    Q, K, V, O, LSE, SORTED_POS, ORDER, KEY_SLOTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_pos_b, stride_slots_b,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr,
):
    """One query row x HEADS heads: gather the w keys, SLOTS slots at a time, fp32 dot products."""
    batch, kv_head, head, head_ok = _program_heads(tl.program_id(1), NUM_HEADS, GROUP, HEADS)
    r = tl.program_id(0)
    row, pos, real = _query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
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
    start, window = _start_and_window(pos, layer_weight, W, LAYER_DEN)
    for j0 in range(0, W, SLOTS):
        j = j0 + tl.arange(0, SLOTS)
        key = _head_key(_slot_base(start, window, j, W)[None, :], _slot_base(start, window, j + 1, W)[None, :],
                        (head + head_offset)[:, None], PATTERN_HEADS)  # [HEADS, SLOTS]
        ok = live[:, None] & (j < W)[None, :] & (key <= pos)
        slot, present = _key_slots(key, ok, SLOTS_B, kv_len, span, HAS_SLOTS)
        row_k, row_v = _row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
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


# ---------------------------------------------------------------------------------------------------------------
# Backward: dQ (query-major, also writes delta = rowsum(dO * O)), then dK/dV (key-major).


@triton.jit
def _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs, kv_len, span,
              scale_log2, BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
              SAME_KV_STRIDE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """dQ step over one key tile per head: dS = P (dP - delta) at each row's one key, dQ += dS K."""
    k, v, select = _key_range_tiles(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span, BM,
                                    D, HAS_SLOTS, WIDE, SAME_KV_STRIDE)
    scores = tl.dot(q, tl.trans(k, 0, 2, 1), input_precision=PRECISION)
    score = tl.max(tl.where(select, scores, float("-inf")), axis=2) * scale_log2
    p = tl.math.exp2(score - lse)
    dp = tl.dot(do, tl.trans(v, 0, 2, 1), input_precision=PRECISION)
    dp_row = tl.sum(tl.where(select, dp, 0.0), axis=2)
    ds = p * (dp_row - delta)
    return _dot_fp32_lhs(tl.where(select, ds[:, :, None], 0.0), k, dq, PRECISION, SPLIT)


@triton.jit
def _dq_slots(q, do, lse, delta, pos, rows_ok, head, head_ok, first_real, last_real, K_B, V_B, SLOTS_B,
              stride_ks, stride_vs, kv_len, span, layer_weight, scale_log2, NUM_HEADS: tl.constexpr,
              HEADS: tl.constexpr, W: tl.constexpr, LAYER_DEN: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
              HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr, ONE_TILE: tl.constexpr,
              PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """dQ [HEADS, BM, D] (unscaled) summed over the w slots; tiles as in :func:`_forward_slots`."""
    dq = tl.zeros([HEADS, BM, D], dtype=tl.float32)
    start, window = _start_and_window(pos, layer_weight, W, LAYER_DEN)
    start_first, window_first = _start_and_window(first_real, layer_weight, W, LAYER_DEN)
    start_last, window_last = _start_and_window(last_real, layer_weight, W, LAYER_DEN)
    base, base_first, base_last = start, start_first, start_last
    for j in range(W):
        next_base = _slot_base(start, window, j + 1, W)
        key = _head_key(base[None, :], next_base[None, :], head[:, None], NUM_HEADS)
        ok = rows_ok & (key <= pos[None, :])
        if ONE_TILE:
            next_first = _slot_base(start_first, window_first, j + 1, W)
            next_last = _slot_base(start_last, window_last, j + 1, W)
            lo = _head_key(base_first, next_first, head, NUM_HEADS)
            hi = tl.where(head_ok, _head_key(base_last, next_last, head, NUM_HEADS), -1)
            dq = _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs,
                           kv_len, span, scale_log2, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
            base_first, base_last = next_first, next_last
        else:
            pending = tl.where(ok, key, _BIG)
            lo = tl.min(pending, axis=1)
            hi = tl.max(tl.where(ok, key, -1), axis=1)
            while tl.min(lo, axis=0) < _BIG:
                dq = _dq_chunk(q, do, dq, lse, delta, key, ok, lo, hi, K_B, V_B, SLOTS_B, stride_ks, stride_vs,
                               kv_len, span, scale_log2, BM, D, HAS_SLOTS, WIDE, SAME_KV_STRIDE, PRECISION, SPLIT)
                lo = tl.min(tl.where(pending >= lo[:, None] + BM, pending, _BIG), axis=1)
        base = next_base
    return dq


@triton.jit
def _esa_backward_dq_kernel(
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
    batch, kv_head, head, head_ok = _program_heads(tl.program_id(1), NUM_HEADS, GROUP, HEADS)
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    row, pos, real = _query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS)
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

    first_real, last_real, consecutive = _position_span(pos, real, first_pos + tl.program_id(0) * BM, BM,
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
    """Slot-j key of position-ordered rows r for one head, made monotone in r over padding: -1 below, _BIG above."""
    if HAS_POSITIONS:
        raw = tl.load(SORTED_POS + batch.to(tl.int64) * stride_pos_b + r, mask=r < q_len, other=-1)
    else:
        raw = first_pos + r
    real = (r < q_len) & (raw >= 0) & (raw < span)
    start, window = _start_and_window(tl.where(real, raw, 0), layer_weight, W, LAYER_DEN)
    key = _head_key(_slot_base(start, window, j, W), _slot_base(start, window, j + 1, W), head, NUM_HEADS)
    return tl.where(real, key, tl.where(raw < 0, -1, _BIG))


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
def _esa_backward_dkdv_kernel(
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
    slot, present = _key_slots(kpos, kpos < span, KEY_SLOTS + batch64 * stride_slots_b, kv_len, span, HAS_SLOTS)
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
                row, pos, real = _query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b,
                                             HAS_POSITIONS)
                start, window = _start_and_window(pos, layer_weight, W, LAYER_DEN)
                key = _head_key(_slot_base(start, window, j, W), _slot_base(start, window, j + 1, W), pattern_head,
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
                dv = _dot_fp32_lhs(p, do, dv, PRECISION, SPLIT)
                dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds = p * (dp - delta[None, :])
                dk = _dot_fp32_lhs(ds, q, dk, PRECISION, SPLIT)
                r0 += BQ

    tl.store(DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + slot[:, None] * stride_dks
             + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=present[:, None])
    tl.store(DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + slot[:, None] * stride_dvs
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=present[:, None])


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd.


@dataclass(frozen=True)
class _Launch:
    """Everything the kernels need besides q, k, v: sizes, the index rule's constants and position tensors."""

    num_heads: int  # the pattern's heads (the index rule's H)
    head_offset: int  # the pattern's head of q's head 0
    group: int
    attn_length: int
    layer_den: int
    layer_weight: int
    scale: float
    q_len: int
    kv_len: int
    span: int
    first_pos: int
    sorted_pos: Tensor | None  # int32 [B or 1, S_q], stable sort of q_positions
    order: Tensor | None  # int32 [B or 1, S_q], the rows in that order
    key_slots: Tensor | None  # int32 [B or 1, span]
    step_one: bool  # keys step by <= 1 per position (H even or 1): one tile per slot for consecutive rows
    precision: str  # tl.dot input precision: "ieee" for fp32 inputs
    split: bool  # 16-bit inputs: fp32 left operands of dots enter as two 16-bit parts

    def position_args(self, device: torch.device) -> tuple:
        """(SORTED_POS, ORDER, KEY_SLOTS, stride_pos_b, stride_slots_b); dummies where absent."""
        dummy = torch.empty(1, dtype=torch.int32, device=device)
        sorted_pos = dummy if self.sorted_pos is None else self.sorted_pos
        order = dummy if self.order is None else self.order
        slots = dummy if self.key_slots is None else self.key_slots
        stride_pos = 0 if self.sorted_pos is None or self.sorted_pos.shape[0] == 1 else self.sorted_pos.stride(0)
        stride_slots = 0 if self.key_slots is None or self.key_slots.shape[0] == 1 else self.key_slots.stride(0)
        return sorted_pos, order, slots, stride_pos, stride_slots

    def rule_args(self) -> tuple:
        return (self.q_len, self.kv_len, self.span, self.first_pos, self.layer_weight, self.scale * _LOG2E,
                self.head_offset)

    def heads_per_program(self) -> int:
        """Query heads per dQ or decode program: the whole KV group, at most 8 (one warp per head)."""
        return triton.next_power_of_2(min(self.group, 8))


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _wide_rows(*tensors: Tensor) -> bool:
    """Whether a row's element offset inside one (batch, head) of these [B, H, S, d] tensors may overflow int32."""
    return any((t.shape[2] - 1) * t.stride(2) + t.shape[3] >= 2**31 for t in tensors)


def _row_offset_kinds(k: Tensor, v: Tensor) -> dict:
    """WIDE: a key row's element offset inside one (batch, KV head) may not fit int32; SAME_KV_STRIDE: K and V rows
    share offsets."""
    return dict(WIDE=_wide_rows(k, v), SAME_KV_STRIDE=k.stride(2) == v.stride(2))


def _forward(q: Tensor, k: Tensor, v: Tensor, launch: _Launch) -> tuple[Tensor, Tensor]:
    batch, heads, q_len, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    sorted_pos, order, slots, stride_pos, stride_slots = launch.position_args(q.device)
    args = (q, k, v, out, lse, sorted_pos, order, slots, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            stride_pos, stride_slots, *launch.rule_args())
    common = dict(NUM_HEADS=heads, PATTERN_HEADS=launch.num_heads, GROUP=launch.group, W=launch.attn_length,
                  LAYER_DEN=launch.layer_den, D=dim, HAS_POSITIONS=launch.sorted_pos is not None,
                  HAS_SLOTS=launch.key_slots is not None, **_row_offset_kinds(k, v))
    kv_heads = heads // launch.group
    if q_len <= DECODE_MAX_QUERIES:
        per_program = launch.heads_per_program()
        slots = min(triton.next_power_of_2(launch.attn_length), 64 // per_program)  # [heads, slots, d] tiles
        _esa_decode_kernel[(q_len, batch * kv_heads * triton.cdiv(launch.group, per_program))](
            *args, HEADS=per_program, SLOTS=slots, num_warps=KERNEL_CONFIG["decode_warps"], **common)
    else:
        _esa_forward_kernel[(triton.cdiv(q_len, BLOCK_QUERIES) * launch.group, batch * kv_heads)](
            *args, BM=BLOCK_QUERIES, STEP_ONE=launch.step_one, PRECISION=launch.precision,
            SPLIT=launch.split and KERNEL_CONFIG["forward_split"], num_warps=1,
            num_stages=KERNEL_CONFIG["forward_stages"], **common)
    return out, lse


def _backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, launch: _Launch,
              need_dkdv: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    batch, heads, q_len, dim = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty_like(lse)
    sorted_pos, order, slots, stride_pos, stride_slots = launch.position_args(q.device)
    per_program = launch.heads_per_program()
    kv_heads = heads // launch.group
    programs = batch * kv_heads * triton.cdiv(launch.group, per_program)
    common = dict(NUM_HEADS=heads, PATTERN_HEADS=launch.num_heads, GROUP=launch.group, W=launch.attn_length,
                  LAYER_DEN=launch.layer_den, D=dim,
                  HAS_POSITIONS=launch.sorted_pos is not None, HAS_SLOTS=launch.key_slots is not None,
                  PRECISION=launch.precision, SPLIT=launch.split)
    offsets = _row_offset_kinds(k, v)
    _esa_backward_dq_kernel[(triton.cdiv(q_len, BLOCK_QUERIES), programs)](
        q, k, v, out, do, dq, lse, delta, sorted_pos, order, slots, *_strides(q), *_strides(k), *_strides(v),
        *_strides(out), *_strides(do), *_strides(dq), stride_pos, stride_slots, *launch.rule_args(), launch.scale,
        HEADS=per_program, BM=BLOCK_QUERIES, STEP_ONE=launch.step_one,
        num_warps=per_program, **offsets, **common)
    if not need_dkdv:
        return dq, None, None
    # without key_slots every slot is some key position's and gets written; with them, unused slots stay 0
    make = torch.empty if launch.key_slots is None else torch.zeros
    dk = make(k.shape, dtype=k.dtype, device=k.device)
    dv = make(v.shape, dtype=v.dtype, device=v.device)
    _esa_backward_dkdv_kernel[(triton.cdiv(launch.span, BLOCK_KEYS), batch * kv_heads)](
        q, k, v, do, dk, dv, lse, delta, sorted_pos, order, slots, *_strides(q), *_strides(k), *_strides(v),
        *_strides(do), *_strides(dk), *_strides(dv), stride_pos, stride_slots, *launch.rule_args(), launch.scale,
        max(q_len, 1).bit_length(), WIDE=_wide_rows(q, do), W_POW2=triton.next_power_of_2(launch.attn_length),
        GROUP_POW2=triton.next_power_of_2(launch.group), BN=BLOCK_KEYS, BQ=KERNEL_CONFIG["dkdv_queries"],
        num_warps=KERNEL_CONFIG["dkdv_warps"], **common)
    return dq, dk, dv


class _EsaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, launch: _Launch) -> Tensor:
        out, lse = _forward(q, k, v, launch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        need_dkdv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.launch, need_dkdv)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def esa_attention(q: Tensor, k: Tensor, v: Tensor, pattern: ESA, scale: float | None = None, *,
                  q_positions: Tensor | None = None, key_slots: Tensor | None = None,
                  deterministic: bool = False, head_offset: int = 0) -> Tensor:
    """ESA attention ``[B, H, S_q, d]`` (q's dtype), differentiable in q, k and v.

    q ``[B, H, S_q, d]``, k/v ``[B, H_kv, S_kv, d]`` (H a multiple of H_kv; any strides with a contiguous last
    dim), d a power of two in [16, 256], float32/bfloat16/float16. q's heads are the pattern's heads
    ``head_offset .. head_offset + H - 1`` (default: all ``pattern.num_heads`` of them); whole KV groups, so
    ``head_offset`` is a multiple of ``H / H_kv`` (the other heads of a layer may run elsewhere).
    ``q_positions`` int32 ``[B or 1, S_q]``: token positions of the query rows (default ``S_kv - S_q + i``), -1
    for padding (output row 0, no gradient). ``key_slots`` int32 ``[B or 1, span]``: key position p of batch b is
    ``k[b, :, key_slots[b, p]]`` (default: slot p); slots outside ``[0, S_kv)`` mark absent keys. A query at
    position p attends, per head, the ESA indices of p that are <= p and present. Query positions outside
    ``[0, span)`` count as padding. For gradients, distinct positions must map to distinct slots.
    ``deterministic``: accepted for the executor interface; every path is deterministic (no atomics).
    """
    head_offset = check_esa_inputs(q, k, v, pattern, head_offset)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    batch, heads, q_len, dim = q.shape
    kv_len = k.shape[2]
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    check_position_tensor("q_positions", q_positions, batch, q_len, q.device)
    check_position_tensor("key_slots", key_slots, batch, None, q.device)
    if q_positions is None and q_len > kv_len:
        raise ValueError(f"without q_positions, S_q ({q_len}) must not exceed S_kv ({kv_len})")
    span = kv_len if key_slots is None else key_slots.shape[1]
    w, layers, pattern_heads = pattern.attn_length, pattern.num_layers, pattern.num_heads
    if 2 * (max(w, span) + 1) * max(w, pattern_heads, layers) >= 2**31:
        raise ValueError(f"key positions ({span}) x max(attn_length, num_heads, num_layers) is too large for "
                         "the kernels' int32 index arithmetic")
    reason = kernel_unavailable(q.device)
    if reason is not None:
        raise ValueError(f"esa_attention needs CUDA tensors or the Triton interpreter (q is on {q.device}: "
                         f"{reason}); elsewhere use esa_attention_reference")
    if q_len == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sorted_pos = order = None
    if q_positions is not None:
        sorted_pos, sort_order = torch.sort(q_positions, dim=1, stable=True)
        order = sort_order.to(torch.int32)
    launch = _Launch(
        num_heads=pattern_heads, head_offset=head_offset, group=heads // k.shape[1], attn_length=w,
        layer_den=max(layers - 1, 1),
        layer_weight=max(layers - 1, 1) - pattern.layer_idx, scale=scale, q_len=q_len, kv_len=kv_len, span=span,
        first_pos=kv_len - q_len, sorted_pos=sorted_pos, order=order,
        key_slots=None if key_slots is None else key_slots.contiguous(),
        step_one=pattern_heads % 2 == 0 or pattern_heads == 1,
        precision="ieee" if q.dtype == torch.float32 else "tf32", split=q.dtype != torch.float32,
    )
    return _EsaAttention.apply(q, k, v, launch)
