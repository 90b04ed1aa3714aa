"""Where queries and keys sit: sizes, token positions (padding, decode, caches) and tile bounds.

Patterns speak of token *positions*, not of tensor indices. A :class:`Geometry` says which position each query
row and each key slot holds:

* without ``positions`` (the *contiguous* layout): query row i sits at position ``kv_len - q_len + i`` and key slot
  j at position j (prefill, or queries that are the last positions of the keys);
* with :class:`Positions` (*tables*): int32 tables ``[B', Q]`` and ``[B', KV]`` per batch element. They describe
  padded batches (a left-padded sequence's first real token is position 0), decode against a cache, and caches
  whose slot is not the position (a ring buffer). Padding queries hold position -1, so they attend nothing (their
  output is 0). Padding keys hold ``span`` (past every real position), so causality alone keeps every pattern
  from attending them.

``mask_mod`` closures read positions through :meth:`Geometry.position_mods`: arithmetic in the contiguous layout,
loads from captured tables otherwise. New table *values* (another padding pattern, the next decode step at the
same sizes) never recompile; a new table *shape* does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flexsparse.masks.forward_state import ForwardState
from flexsparse.validation import as_int

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes: no pair attends / some pairs attend (the kernel evaluates mask_mod) / every pair attends."""

MAX_DENSE_ELEMENTS = 1 << 28
"""Largest B' x H' x Q x KV boolean mask one dense reference may build (256 Mi booleans)."""

PositionMod = Callable[[Tensor, Tensor], Tensor]


def classify(full: Tensor, empty: Tensor) -> Tensor:
    """Tile classes (int8) from boolean 'every pair attends' and 'no pair attends' tensors."""
    return torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)


