"""The pieces every ESA Triton kernel shares: which heads a program owns, its query rows and their positions, key
slots and row offsets, key tiles, the split fp32 dot, and a block's position span.

Positions: query row i sits at ``S_kv - S_q + i`` unless ``q_positions`` says otherwise (-1 = padding; queries are
processed in position order, a stable sort of the rows); key position p lives in slot ``key_slots[b, p]`` (slot p
without ``key_slots``). A key position whose slot is outside ``[0, S_kv)`` (or beyond ``key_slots``) is absent:
it takes no part in the softmax. A query position outside ``[0, span)`` (``span`` = key_slots' length, or S_kv)
is padding.
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(1 << 30)
"""Above every key position: the key of no row."""


@triton.jit
def program_heads(pid, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr):
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
def query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b, HAS_POSITIONS: tl.constexpr):
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
def key_slots(kpos, needed, SLOTS_B, kv_len, span, HAS_SLOTS: tl.constexpr):
    """Slots (int32, 0 where absent) and presence of key positions kpos."""
    if HAS_SLOTS:
        slot = tl.load(SLOTS_B + kpos, mask=needed & (kpos < span), other=-1)
    else:
        slot = kpos
    present = needed & (slot >= 0) & (slot < kv_len)
    return tl.where(present, slot, 0), present


@triton.jit
def row_offsets(slot, stride_ks, stride_vs, WIDE: tl.constexpr, SAME_KV_STRIDE: tl.constexpr):
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
def key_range_tiles(K_B, V_B, SLOTS_B, key, ok, lo, hi, stride_ks, stride_vs, kv_len, span,
                     BM: tl.constexpr, D: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
                     SAME_KV_STRIDE: tl.constexpr):
    """K and V tiles [HEADS, BM, D] of key positions lo + c (c < BM, each head its own lo, rows past hi skipped)
    and the selection [HEADS, BM queries, BM columns]: column c holds query r's key."""
    cols = tl.arange(0, BM)
    dims = tl.arange(0, D)
    kpos = lo[:, None] + cols[None, :]
    slot, present = key_slots(kpos, kpos <= hi[:, None], SLOTS_B, kv_len, span, HAS_SLOTS)
    row_k, row_v = row_offsets(slot, stride_ks, stride_vs, WIDE, SAME_KV_STRIDE)
    k = tl.load(K_B + row_k[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
    v = tl.load(V_B + row_v[:, :, None] + dims[None, None, :], mask=present[:, :, None], other=0.0)
    select = ((key - lo[:, None])[:, :, None] == cols[None, None, :]) & ok[:, :, None]
    if HAS_SLOTS:  # without key slots a real row's key, in [lo, hi] and < S_kv, is always present
        select = select & present[:, None, :]
    return k, v, select


@triton.jit
def dot_fp32_lhs(a, b, acc, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """acc + a @ b for an fp32 a and a 16-bit b: a is rounded to b's dtype, and with SPLIT its rounding error is
    multiplied in by a second dot, so a keeps ~16 bits instead of 8 (bf16)."""
    high = a.to(b.dtype)
    acc = tl.dot(high, b, acc, input_precision=PRECISION)
    if SPLIT:
        acc = tl.dot((a - high.to(tl.float32)).to(b.dtype), b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def position_span(pos, real, first_row_pos, BM: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """(first, last) position of a block's real rows and whether they are consecutive (then one tile per slot
    suffices when keys step by <= 1). Without q_positions the rows are consecutive by construction."""
    if HAS_POSITIONS:
        first = tl.min(tl.where(real, pos, BIG), axis=0)
        last = tl.max(tl.where(real, pos, -1), axis=0)
        count = tl.sum(real.to(tl.int32), axis=0)
        return tl.minimum(first, last), last, (count > 0) & (last - first == count - 1)
    else:
        return first_row_pos, first_row_pos + BM - 1, True
