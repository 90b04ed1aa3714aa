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
* A row with no real token (nothing to pool) is refused with a ValueError: a router deciding on zeros would
  decide silently for no reason. Finding it is one host sync per :func:`boundary_positions` call with a mask, i.e.
  once per model forward (every layer shares the boundary), never per layer.
* The mask says which tokens to pool, so it may be narrower than the attention's padding mask: in training on
  prompt + answer sequences, pass the prompt tokens only (the authors' code pools the context-and-question
  segment through per-sample ``range_ids``), so that the router sees in training what it sees at prefill.

Two steps: :func:`boundary_positions` finds the ``2P`` slots and their weights from the mask alone (a
:class:`Boundary`, the same for every layer of a forward: compute it once and pass it to each router), and
:func:`gather_pool` reads the states there. :func:`boundary_pool` is both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.validation import as_int

DEFAULT_POOL_SIZE = 100
"""P: tokens pooled at each end of a sequence (both papers use 100)."""


def _check_states(states: Tensor) -> None:
    if not isinstance(states, Tensor):
        raise TypeError(f"states must be a tensor [B, S, H, d], got {type(states).__name__}")
    if states.dim() != 4:
        raise ValueError(f"states must be 4-D [B, S, H, d], got shape {tuple(states.shape)}")
    if not states.dtype.is_floating_point:
        raise TypeError(f"states must be floating point, got {states.dtype}")
    if states.shape[0] == 0:
        raise ValueError("states have batch 0: B must be >= 1")
    if states.shape[1] == 0:
        raise ValueError("states must hold at least one token (S >= 1)")


@dataclass(frozen=True)
class Boundary:
    """The tokens boundary pooling reads, from the mask alone: the same for every layer of a forward.

    ``positions``: int64 ``[B, 2P]``, token slots in ``[0, seq)``: ranks ``0 .. P-1`` then ``n-P .. n-1`` among the
    ``n`` real tokens of each row (slots whose rank falls outside ``[0, n)`` hold a clamped, unused slot).
    ``weights``: float32 ``[B, 2P]``, ``1 / min(n, 2P)`` for each pooled token (each real token once), 0 for the
    unused slots. ``seq``: the S the positions index.
    """

    positions: Tensor
    weights: Tensor
    seq: int

    @property
    def pool_size(self) -> int:
        return self.positions.shape[1] // 2


def boundary_positions(key_padding_mask: Tensor | None, batch: int, seq: int, pool_size: int = DEFAULT_POOL_SIZE,
                       device: torch.device | str | None = None) -> Boundary:
    """Where :func:`boundary_pool` reads: the first and last ``pool_size`` real tokens of each row and their weights.

    Args:
        key_padding_mask: ``[batch, seq]``, True (or nonzero) = real token; None: every token is real.
        batch, seq: B and S of the states to pool (S >= 1).
        pool_size: P >= 1, tokens taken at each end.
        device: where the result lives (the mask's device; required without a mask).

    Returns:
        A :class:`Boundary` (``[B, 2P]`` positions and weights) on ``device``; with a mask, after one host sync
        that refuses (ValueError) rows without a real token.
    """
    batch = as_int("batch", batch, minimum=1)
    seq = as_int("seq", seq, minimum=1)
    pool = as_int("pool_size", pool_size, minimum=1)
    if device is None and key_padding_mask is None:
        raise ValueError("boundary_positions needs a device when key_padding_mask is None")
    device = torch.device(getattr(key_padding_mask, "device", "cpu") if device is None else device)
    step = torch.arange(pool, device=device)
    device = step.device  # "cuda" resolved to "cuda:0", so that it compares equal to the mask's device
    if key_padding_mask is None:
        count = torch.full((batch, 1), seq, device=device)
        ranks = torch.cat([step, seq - pool + step])[None].expand(batch, 2 * pool)
        positions = ranks
    else:
        real = _real_tokens(key_padding_mask, batch, seq, device)
        running = real.cumsum(1, dtype=torch.int32)  # [B, S]: real tokens up to and including each slot
        count = running[:, -1:].long()  # [B, 1]
        if not bool(count.min() > 0):  # the one host sync
            empty = (count[:, 0] == 0).nonzero().flatten().tolist()
            raise ValueError(f"key_padding_mask marks no token to pool in rows {empty} (every row needs a True)")
        ranks = torch.cat([step.expand(batch, pool), count - pool + step], dim=1)  # [B, 2P]
        # slot of the r-th real token (0-based): the first slot whose running count reaches r + 1
        positions = torch.searchsorted(running, (ranks + 1).clamp(min=1).to(torch.int32).contiguous())
    # each real token once: prefix ranks [0, min(P, n)), suffix ranks [max(P, n - P), n)
    valid = torch.cat([step.expand(batch, pool) < count, ranks[:, pool:] >= pool], dim=1)
    weights = valid.float() / count.clamp(max=2 * pool).float()  # [B, 2P]
    return Boundary(positions.clamp(0, seq - 1), weights, seq)