@dataclass(frozen=True, eq=False)
class Positions:
    """Token positions of the query rows and key slots of one call, per batch element.

    ``q`` int32 ``[B', Q]`` (-1: a padding query), ``kv`` int32 ``[B', KV]`` (``span``: a padding or empty key
    slot), ``span`` one past the largest real position (a host int). ``B'`` is the batch size or 1 (shared by all
    batch elements). Real positions of one batch element must be distinct. Build one per model forward and pass
    it to every layer: what is derived from it (tables, block masks) is kept in its ``state``
    (:class:`~flexsparse.masks.forward_state.ForwardState`), computed once for all layers.
    """

    q: Tensor
    kv: Tensor
    span: int
    is_contiguous_layout: bool = False
    """The contiguous layout as tables (no padding): set by :meth:`contiguous`, known on the host."""
    state: ForwardState = field(default_factory=ForwardState, repr=False)
    """The forward's derived values (tables, block masks); a new one per Positions unless given."""

    def __post_init__(self) -> None:
        for name, table in (("q", self.q), ("kv", self.kv)):
            if not isinstance(table, Tensor):
                raise TypeError(f"Positions.{name} must be a tensor, got {type(table).__name__}")
            if table.dtype != torch.int32 or table.dim() != 2:
                raise ValueError(f"Positions.{name} must be int32 [B, length], got {table.dtype} {tuple(table.shape)}")
            if table.stride() != (table.shape[1], 1):  # compiled kernels specialise on strides: keep them canonical
                object.__setattr__(self, name, table.clone(memory_format=torch.contiguous_format))
        if self.q.device != self.kv.device:
            raise ValueError(f"Positions.q is on {self.q.device} but Positions.kv is on {self.kv.device}")
        if self.q.shape[0] != self.kv.shape[0] and 1 not in (self.q.shape[0], self.kv.shape[0]):
            raise ValueError(f"Positions.q has batch {self.q.shape[0]}, Positions.kv has {self.kv.shape[0]}")
        object.__setattr__(self, "span", as_int("Positions.span", self.span, minimum=1))

    @classmethod
    def from_padding_mask(cls, key_padding_mask: Tensor, q_len: int) -> Positions:
        """Positions of a padded batch: ``key_padding_mask`` bool ``[B, KV]`` (True = real token, transformers'
        2-D ``attention_mask`` convention); queries are the last ``q_len`` slots. A key's position counts the
        real tokens before it, so left- and right-padded sequences get the positions they have alone."""
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"key_padding_mask must be a tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dim() != 2:
            raise ValueError(f"key_padding_mask must be [B, S_kv], got shape {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype != torch.bool:
            if key_padding_mask.dtype.is_floating_point or key_padding_mask.dtype.is_complex:
                raise TypeError(f"key_padding_mask must be bool (True = real token), got {key_padding_mask.dtype}")
            key_padding_mask = key_padding_mask != 0  # transformers' 0/1 integer attention_mask
        kv_len = key_padding_mask.shape[1]
        q_len = as_int("q_len", q_len, minimum=1, maximum=kv_len)
        real = key_padding_mask
        counted = real.cumsum(-1, dtype=torch.int32) - 1
        kv = torch.where(real, counted, kv_len).to(torch.int32)
        q = torch.where(real[:, kv_len - q_len:], counted[:, kv_len - q_len:], -1).to(torch.int32)
        return cls(q, kv, kv_len)

    @classmethod
    def contiguous(cls, q_len: int, kv_len: int, device: torch.device | str = "cpu") -> Positions:
        """The contiguous layout as tables (queries are the last ``q_len`` positions of ``kv_len``)."""
        kv = torch.arange(kv_len, dtype=torch.int32, device=device)[None]
        return cls(kv[:, kv_len - q_len:], kv, kv_len, is_contiguous_layout=True)

    @property
    def batch(self) -> int:
        return max(self.q.shape[0], self.kv.shape[0])

    @property
    def device(self) -> torch.device:
        return self.q.device

    def padded(self, q_len: int, kv_len: int) -> Positions:
        """The same positions with padding query rows / key slots appended up to ``q_len`` / ``kv_len``."""
        q = torch.nn.functional.pad(self.q, (0, q_len - self.q.shape[1]), value=-1)
        kv = torch.nn.functional.pad(self.kv, (0, kv_len - self.kv.shape[1]), value=self.span)
        return Positions(q, kv, self.span)

    def rows(self, start: int, stop: int) -> Positions:
        """Positions of query rows ``start:stop`` (same keys)."""
        return Positions(self.q[:, start:stop], self.kv, self.span)

    def key_slots(self) -> Tensor:
        """Slot of each position, int64 ``[B', span + 1]`` (-1 where no slot holds it; column ``span`` is -1)."""
        return self.state.key_slots(self._key_slots)

    def _key_slots(self) -> Tensor:
        batch, kv_len = self.kv.shape
        slots = torch.full((batch, self.span + 1), -1, dtype=torch.long, device=self.device)
        slot_ids = torch.arange(kv_len, device=self.device).expand(batch, kv_len)
        slots.scatter_(1, self.kv.long(), slot_ids)
        slots[:, self.span] = -1
        return slots

    def sequence_ends(self) -> Tensor:
        """One past the last real key position of each batch element, int64 ``[B']`` (0 for no real key)."""
        return self.state.sequence_ends(lambda: torch.where(self.kv < self.span, self.kv.long() + 1, 0).amax(-1))


def _per_batch(table: Tensor) -> Callable[[Tensor], Tensor]:
    """``b -> table[b]`` for a per-batch ``[B']`` table, ``b -> table[0]`` for a shared one (traceable)."""
    if table.shape[0] == 1:
        return lambda b: table[0]
    return lambda b: table[b]


def _per_batch_rows(table: Tensor) -> PositionMod:
    """``(b, i) -> table[b, i]`` for a ``[B', N]`` table (``table[0, i]`` when shared); works on the scalars
    FlexAttention passes and on broadcast index tensors alike."""
    if table.shape[0] == 1:
        return lambda b, i: table[0, i]
    return lambda b, i: table[b, i]


@dataclass(frozen=True, eq=False)
class Geometry:
    """Sizes and positions a pattern is asked about.

    ``num_heads`` is the number of query heads, ``block_size`` the BlockMask tile (tokens, square tiles),
    ``positions`` the tables of a padded, decoding or cached call (None: the contiguous layout).
    """

    num_heads: int
    q_len: int
    kv_len: int | None = None
    block_size: int = 128
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    positions: Positions | None = None

    def __post_init__(self) -> None:
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.q_len)
        for name in ("num_heads", "q_len", "kv_len", "block_size"):
            object.__setattr__(self, name, as_int(f"Geometry.{name}", getattr(self, name), minimum=1))
        object.__setattr__(self, "device", torch.device(self.device))
        if self.q_len > self.kv_len:
            raise ValueError(f"Geometry.q_len ({self.q_len}) must not exceed kv_len ({self.kv_len})")
        pos = self.positions
        if pos is not None:
            if not isinstance(pos, Positions):
                raise TypeError(f"Geometry.positions must be Positions, got {type(pos).__name__}")
            if (pos.q.shape[1], pos.kv.shape[1]) != (self.q_len, self.kv_len):
                raise ValueError(f"positions cover {pos.q.shape[1]} queries x {pos.kv.shape[1]} keys, the geometry "
                                 f"has {self.q_len} x {self.kv_len}")
            if pos.device.type != self.device.type:
                raise ValueError(f"positions are on {pos.device}, the geometry on {self.device}")

    # ----- sizes ------------------------------------------------------------------------------------------

    @property
    def is_contiguous(self) -> bool:
        """Query i at position kv_len - q_len + i, key j at position j (no position tables)."""
        return self.positions is None

    @property
    def offset(self) -> int:
        """Position of query 0 in the contiguous layout."""
        return self.kv_len - self.q_len

    @property
    def batch(self) -> int:
        """B': 1 unless the positions differ per batch element."""
        return 1 if self.positions is None else self.positions.batch

    @property
    def span(self) -> int:
        """One past the largest position a key can hold."""
        return self.kv_len if self.positions is None else self.positions.span

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_size)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_size)

    def tables(self) -> Geometry:
        """The same geometry with explicit position tables."""
        if self.positions is not None:
            return self
        return Geometry(self.num_heads, self.q_len, self.kv_len, self.block_size, self.device,
                        Positions.contiguous(self.q_len, self.kv_len, self.device))

    def query_rows(self, start: int, stop: int) -> Geometry:
        """The geometry of query rows ``start:stop`` against all keys (tables)."""
        tables = self.tables()
        return Geometry(self.num_heads, stop - start, self.kv_len, self.block_size, self.device,
                        tables.positions.rows(start, stop))

    # ----- positions --------------------------------------------------------------------------------------

    def q_positions(self) -> Tensor:
        """Position of every query row, int64 ``[B', Q]`` (-1: padding)."""
        if self.positions is None:
            return (torch.arange(self.q_len, device=self.device) + self.offset)[None]
        return self.positions.q.long()

    def kv_positions(self) -> Tensor:
        """Position of every key slot, int64 ``[B', KV]`` (``span``: padding)."""
        if self.positions is None:
            return torch.arange(self.kv_len, device=self.device)[None]
        return self.positions.kv.long()

    def sequence_ends(self) -> Tensor:
        """One past each batch element's last real position, int64 ``[B']``."""
        if self.positions is None:
            return torch.tensor([self.kv_len], device=self.device)
        return self.positions.sequence_ends()

    def position_mods(self) -> tuple[PositionMod, PositionMod]:
        """Traceable ``(q_position(b, q_idx), kv_position(b, kv_idx))`` for mask_mods."""
        if self.positions is None:
            offset = self.offset
            return (lambda b, q_idx: q_idx + offset), (lambda b, kv_idx: kv_idx)
        return _per_batch_rows(self.positions.q), _per_batch_rows(self.positions.kv)

    def per_batch_mod(self, values: Tensor) -> Callable[[Tensor], Tensor]:
        """Traceable ``b -> values[b]`` for a ``[B']`` tensor (``values[0]`` when B' is 1)."""
        return _per_batch(values)

    # ----- tiles ------------------------------------------------------------------------------------------

    def _tile_bounds(self, table: Tensor, length: int, real: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(first, last, any, all) real positions per tile of a ``[B', length]`` table."""
        bs = self.block_size
        tiles = -(-length // bs)
        pad = tiles * bs - length
        exists = torch.ones_like(real)
        table, real, exists = (torch.nn.functional.pad(t, (0, pad)) for t in (table, real, exists))
        table, real, exists = (t.view(t.shape[0], tiles, bs) for t in (table, real, exists))
        big = torch.iinfo(torch.int64).max // 4
        first = torch.where(real, table, big).amin(-1)
        last = torch.where(real, table, -1).amax(-1)
        return first, last, real.any(-1), (real | ~exists).all(-1)

    def q_tile_bounds(self) -> tuple[Tensor, Tensor]:
        """First and last query position of each query tile, int64 ``[B', 1, QB, 1]`` each (real rows only)."""
        if self.positions is None:
            start = torch.arange(self.num_q_blocks, device=self.device) * self.block_size
            last = torch.clamp(start + self.block_size, max=self.q_len) - 1
            return (start + self.offset)[None, None, :, None], (last + self.offset)[None, None, :, None]
        first, last = self._q_tiles()[:2]
        return first[:, None, :, None], last[:, None, :, None]

    def kv_tile_bounds(self) -> tuple[Tensor, Tensor]:
        """First and last key position of each key tile, int64 ``[B', 1, 1, KB]`` each (real keys only)."""
        if self.positions is None:
            start = torch.arange(self.num_kv_blocks, device=self.device) * self.block_size
            last = torch.clamp(start + self.block_size, max=self.kv_len) - 1
            return start[None, None, None, :], last[None, None, None, :]
        first, last = self._kv_tiles()[:2]
        return first[:, None, None, :], last[:, None, None, :]

    def _q_tiles(self):
        q = self.positions.q
        return self.positions.state.tile_bounds("q", self.block_size,
                                                lambda: self._tile_bounds(q.long(), self.q_len, q >= 0))

    def _kv_tiles(self):
        kv, span = self.positions.kv, self.positions.span
        return self.positions.state.tile_bounds("kv", self.block_size,
                                                lambda: self._tile_bounds(kv.long(), self.kv_len, kv < span))

    def restrict(self, classes: Tensor) -> Tensor:
        """Tile classes made exact for padding: tiles without a real query or key are EMPTY, and a tile holding
        any padding row or slot is at most PARTIAL. ``classes`` ``[B', H', QB, KB]``."""
        if self.positions is None:
            return classes
        _, _, q_any, q_all = self._q_tiles()
        _, _, kv_any, kv_all = self._kv_tiles()
        some = q_any[:, None, :, None] & kv_any[:, None, None, :]
        every = q_all[:, None, :, None] & kv_all[:, None, None, :]
        classes = torch.where(some, classes, EMPTY)
        return torch.where((classes == FULL) & ~every, PARTIAL, classes).to(torch.int8)

    def tile_pairs(self) -> Tensor:
        """Real (query, key) pairs per tile, int64 ``[B', 1, QB, KB]``."""
        bs = self.block_size
        if self.positions is None:
            q_count = torch.clamp(self.q_len - torch.arange(self.num_q_blocks, device=self.device) * bs, max=bs)
            kv_count = torch.clamp(self.kv_len - torch.arange(self.num_kv_blocks, device=self.device) * bs, max=bs)
            return (q_count[:, None] * kv_count[None, :])[None, None]
        count = lambda real, n: torch.nn.functional.pad(real.long(), (0, -(-n // bs) * bs - n)).view(
            real.shape[0], -1, bs).sum(-1)
        q_count = count(self.positions.q >= 0, self.q_len)
        kv_count = count(self.positions.kv < self.positions.span, self.kv_len)
        return (q_count[:, :, None] * kv_count[:, None, :])[:, None]

    # ----- dense references -------------------------------------------------------------------------------

    def dense_grid(self, heads: int = 1) -> tuple[Tensor, Tensor]:
        """Query positions ``[B', 1, Q, 1]`` and key positions ``[B', 1, 1, KV]`` for a dense reference of
        ``heads`` heads, refused when it would exceed :data:`MAX_DENSE_ELEMENTS`."""
        self.check_dense(heads)
        return self.q_positions()[:, None, :, None], self.kv_positions()[:, None, None, :]

    def check_dense(self, heads: int = 1) -> None:
        elements = self.batch * heads * self.q_len * self.kv_len
        if elements > MAX_DENSE_ELEMENTS:
            raise ValueError(f"a dense reference of {self.batch} x {heads} x {self.q_len} x {self.kv_len} exceeds "
                             f"{MAX_DENSE_ELEMENTS} elements; dense references are for small sizes")

    def slot_columns(self, by_position: Tensor) -> Tensor:
        """A mask over key *positions* ``[B'', H', Q, span]`` read at each key slot's position:
        ``[B', H', Q, KV]`` (padding slots False)."""
        if self.positions is None and by_position.shape[-1] == self.kv_len:
            return by_position
        kv = torch.clamp(self.kv_positions(), max=self.span)  # padding slots read the appended False column
        padded = torch.nn.functional.pad(by_position, (0, 1))
        batch = max(padded.shape[0], kv.shape[0])
        padded = padded.expand(batch, *padded.shape[1:])
        index = kv[:, None, None, :].expand(batch, padded.shape[1], padded.shape[2], kv.shape[-1])
        return padded.gather(-1, index)
