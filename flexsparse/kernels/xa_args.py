"""The XAttention estimator's arguments, checked once for both implementations (torch and Triton)."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.validation import as_int


def check_estimate_args(q: Tensor, k: Tensor, stride: int, block_size: int, q_start: int | None,
                        kv_valid_len: Tensor | None) -> tuple[int, int, int]:
    """Validate the estimator's arguments; returns (stride, block_size, q_start) as ints."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
    stride = as_int("stride", stride, 1)
    block_size = as_int("block_size", block_size, 1)
    if block_size % stride:
        raise ValueError(f"stride ({stride}) must divide block_size ({block_size})")
    (batch, heads, q_len, dim), (k_batch, kv_heads, kv_len, k_dim) = q.shape, k.shape
    if batch != k_batch or dim != k_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k heads ({kv_heads})")
    if q_len == 0 or kv_len == 0:
        raise ValueError(f"q and k need at least one token, got q_len={q_len}, kv_len={kv_len}")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    q_start = max(kv_len - q_len, 0) if q_start is None else as_int("q_start", q_start, 0)
    if q_start + q_len > kv_len:
        raise ValueError(f"queries at positions {q_start}..{q_start + q_len - 1} need keys up to there; "
                         f"kv_len is {kv_len} (q_len must not exceed kv_len)")
    if kv_valid_len is not None:
        if not isinstance(kv_valid_len, Tensor) or kv_valid_len.dtype.is_floating_point or kv_valid_len.dtype == torch.bool:
            raise TypeError(f"kv_valid_len must be an integer tensor [B], got {kv_valid_len!r:.80}")
        if tuple(kv_valid_len.shape) != (batch,):
            raise ValueError(f"kv_valid_len must have shape [{batch}], got {tuple(kv_valid_len.shape)}")
        if kv_valid_len.device != q.device:
            raise ValueError(f"kv_valid_len is on {kv_valid_len.device} but q is on {q.device}")
    return stride, block_size, q_start
