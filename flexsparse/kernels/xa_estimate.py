"""XAttention's antidiagonal estimate of the attention mass per (query block, key block).

Scoring (mit-han-lab/x-attention's "inverse" mode): queries and keys are cut into groups of ``stride``
consecutive tokens. Group r of the queries and group j of the keys score the sum of one antidiagonal of their
``stride x stride`` tile of QK^T: query ``r*stride + stride-1-t`` with key ``j*stride + t``, t = 0..stride-1; the
score is scaled by ``1 / (sqrt(d) * stride)``. Each query group takes a softmax over the key groups it may see,
and the probabilities are summed per (query block, key block); a block holds ``block_size / stride`` groups. A
query block's row of masses therefore sums to its number of valid query groups (``block_size / stride`` when
full). Cost: ``2 B H_q S_q S_kv d / stride`` FLOPs, halved by causality when S_q = S_kv.

Positions and padding. Query row i sits at absolute position ``q_start + i`` (default ``S_kv - S_q``: the last
S_q positions, bottom-right aligned as in chunked prefill); key j at position j. Query blocks are counted from
query row 0, key blocks from key 0. A query group sees key group j when ``j * stride`` <= the position of the
group's first query (when ``q_start`` is a multiple of ``stride`` this is exactly causal at group level). With
``kv_valid_len`` (int ``[B]``), keys at index >= ``kv_valid_len[b]`` are padding: their contributions are zeroed
and their groups leave the softmax; query groups whose first position is >= the valid length get zero mass.
Partial groups (sizes not divisible by ``stride``) count their real tokens only. GQA: query head h reads key
head ``h // (H_q / H_kv)``, without copying K.

Two implementations compute the same numbers: :func:`block_mass_torch` (this module: PyTorch, chunked over query
rows, optionally ``torch.compile``'d; the reference) and the fused Triton kernel of
:mod:`flexsparse.kernels.xa_estimate_triton` (scores, softmax and block sums in one launch per chunk).
:func:`antidiagonal_block_mass` dispatches between them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flexsparse.kernels.availability import kernels_preferred_on
from flexsparse.kernels.xa_args import check_estimate_args

Backend = Literal["auto", "torch", "triton"]
_ROWS_PER_CHUNK = 1 << 14  # query tokens per chunk of the torch path (bounds the [chunk, S / stride] score slab)
_compiled_chunk = None


def _block_mass_chunk(rq: Tensor, rk: Tensor, group_start: Tensor, row_ok: Tensor,
                      valid_groups: Tensor, rows_per_block: int) -> Tensor:
    """Softmax mass per (query block, key block) for a chunk of c reshaped query rows.

    rq ``[B, Hkv, G, c, stride*d]`` (already scaled), rk ``[B, Hkv, n_keys, stride*d]`` holding only the key groups
    these rows may see; ``group_start`` int ``[c]``: the key group of each row's first query position (the last
    group it sees); ``row_ok`` bool ``[B, c]``; ``valid_groups`` int ``[B]``: key groups holding a valid key.
    Returns float32 ``[B, Hkv, G, c / rows_per_block, n_keys / rows_per_block]``.
    """
    scores = torch.einsum("bhgid,bhjd->bhgij", rq, rk).float()
    cols = torch.arange(rk.shape[2], device=rq.device)
    hidden = (cols[None, None, :] > group_start[None, :, None]) | (cols[None, None, :] >= valid_groups[:, None, None])
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~row_ok[:, None, None, :, None], 0.0)
    b, h, g, c, n = probs.shape
    return probs.view(b, h, g, c // rows_per_block, rows_per_block, n // rows_per_block, rows_per_block).sum((4, 6))


def _compiled_block_mass_chunk():
    """The chunk kernel compiled once per process; dynamic shapes, since causal chunks see growing key ranges."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_block_mass_chunk, dynamic=True)
    return _compiled_chunk


