"""One attention call as the executors see it: inputs, geometry (sizes and positions) and a head selection."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.heads import query_heads
from flexsparse.masks.geometry import Geometry


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """q ``[B, H, Q, d]``, k/v ``[B, H_kv, KV, d]`` (SDPA layout) and where their rows sit (``geometry``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    geometry: Geometry
    needs_grad: bool
    kv_heads: tuple[int, ...]
    """The layer's KV heads that k/v hold (all of them, or the subset a cache group passes)."""

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.q.shape[1] // self.k.shape[1]

    def subset_query_heads(self) -> Tensor | None:
        """The layer's query heads q holds (int64 on q's device) when it holds only some of them, else None:
        what a content-dependent pattern is resolved for."""
        if self.q.shape[1] == self.geometry.num_heads:
            return None
        return _query_head_index(self.kv_heads, self.group_size, self.q.device)


@functools.lru_cache(maxsize=256)
def _query_head_index(kv_heads: tuple[int, ...], group_size: int, device: torch.device) -> Tensor:
    """The query heads of ``kv_heads`` as an int64 tensor on ``device``, copied there once."""
    return torch.tensor(query_heads(kv_heads, group_size), dtype=torch.long, device=device)


@dataclass(frozen=True, eq=False)
class HeadSelection:
    """Some KV heads of a call and their query heads, as slices where contiguous (views, no copy)."""

    kv_heads: tuple[int, ...]
    """Indices into the call's KV heads."""
    q_index: slice | Tensor
    kv_index: slice | Tensor
    q_heads: Tensor
    """The layer's query-head ids (int64 ``[H_sel]``): what a per-head pattern's mask_mod calls ``h``."""
    is_all: bool
    """Every head of the layer, in order."""

    @classmethod
    def of(cls, kv_heads: tuple[int, ...], call: AttentionCall, num_kv_heads: int) -> HeadSelection:
        """Heads ``kv_heads`` (indices into the call's KV heads) of a call, in a layer of ``num_kv_heads``."""
        group, device = call.group_size, call.q.device
        local_q = query_heads(kv_heads, group)
        layer_q = query_heads([call.kv_heads[h] for h in kv_heads], group)
        return cls(kv_heads, _index(local_q, device), _index(list(kv_heads), device),
                   torch.tensor(layer_q, dtype=torch.long, device=device),
                   tuple(call.kv_heads[h] for h in kv_heads) == tuple(range(num_kv_heads)))

    def pick(self, call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of the selected heads (views when the heads are contiguous)."""
        return call.q[:, self.q_index], call.k[:, self.kv_index], call.v[:, self.kv_index]


def _index(heads: list[int], device: torch.device) -> slice | Tensor:
    if heads == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, dtype=torch.long, device=device)


@dataclass(frozen=True, eq=False)
class GroupModes:
    """Which pattern each selected head runs: ``q_modes`` int ``[B or 1, H_sel]`` (query heads, on the device),
    and ``host``, the modes of the selected KV heads when the host knows them (default modes), else None."""

    q_modes: Tensor
    host: tuple[int, ...] | None

    @property
    def uniform(self) -> int | None:
        """The one mode of every selected head, when the host knows it."""
        return self.host[0] if self.host is not None and len(set(self.host)) == 1 else None
