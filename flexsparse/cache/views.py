"""How one decode step's query sees a store: a :class:`StepView`, built once per forward for all layers.

A view says where the new token goes (``slot``) and which slots the query attends, in the cheapest form the
cache's padding allows (:class:`PaddingLayout`, read at prefill with the padding check's one host sync):

* no padding: every one of the first ``filled`` slots (``prefix``), and also as per-row ranges ``lo/hi``;
* a left-padded prompt: per-row slot ranges ``lo[b] <= slot < hi[b]`` on the device (a row's real tokens are the
  last ``real_b`` slots of an every-key store and the first ``min(real_b, capacity)`` of a ring);
* any other padding: a boolean ``visible`` mask over the first ``filled`` slots, and the positions a pattern's own
  decoder needs (``q_positions``, ``key_slots``).

:class:`StepViews` builds them from the forward's padding (anything with the :class:`ForwardPadding` methods,
e.g. transformers' :class:`~flexsparse.integrations.forward_mask.ForwardMask`) and keeps what it built for the
forward, so every layer of the forward shares it: no per-layer tensor work, no host sync.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from flexsparse.cache.capacity import ring_slot_of, ring_slot_on_host, ring_slot_positions
from flexsparse.cache.stores import KVStore, RingStore
from flexsparse.masks import Positions

T = TypeVar("T")


class PaddingLayout(enum.Enum):
    """The padding of a cache's tokens so far."""

    NONE = "none"
    """No padding token: token t is position t in every row."""
    LEFT = "left"
    """A left-padded prompt, every later token real."""
    OTHER = "other"
    """Anything else (a right-padded prompt, padding after the prompt): decode reads position masks."""


class ForwardPadding(Protocol):
    """What :class:`StepViews` reads of a forward's padding."""

    batch: int
    span: int
    device: torch.device

    def real_counts(self, tokens: int) -> Tensor: ...  # int64 [B'] real tokens among the first `tokens`

    def table_positions(self) -> Positions: ...  # query and key-slot positions as tables

    def new_positions(self) -> Tensor: ...  # int64 [B', q_len] of the new tokens (span: padding)


@dataclass(slots=True)
class StepView:
    """One store as a one-token step's query sees it. ``filled``: slots ``[0, filled)`` may hold keys the query
    reads; ``slot`` int64 ``[B]``: where the new token goes (``host_slot`` the same when every row shares it);
    ``lo``/``hi`` int64 ``[B]``: the attended slot range of each row, every one a key the query attends (None
    for position masks); ``prefix``: every row attends all of the first ``filled`` slots; ``visible`` bool
    ``[B', filled]`` and ``empty`` bool ``[B', 1]`` (queries that read none: padding, whose row is 0): the
    position mask; ``positions()`` gives ``(q_positions, key_slots)``, int ``[B', 1]`` and int32 ``[B', span]`` (the
    slot of each position), for decoders of a pattern's own keys, built on first use (None without padding: slot
    t holds position t)."""

    filled: int
    slot: Tensor
    lo: Tensor | None = None
    hi: Tensor | None = None
    prefix: bool = False
    host_slot: int | None = None
    visible: Tensor | None = None
    empty: Tensor | None = None
    positions: Callable[[], tuple[Tensor, Tensor]] | None = None
    rows: Tensor | None = None
    """int64 ``[B]`` rows of an indexed write (with ``slot``; None: ``host_slot`` in every row)."""

    @property
    def ranged(self) -> bool:
        """Whether the view gives each row's attended slots as a range (``lo``/``hi``)."""
        return self.lo is not None


class _Sequence:
    """The int64 sequence ``0, 1, 2, ...`` on each device, shared by a cache's layers and forwards: a per-row
    constant (a slot, a length) is a stride-0 view into it, so making one launches no kernel. Grows by doubling."""

    def __init__(self) -> None:
        self._on: dict[torch.device, Tensor] = {}

    def constant(self, device: torch.device, batch: int, value: int) -> Tensor:
        table = self._on.get(device)
        if table is None or value >= table.shape[0]:
            size = max(4096, 2 * value + 2, 0 if table is None else 2 * table.shape[0])
            table = self._on[device] = torch.arange(size, dtype=torch.long, device=device)
        return table.as_strided((batch,), (0,), value)


