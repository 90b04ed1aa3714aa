"""XA: XAttention's antidiagonal block selection (Xu et al., ICML 2025), and the static block-table pattern it
resolves to.

Estimation follows mit-han-lab/x-attention ("inverse" mode): keys are grouped in runs of ``stride`` tokens, the
queries of each group are taken in reverse, so a dot product of the reshaped rows sums one antidiagonal of a
``stride x stride`` tile of QK^T. Scores are scaled by ``1 / (sqrt(d) * stride)``, masked causally at the
reshaped level (tile j <= tile i, as in the reference), soft-maxed per reshaped query row, and summed per
(query block, key block). Selection keeps, per (batch, query head, query block), the sink block and the diagonal
block, then key blocks in descending estimated mass until the kept share of the row reaches ``threshold``.

Deviations, on purpose: (1) the kept set is the smallest that *reaches* the threshold; the reference's cumulative
sum is offset by one in rows where the sink and diagonal blocks differ and drops the block that crosses it, so
its kept mass can fall short. (2) GQA: every query head gets its own selection (the reference requires as many
query as key heads); key heads are shared without copies. (3) ``threshold >= 1`` keeps every causal block.
XA selects blocks for prefill: queries and keys must have the same length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flexsparse.masks.base import Geometry, MaskMod, Pattern, classify

_ROWS_PER_CHUNK = 1 << 14  # query tokens estimated per chunk (bounds the [chunk, S / stride] score slab)
_compiled_chunk = None


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


def _block_mass_chunk(rq: Tensor, rk: Tensor, first_row: int, n_real: int, rows_per_block: int) -> Tensor:
    """Softmax mass per (query block, key block) for reshaped query rows starting at ``first_row``.

    rq ``[B, Hkv, G, c, stride*d]`` (already scaled), rk ``[B, Hkv, n_keys, stride*d]`` holding only the keys
    these rows may see. Returns float32 ``[B, Hkv, G, c / rows_per_block, n_keys / rows_per_block]``.
    """
    scores = torch.einsum("bhgid,bhjd->bhgij", rq, rk).float()
    rows = first_row + torch.arange(rq.shape[3], device=rq.device)[:, None]
    cols = torch.arange(rk.shape[2], device=rq.device)[None, :]
    scores = scores.masked_fill((cols > rows) | (cols >= n_real), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(rows >= n_real, 0.0)
    b, h, g, c, n = probs.shape
    return probs.view(b, h, g, c // rows_per_block, rows_per_block, n // rows_per_block, rows_per_block).sum((4, 6))


def _compiled_block_mass_chunk():
    """The chunk kernel compiled once per process; dynamic shapes, since causal chunks see growing key ranges."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_block_mass_chunk, dynamic=True)
    return _compiled_chunk


