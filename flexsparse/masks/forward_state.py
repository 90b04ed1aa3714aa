"""What one model forward computes once and all its layers reuse: :class:`ForwardState`, one named entry each.

A forward's layers share their position tables, and with them what is derived from those tables (key slots, tile
bounds, the tables at a compiled bucket, a batch part's rows, block masks) and, in the transformers integration,
from the padding mask (its layout, real-token counts, a router's pooling boundary). A sparse KV cache keeps its
own per-forward entries (:class:`~flexsparse.cache.views.StepViews`). One
state belongs to one set of tables: :class:`~flexsparse.masks.geometry.Positions` holds it (and the
:class:`~flexsparse.integrations.forward_mask.ForwardMask` that built them), so building the Positions (or the mask)
once per forward and passing it to every layer computes each entry once per forward. Tables derived from others
are Positions with states of their own, held by the state they derive from.

Every entry is read through a method that takes the ``build`` computing it: the first call builds and stores it,
later calls return the stored value. Keyed entries say what their key is.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

if TYPE_CHECKING:
    from flexsparse.masks.geometry import Positions

T = TypeVar("T")
_UNSET: Any = object()


def _entry(table: dict, key: Hashable, build: Callable[[], T]) -> T:
    found = table.get(key, _UNSET)
    if found is _UNSET:
        found = table[key] = build()
    return found


class ForwardState:
    """The per-forward cache of one set of position tables (and of the padding mask they came from)."""

    def __init__(self) -> None:
        # of the position tables
        self._key_slots: Tensor | None = None
        self._sequence_ends: Tensor | None = None
        self._tile_bounds: dict[tuple[str, int], tuple[Tensor, ...]] = {}
        self._bucketed: dict[tuple[int, int], Positions] = {}
        self._batch_rows: dict[tuple[int, int], Positions] = {}
        self._flex_masks: dict[tuple[int, int, int, int, int], Any] = {}
        # of the padding mask (the transformers integration)
        self._padding_layout: str | None = None
        self._new_tokens_padded: bool | None = None
        self._positions: Positions | None = _UNSET
        self._contiguous_tables: Positions | None = None
        self._capacity_positions: dict[int, Positions] = {}
        self._real_counts: dict[int, Tensor] = {}
        # of a routed layer
        self._router_boundaries: dict[tuple, tuple[Tensor | None, Any]] = {}

    # ----- of the position tables ----------------------------------------------------------------------------

    def key_slots(self, build: Callable[[], Tensor]) -> Tensor:
        """The slot of each position (:meth:`Positions.key_slots`)."""
        if self._key_slots is None:
            self._key_slots = build()
        return self._key_slots

    def sequence_ends(self, build: Callable[[], Tensor]) -> Tensor:
        """One past each batch element's last real position (:meth:`Positions.sequence_ends`)."""
        if self._sequence_ends is None:
            self._sequence_ends = build()
        return self._sequence_ends

    def tile_bounds(self, axis: str, block_size: int, build: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """(first, last, any, all) real positions per tile of the ``axis`` (``"q"`` or ``"kv"``) table."""
        return _entry(self._tile_bounds, (axis, block_size), build)

    def bucketed(self, q_len: int, kv_len: int, build: Callable[[], Positions]) -> Positions:
        """The tables padded to a compiled bucket of ``q_len`` query rows and ``kv_len`` key slots."""
        return _entry(self._bucketed, (q_len, kv_len), build)

    def batch_rows(self, start: int, size: int, build: Callable[[], Positions]) -> Positions:
        """The tables of batch elements ``start .. start + size`` (a compiled batch part)."""
        return _entry(self._batch_rows, (start, size), build)

    def flex_masks(self, executor: object, num_heads: int, q_len: int, kv_len: int, block_size: int,
                   build: Callable[[], T]) -> T:
        """A flex executor's masks at a geometry of these tables (its mask set; the executor is a layer's, so
        keyed by its identity for this forward)."""
        return _entry(self._flex_masks, (id(executor), num_heads, q_len, kv_len, block_size), build)

    # ----- of the padding mask ----------------------------------------------------------------------------

    def padding_layout(self, build: Callable[[], str]) -> str:
        """``"none"``, ``"left"`` or ``"other"`` (:meth:`ForwardMask.padding_layout`; a host sync to build)."""
        if self._padding_layout is None:
            self._padding_layout = build()
        return self._padding_layout

    def new_tokens_padded(self, build: Callable[[], bool]) -> bool:
        """Whether any query token is padding (a host sync to build)."""
        if self._new_tokens_padded is None:
            self._new_tokens_padded = build()
        return self._new_tokens_padded

    def positions(self, build: Callable[[], Positions | None]) -> Positions | None:
        """The forward's positions (None: the contiguous layout)."""
        if self._positions is _UNSET:
            self._positions = build()
        return self._positions

    def contiguous_tables(self, build: Callable[[], Positions]) -> Positions:
        """The contiguous layout as tables (a prefill without padding, where a cache needs tables)."""
        if self._contiguous_tables is None:
            self._contiguous_tables = build()
        return self._contiguous_tables

    def capacity_positions(self, capacity: int, build: Callable[[], Positions]) -> Positions:
        """The positions with the key slots extended to ``capacity`` (a cache buffer's length)."""
        return _entry(self._capacity_positions, capacity, build)

    def real_counts(self, tokens: int, build: Callable[[], Tensor]) -> Tensor:
        """Real tokens among the first ``tokens``, per row."""
        return _entry(self._real_counts, tokens, build)

    # ----- of a routed layer ----------------------------------------------------------------------------

    def router_boundary(self, pool_size: int, batch: int, seq: int, device: object, pool_mask: Tensor | None,
                        build: Callable[[], T]) -> T:
        """Where a router of ``pool_size`` pools ``[batch, seq]`` states, from ``pool_mask`` (None: the padding).
        Kept with the pooling mask it came from: another mask (even at a reused id) builds anew."""
        key = (pool_size, batch, seq, device, id(pool_mask))
        found = self._router_boundaries.get(key)
        if found is None or found[0] is not pool_mask:
            found = self._router_boundaries[key] = (pool_mask, build())
        return found[1]
