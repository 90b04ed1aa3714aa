"""The padding of one model forward, as flexsparse's attention function and sparse KV cache read it.

transformers builds a model's attention mask once per forward through its mask-function registry and passes the
result to every layer. flexsparse's mask function returns a :class:`ForwardMask` instead of a 4-D tensor: the 2-D
padding mask itself, from which every layer derives token positions. What is derived from it is kept in its
``state`` (a :class:`~flexsparse.masks.forward_state.ForwardState`, which the positions it builds share), so all layers
of one forward share the position tables, the block masks built on them and a sparse KV cache's per-row tensors.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from flexsparse.masks import Positions
from flexsparse.masks.forward_state import ForwardState


class ForwardMask:
    """Padding of one forward: ``padding`` bool ``[B, kv_len]`` (True = real token) or None (no padding);
    the queries are tokens ``q_start .. q_start + q_len`` of the ``kv_len`` key slots: the last ones (the default)
    for a dynamic or sparse cache, earlier ones in a static cache, whose later slots are empty (padding).

    A token's position counts the real tokens before it, so every sequence of a padded batch sees the positions it
    has alone; padding tokens have no position. ``span`` is ``kv_len``: one past any real position.
    """

    def __init__(self, padding: Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device,
                 q_start: int | None = None) -> None:
        if padding is not None and tuple(padding.shape) != (batch, kv_len):
            raise ValueError(f"padding mask must be [B, kv_len] = [{batch}, {kv_len}], got {tuple(padding.shape)}")
        if not 0 < q_len <= kv_len:
            raise ValueError(f"q_len ({q_len}) must be in [1, kv_len={kv_len}]")
        self.q_start = kv_len - q_len if q_start is None else q_start
        if not 0 <= self.q_start <= kv_len - q_len:
            raise ValueError(f"queries start at {self.q_start}, past the {kv_len} key slots")
        if self.q_start + q_len < kv_len and padding is None:  # a static cache without a mask: slots fill in order
            padding = torch.arange(kv_len, device=device)[None].expand(batch, kv_len) < self.q_start + q_len
        self.padding = padding
        self.batch, self.q_len, self.kv_len = batch, q_len, kv_len
        self.device = torch.device(device)
        self.state = ForwardState()

    @property
    def span(self) -> int:
        return self.kv_len

    def has_padding(self) -> bool:
        """Whether any token is padding (one host sync, once per forward; called in prefill only)."""
        return self.padding_layout() != "none"

    def padding_layout(self) -> str:
        """``"none"`` (no padding token), ``"left"`` (every row: padding, then only real tokens, as a left-padded
        prompt) or ``"other"``; one host sync, once per forward."""
        return self.state.padding_layout(self._padding_layout)

    def _padding_layout(self) -> str:
        if self.padding is None:
            return "none"
        real = self.padding
        no_padding, left = torch.stack([real.all(), (real[:, 1:] >= real[:, :-1]).all()]).tolist()
        return "none" if no_padding else "left" if left else "other"

    def new_tokens_padded(self) -> bool:
        """Whether any query token (a new one) is padding: one host sync per forward, shared by its layers."""
        def build() -> bool:
            rows = self.padding[:, self.q_start:self.q_start + self.q_len] if self.padding is not None else None
            return rows is not None and not bool(rows.all())
        return self.state.new_tokens_padded(build)

    def positions(self) -> Positions | None:
        """Positions of the queries and of every token as a key slot; None for a prefill without padding (the
        contiguous layout, which runs SDPA's causal kernel and flex without position tables). They share the
        mask's state."""
        return self.state.positions(self._positions)

    def _positions(self) -> Positions | None:
        if self.q_len == self.kv_len and not self.has_padding():
            return None
        if self.padding is None:
            found = Positions.contiguous(self.q_len, self.kv_len, self.device)
        elif self.q_start + self.q_len == self.kv_len:
            found = Positions.from_padding_mask(self.padding, self.q_len)
        else:
            counted = self.padding.cumsum(-1, dtype=torch.int32) - 1
            rows = slice(self.q_start, self.q_start + self.q_len)
            kv = torch.where(self.padding, counted, self.kv_len).to(torch.int32)
            q = torch.where(self.padding[:, rows], counted[:, rows], -1).to(torch.int32)
            found = Positions(q, kv, self.kv_len)
        return dataclasses.replace(found, state=self.state)

    def table_positions(self) -> Positions:
        """:meth:`positions` as tables, also for a prefill without padding (a cache's views need tables)."""
        return self.positions() or self.state.contiguous_tables(lambda: dataclasses.replace(
            Positions.contiguous(self.q_len, self.kv_len, self.device), state=self.state))

    def positions_in(self, capacity: int) -> Positions:
        """Positions with the key slots extended to ``capacity`` empty slots (a cache buffer's length)."""
        return self.state.capacity_positions(capacity, lambda: self.table_positions().padded(self.q_len, capacity))

    def real_counts(self, tokens: int) -> Tensor:
        """Real tokens among the first ``tokens``, int64 ``[B']`` (B' = 1 without padding)."""
        if self.padding is None:
            return self.state.real_counts(tokens, lambda: torch.full((1,), tokens, dtype=torch.long,
                                                                     device=self.device))
        return self.state.real_counts(tokens, lambda: self.padding[:, :tokens].sum(-1))

    def new_positions(self) -> Tensor:
        """Positions of the query tokens (the new ones), int64 ``[B', q_len]``, ``span`` for padding."""
        return self.table_positions().kv[:, self.q_start:self.q_start + self.q_len].long()
