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


def runs_from_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Runs of True in boolean rows ``[..., KV]`` as (first, last) ``[..., R]``, empty runs (1, 0) padded last."""
    padded = torch.nn.functional.pad(rows.to(torch.int8), (1, 1))
    step = padded.diff(dim=-1)
    starts, ends = step == 1, step == -1  # [..., KV + 1]
    count = starts.sum(-1)
    width = max(int(count.max()) if count.numel() else 0, 1)
    positions = torch.arange(step.shape[-1], device=rows.device)
    order_s = torch.argsort((~starts).to(torch.int8), dim=-1, stable=True)[..., :width]
    order_e = torch.argsort((~ends).to(torch.int8), dim=-1, stable=True)[..., :width]
    valid = torch.arange(width, device=rows.device) < count[..., None]
    first = torch.where(valid, positions[order_s], 1)
    last = torch.where(valid, positions[order_e] - 1, 0)
    return first, last


def normalize_runs(first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """Sort runs ``[..., R]`` by first key (empty ones last) and merge overlapping or adjacent ones."""
    empty = first > last
    big = torch.iinfo(first.dtype).max
    order = torch.argsort(torch.where(empty, big, first), dim=-1, stable=True)
    first, last, empty = first.gather(-1, order), last.gather(-1, order), empty.gather(-1, order)
    reach = torch.where(empty, -2, last).cummax(-1).values  # furthest key covered by runs so far
    opens = ~empty & torch.cat([torch.ones_like(empty[..., :1]), first[..., 1:] > reach[..., :-1] + 1], -1)
    group = opens.cumsum(-1) - 1  # merged run index of each run
    width = first.shape[-1]
    merged_first = torch.full_like(first, 1).scatter_reduce(-1, group.clamp(min=0), torch.where(opens, first, big),
                                                            "amin", include_self=False)
    merged_last = torch.zeros_like(last).scatter_reduce(-1, group.clamp(min=0), torch.where(empty, -1, last),
                                                        "amax", include_self=False)
    count = opens.sum(-1, keepdim=True)
    valid = torch.arange(width, device=first.device) < count
    return torch.where(valid, merged_first, 1), torch.where(valid, merged_last, 0)


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

    @property
    def required_heads(self) -> int | None:
        """The number of query heads this pattern is defined for, or None if it treats every head alike."""
        return None

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys attended by the given absolute query positions as runs of consecutive keys.

        Returns (first, last), integer ``[R, H', P]`` (slot-major, the layout the receptive-field verifier
        scans): per head and query, R runs ``first..last`` (inclusive), the non-empty ones first, ascending and
        disjoint, then empty ones (first > last). Default: read off :meth:`dense` (small sizes); patterns with
        structure override it.
        """
        dense = self.dense(geo)
        if dense.shape[0] != 1:
            raise ValueError(f"key_runs needs a pattern without a batch dimension; {self!r} has {dense.shape[0]}")
        first, last = runs_from_rows(dense[0][:, positions.long() - geo.offset])
        return first.permute(2, 0, 1), last.permute(2, 0, 1)

    def union_key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Runs of the keys any head attends, ``[R, P]``: first and last keys both non-decreasing along R
        (repeats allowed), empty runs last. What the receptive-field verifier reads.

        Default: the heads' :meth:`key_runs` sorted together and merged.
        """
        first, last = (t.reshape(t.shape[0] * t.shape[1], -1).T for t in self.key_runs(geo, positions))
        first, last = normalize_runs(first, last)
        return first.T, last.T

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