def gather_pool(states: Tensor, boundary: Boundary) -> Tensor:
    """The weighted sum of ``states`` at the ``boundary`` positions, per head: ``[B, S, H, d]`` -> ``[B, H, d]``
    in ``states``' dtype (accumulated in float32). Reads ``2P`` tokens per sequence."""
    _check_states(states)
    check_boundary(boundary, states.shape[0], states.shape[1], states.device)
    rows = torch.arange(states.shape[0], device=states.device)[:, None]
    picked = states[rows, boundary.positions].float()  # [B, 2P, H, d]
    picked = torch.where((boundary.weights != 0)[:, :, None, None], picked, 0.0)  # unused slots may hold padding
    pooled = torch.einsum("bphd,bp->bhd", picked, boundary.weights)
    return pooled.to(states.dtype)


def check_boundary(boundary: Boundary, batch: int, seq: int, device: torch.device,
                   pool_size: int | None = None) -> None:
    """``boundary`` must be a :class:`Boundary` for ``batch`` rows of ``seq`` tokens on ``device`` (and of
    ``pool_size`` when given)."""
    if not isinstance(boundary, Boundary):
        raise TypeError(f"boundary must be a Boundary (boundary_positions(...)), got {type(boundary).__name__}")
    positions, weights = boundary.positions, boundary.weights
    if positions.dim() != 2 or positions.shape[0] != batch or positions.shape[1] % 2 or positions.shape[1] == 0:
        raise ValueError(f"boundary.positions must be [B, 2P] with B = {batch}, got {tuple(positions.shape)}")
    if pool_size is not None and positions.shape[1] != 2 * pool_size:
        raise ValueError(f"boundary pools {positions.shape[1] // 2} tokens at each end, the router pools {pool_size}")
    if weights.shape != positions.shape or weights.dtype != torch.float32 or positions.dtype != torch.long:
        raise ValueError("boundary must hold int64 positions and float32 weights of one shape [B, 2P], got "
                         f"{positions.dtype} {tuple(positions.shape)} and {weights.dtype} {tuple(weights.shape)}")
    if boundary.seq != seq:
        raise ValueError(f"boundary was computed for {boundary.seq} tokens, the states hold {seq}")
    if positions.device != device or weights.device != device:
        raise ValueError(f"boundary is on {positions.device} but the states are on {device}")


def boundary_pool(states: Tensor, key_padding_mask: Tensor | None = None,
                  pool_size: int = DEFAULT_POOL_SIZE) -> Tensor:
    """Mean of the first and last ``pool_size`` real tokens of each sequence, per head.

    Args:
        states: ``[B, S, H, d]`` per-head states (e.g. key or query projections before RoPE).
        key_padding_mask: ``[B, S]``, True (or nonzero) = real token; None: every token is real.
        pool_size: P >= 1, tokens taken at each end.

    Returns:
        ``[B, H, d]`` in ``states``' dtype (accumulated in float32). Runs on the states' device without host sync
        when ``key_padding_mask`` is None (one, to refuse rows without a real token, with a mask).
        NaN/inf in the pooled tokens give NaN/inf results (routers refuse them: :meth:`Router.route`).
        The same as ``gather_pool(states, boundary_positions(key_padding_mask, B, S, pool_size, states.device))``.
    """
    _check_states(states)
    boundary = boundary_positions(key_padding_mask, states.shape[0], states.shape[1], pool_size, states.device)
    return gather_pool(states, boundary)


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
