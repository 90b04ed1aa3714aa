"""Boundary pooling: a sequence's task representation from its first and last real tokens (seed 000, App. C.1;
seed 003, App. D.1).

The mean of the first ``P`` and the last ``P`` *real* tokens of each sequence, per head. Choices (the papers leave
them open, the authors' code differs):

* One rule for training and inference. Elastic Attention's code pools the whole prompt segment in training and the
  boundary at inference; here both pool the boundary, so what the router learns is what it sees when deployed.
* A sequence with fewer than ``2P`` real tokens pools the mean of its real tokens, each counted once (the authors'
  code concatenates the two slices, so their overlap counts twice).
* Padding is read from a ``key_padding_mask`` (True = real token; left, right or any padding): the ``r``-th real
  token is found by a binary search on the mask's running count, so the states are read at ``2P`` positions per
  sequence whatever the length; the only pass over all ``S`` positions is the running count of the boolean mask.
* A row with no real token pools to zeros (a defined result, no host sync to raise an error).
* The mask says which tokens to pool, so it may be narrower than the attention's padding mask: in training on
  prompt + answer sequences, pass the prompt tokens only (the authors' code pools the context-and-question
  segment through per-sample ``range_ids``), so that the router sees in training what it sees at prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.validation import as_int

DEFAULT_POOL_SIZE = 100
"""P: tokens pooled at each end of a sequence (both papers use 100)."""


def boundary_pool(states: Tensor, key_padding_mask: Tensor | None = None,
                  pool_size: int = DEFAULT_POOL_SIZE) -> Tensor:
    """Mean of the first and last ``pool_size`` real tokens of each sequence, per head.

    Args:
        states: ``[B, S, H, d]`` per-head states (e.g. key or query projections before RoPE).
        key_padding_mask: ``[B, S]``, True (or nonzero) = real token; None: every token is real.
        pool_size: P >= 1, tokens taken at each end.

    Returns:
        ``[B, H, d]`` in ``states``' dtype (accumulated in float32). Runs on the states' device without host sync.
    """
    if not isinstance(states, Tensor):
        raise TypeError(f"states must be a tensor [B, S, H, d], got {type(states).__name__}")
    if states.dim() != 4:
        raise ValueError(f"states must be 4-D [B, S, H, d], got shape {tuple(states.shape)}")
    if not states.dtype.is_floating_point:
        raise TypeError(f"states must be floating point, got {states.dtype}")
    batch, seq, _, _ = states.shape
    if seq == 0:
        raise ValueError("states must hold at least one token (S >= 1)")
    pool = as_int("pool_size", pool_size, minimum=1)
    device = states.device
    step = torch.arange(pool, device=device)
    if key_padding_mask is None:
        count = torch.full((batch, 1), seq, device=device)
        ranks = torch.cat([step, seq - pool + step])[None].expand(batch, 2 * pool)
        positions = ranks
    else:
        real = _real_tokens(key_padding_mask, batch, seq, device)
        running = real.cumsum(1, dtype=torch.int32)  # [B, S]: real tokens up to and including each slot
        count = running[:, -1:].long()  # [B, 1]
        ranks = torch.cat([step.expand(batch, pool), count - pool + step], dim=1)  # [B, 2P]
        # slot of the r-th real token (0-based): the first slot whose running count reaches r + 1
        positions = torch.searchsorted(running, (ranks + 1).clamp(min=1).to(torch.int32).contiguous())
    # each real token once: prefix ranks [0, min(P, n)), suffix ranks [max(P, n - P), n)
    valid = torch.cat([step.expand(batch, pool) < count, ranks[:, pool:] >= pool], dim=1)
    weights = valid.float() / count.clamp(min=1, max=2 * pool).float()  # [B, 2P]
    rows = torch.arange(batch, device=device)[:, None]
    picked = states[rows, positions.clamp(0, seq - 1)].float()  # [B, 2P, H, d]: 2P tokens read per sequence
    picked = torch.where(valid[:, :, None, None], picked, 0.0)  # slots past the real tokens may hold padding
    pooled = torch.einsum("bphd,bp->bhd", picked, weights)
    return pooled.to(states.dtype)


def _real_tokens(key_padding_mask: Tensor, batch: int, seq: int, device: torch.device) -> Tensor:
    """The mask as bool ``[B, S]`` (transformers' 0/1 integer ``attention_mask`` is accepted), checked."""
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(f"key_padding_mask must be a bool tensor [B, S], got {type(key_padding_mask).__name__}")
    if tuple(key_padding_mask.shape) != (batch, seq):
        raise ValueError(f"key_padding_mask must have shape [B, S] = [{batch}, {seq}], got "
                         f"{tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but states are on {device}")
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask
    if key_padding_mask.dtype.is_floating_point or key_padding_mask.dtype.is_complex:
        raise TypeError(f"key_padding_mask must be bool (True = real token), got {key_padding_mask.dtype}")
    return key_padding_mask != 0
