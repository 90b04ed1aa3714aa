"""A layer call's inputs checked, and described: which KV heads it runs, and its geometry (sizes and positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.heads import query_heads
from flexsparse.masks.geometry import Geometry, Positions
from flexsparse.validation import as_int


def kv_head_tuple(kv_heads: Sequence[int] | None, num_kv_heads: int) -> tuple[int, ...]:
    """The call's KV heads: all of them for None, else distinct ascending indices."""
    if kv_heads is None:
        return tuple(range(num_kv_heads))
    if isinstance(kv_heads, (str, bytes)) or not isinstance(kv_heads, Sequence) or not kv_heads:
        raise TypeError(f"kv_heads must be a non-empty sequence of KV head indices, got {kv_heads!r}")
    heads = tuple(as_int("kv_heads entry", h, minimum=0, maximum=num_kv_heads - 1) for h in kv_heads)
    if list(heads) != sorted(set(heads)):
        raise ValueError(f"kv_heads must be distinct and ascending, got {list(heads)}")
    return heads


class QueryHeadIndex:
    """The query heads of some KV heads: a slice when contiguous, else an index tensor made once per device
    (indexing with a Python list would copy it to the device, a host sync, on every call)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._tensors: dict[tuple, Tensor] = {}

    def __call__(self, kv_heads: tuple[int, ...], device: torch.device) -> slice | Tensor:
        rows = query_heads(kv_heads, self.group_size)
        if rows == list(range(rows[0], rows[-1] + 1)):
            return slice(rows[0], rows[-1] + 1)
        key = (kv_heads, device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(rows, device=device)
        return self._tensors[key]


def check_inputs(q: Tensor, k: Tensor, v: Tensor, kv_heads: tuple[int, ...], num_heads: int, num_kv_heads: int,
                 head_dim: int, check_finite: bool) -> None:
    """q ``[B, H_sel, S_q, d]`` and k/v ``[B, H_kv_sel, S_kv, d]`` of the selected heads, or a clear error."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
    subset = "" if len(kv_heads) == num_kv_heads else f" for kv_heads={list(kv_heads)}"
    q_heads = len(kv_heads) * (num_heads // num_kv_heads)
    if q.shape[1] != q_heads:
        raise ValueError(f"q has {q.shape[1]} heads, expected {q_heads}{subset} (num_heads={num_heads})")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1] != len(kv_heads):
            raise ValueError(f"{name} has {t.shape[1]} heads, expected {len(kv_heads)}{subset} "
                             f"(num_kv_heads={num_kv_heads})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch {t.shape[0]}, q has batch {q.shape[0]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] != head_dim:
            raise ValueError(f"{name} has head_dim {t.shape[-1]}, expected {head_dim}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v lengths differ: {k.shape[2]} vs {v.shape[2]}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"q_len ({q.shape[2]}) exceeds kv_len ({k.shape[2]}): queries are the last positions")
    if q.shape[2] == 0:
        raise ValueError("q has no queries (q_len 0)")
    if q.shape[0] == 0:
        raise ValueError("q, k and v have batch 0: B must be >= 1")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be floating point, got {q.dtype}")
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or inf (check_finite=True)")


def call_geometry(q: Tensor, k: Tensor, num_heads: int, block_size: int, key_padding_mask: Tensor | None,
                  positions: Positions | None) -> Geometry:
    """The geometry of a call: positions from a padding mask, given directly, or contiguous (as tensors when
    ``S_q != S_kv``, so that a new offset is not a recompile)."""
    batch, q_len, kv_len = q.shape[0], q.shape[2], k.shape[2]
    if key_padding_mask is not None and positions is not None:
        raise ValueError("give key_padding_mask or positions, not both")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"key_padding_mask must be a bool tensor [B, S_kv], got "
                            f"{type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (batch, kv_len):
            raise ValueError(f"key_padding_mask must have shape [B, S_kv] = [{batch}, {kv_len}], got "
                             f"{tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
        positions = Positions.from_padding_mask(key_padding_mask, q_len)
    elif positions is not None:
        if not isinstance(positions, Positions):
            raise TypeError(f"positions must be flexsparse.Positions, got {type(positions).__name__}")
        if positions.batch not in (1, batch):
            raise ValueError(f"positions have batch {positions.batch}, inputs have batch {batch}")
        if positions.device != q.device:
            raise ValueError(f"positions are on {positions.device} but q is on {q.device}")
    elif q_len != kv_len:  # decode or a chunk: positions as tensors, so a new offset is not a recompile
        positions = Positions.contiguous(q_len, kv_len, q.device)
    return Geometry(num_heads, q_len, kv_len, block_size, q.device, positions)
