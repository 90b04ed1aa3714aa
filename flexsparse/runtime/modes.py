"""A layer's modes: which of its patterns each KV head runs, given as names, indices or an int tensor.

Modes the host knows (default modes, one name or index, a list of them) are planned per head; a tensor of modes
(a router's decision, ``[H_kv]`` or ``[B, H_kv]`` on q's device) is never read on the host.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from flexsparse.masks.base import Pattern
from flexsparse.validation import as_int

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


class ModeTable:
    """Modes of a layer of ``num_kv_heads`` KV heads (GQA groups of ``group_size`` query heads) over ``names``."""

    def __init__(self, names: Sequence[str], num_kv_heads: int, group_size: int) -> None:
        self.names, self.num_kv_heads, self.group_size = list(names), num_kv_heads, group_size
        self._head_modes: dict[tuple, Tensor] = {}  # (device, host modes) -> per query head modes

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
        indices = []
        for m in modes:
            if isinstance(m, str):
                indices.append(self.index(m))
            else:
                try:
                    indices.append(as_int("modes entry", m, minimum=0, maximum=len(self.names) - 1))
                except (TypeError, ValueError):
                    raise ValueError(f"modes entries must be pattern names or indices < {len(self.names)}, "
                                     f"got {m!r}") from None
        return tuple(indices)

    def index(self, mode: str | int) -> int:
        """One mode by pattern name or index."""
        if isinstance(mode, str):
            if mode not in self.names:
                raise ValueError(f"modes names unknown pattern {mode!r}; known: {self.names}")
            return self.names.index(mode)
        return as_int("modes", mode, minimum=0, maximum=len(self.names) - 1)

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

    def head_modes(self, q: Tensor, modes: CallModes,
                   default: tuple[int, ...]) -> tuple[Tensor, tuple[int, ...] | None]:
        """Per query-head modes ``[B or 1, H]`` on q's device, and the per-KV-head modes if the host knows them
        (``default`` for None, one name or index, or a list of them: planned alike; a tensor is not read on the
        host)."""
        if not isinstance(modes, Tensor):
            if modes is None:
                host = default
            elif isinstance(modes, (str, numbers.Integral)):
                host = (self.index(modes),) * self.num_kv_heads
            else:
                host = self.host(modes)
            cached = self._head_modes.get((q.device, host))
            if cached is None:
                cached = torch.tensor(host, device=q.device)[None].repeat_interleave(self.group_size, dim=1)
                self._head_modes[(q.device, host)] = cached
            return cached, host
        kv_modes = self.check_tensor(modes, q.shape[0])
        if kv_modes.device != q.device:
            raise ValueError(f"modes is on {kv_modes.device} but q is on {q.device}")
        if kv_modes.dim() == 1:
            kv_modes = kv_modes[None]
        return kv_modes.long().repeat_interleave(self.group_size, dim=1), None
