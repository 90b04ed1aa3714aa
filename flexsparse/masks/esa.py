"""ESA: Elastic Sparse Attention, depth-interpolated dilation with per-head shifts (seed 004).

For layer l of L, ``alpha = l / (L - 1)`` (0 when L = 1). Query i (absolute position) attends ``attn_length`` = w
keys. With ``n = max(w, i + 1)`` (the authors' ``end_ids + 1``):

* start ``s = round((n - w)(1 - alpha))``: the authors compute ``round(n - D_i)`` with span
  ``D_i = w(1 - alpha) + n * alpha``; note they use ``n``, not ``i + 1``, so queries i < w see span w.
* ``window = n - s`` and base indices ``base_j = s + round(j * window / w)`` for j = 0..w (spacing window / w);
* head h of H takes ``round(base_j * (1 - t) + (base_{j+1} - 1) * t)`` with ``t = h / (H - 1)`` (0 when H = 1):
  head 0 the base set, the last head the set shifted by -1;
* keys > i are masked (causal).

This follows HighCWu/elastic-sparse-attention's index code, which differs from the paper's prose in using
``n = max(w, i + 1)`` for the span. Every ``round`` is round-half-to-even like ``torch.round``, but computed on
exact rationals in integer arithmetic instead of the authors' float32; the two agree on the paper's
configurations (tests compare them). No clamping is needed: ``0 <= s`` and every index lies in ``[s, n - 1]``.
No duplicates arise: the spacing is >= 1, so the bases strictly increase, and head h's j-th index lies in
``[base_j, base_{j+1} - 1]``, so each query's w indices are distinct (the authors' kernels would count a duplicate
twice; none exists). Indices are int32 inside ``mask_mod``, so ``kv_len * max(w, H, L)`` must stay below 2**31.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from flexsparse.kernels.esa_index import EsaIndexRule
from flexsparse.masks.base import MaskMod, Pattern
from flexsparse.masks.geometry import Geometry, classify
from flexsparse.validation import as_int

_INT32_LIMIT = 2**31 - 1
_QUERY_CHUNK = 4096


def round_half_even_div(num: Tensor, den: int) -> Tensor:
    """``round(num / den)`` for an integer tensor num and an int den > 0, ties to even, exactly.

    ``floor(num / den + 1/2)`` rounds ties up; a tie is when ``2 num + den`` is a multiple of ``2 den``, and then
    an odd result steps down to the even neighbour.
    """
    if den % 2 == 1:  # num / den is never a tie for odd den
        return torch.div(num + den // 2, den, rounding_mode="floor")
    shifted = 2 * num + den
    rounded = torch.div(shifted, 2 * den, rounding_mode="floor")
    tie_to_odd = (shifted - rounded * (2 * den) == 0) & (rounded % 2 == 1)
    return rounded - tie_to_odd.to(rounded.dtype)


def _start_and_window(positions: Tensor, w: int, denominator: int, layer_weight) -> tuple[Tensor, Tensor]:
    """s = round((n - w) * (L - 1 - l) / (L - 1)) with n = max(w, i + 1), and the window n - s.

    ``layer_weight`` is ``denominator - layer_idx`` (an int or a captured tensor)."""
    n = torch.clamp(positions + 1, min=w)
    start = round_half_even_div((n - w) * layer_weight, denominator)
    return start, n - start


def _slot_index(start: Tensor, window: Tensor, j: Tensor, head: Tensor, w: int, heads: int) -> Tensor:
    """Key index of slot j for a head (broadcast int tensors)."""
    base = start + round_half_even_div(j * window, w)
    if heads == 1:
        return base
    shifted = start + round_half_even_div((j + 1) * window, w) - 1
    return round_half_even_div(base * (heads - 1 - head) + shifted * head, heads - 1)


class ESA(Pattern):
    """Elastic Sparse Attention for layer ``layer_idx`` of ``num_layers``, ``num_heads`` query heads.

    A pattern models must be trained with: put into a pretrained model that was not, it destroys quality
    (SmolLM2-135M at attn_length 256: perplexity x13-26 at 2K-8K; ``flexsparse eval --methods full esa`` shows it).
    """

    name = "esa"

    def __init__(self, layer_idx: int, num_layers: int, attn_length: int, num_heads: int) -> None:
        num_layers, attn_length = as_int("num_layers", num_layers, 1), as_int("attn_length", attn_length, 1)
        num_heads, layer_idx = as_int("num_heads", num_heads, 1), as_int("layer_idx", layer_idx, 0)
        if layer_idx >= num_layers:
            raise ValueError(f"layer_idx must be in [0, num_layers={num_layers}), got {layer_idx}")
        self.layer_idx, self.num_layers = layer_idx, num_layers
        self.attn_length, self.num_heads = attn_length, num_heads

    def __repr__(self) -> str:
        return (f"ESA(layer_idx={self.layer_idx}, num_layers={self.num_layers}, "
                f"attn_length={self.attn_length}, num_heads={self.num_heads})")

    def _check(self, geo: Geometry) -> None:
        if geo.num_heads != self.num_heads:
            raise ValueError(f"ESA was built for num_heads={self.num_heads}, the geometry has {geo.num_heads} heads")
        if (geo.span + 1) * max(self.attn_length, self.num_heads, self.num_layers) > _INT32_LIMIT:
            raise ValueError(f"positions * max(attn_length, num_heads, num_layers) must be < 2**31 for ESA, "
                             f"got positions up to {geo.span}")

    def _start_and_window(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Start s and window n - s for absolute query positions (any int tensor)."""
        return _start_and_window(positions, self.attn_length, max(self.num_layers - 1, 1),
                                 max(self.num_layers - 1, 1) - self.layer_idx)

    @functools.cached_property
    def index_rule(self) -> EsaIndexRule:
        """The four integers the ESA kernels take (:class:`~flexsparse.kernels.esa_index.EsaIndexRule`), built once
        (a decode step reads it per layer)."""
        return EsaIndexRule(self.layer_idx, self.num_layers, self.attn_length, self.num_heads)

    def indices(self, positions: Tensor) -> Tensor:
        """Key indices ``[H, len(positions), w]`` of the given absolute query positions, before masking.

        Same dtype as ``positions`` (int32 is exact while ``kv_len * max(w, H, L) < 2**31``).
        """
        return self._slot_major_indices(positions).permute(1, 2, 0)

    def _slot_major_indices(self, positions: Tensor) -> Tensor:
        """Key indices ``[w, H, P]`` (slot, head, query)."""
        w, heads = self.attn_length, self.num_heads
        start, window = (t[None, :] for t in self._start_and_window(positions))
        slots = torch.arange(w + 1, device=positions.device, dtype=positions.dtype)[:, None]
        bases = start + round_half_even_div(slots * window, w)  # [w + 1, P], shared by all heads
        base, shifted = bases[:w, None], bases[1:, None] - 1
        if heads == 1:
            return base
        head = torch.arange(heads, device=positions.device, dtype=positions.dtype)[None, :, None]
        return round_half_even_div(base * (heads - 1 - head) + shifted * head, heads - 1)

    def mask_mod(self, geo: Geometry) -> MaskMod:
        """Closed form: the slot j whose [base_j, base_{j+1} - 1] holds key position k is within 1 of
        ``(k - s) * w // window``; k is attended iff one of those 3 slots' index equals it.

        The layer enters as a captured tensor, so every layer of a model shares one compiled kernel.
        """
        self._check(geo)
        q_pos, kv_pos = geo.position_mods()
        w, heads = self.attn_length, self.num_heads
        denominator = max(self.num_layers - 1, 1)
        layer_weight = torch.tensor(denominator - self.layer_idx, dtype=torch.int32, device=geo.device)

        def esa_mask(b, h, q_idx, kv_idx):
            i, k = q_pos(b, q_idx), kv_pos(b, kv_idx)
            start, window = _start_and_window(i, w, denominator, layer_weight)
            estimate = torch.div((k - start) * w, window, rounding_mode="floor")
            hit = torch.zeros_like(k, dtype=torch.bool)
            for delta in (-1, 0, 1):
                j = torch.clamp(estimate + delta, 0, w - 1)
                hit = hit | (_slot_index(start, window, j, h, w, heads) == k)
            return hit & (k <= i)

        return esa_mask

    def _chunks(self, geo: Geometry):
        """Per batch element b' and chunk of query rows: (b', rows, key slots [H, rows, w], attended [H, rows, w]).

        Indices are computed from each row's position, mapped to slots (identity in the contiguous layout), and
        kept where causal and present (a padding query attends nothing)."""
        self._check(geo)
        q_positions = geo.q_positions()
        slots_of = None if geo.is_contiguous else geo.positions.key_slots()
        for b in range(q_positions.shape[0]):
            for first in range(0, geo.q_len, _QUERY_CHUNK):
                rows = torch.arange(first, min(first + _QUERY_CHUNK, geo.q_len), device=geo.device)
                positions = q_positions[b, rows]
                index = self.indices(torch.clamp(positions, min=0))
                valid = (index <= positions[None, :, None])
                if slots_of is not None:
                    table = slots_of[b if slots_of.shape[0] > 1 else 0]
                    index = table[torch.clamp(index, max=table.shape[0] - 1)]
                    valid &= index >= 0
                yield b, rows, index, valid

    def block_classes(self, geo: Geometry) -> Tensor:
        """Count attended pairs per tile in O(B' H Q w); a tile is full when every real pair in it is attended."""
        bs, nkb = geo.block_size, geo.num_kv_blocks
        counts = torch.zeros(geo.batch, self.num_heads, geo.num_q_blocks * nkb, dtype=torch.int32, device=geo.device)
        for b, rows, index, valid in self._chunks(geo):
            tile = (rows // bs)[None, :, None] * nkb + index // bs
            counts[b].scatter_add_(1, tile.masked_fill(~valid, 0).flatten(1), valid.flatten(1).int())
        counts = counts.view(geo.batch, self.num_heads, geo.num_q_blocks, nkb)
        q_first, _ = geo.q_tile_bounds()
        _, kv_last = geo.kv_tile_bounds()
        full = (counts == geo.tile_pairs()) & (kv_last <= q_first)
        return classify(full=full, empty=counts == 0)

    def dense(self, geo: Geometry) -> Tensor:
        geo.check_dense(self.num_heads)
        mask = torch.zeros(geo.batch, self.num_heads, geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device)
        for b, rows, index, valid in self._chunks(geo):
            head = torch.arange(self.num_heads, device=geo.device)[:, None, None].expand_as(index)
            row = rows[None, :, None].expand_as(index)
            mask[b][head[valid], row[valid], index[valid]] = True
        return mask

    @property
    def required_heads(self) -> int:
        return self.num_heads

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """w single-key runs per head, ascending; causally masked keys (the largest) become empty runs last.

        Layer 0 of several (alpha = 0) has spacing 1 and identical heads: one run per query.
        """
        self._check(geo)
        if self.layer_idx == 0 and self.num_layers > 1:
            start, window = self._start_and_window(positions)
            return start[None, None], torch.minimum(start + window - 1, positions)[None, None]
        index = self._slot_major_indices(positions)
        valid = index <= positions[None, None, :]
        return torch.where(valid, index, 1), torch.where(valid, index, 0)

    def union_key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Already ascending in (slot, head) order: head h's slot-j key lies in [base_j, base_{j+1} - 1] and
        grows with h. Causally masked keys are the largest, so they come last."""
        first, last = self.key_runs(geo, positions)
        return first.reshape(-1, positions.numel()), last.reshape(-1, positions.numel())

    def attended(self, geo: Geometry) -> Tensor:
        counts = torch.zeros(geo.batch, self.num_heads, geo.q_len, dtype=torch.long, device=geo.device)
        for b, rows, _, valid in self._chunks(geo):
            counts[b, :, rows] = valid.sum(-1)
        return counts