class StepViews:
    """The step views of one cache, for the forward whose padding it was last given (:meth:`for_forward`)."""

    def __init__(self) -> None:
        self._sequence = _Sequence()
        self._padding: ForwardPadding | None = None
        self._layout = PaddingLayout.NONE
        self._entries: dict[Hashable, Any] = {}

    def for_forward(self, padding: ForwardPadding, layout: PaddingLayout) -> StepViews:
        """Views of this forward (what was built for another forward is dropped)."""
        if padding is not self._padding or layout is not self._layout:
            self._padding, self._layout, self._entries = padding, layout, {}
        return self

    def _entry(self, key: Hashable, build: Callable[[], T]) -> T:
        found = self._entries.get(key)
        if found is None:
            found = self._entries[key] = build()
        return found

    def constant(self, value: int) -> Tensor:
        """``value`` for every row, int64 ``[B]`` (a read-only view)."""
        found = self._entries.get(value)  # int keys: the constants
        if found is None:
            found = self._entries[value] = self._sequence.constant(self._padding.device, self._padding.batch, value)
        return found

    def _per_row(self, values: Tensor) -> Tensor:
        """``[B']`` values (B' = 1 when shared by the batch) as ``[B]``."""
        batch = self._padding.batch
        return values if values.shape[0] == batch else values.expand(batch).contiguous()

    def real_counts(self, tokens: int) -> Tensor:
        """Real tokens among the first ``tokens`` of each row, int64 ``[B]``."""
        return self._entry(("real", tokens), lambda: self._per_row(self._padding.real_counts(tokens)))

    # ----- one-token steps ------------------------------------------------------------------------------------

    def step(self, store: KVStore, past: int) -> StepView:
        """The view of a one-token step (the new token at slot count ``past``) over ``store``."""
        if isinstance(store, RingStore):
            return self._ring_step(store, past)
        return self._every_key_step(past)

    def _every_key_step(self, past: int) -> StepView:
        tokens, layout = past + 1, self._layout
        slot = self.constant(past)
        if layout is PaddingLayout.NONE:
            return StepView(tokens, slot, self.constant(0), self.constant(tokens), prefix=True, host_slot=past)
        if layout is PaddingLayout.LEFT:  # a row's real tokens are its last slots
            lo = self._entry(("left", tokens), lambda: tokens - self.real_counts(tokens))
            return StepView(tokens, slot, lo, self.constant(tokens), host_slot=past, positions=self._positions)
        table = self._padding.table_positions()
        visible, empty = self._entry(("visible", tokens), lambda: _visible(table.kv, table.q))
        return StepView(tokens, slot, visible=visible, empty=empty, host_slot=past, positions=self._positions)

    def _positions(self) -> tuple[Tensor, Tensor]:
        """The forward's query positions and the slot of each key position (every-key stores: slot t is token t)."""
        def build() -> tuple[Tensor, Tensor]:
            table = self._padding.table_positions()
            return table.q, table.key_slots()[:, :table.span].to(torch.int32)
        return self._entry("positions", build)

    def _ring_step(self, store: RingStore, past: int) -> StepView:
        tokens, layout, capacity = past + 1, self._layout, store.capacity
        sink, window = store.sink, store.window
        if layout is PaddingLayout.NONE:  # token t is position t: the slot is known on the host
            host_slot = ring_slot_on_host(past, sink, window)
            filled = min(tokens, capacity)
            return StepView(filled, self.constant(host_slot), self.constant(0), self.constant(filled), prefix=True,
                            host_slot=host_slot)
        if layout is PaddingLayout.LEFT:  # the new token is real: real token `real - 1` of its row
            real = self.real_counts(tokens)
            slot = self._entry(("ring slot", sink, window), lambda: ring_slot_of(real - 1, sink, window))
            hi = self._entry(("ring filled", tokens, capacity), lambda: real.clamp(max=capacity))
            return StepView(capacity, slot, self.constant(0), hi, rows=self._rows())
        padding = self._padding

        def write_slot() -> Tensor:  # a padding token goes to the next real one's slot, which no query reads now
            new_real = (padding.new_positions()[:, 0] < padding.span).long()
            return ring_slot_of(self._per_row(padding.real_counts(tokens) - new_real), sink, window)

        slot = self._entry(("ring write slot", sink, window), write_slot)
        positions = self.ring_positions(store, tokens)
        visible, empty = self._entry(("ring visible", sink, window, capacity, tokens),
                                     lambda: _visible(positions, padding.table_positions().q))
        return StepView(capacity, slot, visible=visible, empty=empty, rows=self._rows())

    def _rows(self) -> Tensor:
        return self._entry("rows", lambda: torch.arange(self._padding.batch, device=self._padding.device))

    # ----- chunks and prefill -----------------------------------------------------------------------------------

    def ring_positions(self, store: RingStore, tokens: int) -> Tensor:
        """Position held by each slot of ``store`` once ``tokens`` slots were written, int32 ``[B', capacity]``
        (``span``: empty)."""
        sink, window, capacity, padding = store.sink, store.window, store.capacity, self._padding
        return self._entry(("ring positions", sink, window, capacity, tokens), lambda: ring_slot_positions(
            padding.real_counts(tokens), sink, window, capacity, padding.span))


def _visible(kv_positions: Tensor, q_positions: Tensor) -> tuple[Tensor, Tensor]:
    """Which slots a one-token step's query may read: bool ``[B', S]`` (slot positions ``kv_positions`` int
    ``[B', S]`` at most the query's, ``q_positions`` ``[B', 1]``), and bool ``[B', 1]`` for queries that read none
    (padding: their row is 0; slot 0 stands in, so SDPA gives no NaN)."""
    allowed = kv_positions <= q_positions
    empty = ~allowed.any(-1, keepdim=True)
    first = torch.arange(allowed.shape[-1], device=allowed.device) == 0
    return allowed | (empty & first), empty
