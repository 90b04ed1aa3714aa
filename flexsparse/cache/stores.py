"""A sparse KV cache's buffers: per head group of a layer, a store that keeps every key or a sink + window ring.

What a group's store keeps follows from its pattern (:attr:`~flexsparse.masks.Pattern.decode_reads`): a ring for
patterns whose decode reads exactly a sink and a window, every key otherwise (:func:`store_kind`). A store holds
``keys``/``values`` ``[B, H_group, capacity, d]`` and writes into them; how a step's query sees them is a
:class:`~flexsparse.cache.views.StepView`, and who attends them is an executor
(:meth:`~flexsparse.runtime.executors.Executor.decode`).

Capacities. With a known maximum length a store's first allocation holds it exactly (a ring: at most
``sink + window``). Without one, and past it, buffers grow on :func:`~flexsparse.cache.capacity.grown_capacity`'s
grid, or on a ``bucket`` function the owner gives (compiled flex's buckets for stores a plan reads whole).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flexsparse.cache.capacity import grown_capacity
from flexsparse.masks import DecodeReads, Pattern


class StoreKind(enum.Enum):
    """What a head group's store keeps."""

    EVERY_KEY = "every key"
    """Every token, slot ``t`` holding token ``t``."""
    RING = "ring"
    """The sink and the last ``window`` tokens, in ``sink + window`` slots."""


def store_kind(pattern: Pattern) -> StoreKind:
    """The store a pattern's heads need: a ring when its decode reads exactly a sink and a window."""
    return StoreKind.RING if pattern.decode_reads is DecodeReads.SINK_AND_WINDOW else StoreKind.EVERY_KEY


class HeadIndex:
    """Some heads of a ``[B, heads, ...]`` tensor: a slice when contiguous (a view), else an index tensor kept per
    device (indexing a CUDA tensor with a Python list copies the list to the device and syncs the host)."""

    def __init__(self, heads: Sequence[int]) -> None:
        heads = list(heads)
        self.slice = slice(heads[0], heads[-1] + 1) if heads == list(range(heads[0], heads[-1] + 1)) else None
        self.heads = heads
        self._on: dict[torch.device, Tensor] = {}

    def tensor(self, device: torch.device) -> Tensor:
        """The heads as an int64 tensor on ``device`` (made once per device)."""
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = torch.tensor(self.heads, dtype=torch.long, device=device)
        return found

    def pick(self, t: Tensor) -> Tensor:
        return t[:, self.slice] if self.slice is not None else t.index_select(1, self.tensor(t.device))


