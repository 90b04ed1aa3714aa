"""A layer's modes: which of its patterns each KV head runs, given as names, indices or an int tensor.

Modes the host knows (default modes, one name or index, a list of them) are planned per head; a tensor of modes
(a router's decision, ``[H_kv]`` or ``[B, H_kv]`` on q's device) is never read on the host.

The names used across flexsparse (one meaning each):

- ``modes``: the pattern index of each KV head, ``[H_kv]`` or ``[B, H_kv]`` (the public ``modes`` arguments,
  ``HybridAttention.default_modes``, ``Routing.modes()``);
- ``host_modes``: the same as a tuple the host knows (None when the modes are a device tensor);
- ``q_modes``: the modes expanded to each query head, int ``[B or 1, H]`` on the device (what the executors and
  the composed masks read; :func:`flexsparse.heads.per_query_head`);
- ``full_mode`` / ``sparse_mode``: one pattern index (a router's two choices);
- ``PerHead.modes``: the pattern combinator's own per-head indices, over the heads of its geometry.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from flexsparse.heads import per_query_head
from flexsparse.masks.base import Pattern

CallModes = Tensor | int | str | Sequence[str | int] | None
"""Per-call modes: None (the defaults), an int tensor ``[H_kv]`` / ``[B, H_kv]``, one name or index for every head,
or a list of names or indices, one per KV head."""


def as_pattern_dict(patterns: Mapping[str, Pattern] | Pattern) -> OrderedDict[str, Pattern]:
    """A Pattern (named "default") or a non-empty mapping name -> Pattern, as an ordered dict."""
    if isinstance(patterns, Pattern):
        return OrderedDict(default=patterns)
    if not isinstance(patterns, Mapping) or not patterns:
        raise TypeError("patterns must be a Pattern or a non-empty mapping of name -> Pattern")
    for name, p in patterns.items():
        if not isinstance(name, str) or not isinstance(p, Pattern):
            raise TypeError(f"patterns must map str -> Pattern, got {name!r} -> {type(p).__name__}")
    return OrderedDict(patterns)


def mode_index(names: Sequence[str], mode: object, where: str = "modes") -> int:
    """One mode, a pattern name or an index into ``names``, as the index; a ValueError naming ``where`` (e.g.
    ``"modes for layer 0, KV head 1"``) for an unknown name or anything else."""
    if isinstance(mode, str):
        if mode not in names:
            raise ValueError(f"{where} names unknown pattern {mode!r}; known: {list(names)}")
        return list(names).index(mode)
    if isinstance(mode, bool) or not isinstance(mode, numbers.Integral) or not 0 <= mode < len(names):
        raise ValueError(f"{where} must be a pattern name or an index < {len(names)}, got {mode!r}")
    return int(mode)


class ModeTable:
    """Modes of a layer of ``num_kv_heads`` KV heads (GQA groups of ``group_size`` query heads) over ``names``."""

    def __init__(self, names: Sequence[str], num_kv_heads: int, group_size: int) -> None:
        self.names, self.num_kv_heads, self.group_size = list(names), num_kv_heads, group_size
        self._q_modes: dict[tuple, Tensor] = {}  # (device, host modes) -> q_modes

    def default_tensor(self, modes: Sequence[str | int] | Tensor | None) -> Tensor:
        """Default modes as an int64 CPU tensor ``[H_kv]`` (all the first pattern if None)."""
        if modes is None:
            return torch.zeros(self.num_kv_heads, dtype=torch.long)
        if isinstance(modes, Tensor):
            if modes.dim() != 1:
                raise ValueError(f"default modes must be one per KV head, shape [{self.num_kv_heads}], got "
                                 f"{tuple(modes.shape)}; per-input [B, H_kv] modes go to forward(modes=...)")
            return self.check_tensor(modes, batch=None).cpu().long()
        return torch.tensor(self.host(modes), dtype=torch.long)

    def host(self, modes: Sequence[str | int]) -> tuple[int, ...]:
        """A list or tuple of pattern names or indices, one per KV head, as indices."""
        if isinstance(modes, (str, bytes)) or not isinstance(modes, Sequence):
            raise TypeError(f"modes must be a sequence of pattern names/indices or a tensor, got {type(modes).__name__}")
        if len(modes) != self.num_kv_heads:
            raise ValueError(f"modes must have one entry per KV head ({self.num_kv_heads}), got {len(modes)}")
        return tuple(mode_index(self.names, m, f"modes for KV head {head}") for head, m in enumerate(modes))

    def check_tensor(self, modes: Tensor, batch: int | None) -> Tensor:
        if not isinstance(modes, Tensor):
            raise TypeError(f"modes must be a tensor, got {type(modes).__name__}")
        if modes.dtype.is_floating_point or modes.dtype.is_complex or modes.dtype == torch.bool:
            raise TypeError(f"modes must be an integer tensor (indices into patterns), got {modes.dtype}")
        if modes.dim() not in (1, 2) or modes.shape[-1] != self.num_kv_heads:
            raise ValueError(f"modes must have shape [{self.num_kv_heads}] or [B, {self.num_kv_heads}] "
                             f"(one per KV head), got {tuple(modes.shape)}")
        if modes.dim() == 2 and batch is not None and modes.shape[0] not in (1, batch):
            raise ValueError(f"modes has batch {modes.shape[0]}, inputs have batch {batch}")
        if modes.device.type == "cpu" and modes.numel() and (modes.min() < 0 or modes.max() >= len(self.names)):
            raise ValueError(f"modes must index the {len(self.names)} patterns, got {modes.unique().tolist()}")
        return modes

    def q_modes(self, q: Tensor, modes: CallModes,
                default: tuple[int, ...]) -> tuple[Tensor, tuple[int, ...] | None]:
        """Per query-head modes ``[B or 1, H]`` on q's device, and the per-KV-head modes if the host knows them
        (``default`` for None, one name or index, or a list of them: planned alike; a tensor is not read on the
        host)."""
        if not isinstance(modes, Tensor):
            if modes is None:
                host = default
            elif isinstance(modes, (str, numbers.Integral)):
                host = (mode_index(self.names, modes),) * self.num_kv_heads
            else:
                host = self.host(modes)
            cached = self._q_modes.get((q.device, host))
            if cached is None:
                cached = per_query_head(torch.tensor(host, device=q.device)[None], self.group_size, dim=1)
                self._q_modes[(q.device, host)] = cached
            return cached, host
        modes = self.check_tensor(modes, q.shape[0])
        if modes.device != q.device:
            raise ValueError(f"modes is on {modes.device} but q is on {q.device}")
        if modes.dim() == 1:
            modes = modes[None]
        return per_query_head(modes.long(), self.group_size, dim=1), None
