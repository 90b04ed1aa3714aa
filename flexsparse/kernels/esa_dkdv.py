"""The ESA dK/dV kernel (key-major, no atomics on the gradients: deterministic) and the work list it walks.

A program owns BN key positions of one KV head. The queries whose slot-j key for head h falls in those positions
are a contiguous run of position-ordered rows (keys are non-decreasing in the position), found by binary search.

A small kernel, :func:`esa_dkdv_work_kernel`, turns the runs into a work list before the main kernel starts:
per program, one entry per BQ-row chunk of every (head of the group, slot) run, packed as ``(first row, head,
slot)`` in one integer.

The main kernel, :func:`esa_dkdv_kernel`, then runs one flat loop over its entries, which the compiler pipelines:
the next chunks' query and dO rows load (``cp.async``) while the current one computes. One warp per program, so a
chunk's P and dS go from the score tile's registers into the next dot without crossing warps. Per chunk:
``S = Q K^T`` and ``dP = dO V^T`` ([BQ, BN] on the tensor cores), each row keeps the one column holding its key,
``dV += P^T dO`` and ``dK += dS^T Q`` in fp32.

16-bit inputs: P and dS enter ``P dO`` and ``dS Q`` rounded to 16 bits, as in dense bf16 attention's backward
(``SPLIT`` keeps their rounding error as a second 16-bit part); fp32 inputs stay fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.esa_index_triton import head_key, slot_base, start_and_window
from flexsparse.kernels.esa_shared import BIG, dot_fp32_lhs, key_slots, query_rows


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
def _program_pair_and_block(program, pairs, blocks, HEAD_MAJOR: tl.constexpr):
    """(pair = batch x KV heads + KV head, key block) of dK/dV program ``program``: head-major (a head's blocks
    in order, so programs running together read neighbouring query rows from L2), or block-major (every head's
    first block, the most work, first: a shorter tail when the grid is a few waves)."""
    if HEAD_MAJOR:
        return program // blocks, program % blocks
    else:
        return program % pairs, program // pairs


@triton.jit
def _chunks(first_key, kv_head, batch, q_len, span, first_pos, layer_weight, head_offset, search_steps,
            SORTED_POS, stride_pos_b, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
            LAYER_DEN: tl.constexpr, GROUP_POW2: tl.constexpr, W_POW2: tl.constexpr, BN: tl.constexpr,
            BQ: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """(first row, chunk count) [GROUP_POW2 * W_POW2] of each (head of the group, slot) run of rows whose key
    lies in key positions [first_key, first_key + BN); lanes past GROUP or W count 0."""
    lane = tl.arange(0, GROUP_POW2 * W_POW2)
    member, slot = lane // W_POW2, lane % W_POW2
    head = kv_head * GROUP + tl.minimum(member, GROUP - 1) + head_offset
    first = _first_row_with_key_at_least(first_key, slot, head, batch, q_len, span, first_pos, layer_weight,
                                         search_steps, SORTED_POS, stride_pos_b, PATTERN_HEADS, W, LAYER_DEN,
                                         HAS_POSITIONS)
    end = _first_row_with_key_at_least(first_key + BN, slot, head, batch, q_len, span, first_pos, layer_weight,
                                       search_steps, SORTED_POS, stride_pos_b, PATTERN_HEADS, W, LAYER_DEN,
                                       HAS_POSITIONS)
    used = (member < GROUP) & (slot < W) & (end > first)
    return first, tl.where(used, (end - first + BQ - 1) // BQ, 0)


@triton.jit
def esa_dkdv_work_kernel(USED, RANGES, WORK, SORTED_POS, stride_pos_b, pairs, blocks, q_len, span, first_pos,
                         layer_weight, head_offset, search_steps, NUM_HEADS: tl.constexpr,
                         PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
                         LAYER_DEN: tl.constexpr, GROUP_POW2: tl.constexpr, W_POW2: tl.constexpr,
                         BN: tl.constexpr, BQ: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                         HEAD_MAJOR: tl.constexpr):
    """Each dK/dV program's work entries, ``row * GROUP_POW2 * W_POW2 + member * W_POW2 + slot`` for each BQ-row
    chunk, ordered by (member, slot, row), at ``WORK[RANGES[2 p] : RANGES[2 p + 1]]`` for program p (numbered
    as the main kernel's). ``USED`` (int64 [1], zero) hands out the space: where a program's entries land varies
    from run to run, what each program reads does not."""
    program = tl.program_id(0)
    pair, block = _program_pair_and_block(program, pairs, blocks, HEAD_MAJOR)
    kv_heads: tl.constexpr = NUM_HEADS // GROUP
    first, count = _chunks(block * BN, pair % kv_heads, pair // kv_heads, q_len, span, first_pos, layer_weight,
                           head_offset, search_steps, SORTED_POS, stride_pos_b, PATTERN_HEADS, GROUP, W,
                           LAYER_DEN, GROUP_POW2, W_POW2, BN, BQ, HAS_POSITIONS)
    total = tl.sum(count, axis=0).to(tl.int64)
    base = tl.atomic_add(USED, total)
    tl.store(RANGES + 2 * program.to(tl.int64), base)
    tl.store(RANGES + 2 * program.to(tl.int64) + 1, base + total)
    at = base + tl.cumsum(count, axis=0) - count
    lane = tl.arange(0, GROUP_POW2 * W_POW2).to(WORK.dtype.element_ty)
    entry = first.to(WORK.dtype.element_ty) * (GROUP_POW2 * W_POW2) + lane
    most = tl.max(count, axis=0)
    chunk = 0
    while chunk < most:
        tl.store(WORK + at + chunk, entry + chunk * BQ * (GROUP_POW2 * W_POW2), mask=chunk < count)
        chunk += 1


@triton.jit
def esa_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, SORTED_POS, ORDER, KEY_SLOTS, RANGES, WORK,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_pos_b, stride_slots_b, pairs, blocks,
    q_len, kv_len, span, first_pos, layer_weight, scale_log2, head_offset, sm_scale,
    NUM_HEADS: tl.constexpr, PATTERN_HEADS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    LAYER_DEN: tl.constexpr, D: tl.constexpr, GROUP_POW2: tl.constexpr, W_POW2: tl.constexpr, BN: tl.constexpr,
    BQ: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_SLOTS: tl.constexpr, WIDE: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):
    """dK, dV of BN key positions of one KV head, summed over the group's heads and slots, in fp32.

    Programs in :func:`_program_pair_and_block`'s order."""
    kv_heads: tl.constexpr = NUM_HEADS // GROUP
    program = tl.program_id(0)
    pair, block = _program_pair_and_block(program, pairs, blocks, HEAD_MAJOR)
    batch = pair // kv_heads
    kv_head = pair % kv_heads
    batch64 = batch.to(tl.int64)
    first_key = block * BN
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    kpos = first_key + cols
    slot, present = key_slots(kpos, kpos < span, KEY_SLOTS + batch64 * stride_slots_b, kv_len, span, HAS_SLOTS)
    slot = slot.to(tl.int64)
    k = tl.load(K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + slot[:, None] * stride_ks
                + dims[None, :], mask=present[:, None], other=0.0)
    v = tl.load(V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + slot[:, None] * stride_vs
                + dims[None, :], mask=present[:, None], other=0.0)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    begin = tl.load(RANGES + 2 * program.to(tl.int64))
    end = tl.load(RANGES + 2 * program.to(tl.int64) + 1)
    for at in tl.range(begin, end, num_stages=STAGES):
        entry = tl.load(WORK + at)
        r0 = (entry // (GROUP_POW2 * W_POW2)).to(tl.int32)
        j = (entry % W_POW2).to(tl.int32)
        head = kv_head * GROUP + ((entry // W_POW2) % GROUP_POW2).to(tl.int32)
        head64 = head.to(tl.int64)
        r = r0 + tl.arange(0, BQ)
        row, pos, real = query_rows(r, batch, q_len, span, first_pos, SORTED_POS, ORDER, stride_pos_b,
                                    HAS_POSITIONS)
        start, window = start_and_window(pos, layer_weight, W, LAYER_DEN)
        key = head_key(slot_base(start, window, j, W), slot_base(start, window, j + 1, W), head + head_offset,
                       PATTERN_HEADS)
        ok = real & (key <= pos)
        # [BQ rows, BN keys]: row i keeps the column of its key. Rows past q_len read row q_len - 1 (finite
        # values, weight 0), so the loads need no mask.
        select = ((key[:, None] - first_key) == cols[None, :]) & ok[:, None] & present[None, :]
        row = tl.minimum(row, q_len - 1)
        if WIDE:
            row = row.to(tl.int64)
        q = tl.load(Q + batch64 * stride_qb + head64 * stride_qh + row[:, None] * stride_qs + dims[None, :])
        do = tl.load(DO + batch64 * stride_dob + head64 * stride_doh + row[:, None] * stride_dos + dims[None, :])
        stat = (batch64 * NUM_HEADS + head64) * q_len + row
        lse = tl.load(LSE + stat)
        delta = tl.load(DELTA + stat)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BQ, BN]
        p = tl.where(select, tl.math.exp2(scores * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dv = dot_fp32_lhs(tl.trans(p), do, dv, PRECISION, SPLIT)
        dk = dot_fp32_lhs(tl.trans(ds), q, dk, PRECISION, SPLIT)

    tl.store(DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + slot[:, None] * stride_dks
             + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=present[:, None])
    tl.store(DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + slot[:, None] * stride_dvs
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=present[:, None])
