"""XA: XAttention's content-dependent block selection (Xu et al., ICML 2025) as a pattern.

For each input, :meth:`XAttention.resolve` estimates the attention mass per (query block, key block) with strided
antidiagonal scoring (:mod:`flexsparse.kernels.xa_estimate`, fused in Triton on CUDA) and keeps, per (batch,
query head, query block), the sink and diagonal blocks and the heaviest further blocks until the kept share of
the row reaches ``threshold``, with one block of margin by default (:mod:`flexsparse.masks.xa_selection`
describes the rules and the reference's). The result is a static :class:`BlockTable`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.masks.base import DecodeReads, Pattern
from flexsparse.masks.block_table import BlockTable
from flexsparse.masks.geometry import Geometry
from flexsparse.masks.window import Causal
from flexsparse.masks.xa_selection import RULES, Rule, estimate_and_select
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
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"q_len ({q.shape[2]}) must not exceed kv_len ({k.shape[2]})")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")


class XAttention(Pattern):
    """XA: content-dependent block selection by antidiagonal scoring; resolve it on q/k for each input.

    ``threshold`` in (0, 1], a float or one value per query head; ``stride`` divides ``block_size``;
    ``block_size`` is a multiple of 16 (and of the attention's BlockMask block size); ``rule`` "plus_one"
    (default: the reference's first-chunk rule at every length) or "minimal" (the fewest blocks that reach the
    threshold). ``compile`` runs the PyTorch estimator through torch.compile (when Triton is not used).

    Prefill and chunks of a prefill (at least ``block_size`` queries, bottom-right aligned) are estimated; decode
    (fewer queries) runs XA heads as full causal attention, as the papers' decode does. Padded batches are
    estimated on each sequence's real tokens, aligned at position 0, so a sequence selects the same blocks as it
    does alone; a chunk of a padded batch runs as full attention.
    """

    name = "xattention"
    decode_reads = DecodeReads.EVERY_EARLIER_KEY  # decode resolves to full causal attention
    optional_arguments = ("compile",)  # how the estimator runs; configs saved before it was an argument lack it

    def __init__(self, threshold: float | Sequence[float] | Tensor = 0.9, stride: int = 16,
                 block_size: int = 128, compile: bool | None = None, rule: Rule = "plus_one") -> None:
        stride, block_size = as_int("stride", stride, minimum=1), as_int("block_size", block_size, minimum=16)
        if block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
        if block_size % stride:
            raise ValueError(f"stride ({stride}) must divide block_size ({block_size})")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        try:
            if isinstance(threshold, (bool, str, bytes)):
                raise TypeError
            thresholds = torch.as_tensor(threshold, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"threshold must be a float or per-head floats, got {threshold!r}") from None
        if thresholds.numel() == 0 or not bool(((thresholds > 0) & (thresholds <= 1)).all()):
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold, self.stride, self.block_size, self.compile = thresholds, stride, block_size, compile
        self.rule = rule
        self._thresholds_on: dict[torch.device, Tensor] = {}

    def __repr__(self) -> str:
        t = self.threshold
        shown = f"{float(t[0]):g}" if t.numel() == 1 else f"<{t.numel()} per-head>"
        rule = "" if self.rule == "plus_one" else f", rule={self.rule!r}"
        return f"XAttention(threshold={shown}, stride={self.stride}, block_size={self.block_size}{rule})"

    @property
    def is_dynamic(self) -> bool:
        return True

    def select(self, q: Tensor, k: Tensor, kv_valid_len: Tensor | None = None,
               query_heads: Tensor | None = None) -> Tensor:
        """Selected blocks, bool ``[B, H_q, QB, KB]``: queries bottom-right aligned against the keys;
        ``kv_valid_len`` int ``[B]``: keys and queries at index >= it are padding; ``query_heads`` int64 ``[H_q]``:
        the layer's query heads q holds (per-head thresholds are taken for them)."""
        _check_qk(q, k)
        threshold = self._thresholds_on.get(q.device)
        if threshold is None:  # copied to each device once, not per call
            threshold = self._thresholds_on[q.device] = self.threshold.to(q.device)
        if query_heads is not None and threshold.numel() > 1:
            if int(query_heads.numel()) != q.shape[1]:
                raise ValueError(f"query_heads has {query_heads.numel()} entries, q has {q.shape[1]} heads")
            threshold = threshold.index_select(0, query_heads.to(threshold.device))
        if threshold.numel() not in (1, q.shape[1]):
            raise ValueError(f"threshold has {threshold.numel()} values, q has {q.shape[1]} heads")
        compiled = q.device.type == "cuda" if self.compile is None else self.compile
        return estimate_and_select(q, k, threshold, self.stride, self.block_size, rule=self.rule,
                                   kv_valid_len=kv_valid_len, compiled=compiled)

    def resolve(self, q: Tensor, k: Tensor, geo: Geometry | None = None,
                query_heads: Tensor | None = None) -> Pattern:
        """The block table for these inputs (a :class:`BlockTable` over positions), or :class:`Causal` in decode.
        ``geo`` carries the positions of a padded batch (None: contiguous). With ``query_heads`` (q holds only
        these query heads of the layer: per-head thresholds are theirs) the table has ``geo.num_heads`` rows, those
        of other heads empty (never read)."""
        q_len, kv_len = q.shape[2], k.shape[2]
        contiguous = geo is None or geo.is_contiguous or geo.positions.is_contiguous_layout
        if q_len < kv_len and (q_len < self.block_size or not contiguous):
            return Causal()
        if query_heads is not None and geo is None:
            raise ValueError("resolve(query_heads=...) needs the layer's geometry (geo) for its number of heads")
        if contiguous:
            table = self.select(q, k, query_heads=query_heads)
            return BlockTable(self._layer_rows(table, query_heads, geo), self.block_size, q_start=kv_len - q_len)
        table = self._select_padded(q, k, geo, query_heads)
        return BlockTable(self._layer_rows(table, query_heads, geo), self.block_size)

    @staticmethod
    def _layer_rows(table: Tensor, query_heads: Tensor | None, geo: Geometry | None) -> Tensor:
        """``table`` ``[B, H', QB, KB]`` of ``query_heads`` placed in the layer's ``[B, H, QB, KB]``."""
        if query_heads is None:
            return table
        full = table.new_zeros(table.shape[0], geo.num_heads, *table.shape[2:])
        return full.index_copy_(1, query_heads.to(table.device), table)

    def _select_padded(self, q: Tensor, k: Tensor, geo: Geometry, query_heads: Tensor | None = None) -> Tensor:
        """Gather each sequence's real tokens to the front (position p to index p), estimate with the padding
        keys excluded, and select: the table is over positions, like the sequence's own alone."""
        seq = k.shape[2]
        slots = geo.positions.key_slots()[:, :seq]  # [B', S]: slot of position p, -1 past the sequence's end
        index = torch.clamp(slots, min=0)[:, None, :, None]
        aligned_q = q.gather(2, index.expand(q.shape[0], q.shape[1], seq, q.shape[3]))
        aligned_k = k.gather(2, index.expand(k.shape[0], k.shape[1], seq, k.shape[3]))
        lengths = geo.sequence_ends().expand(q.shape[0])
        return self.select(aligned_q, aligned_k, kv_valid_len=lengths, query_heads=query_heads)

    def _unresolved(self, *_):
        raise ValueError("XAttention is content-dependent: use pattern.resolve(q, k, geo) (HybridAttention does)")

    mask_mod = block_classes = dense = attended = key_runs = _unresolved
