"""The Pattern protocol: what every attention pattern answers for a given geometry.

A pattern decides which keys each query may attend to. For a :class:`Geometry` it gives

1. ``mask_mod(geo)``: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` closure;
2. ``block_classes(geo)``: for every (query block, key block) whether it is empty, partial or full, in closed
   form; :meth:`Pattern.block_mask` turns this into a ``BlockMask`` with full blocks marked;
3. ``dense(geo)``: the boolean reference ``[B', H', Q, KV]`` built independently of ``mask_mod``, for tests;
4. ``attended(geo)``: how many keys each query attends to, ``[B', H', Q]``.

``B'`` is 1 for patterns that do not depend on the batch element and ``H'`` is 1 for patterns that treat all
heads alike; both broadcast. Query ``i`` of ``q_len`` sits at absolute position ``i + kv_len - q_len`` (queries are
the last positions, as in prefill with a cache or decode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Block classes: no pair attends / some pairs attend (the kernel evaluates mask_mod) / every pair attends."""

MAX_DENSE_ELEMENTS = 1 << 28
"""Largest B*H*Q*KV a dense reference may materialise (256 Mi booleans)."""


@dataclass(frozen=True)
class Geometry:
    """Sizes a pattern is asked about.

    ``num_heads`` is the number of query heads, ``block_size`` the BlockMask tile (tokens, square tiles).
    """

    num_heads: int
    q_len: int
    kv_len: int | None = None
    block_size: int = 128
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.q_len)
        object.__setattr__(self, "device", torch.device(self.device))
        for name in ("num_heads", "q_len", "kv_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Geometry.{name} must be a positive int, got {value!r}")
        if self.q_len > self.kv_len:
            raise ValueError(f"Geometry.q_len ({self.q_len}) must not exceed kv_len ({self.kv_len})")

    @property
    def offset(self) -> int:
        """Absolute position of query 0."""
        return self.kv_len - self.q_len

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_size)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_size)

    def q_positions(self) -> Tensor:
        """Absolute positions of the queries, int64 ``[Q]``."""
        return torch.arange(self.q_len, device=self.device) + self.offset

    def q_block_bounds(self) -> tuple[Tensor, Tensor]:
        """First and one-past-last absolute query position of each query block, int64 ``[QB, 1]`` each."""
        start = torch.arange(self.num_q_blocks, device=self.device) * self.block_size
        stop = torch.clamp(start + self.block_size, max=self.q_len)
        return (start + self.offset)[:, None], (stop + self.offset)[:, None]

    def kv_block_bounds(self) -> tuple[Tensor, Tensor]:
        """First and one-past-last key position of each key block, int64 ``[1, KB]`` each."""
        start = torch.arange(self.num_kv_blocks, device=self.device) * self.block_size
        stop = torch.clamp(start + self.block_size, max=self.kv_len)
        return start[None, :], stop[None, :]

    def dense_grid(self) -> tuple[Tensor, Tensor]:
        """Absolute query positions ``[Q, 1]`` and key positions ``[1, KV]``, bounded for dense references."""
        if self.num_heads * self.q_len * self.kv_len > MAX_DENSE_ELEMENTS:
            raise ValueError(
                f"a dense reference of {self.num_heads} x {self.q_len} x {self.kv_len} exceeds "
                f"{MAX_DENSE_ELEMENTS} elements; dense references are for small test sizes"
            )
        return self.q_positions()[:, None], torch.arange(self.kv_len, device=self.device)[None, :]


def classify(full: Tensor, empty: Tensor) -> Tensor:
    """Block classes (int8) from boolean 'every pair attends' and 'no pair attends' tensors."""
    return torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)


class Pattern(ABC):
    """An attention pattern. Subclasses implement the four capabilities for a :class:`Geometry`."""

    name: str = "pattern"
    is_full: bool = False
    """True for full causal attention (FA): such heads count as dense in MSR/ESR."""

    def resolve(self, q: Tensor, k: Tensor) -> Pattern:
        """The static pattern to use for these queries/keys. Content-dependent patterns (XA) override this."""
        return self

    @property
    def is_dynamic(self) -> bool:
        """Whether :meth:`resolve` depends on q/k (then the pattern is resolved on every call)."""
        return False

    @abstractmethod
    def mask_mod(self, geo: Geometry) -> MaskMod:
        """FlexAttention mask_mod for this geometry (``h`` is the query head)."""

    @abstractmethod
    def block_classes(self, geo: Geometry) -> Tensor:
        """int8 ``[B', H', QB, KB]`` of EMPTY / PARTIAL / FULL, without an O(Q*KV) scan."""

    @abstractmethod
    def dense(self, geo: Geometry) -> Tensor:
        """Boolean reference ``[B', H', Q, KV]`` (small sizes only)."""

    def attended(self, geo: Geometry) -> Tensor:
        """Keys attended per query, int64 ``[B', H', Q]``. Default: counted from :meth:`dense`."""
        return self.dense(geo).sum(-1)

    def block_mask(self, geo: Geometry) -> BlockMask:
        """BlockMask with partial and full blocks from :meth:`block_classes`."""
        from flexsparse.masks.blocks import block_mask_from_classes

        return block_mask_from_classes(self.block_classes(geo), geo, self.mask_mod(geo))

    def __or__(self, other: Pattern) -> Pattern:
        from flexsparse.masks.combine import Union

        return Union(self, other)

    def __and__(self, other: Pattern) -> Pattern:
        from flexsparse.masks.combine import Intersection

        return Intersection(self, other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
