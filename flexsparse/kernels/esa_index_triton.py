"""ESA's index rule (:class:`~flexsparse.kernels.esa_index.EsaIndexRule`) in Triton, for the kernels: int32 and
exact (the launcher checks the range), the rounds half to even in unsigned arithmetic."""

from __future__ import annotations

import triton
import triton.language as tl


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
def start_and_window(pos, layer_weight, W: tl.constexpr, LAYER_DEN: tl.constexpr):
    """Start s and window n - s of query positions pos (n = max(w, pos + 1))."""
    n = tl.maximum(pos + 1, W)
    start = _round_div((n - W) * layer_weight, LAYER_DEN)
    return start, n - start


@triton.jit
def slot_base(start, window, j, W: tl.constexpr):
    """base_j = s + round(j * window / w)."""
    return start + _round_div(j * window, W)


@triton.jit
def head_key(base, next_base, head, NUM_HEADS: tl.constexpr):
    """Key of a slot for a head: round((base_j (H - 1 - h) + (base_{j+1} - 1) h) / (H - 1)) (broadcasts)."""
    if NUM_HEADS == 1:
        return base + 0 * head
    else:
        return _round_div(base * (NUM_HEADS - 1 - head) + (next_base - 1) * head, NUM_HEADS - 1)
