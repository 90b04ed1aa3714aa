"""ESA keys in closed form: the union of a query's keys' sets as one interval in O(1), where it is one.

ESA query q >= w - 1 (``n = q + 1``) has start ``s``, window ``W = n - s`` and bases ``base_j = s + round(j W / w)``
(j = 0..w, ``base_w = n``); head h of H takes ``round(base_j + h d_j)`` in slot j with
``d_j = (base_{j+1} - 1 - base_j) / (H - 1)``. For a set of heads ``h_1 < ... < h_m``:

* the smallest key is head h_1's in slot 0, the largest head h_m's in slot w - 1 (both O(1) from ``s, W``);
* consecutive keys are at most ``c D + 2`` apart (floored), where ``D = (G - 1) / (H - 1)``,
  ``G = W // w + 1 >= base_{j+1} - base_j``, and ``c`` is the largest head-index step between consecutive chosen
  heads, counting the wrap from h_m in one slot to h_1 in the next; rounding moves each key by at most 1/2.
  With H = 1 the keys are the bases, at most G apart.

With ``lo`` non-decreasing, the keys' last intervals ``[lo(k), k]`` chain into the single interval
``[lo(k_min), k_max]`` when every key but the first reaches back over the gap before it, which holds when the
smallest width ``k - lo(k)`` over ``(k_min, k_max]`` is at least the gap bound minus 1 (a range minimum). Then no
key's middle adds anything when none in ``[k_min, k_max]`` starts below ``lo(k_min)``, and no key's prefix does when
``pre`` is non-decreasing (the query's own ``pre`` is the largest). Queries that fail any test take the exact
path over their keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks.esa import ESA, round_half_even_div
from flexsparse.verify.layer_state import LayerState


def esa_chain(esa: ESA, heads: tuple[int, ...] | None, prev: LayerState, rows: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(ok, first, last), each ``[n]`` for the query positions ``rows`` (int64): where ok, the union over the
    keys k of the given heads of ``C(k)`` is exactly ``[first, last]``."""
    ok = torch.zeros_like(rows, dtype=torch.bool)
    if not prev.lo_monotone or (prev.any_pre and not prev.pre_monotone):
        return ok, rows, rows
    w, num_heads = esa.attn_length, esa.num_heads
    chosen = sorted(heads) if heads is not None else list(range(num_heads))
    denominator = max(esa.num_layers - 1, 1)
    n = torch.clamp(rows + 1, min=w)
    start = round_half_even_div((n - w) * (denominator - esa.layer_idx), denominator)
    window = n - start
    base_1 = start + round_half_even_div(window, w)
    base_last = start + round_half_even_div((w - 1) * window, w)  # base_{w-1}
    gap_step = window // w  # G - 1
    if num_heads == 1:
        k_min, k_max, gap = start, base_last, gap_step + 1
    else:
        first_head, last_head = chosen[0], chosen[-1]
        steps = [b - a for a, b in zip(chosen, chosen[1:])] + [num_heads - 1 - last_head + first_head]
        k_min = round_half_even_div(start * (num_heads - 1 - first_head) + (base_1 - 1) * first_head, num_heads - 1)
        k_max = round_half_even_div(base_last * (num_heads - 1 - last_head) + (n - 1) * last_head, num_heads - 1)
        gap = max(steps) * gap_step // (num_heads - 1) + 2
    ok = rows >= w - 1  # every key <= the query
    chain = ok & (k_max > k_min)
    if bool(chain.any()):
        widths = prev.run_min_width(k_min[chain] + 1, k_max[chain])
        ok[chain] = widths >= gap[chain] - 1
    first = prev.lo.view()[torch.where(ok, k_min, 0)].long()
    if prev.num_middles and bool(ok.any()):
        ok[ok.clone()] = prev.run_min_middle(k_min[ok], k_max[ok]) >= first[ok]
    return ok, first, k_max