def block_mass_torch(q: Tensor, k: Tensor, stride: int, block_size: int, *, q_start: int | None = None,
                     kv_valid_len: Tensor | None = None, compiled: bool = False) -> Tensor:
    """The PyTorch estimator (reference of the Triton kernel): float32 ``[B, H_q, QB, KB]``.

    Same arguments as :func:`antidiagonal_block_mass`. Scores are computed in q's dtype (float32 inputs give
    float32 scores), softmax and sums in float32.
    """
    stride, block_size, q_start = check_estimate_args(q, k, stride, block_size, q_start, kv_valid_len)
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q_blocks, kv_blocks = -(-q_len // block_size), -(-kv_len // block_size)
    q = F.pad(q, (0, 0, 0, q_blocks * block_size - q_len))
    k = F.pad(k, (0, 0, 0, kv_blocks * block_size - kv_len))
    valid = torch.full((batch,), kv_len, device=q.device) if kv_valid_len is None else kv_valid_len.clamp(0, kv_len)
    positions = q_start + torch.arange(q.shape[2], device=q.device)
    if kv_valid_len is not None:  # padding keys and the queries past the valid length contribute nothing
        k = k.masked_fill((torch.arange(k.shape[2], device=q.device) >= valid[:, None])[:, None, :, None], 0)
        q = q.masked_fill((positions >= valid[:, None])[:, None, :, None], 0)
    n_rows, n_groups = q.shape[2] // stride, k.shape[2] // stride
    rk = k.reshape(batch, kv_heads, n_groups, stride * dim)
    rq = q.view(batch, heads, n_rows, stride, dim).flip(3).reshape(batch, kv_heads, heads // kv_heads, n_rows,
                                                                   stride * dim)
    rq = rq * (dim**-0.5 / stride)
    row_first = positions[::stride]  # position of each query group's first token
    group_start = row_first // stride
    row_ok = (torch.arange(n_rows, device=q.device)[None, :] * stride < q_len) & (row_first[None, :] < valid[:, None])
    valid_groups = -(-valid // stride)
    per_block = block_size // stride
    chunk = max(per_block, _ROWS_PER_CHUNK // stride // per_block * per_block)
    step = _compiled_block_mass_chunk() if compiled else _block_mass_chunk
    parts = []
    for first in range(0, n_rows, chunk):
        last = min(first + chunk, n_rows)
        seen = (q_start + (last - 1) * stride) // stride + 1  # key groups the chunk's last row sees
        seen = min(-(-seen // per_block) * per_block, n_groups)
        mass = step(rq[:, :, :, first:last], rk[:, :, :seen], group_start[first:last],
                    row_ok[:, first:last], valid_groups, per_block)
        parts.append(F.pad(mass, (0, kv_blocks - mass.shape[-1])))
    return torch.cat(parts, dim=3).reshape(batch, heads, q_blocks, kv_blocks)


def antidiagonal_block_mass(q: Tensor, k: Tensor, stride: int, block_size: int, compiled: bool = False, *,
                            q_start: int | None = None, kv_valid_len: Tensor | None = None,
                            backend: Backend = "auto") -> Tensor:
    """Estimated attention mass per block, float32 ``[B, H_q, QB, KB]`` (QB = ceil(S_q / block_size),
    KB = ceil(S_kv / block_size)); a query block's row sums to its number of valid query groups.

    q ``[B, H_q, S_q, d]``, k ``[B, H_kv, S_kv, d]`` with H_kv dividing H_q; ``q_start``: absolute position of
    query row 0 (default ``S_kv - S_q``); ``kv_valid_len`` int ``[B]`` or None: keys at index >= it are padding
    (values outside [0, S_kv] are clamped; never read on the host). ``backend``: ``"triton"`` (the fused kernel;
    CUDA, or CPU under TRITON_INTERPRET=1), ``"torch"`` (:func:`block_mass_torch`, ``compiled`` picks
    torch.compile), ``"auto"``: triton on CUDA when the kernel supports the shape
    (:func:`~flexsparse.kernels.xa_estimate_triton.triton_supports`), else torch.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend != "torch":
        check_estimate_args(q, k, stride, block_size, q_start, kv_valid_len)
        use_triton = backend == "triton"
        if backend == "auto" and kernels_preferred_on(q.device):  # else the compiled torch path
            from flexsparse.kernels.xa_estimate_triton import triton_supports

            use_triton = triton_supports(q, stride, block_size) is None
        if use_triton:
            from flexsparse.kernels.xa_estimate_triton import block_mass_triton

            return block_mass_triton(q, k, stride, block_size, q_start=q_start, kv_valid_len=kv_valid_len)
    return block_mass_torch(q, k, stride, block_size, q_start=q_start, kv_valid_len=kv_valid_len, compiled=compiled)