class KVStore:
    """One head group's buffers, every key kept: ``kv_heads`` of the layer (the heads a write picks from the
    layer's keys), ``max_length`` (the first allocation's size when known), ``bucket`` (capacities instead of the
    growth grid: a plan that reads the whole buffer compiles once per bucket)."""

    kind = StoreKind.EVERY_KEY

    def __init__(self, kv_heads: Sequence[int], max_length: int | None = None,
                 bucket: Callable[[int], int] | None = None) -> None:
        self.heads = HeadIndex(kv_heads)
        self.max_length = max_length
        self.bucket = bucket
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def fixed_size(self) -> int | None:
        """The most slots the store ever needs (None: it grows with the tokens)."""
        return None

    def memory_bytes(self) -> int:
        """Bytes of the allocated buffers."""
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()

    def used_bytes(self, tokens: int) -> int:
        """Bytes of the slots that hold one of ``tokens`` tokens (per sequence, padding included)."""
        if self.keys is None:
            return 0
        batch, heads, _, dim = self.keys.shape
        return 2 * batch * heads * min(tokens, self.capacity) * dim * self.keys.element_size()

    def reserve(self, like: Tensor, tokens: int) -> None:
        """Room for ``tokens`` (``like``: keys ``[B, H_kv, q, d]`` of the layer, for batch, dtype and device): the
        maximum length on the first allocation when known, else the growth grid (or the bucket)."""
        if tokens <= self.capacity:
            return
        if self.keys is None and self.max_length is not None:
            wanted = max(tokens, self.max_length)
        else:
            wanted = grown_capacity(tokens)
        self._allocate(like, wanted if self.bucket is None else self.bucket(wanted))

    def _allocate(self, like: Tensor, capacity: int) -> None:
        shape = (like.shape[0], len(self.heads.heads), capacity, like.shape[3])
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self.keys is not None:  # growing: keep what is cached
            keys[:, :, : self.capacity] = self.keys
            values[:, :, : self.capacity] = self.values
        self.keys, self.values = keys, values

    def write(self, key: Tensor, value: Tensor, first: int) -> None:
        """The layer's new keys/values ``[B, H_kv, q, d]`` into slots ``first .. first + q``."""
        end = first + key.shape[2]
        self.keys[:, :, first:end] = self.heads.pick(key)
        self.values[:, :, first:end] = self.heads.pick(value)

    def write_rows(self, key: Tensor, value: Tensor, rows: Tensor, slot: Tensor) -> None:
        """One new token per sequence (``[B, H_kv, 1, d]``) into slot ``slot[b]`` of row ``rows[b]``."""
        self.keys[rows, :, slot] = self.heads.pick(key)[:, :, 0]
        self.values[rows, :, slot] = self.heads.pick(value)[:, :, 0]

    def map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply a batch reordering (beam search, repeats, a selection) to the buffers."""
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reset(self) -> None:
        self.keys = self.values = None


class RingStore(KVStore):
    """A sink + window ring: ``sink + window`` slots (fewer for a shorter generation; see
    :func:`~flexsparse.cache.capacity.ring_slot_of` for where each position goes)."""

    kind = StoreKind.RING

    def __init__(self, kv_heads: Sequence[int], sink: int, window: int, max_length: int | None = None) -> None:
        super().__init__(kv_heads, max_length)
        self.sink, self.window = sink, window

    @property
    def fixed_size(self) -> int:
        return self.sink + self.window

    def reserve(self, like: Tensor, tokens: int) -> None:
        """Room for ``tokens``, at most ``sink + window`` slots. Below that the ring has not wrapped (slot p holds
        position p), so growing keeps the filled slots where they are."""
        if tokens <= self.capacity or self.capacity == self.fixed_size:
            return
        if self.keys is None and self.max_length is not None:
            wanted = max(tokens, self.max_length)
        else:
            wanted = grown_capacity(tokens)
        self._allocate(like, min(self.fixed_size, wanted))

    def rewrite(self, key: Tensor, value: Tensor, after: Tensor, new_positions: Tensor, real_before: Tensor,
                span: int) -> None:
        """Write the new tokens that stay (prefill and chunks; every slot is rewritten): ``after`` int ``[B', R]``,
        the position each slot holds once they are written (``span``: empty); ``new_positions`` int64
        ``[B', q]`` of the new tokens (``span`` for padding); ``real_before`` ``[B']`` real tokens before them."""
        q_len = key.shape[2]
        after = after.long()
        ordered = torch.where(new_positions < span, new_positions, -1).cummax(-1).values
        rows = max(ordered.shape[0], after.shape[0])  # B' is 1 for tables shared by the batch (no padding)
        ordered, after = ordered.expand(rows, -1).contiguous(), after.expand(rows, -1)
        token = torch.searchsorted(ordered, after.contiguous()).clamp(max=q_len - 1)  # the new token at that position
        from_new = (after >= real_before[:, None]) & (after < span)
        batch, heads, _, dim = self.keys.shape
        index = token[:, None, :, None].expand(batch, heads, self.capacity, dim)
        keep = from_new[:, None, :, None]
        self.keys = torch.where(keep, self.heads.pick(key).gather(2, index), self.keys)
        self.values = torch.where(keep, self.heads.pick(value).gather(2, index), self.values)


def make_store(pattern: Pattern | None, kv_heads: Sequence[int], max_length: int | None,
               bucket: Callable[[int], int] | None = None) -> KVStore:
    """The store for heads of ``pattern`` (None: heads of several patterns, every key kept)."""
    if pattern is not None and store_kind(pattern) is StoreKind.RING:
        return RingStore(kv_heads, pattern.sink, pattern.window, max_length)
    return KVStore(kv_heads, max_length, bucket)
