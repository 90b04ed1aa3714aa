"""XA: XAttention's content-dependent block selection (Xu et al., ICML 2025) as a pattern.

For each input, :meth:`XAttention.resolve` estimates the attention mass per (query block, key block) with strided
antidiagonal scoring (:mod:`flexsparse.kernels.xa_estimate`) and keeps, per (batch, query head, query block), the
sink and diagonal blocks, then key blocks in descending estimated mass until the kept share of the row reaches
``threshold`` (:mod:`flexsparse.masks.xa_selection`). The result is a static :class:`BlockTable`.

Deviations, on purpose: (1) the kept set is the smallest that *reaches* the threshold; the reference's cumulative
sum is offset by one in rows where the sink and diagonal blocks differ and drops the block that crosses it, so
its kept mass can fall short. (2) GQA: every query head gets its own selection (the reference requires as many
query as key heads); key heads are shared without copies. (3) ``threshold >= 1`` keeps every causal block.
XA selects blocks for prefill: queries and keys must have the same length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
from flexsparse.masks.base import Pattern
from flexsparse.masks.block_table import BlockTable
from flexsparse.masks.geometry import Geometry
from flexsparse.masks.window import Causal
from flexsparse.masks.xa_selection import select_blocks
from flexsparse.validation import as_int


def _check_qk(q: Tensor, k: Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]})")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"XAttention selects blocks in prefill: q_len ({q.shape[2]}) must equal kv_len ({k.shape[2]})")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")


class XAttention(Pattern):
    """XA: content-dependent block selection by antidiagonal scoring; resolve it on q/k for each input.

    ``threshold`` in (0, 1], a float or one value per query head; ``stride`` divides ``block_size``;
    ``block_size`` is a multiple of 16 (and of the attention's BlockMask block size).

    XA selects blocks for prefill (queries and keys of the same length). Decode and chunked prefill (fewer
    queries than keys) run XA heads as full causal attention, as the papers' decode does. Padded batches are
    estimated on each sequence's real tokens, aligned at position 0, so a sequence selects the same blocks as it
    does alone.
    """

    name = "xattention"

    def __init__(self, threshold: float | Sequence[float] | Tensor = 0.9, stride: int = 16,
                 block_size: int = 128, compile: bool | None = None) -> None:
        stride, block_size = as_int("stride", stride, minimum=1), as_int("block_size", block_size, minimum=16)
        if block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
        if block_size % stride:
            raise ValueError(f"stride ({stride}) must divide block_size ({block_size})")
        try:
            if isinstance(threshold, (bool, str, bytes)):
                raise TypeError
            thresholds = torch.as_tensor(threshold, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"threshold must be a float or per-head floats, got {threshold!r}") from None
        if thresholds.numel() == 0 or not bool(((thresholds > 0) & (thresholds <= 1)).all()):
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold, self.stride, self.block_size, self.compile = thresholds, stride, block_size, compile
        self._thresholds_on: dict[torch.device, Tensor] = {}

    def __repr__(self) -> str:
        t = self.threshold
        shown = f"{float(t[0]):g}" if t.numel() == 1 else f"<{t.numel()} per-head>"
        return f"XAttention(threshold={shown}, stride={self.stride}, block_size={self.block_size})"

    @property
    def is_dynamic(self) -> bool:
        return True

    def estimate(self, q: Tensor, k: Tensor, kv_valid_len: Tensor | None = None) -> Tensor:
        """Antidiagonal block mass ``[B, H_q, QB, KB]`` (float32); ``kv_valid_len`` int ``[B]``: keys and
        queries at index >= it are padding."""
        _check_qk(q, k)
        compiled = q.device.type == "cuda" if self.compile is None else self.compile
        if kv_valid_len is None:
            return antidiagonal_block_mass(q, k, self.stride, self.block_size, compiled)
        return antidiagonal_block_mass(q, k, self.stride, self.block_size, compiled, kv_valid_len=kv_valid_len)

    def select(self, q: Tensor, k: Tensor, kv_valid_len: Tensor | None = None) -> Tensor:
        """Selected blocks, bool ``[B, H_q, QB, KB]``."""
        mass = self.estimate(q, k, kv_valid_len)
        threshold = self._thresholds_on.get(mass.device)
        if threshold is None:  # copied to each device once, not per call
            threshold = self._thresholds_on[mass.device] = self.threshold.to(mass.device)
        if threshold.numel() not in (1, q.shape[1]):
            raise ValueError(f"threshold has {threshold.numel()} values, q has {q.shape[1]} heads")
        return select_blocks(mass, threshold.expand(q.shape[1]))

    def resolve(self, q: Tensor, k: Tensor, geo: Geometry | None = None) -> Pattern:
        """The block table for these inputs (a :class:`BlockTable` over positions), or :class:`Causal` when
        there are fewer queries than keys. ``geo`` carries the positions of a padded batch (None: contiguous)."""
        if q.shape[2] != k.shape[2]:
            return Causal()
        if geo is None or geo.is_contiguous:
            return BlockTable(self.select(q, k), self.block_size)
        return BlockTable(self._select_padded(q, k, geo), self.block_size)

    def _select_padded(self, q: Tensor, k: Tensor, geo: Geometry) -> Tensor:
        """Gather each sequence's real tokens to the front (position p to index p), estimate with the padding
        keys excluded, and select: the table is over positions, like the sequence's own alone."""
        seq = k.shape[2]
        slots = geo.positions.key_slots()[:, :seq]  # [B', S]: slot of position p, -1 past the sequence's end
        index = torch.clamp(slots, min=0)[:, None, :, None]
        aligned_q = q.gather(2, index.expand(q.shape[0], q.shape[1], seq, q.shape[3]))
        aligned_k = k.gather(2, index.expand(k.shape[0], k.shape[1], seq, k.shape[3]))
        lengths = geo.sequence_ends().expand(q.shape[0])
        return self.select(aligned_q, aligned_k, kv_valid_len=lengths)

    def _unresolved(self, *_):
        raise ValueError("XAttention is content-dependent: use pattern.resolve(q, k, geo) (HybridAttention does)")

    mask_mod = block_classes = dense = attended = key_runs = _unresolved
