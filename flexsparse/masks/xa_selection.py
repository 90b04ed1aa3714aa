"""XAttention's block selection: from estimated block masses to the kept (query block, key block) pairs.

Every query block keeps the sink (key block 0) and its *diagonal band* (the key blocks that hold its own
positions: one when positions are block-aligned, two when a bottom-right offset makes the block straddle two key
blocks), then further causal key blocks, heaviest estimated mass first, until the kept mass reaches ``threshold``
of the row's estimated mass:

``rule="minimal"``   the sink and the band count first; then the fewest further blocks that reach the threshold;
``rule="plus_one"``  (default) the band counts first; every other causal block, the sink included, is ranked by
                     mass; the fewest ranked blocks that reach the threshold, *plus the next one* (never a block of
                     zero estimated mass); the sink is kept in any case. One block of margin for the error of the
                     estimate; a superset of ``"minimal"`` (at most two blocks more per row).

The reference's rule (mit-han-lab/x-attention, ``find_blocks_chunked``), in our words: rows are processed in
chunks of query blocks (16K tokens at most, 2K from 128K tokens on, by its default chunk size). In a row it marks
the sink and the diagonal as forced, sorts the remaining blocks by mass, and builds a running sum that starts
with the forced mass; a sorted block is kept while the sum *before* it is below ``threshold * row mass``. That is
``"minimal"``. But in the first chunk (the rows whose diagonal lies in key blocks ``0 .. chunk``, i.e. every row
when the sequence fits one chunk), writing the diagonal overwrites the sink column, so only the diagonal is
forced while the running sum still skips two sorted places: the heaviest non-diagonal block is kept
unconditionally and every later block is judged by the sum before its predecessor; the sink comes back through
its index trick (dropped places select column 0). That is exactly ``"plus_one"``. Its extra block is what makes
the reference's kept *true* attention mass exceed the minimal set's, so which rows get it depends on the chunk
size and the sequence length. ``"plus_one"`` gives every row that margin at every length: it equals the
reference where the prompt fits one chunk (<= 16K tokens) and keeps a superset of it beyond, at a density within
0.01 of the reference's (docs/notes/xa.md has the measurements).

``threshold >= 1`` keeps every causal block. Query blocks whose positions are all padding (at or past
``kv_valid_len``) keep the sink block only, so no row of the table is empty. Two implementations:
:func:`select_blocks_torch` (sort, cumulative sum; the reference) and the Triton kernel of
:mod:`flexsparse.kernels.xa_estimate_triton` (bisection on the mass cut-off, no sort), dispatched by
:func:`select_blocks`. They agree except where two blocks of equal mass straddle the cut-off (the kernel keeps
both).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernels_preferred_on
from flexsparse.kernels.xa_args import check_estimate_args
from flexsparse.kernels.xa_estimate import Backend, antidiagonal_block_mass
from flexsparse.validation import as_int

Rule = Literal["plus_one", "minimal"]
RULES = ("plus_one", "minimal")
_MASS_CHUNK_BYTES = 256 << 20  # estimate_and_select: float32 masses held at once


def block_rows(q_blocks: int, kv_blocks: int, device: torch.device, q_len: int | None = None,
               kv_len: int | None = None, block_size: int | None = None, q_start: int | None = None,
               kv_valid_len: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per (batch, query block): (first diagonal key block, last causal key block, has a valid query), ``[B', QB]``.

    Without token sizes (``block_size`` None) the table is block-aligned and bottom-right: query block i's
    diagonal is key block ``i + kv_blocks - q_blocks``. ``B'`` is 1 without ``kv_valid_len``.
    """
    if block_size is None:
        if kv_valid_len is not None or q_len is not None or kv_len is not None or q_start is not None:
            raise ValueError("q_len, kv_len, q_start and kv_valid_len are in tokens: pass block_size with them")
        block_size, q_len, kv_len, q_start = 1, q_blocks, kv_blocks, kv_blocks - q_blocks
    else:
        block_size = as_int("block_size", block_size, 1)
        if q_len is None or kv_len is None:
            raise ValueError("with block_size, pass q_len and kv_len (tokens) too")
        q_len, kv_len = as_int("q_len", q_len, 1), as_int("kv_len", kv_len, 1)
        q_start = max(kv_len - q_len, 0) if q_start is None else as_int("q_start", q_start, 0)
        if q_start + q_len > kv_len:
            raise ValueError(f"queries end at position {q_start + q_len}, past kv_len {kv_len}")
    if (-(-q_len // block_size), -(-kv_len // block_size)) != (q_blocks, kv_blocks):
        raise ValueError(f"mass has {q_blocks} x {kv_blocks} blocks; q_len {q_len} and kv_len {kv_len} at block "
                         f"{block_size} need {-(-q_len // block_size)} x {-(-kv_len // block_size)}")
    first = q_start + torch.arange(q_blocks, device=device) * block_size
    last = torch.clamp(first + block_size, max=q_start + q_len) - 1
    if kv_valid_len is None:
        valid = torch.full((1, 1), kv_len, device=device)
    else:
        valid = kv_valid_len.to(device).clamp(0, kv_len)[:, None]
    row_ok = first[None, :] < valid
    last = torch.minimum(last[None, :], valid - 1)
    return (first // block_size)[None, :].expand_as(row_ok), torch.where(row_ok, last // block_size, 0), row_ok


def _check_mass_threshold(mass: Tensor, threshold: Tensor | float, rule: str) -> Tensor:
    if not isinstance(mass, Tensor) or mass.dim() != 4 or not mass.dtype.is_floating_point:
        raise TypeError(f"mass must be a float tensor [B, H, QB, KB], got {getattr(mass, 'shape', mass)!r:.80}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):  # a fill, not a host-to-device copy
        threshold = torch.full((1,), float(threshold), device=mass.device)
    threshold = torch.as_tensor(threshold, dtype=torch.float32, device=mass.device).flatten()
    if threshold.numel() not in (1, mass.shape[1]):
        raise ValueError(f"threshold has {threshold.numel()} values; mass has {mass.shape[1]} heads")
    return threshold.expand(mass.shape[1])


def select_blocks_torch(mass: Tensor, threshold: Tensor | float, *, rule: Rule = "plus_one",
                        q_len: int | None = None, kv_len: int | None = None, block_size: int | None = None,
                        q_start: int | None = None, kv_valid_len: Tensor | None = None) -> Tensor:
    """The PyTorch selection (sort and cumulative sum): bool ``[B, H, QB, KB]``; see :func:`select_blocks`."""
    threshold = _check_mass_threshold(mass, threshold, rule)
    batch, heads, q_blocks, kv_blocks = mass.shape
    diag_lo, diag_hi, row_ok = block_rows(q_blocks, kv_blocks, mass.device, q_len, kv_len, block_size, q_start,
                                          kv_valid_len)
    kb = torch.arange(kv_blocks, device=mass.device)
    diag_lo, diag_hi, row_ok = diag_lo[:, None, :, None], diag_hi[:, None, :, None], row_ok[:, None, :, None]
    causal = (kb <= diag_hi) & row_ok
    sink = causal & (kb == 0)
    credited = causal & (kb >= diag_lo)  # the diagonal band: kept, and its mass counted first
    if rule == "minimal":
        credited = credited | sink
    mass = mass.float().masked_fill(~causal, 0.0)
    required = mass.sum(-1, keepdim=True) * threshold.view(1, -1, 1, 1)
    rest = required - (mass * credited).sum(-1, keepdim=True)
    ranked = causal & ~credited
    ordered, order = torch.sort(torch.where(ranked, mass, -1.0), dim=-1, descending=True, stable=True)
    before = ordered.clamp(min=0).cumsum(-1) - ordered.clamp(min=0)  # ranked mass kept before each block
    keep_sorted = (before < rest) & (ordered >= 0)
    if rule == "plus_one":
        n_min = keep_sorted.sum(-1, keepdim=True)
        place = torch.arange(kv_blocks, device=mass.device)
        keep_sorted |= (place == n_min) & (ordered > 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    everything = (threshold >= 1).view(1, -1, 1, 1)
    keep = (keep | credited | sink | everything) & causal
    return keep | ((kb == 0) & ~row_ok)  # padding query blocks: the sink only


def select_blocks(mass: Tensor, threshold: Tensor | float, *, rule: Rule = "plus_one", q_len: int | None = None,
                  kv_len: int | None = None, block_size: int | None = None, q_start: int | None = None,
                  kv_valid_len: Tensor | None = None, backend: Backend = "auto") -> Tensor:
    """Kept blocks, bool ``[B, H, QB, KB]``, from estimated masses ``[B, H, QB, KB]`` (the rules: module docstring).

    ``threshold``: a float or one per head (``[H]``, a tensor on any device; values >= 1 keep every causal
    block). Geometry: ``q_len``, ``kv_len`` (tokens), ``block_size``, ``q_start`` (absolute position of query 0,
    default ``kv_len - q_len``) and ``kv_valid_len`` (int ``[B]``) as for the estimator; without them the table
    is block-aligned, bottom-right. ``backend``: ``"torch"`` (:func:`select_blocks_torch`), ``"triton"`` (the
    bisection kernel), ``"auto"`` (triton on CUDA when installed).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and kernels_preferred_on(mass.device))
    if not use_triton:
        return select_blocks_torch(mass, threshold, rule=rule, q_len=q_len, kv_len=kv_len, block_size=block_size,
                                   q_start=q_start, kv_valid_len=kv_valid_len)
    from flexsparse.kernels.xa_estimate_triton import select_blocks_triton

    threshold = _check_mass_threshold(mass, threshold, rule)
    diag_lo, diag_hi, row_ok = block_rows(mass.shape[2], mass.shape[3], mass.device, q_len, kv_len, block_size,
                                          q_start, kv_valid_len)
    return select_blocks_triton(mass, threshold, diag_lo, diag_hi, row_ok, plus_one=rule == "plus_one")


def estimate_and_select(q: Tensor, k: Tensor, threshold: Tensor | float, stride: int, block_size: int, *,
                        rule: Rule = "plus_one", q_start: int | None = None, kv_valid_len: Tensor | None = None,
                        backend: Backend = "auto", compiled: bool = False) -> Tensor:
    """XAttention's block table for q/k: bool ``[B, H_q, QB, KB]``, estimated and selected chunk by chunk.

    Same as ``select_blocks(antidiagonal_block_mass(q, k, ...), ...)`` but holds at most ~256 MiB of float32
    masses at a time (a 1M-token, 32-head table needs 8 GiB of masses but 2 GiB of booleans).
    """
    stride, block_size, q_start = check_estimate_args(q, k, stride, block_size, q_start, kv_valid_len)
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    q_blocks, kv_blocks = -(-q_len // block_size), -(-kv_len // block_size)
    rows = max(1, _MASS_CHUNK_BYTES // (batch * heads * kv_blocks * 4))
    if rows >= q_blocks:
        mass = antidiagonal_block_mass(q, k, stride, block_size, compiled, q_start=q_start,
                                       kv_valid_len=kv_valid_len, backend=backend)
        return select_blocks(mass, threshold, rule=rule, q_len=q_len, kv_len=kv_len, block_size=block_size,
                             q_start=q_start, kv_valid_len=kv_valid_len, backend=backend)
    table = torch.empty(batch, heads, q_blocks, kv_blocks, dtype=torch.bool, device=q.device)
    for first in range(0, q_blocks, rows):
        last = min(first + rows, q_blocks)
        part = q[:, :, first * block_size: last * block_size]
        start = q_start + first * block_size
        mass = antidiagonal_block_mass(part, k, stride, block_size, compiled, q_start=start,
                                       kv_valid_len=kv_valid_len, backend=backend)
        table[:, :, first:last] = select_blocks(mass, threshold, rule=rule, q_len=part.shape[2], kv_len=kv_len,
                                                block_size=block_size, q_start=start, kv_valid_len=kv_valid_len,
                                                backend=backend)
    return table