def antidiagonal_block_mass(q: Tensor, k: Tensor, stride: int, block_size: int, compiled: bool = False) -> Tensor:
    """Estimated attention mass per block, float32 ``[B, H_q, QB, KB]``; each row sums to block_size / stride.

    q ``[B, H_q, S, d]``, k ``[B, H_kv, S, d]``. Cost: ``2 B H_q S^2 d / (2 stride)`` FLOPs (causal half).
    """
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    padded = -(-seq // block_size) * block_size
    q, k = F.pad(q, (0, 0, 0, padded - seq)), F.pad(k, (0, 0, 0, padded - seq))
    n, n_real = padded // stride, -(-seq // stride)
    rk = k.reshape(batch, kv_heads, n, stride * dim)
    rq = q.view(batch, heads, n, stride, dim).flip(3).reshape(batch, kv_heads, heads // kv_heads, n, stride * dim)
    rq = rq * (dim**-0.5 / stride)
    rows_per_block = block_size // stride
    chunk = max(rows_per_block, _ROWS_PER_CHUNK // stride // rows_per_block * rows_per_block)
    step = _compiled_block_mass_chunk() if compiled else _block_mass_chunk
    parts = []
    for first in range(0, n, chunk):
        last = min(first + chunk, n)  # causal: these rows see reshaped keys < last only
        mass = step(rq[:, :, :, first:last], rk[:, :, :last], first, n_real, rows_per_block)
        parts.append(F.pad(mass, (0, n // rows_per_block - mass.shape[-1])))
    return torch.cat(parts, dim=3).reshape(batch, heads, padded // block_size, padded // block_size)


def select_blocks(mass: Tensor, threshold: Tensor) -> Tensor:
    """Boolean ``[B, H, QB, KB]``: sink + diagonal + the fewest other causal blocks, heaviest first, whose
    mass with the forced ones reaches ``threshold`` (``[H]``) of the row."""
    qb = torch.arange(mass.shape[2], device=mass.device)[:, None]
    kb = torch.arange(mass.shape[3], device=mass.device)[None, :]
    causal = kb <= qb
    forced = (kb == 0) | (kb == qb)
    mass = mass.masked_fill(~causal, 0.0)
    required = mass.sum(-1, keepdim=True) * threshold.to(mass.dtype).view(1, -1, 1, 1)
    rank_key = torch.where(forced, float("inf"), torch.where(causal, mass, float("-inf")))
    order = torch.argsort(rank_key, dim=-1, descending=True, stable=True)
    ordered = mass.gather(-1, order)
    before = ordered.cumsum(-1) - ordered  # mass kept before each block in selection order
    keep_sorted = before < required
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    everything = (threshold >= 1).view(1, -1, 1, 1)
    return (keep | forced | everything) & causal


class BlockTable(Pattern):
    """A static block selection: query i attends key k <= i when ``table[b, h, i // tb, k // tb]``.

    ``table`` bool ``[B', H', QB, KB]`` at ``table_block`` tokens per block (B' and H' may be 1).
    """

    name = "block_table"

    def __init__(self, table: Tensor, table_block: int) -> None:
        if table.dtype != torch.bool or table.dim() != 4:
            raise TypeError(f"table must be a bool tensor [B, H, QB, KB], got {table.dtype} {tuple(table.shape)}")
        self.table, self.table_block = table, table_block

    def __repr__(self) -> str:
        return f"BlockTable(shape={tuple(self.table.shape)}, table_block={self.table_block})"

    @property
    def required_heads(self) -> int | None:
        return self.table.shape[1] if self.table.shape[1] > 1 else None

    def _table_for(self, geo: Geometry) -> Tensor:
        if geo.q_len != geo.kv_len:
            raise ValueError("a BlockTable covers prefill: q_len must equal kv_len")
        expected = (-(-geo.q_len // self.table_block), -(-geo.kv_len // self.table_block))
        if tuple(self.table.shape[-2:]) != expected:
            raise ValueError(f"table covers {tuple(self.table.shape[-2:])} blocks, geometry needs {expected}")
        if self.table.shape[1] not in (1, geo.num_heads):
            raise ValueError(f"table has {self.table.shape[1]} heads, geometry has {geo.num_heads}")
        return self.table.to(geo.device)

    def mask_mod(self, geo: Geometry) -> MaskMod:
        table, tb = self._table_for(geo), self.table_block
        per_batch, per_head = table.shape[0] > 1, table.shape[1] > 1

        def block_table_mask(b, h, q_idx, kv_idx):
            kept = table[b if per_batch else 0, h if per_head else 0, q_idx // tb, kv_idx // tb]
            return kept & (q_idx >= kv_idx)

        return block_table_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        table = self._table_for(geo)
        if self.table_block % geo.block_size:
            raise ValueError(f"table_block ({self.table_block}) must be a multiple of block_size ({geo.block_size})")
        ratio = self.table_block // geo.block_size
        tiles = table.repeat_interleave(ratio, -2).repeat_interleave(ratio, -1)
        tiles = tiles[..., : geo.num_q_blocks, : geo.num_kv_blocks]
        q_lo, q_hi = geo.q_block_bounds()
        kv_lo, kv_hi = geo.kv_block_bounds()
        return classify(full=tiles & (kv_hi - 1 <= q_lo), empty=~tiles | (kv_lo > q_hi - 1))

    def dense(self, geo: Geometry) -> Tensor:
        geo.dense_grid()
        table, tb = self._table_for(geo), self.table_block
        tokens = table.repeat_interleave(tb, -2).repeat_interleave(tb, -1)[..., : geo.q_len, : geo.kv_len]
        return tokens & torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool, device=geo.device).tril()

    def attended(self, geo: Geometry) -> Tensor:
        """Closed form: kept blocks before the diagonal count whole (all their keys precede the query), the
        diagonal block up to the query, later blocks not at all."""
        table, tb = self._table_for(geo), self.table_block
        blocks = torch.arange(table.shape[-1], device=geo.device)
        before_diagonal = (table & (blocks[None, :] < blocks[:, None])).sum(-1) * tb  # [B', H', QB]
        diagonal = table.diagonal(dim1=-2, dim2=-1)  # [B', H', QB]
        i = torch.arange(geo.q_len, device=geo.device)
        return before_diagonal[..., i // tb] + diagonal[..., i // tb] * (i % tb + 1)


class XAttention(Pattern):
    """XA: content-dependent block selection by antidiagonal scoring; resolve it on q/k for each input.

    ``threshold`` in (0, 1], a float or one value per query head; ``stride`` divides ``block_size``;
    ``block_size`` is a multiple of 16 (and of the attention's BlockMask block size).
    """

    name = "xattention"

    def __init__(self, threshold: float | Sequence[float] | Tensor = 0.9, stride: int = 16,
                 block_size: int = 128, compile: bool | None = None) -> None:
        for arg, value in (("stride", stride), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if block_size < 16 or block_size % 16:
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

    def estimate(self, q: Tensor, k: Tensor) -> Tensor:
        """Antidiagonal block mass ``[B, H_q, QB, KB]`` (float32)."""
        _check_qk(q, k)
        compiled = q.device.type == "cuda" if self.compile is None else self.compile
        return antidiagonal_block_mass(q, k, self.stride, self.block_size, compiled)

    def select(self, q: Tensor, k: Tensor) -> Tensor:
        """Selected blocks, bool ``[B, H_q, QB, KB]``."""
        mass = self.estimate(q, k)
        threshold = self._thresholds_on.get(mass.device)
        if threshold is None:  # copied to each device once, not per call
            threshold = self._thresholds_on[mass.device] = self.threshold.to(mass.device)
        if threshold.numel() not in (1, q.shape[1]):
            raise ValueError(f"threshold has {threshold.numel()} values, q has {q.shape[1]} heads")
        return select_blocks(mass, threshold.expand(q.shape[1]))

    def resolve(self, q: Tensor, k: Tensor) -> BlockTable:
        return BlockTable(self.select(q, k), self.block_size)

    def _unresolved(self, *_):
        raise ValueError("XAttention is content-dependent: use pattern.resolve(q, k) (HybridAttention does)")

    mask_mod = block_classes = dense = attended = key_runs = _unresolved
