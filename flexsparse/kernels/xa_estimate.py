"""XAttention's antidiagonal estimate of the attention mass per (query block, key block).

Reference implementation in PyTorch (chunked over query rows, optionally torch.compile'd). Keys are grouped in runs
of ``stride`` tokens and the queries of each group taken in reverse, so a dot product of the reshaped rows sums one
antidiagonal of a ``stride x stride`` tile of QK^T (mit-han-lab/x-attention's "inverse" mode). Scores are scaled by
``1 / (sqrt(d) * stride)``, masked causally at the reshaped level, soft-maxed per reshaped query row and summed per
block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_ROWS_PER_CHUNK = 1 << 14  # query tokens estimated per chunk (bounds the [chunk, S / stride] score slab)
_compiled_chunk = None


def _block_mass_chunk(rq: Tensor, rk: Tensor, first_row: int, n_real: int, rows_per_block: int) -> Tensor:
    """Softmax mass per (query block, key block) for reshaped query rows starting at ``first_row``.

    rq ``[B, Hkv, G, c, stride*d]`` (already scaled), rk ``[B, Hkv, n_keys, stride*d]`` holding only the keys
    these rows may see. Returns float32 ``[B, Hkv, G, c / rows_per_block, n_keys / rows_per_block]``.
    """
    scores = torch.einsum("bhgid,bhjd->bhgij", rq, rk).float()
    rows = first_row + torch.arange(rq.shape[3], device=rq.device)[:, None]
    cols = torch.arange(rk.shape[2], device=rq.device)[None, :]
    scores = scores.masked_fill((cols > rows) | (cols >= n_real), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(rows >= n_real, 0.0)
    b, h, g, c, n = probs.shape
    return probs.view(b, h, g, c // rows_per_block, rows_per_block, n // rows_per_block, rows_per_block).sum((4, 6))


def _compiled_block_mass_chunk():
    """The chunk kernel compiled once per process; dynamic shapes, since causal chunks see growing key ranges."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_block_mass_chunk, dynamic=True)
    return _compiled_chunk


def antidiagonal_block_mass(q: Tensor, k: Tensor, stride: int, block_size: int, compiled: bool = False) -> Tensor:
    """Estimated attention mass per block, float32 ``[B, H_q, QB, KB]``; each row sums to block_size / stride.

    q ``[B, H_q, S, d]``, k ``[B, H_kv, S, d]``. Cost: ``2 B H_q S^2 d / (2 stride)`` FLOPs (causal half).
    """
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    padded = -(-seq // block_size) * block_size
    q, k = F.pad(q, (0, 0, 0, padded - seq)), F.pad(k, (0, 0, 0, padded - seq))
    n, n_real = padded // stride, -(-seq // stride)
    rk = k.reshape(batch, kv_heads, n, stride * dim)
    rq = q.view(batch, heads, n, stride, dim).flip(3).reshape(batch, kv_heads, heads // kv_heads, n, stride * dim)
    rq = rq * (dim**-0.5 / stride)
    rows_per_block = block_size // stride
    chunk = max(rows_per_block, _ROWS_PER_CHUNK // stride // rows_per_block * rows_per_block)
    step = _compiled_block_mass_chunk() if compiled else _block_mass_chunk
    parts = []
    for first in range(0, n, chunk):
        last = min(first + chunk, n)  # causal: these rows see reshaped keys < last only
        mass = step(rq[:, :, :, first:last], rk[:, :, :last], first, n_real, rows_per_block)
        parts.append(F.pad(mass, (0, n // rows_per_block - mass.shape[-1])))
    return torch.cat(parts, dim=3).reshape(batch, heads, padded // block_size, padded // block_size)
