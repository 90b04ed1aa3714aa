"""Fused Triton kernels for XAttention: the antidiagonal block-mass estimate and the block selection.

Estimate (:func:`block_mass_triton`; the same numbers as :func:`flexsparse.kernels.xa_estimate.block_mass_torch`,
whose docstring defines them). One program owns ``BLOCK_M`` reshaped query rows (groups of ``stride`` queries) of
one query head and walks the key groups it may see in tiles of ``BLOCK_N``, in one loop over (key tile,
antidiagonal position) so that loads stream across tile boundaries:

1. scores: ``stride`` tensor-core products of ``[BLOCK_M, d] x [d, BLOCK_N]``, query token ``stride-1-t`` of each
   group against key token ``t`` of each group (the antidiagonal), accumulated in float32. Tiles come through
   tensor descriptors (TMA) on views ``[B*H, groups, stride*d]`` of q and k (a box per antidiagonal position),
   or through masked pointer loads where that layout does not apply (padding, lengths not divisible by the
   stride, float32, odd head_dim). K is read from its KV head (GQA without copies);
2. an online softmax per row (running max and sum, in base 2), and the row's unnormalised probabilities summed
   per key block, written to a float32 scratch ``[rows, key blocks]`` with the running max of that tile;
3. after the last tile, the program reads its scratch back, rescales each tile's sums by
   ``exp2(max_then - max_final) / sum_final`` and adds the rows of each query block: the block masses.

Scores are computed once (a two-pass softmax would compute them twice); the scratch holds block sums, not scores
(``block_size / stride`` times fewer columns). Rows are processed in equal launches so the scratch stays under
``_SCRATCH_BYTES`` (1M tokens fit). Programs start with the rows that see the most keys. Its throughput and
share of SDPA's causal forward on an H100: docs/notes/xa.md.

Selection (:func:`select_blocks_triton`): one program per (batch, head, query block) holds the row's masses in
registers and finds the mass cut-off of the minimal set by bisection on the float bit patterns (31 masked sums,
no sort): the largest ``c`` such that the ranked blocks of mass >= c reach the required mass. ``plus_one`` then
adds the heaviest block below the cut. Rules and geometry: :mod:`flexsparse.masks.xa_selection`.

CPU: the kernels run under ``TRITON_INTERPRET=1`` (slow; for tests at small sizes).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.xa_args import check_estimate_args

_SCRATCH_BYTES = 2 << 30  # float32 block sums held per launch (rows x key blocks x heads)
_MAX_SELECT_BLOCKS = 16384  # key blocks a selection row holds in registers
DEFAULT_CONFIG = (128, 256, 8, 2, True)  # BLOCK_M, BLOCK_N (groups), warps, stages, tensor descriptors (H100 sweep)


def triton_supports(q: Tensor, stride: int, block_size: int) -> str | None:
    """None when the Triton estimator handles these inputs, else the reason it does not."""
    reason = kernel_unavailable(q.device)
    if reason is not None:
        return reason
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (float16, bfloat16 or float32 expected)"
    per_block = block_size // stride
    if per_block & (per_block - 1) or per_block > 128:
        return f"block_size / stride = {per_block} must be a power of two <= 128"
    if q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} > 256"
    return None


@triton.jit
def _antidiagonal_product(acc, jt, t, bh, b, h, q_row, first_q, row_ok, q_len, q_start, valid_len, q_base, k_base,
                          stride_qs, stride_ks, Q_DESC, K_DESC, HEADS: tl.constexpr, GROUP: tl.constexpr,
                          STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          USE_TMA: tl.constexpr):
    """acc += scores of query token ``stride-1-t`` of each row's group against key token ``t`` of each group."""
    if USE_TMA:  # [B*H, groups, stride*d] views: one box per antidiagonal position, zeros past the end
        q_tile = tl.reshape(Q_DESC.load([bh, q_row, (STRIDE - 1 - t) * HEAD_DIM]), [BLOCK_M, HEAD_DIM])
        k_tile = tl.reshape(K_DESC.load([b * (HEADS // GROUP) + h // GROUP, jt * BLOCK_N, t * HEAD_DIM]),
                            [BLOCK_N, HEAD_DIM])
        return tl.dot(q_tile, k_tile.T, acc, input_precision=PRECISION)
    dims = tl.arange(0, DIM_PAD)
    qi = first_q + (STRIDE - 1 - t)
    q_mask = (row_ok & (qi < q_len) & (q_start + qi < valid_len))[:, None]
    if DIM_PAD != HEAD_DIM:
        q_mask = q_mask & (dims[None, :] < HEAD_DIM)
    q_tile = tl.load(q_base + qi.to(tl.int64)[:, None] * stride_qs + dims[None, :], mask=q_mask, other=0.0)
    ki = (jt * BLOCK_N + tl.arange(0, BLOCK_N)) * STRIDE + t
    k_mask = (ki < valid_len)[None, :]
    if DIM_PAD != HEAD_DIM:
        k_mask = k_mask & (dims[:, None] < HEAD_DIM)
    k_tile = tl.load(k_base + ki.to(tl.int64)[None, :] * stride_ks + dims[:, None], mask=k_mask, other=0.0)
    return tl.dot(q_tile, k_tile, acc, input_precision=PRECISION)


@triton.jit
def _softmax_tile(acc, jt, m_i, l_i, last_group, valid_groups, scale_log2, scratch, row_max,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_N: tl.constexpr, PER_BLOCK: tl.constexpr):
    """Online softmax over one tile of key groups; writes the rows' block sums and running max to the scratch."""
    groups = jt * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = (groups[None, :] <= last_group[:, None]) & (groups[None, :] < valid_groups)
    s = tl.where(seen, acc * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p, 1)
    sums = tl.sum(tl.reshape(p, [BLOCK_M, BLOCKS_N, PER_BLOCK]), 2)
    tl.store(scratch + jt * BLOCKS_N + tl.arange(0, BLOCKS_N)[None, :], sums)
    tl.store(row_max + jt, m_new)
    return m_new, l_i


@triton.jit
def _block_mass_kernel(
    Q, K, Q_DESC, K_DESC, KV_VALID, MASS, SCRATCH, ROW_MAX,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_mb, stride_mh, stride_mq,
    q_len, kv_len, q_start, row0, chunk_rows, kv_blocks, scratch_rows, tiles_max, scale_log2,
    HEADS: tl.constexpr, GROUP: tl.constexpr, STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_N: tl.constexpr, Q_BLOCKS_M: tl.constexpr, HAS_VALID: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    bh = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the rows that see the most keys first
    b = bh // HEADS
    h = bh % HEADS
    valid_len = kv_len
    if HAS_VALID:
        valid_len = tl.minimum(tl.maximum(tl.load(KV_VALID + b).to(tl.int32), 0), kv_len)
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row in this chunk
    first_q = (row0 + local) * STRIDE  # q index of each group's first query
    row_ok = (local < chunk_rows) & (first_q < q_len) & (q_start + first_q < valid_len)
    last_group = (q_start + first_q) // STRIDE  # the last key group each row sees
    valid_groups = (valid_len + STRIDE - 1) // STRIDE
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, chunk_rows) - 1 + row0
    seen_groups = tl.minimum((q_start + last_row * STRIDE) // STRIDE + 1, valid_groups)
    n_tiles = tl.cdiv(seen_groups, BLOCK_N)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    scratch_cols = tiles_max * BLOCKS_N
    scratch = SCRATCH + bh.to(tl.int64) * scratch_rows * scratch_cols + local[:, None] * scratch_cols
    row_max = ROW_MAX + bh.to(tl.int64) * scratch_rows * tiles_max + local * tiles_max
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    q_row = row0 + tile * BLOCK_M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # one loop over (key tile, antidiagonal position), so loads stream across tile boundaries
    for step in range(0, n_tiles * STRIDE):
        jt = step // STRIDE
        t = step % STRIDE
        acc = _antidiagonal_product(acc, jt, t, bh, b, h, q_row, first_q, row_ok, q_len, q_start, valid_len, q_base,
                                    k_base, stride_qs, stride_ks, Q_DESC, K_DESC, HEADS, GROUP, STRIDE, HEAD_DIM,
                                    DIM_PAD, BLOCK_M, BLOCK_N, PRECISION, USE_TMA)
        if t == STRIDE - 1:
            m_i, l_i = _softmax_tile(acc, jt, m_i, l_i, last_group, valid_groups, scale_log2, scratch, row_max,
                                     BLOCK_M, BLOCK_N, BLOCKS_N, PER_BLOCK)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tl.debug_barrier()  # the scratch written above is read back below by other threads of this program
    inv = tl.where(row_ok & (l_i > 0), 1.0 / l_i, 0.0)
    qb = tile * Q_BLOCKS_M + tl.arange(0, Q_BLOCKS_M)
    mass_base = MASS + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + qb.to(tl.int64)[:, None] * stride_mq
    qb_ok = qb < chunk_rows // PER_BLOCK
    cols = tl.arange(0, BLOCKS_N)
    for jt in range(0, n_tiles):
        sums = tl.load(scratch + jt * BLOCKS_N + cols[None, :])
        weight = tl.exp2(tl.load(row_max + jt) - m_i) * inv
        block_mass = tl.sum(tl.reshape(sums * weight[:, None], [Q_BLOCKS_M, PER_BLOCK, BLOCKS_N]), 1)
        kb = jt * BLOCKS_N + cols
        tl.store(mass_base + kb[None, :], block_mass, mask=qb_ok[:, None] & (kb < kv_blocks)[None, :])


def block_mass_triton(q: Tensor, k: Tensor, stride: int, block_size: int, *, q_start: int | None = None,
                      kv_valid_len: Tensor | None = None,
                      config: tuple[int, int, int, int, bool] | None = None) -> Tensor:
    """The fused estimator: float32 ``[B, H_q, QB, KB]``, as :func:`~flexsparse.kernels.xa_estimate.block_mass_torch`.

    ``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages, tma), default :data:`DEFAULT_CONFIG` (tiles raised to
    ``block_size / stride`` where smaller). ``tma`` loads q/k tiles with tensor descriptors where the layout
    allows (16-bit inputs, power-of-two head_dim <= 256, lengths divisible by ``stride``, no ``kv_valid_len``),
    else with pointers.
    """
    stride, block_size, q_start = check_estimate_args(q, k, stride, block_size, q_start, kv_valid_len)
    reason = triton_supports(q, stride, block_size)
    if reason is not None:
        raise ValueError(f"the Triton estimator does not support these inputs: {reason}")
    if k.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    block_m, block_n, num_warps, num_stages, tma = config or DEFAULT_CONFIG
    per_block = block_size // stride
    block_m, block_n = max(block_m, per_block, 16), max(block_n, per_block, 16)
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    descriptors = _descriptors(q, k, stride, block_m, block_n) if tma and kv_valid_len is None else None
    q_blocks, kv_blocks = -(-q_len // block_size), -(-kv_len // block_size)
    mass = torch.zeros(batch, heads, q_blocks, kv_blocks, device=q.device, dtype=torch.float32)
    rows = q_blocks * per_block
    tiles_max = -(-(-(-kv_len // stride)) // block_n)
    per_row_bytes = batch * heads * (tiles_max * (block_n // per_block) + tiles_max) * 4
    most = max(block_m, _SCRATCH_BYTES // per_row_bytes // block_m * block_m)
    launches = -(-rows // most)
    chunk = -(-rows // launches // block_m) * block_m  # equal launches rather than a short last one
    scratch = torch.empty(batch * heads, chunk, tiles_max * (block_n // per_block), device=q.device)
    row_max = torch.empty(batch * heads, chunk, tiles_max, device=q.device)
    valid = kv_valid_len if kv_valid_len is not None else mass  # any tensor: not read without HAS_VALID
    scale_log2 = 1.0 / (math.sqrt(dim) * stride) / math.log(2.0)
    for row0 in range(0, rows, chunk):
        chunk_rows = min(chunk, rows - row0)
        part = mass[:, :, row0 // per_block:]
        grid = (batch * heads, -(-chunk_rows // block_m))
        _block_mass_kernel[grid](
            q, k, *(descriptors or (q, k)), valid, part, scratch, row_max,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            part.stride(0), part.stride(1), part.stride(2),
            q_len, kv_len, q_start, row0, chunk_rows, kv_blocks, chunk, tiles_max, scale_log2,
            HEADS=heads, GROUP=heads // kv_heads, STRIDE=stride, HEAD_DIM=dim,
            DIM_PAD=max(16, triton.next_power_of_2(dim)), PER_BLOCK=per_block, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCKS_N=block_n // per_block, Q_BLOCKS_M=block_m // per_block,
            HAS_VALID=kv_valid_len is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_TMA=descriptors is not None,
            num_warps=num_warps, num_stages=num_stages,
        )
    return mass


def _descriptors(q: Tensor, k: Tensor, stride: int, block_m: int, block_n: int):
    """Tensor descriptors of q and k as ``[B*H, groups, stride*d]`` (boxes of one antidiagonal position), or None
    where that layout is not available."""
    dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or dim & (dim - 1) or not 16 <= dim <= 256:
        return None
    if q.shape[2] % stride or k.shape[2] % stride or block_m > 256 or block_n > 256:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    try:
        views = [t.view(t.shape[0] * t.shape[1], t.shape[2] // stride, stride * dim) for t in (q, k)]
        return (TensorDescriptor.from_tensor(views[0], [1, block_m, dim]),
                TensorDescriptor.from_tensor(views[1], [1, block_n, dim]))
    except (RuntimeError, AssertionError):  # not viewable, or not 16-byte aligned
        return None


@triton.jit
def _select_kernel(
    MASS, THRESHOLD, DIAG_LO, DIAG_HI, ROW_OK, OUT,
    stride_mb, stride_mh, stride_mq, stride_rb, heads, q_blocks, kv_blocks,
    PLUS_ONE: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    pid = tl.program_id(0)
    qb = pid % q_blocks
    bh = pid // q_blocks
    h = bh % heads
    b = bh // heads
    row = b.to(tl.int64) * stride_rb + qb
    lo = tl.load(DIAG_LO + row)
    hi = tl.load(DIAG_HI + row)
    ok = tl.load(ROW_OK + row) != 0
    threshold = tl.load(THRESHOLD + h)
    zeros = tl.zeros([BLOCK_KB], tl.float32)  # scalar float comparisons are broadcast to rows first
    kb = tl.arange(0, BLOCK_KB)
    causal = tl.where(ok, (kb <= hi) & (kb < kv_blocks), False)  # scalar & vector bools: int32 in triton 3.9's interpreter
    base = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + qb.to(tl.int64) * stride_mq
    mass = tl.maximum(tl.load(MASS + base + kb, mask=causal, other=0.0), 0.0)
    sink = causal & (kb == 0)
    credited = causal & (kb >= lo)
    if not PLUS_ONE:
        credited = credited | sink
    ranked = causal & ~credited
    rest = tl.sum(mass, 0) * threshold - tl.sum(tl.where(credited, mass, 0.0), 0)
    bits = mass.to(tl.int32, bitcast=True)  # non-negative floats order like their bit patterns
    low = tl.full([], 0, tl.int32)
    high = tl.full([], 0x7F800000, tl.int32)  # +inf
    for _ in range(31):
        mid = low + (high - low) // 2
        reached = tl.sum(tl.where(ranked & (bits >= mid), mass, 0.0), 0) >= rest
        low = tl.where(reached, mid, low)
        high = tl.where(reached, high, mid)
    cut = tl.where(rest > 0, low, 0x7F800000)
    keep = ranked & (bits >= cut)
    if PLUS_ONE:
        following = tl.max(tl.where(ranked & (bits < cut), mass, 0.0), 0)  # the heaviest block not kept
        keep = keep | (ranked & (mass >= following) & (zeros + following > 0))
    keep = keep | credited | sink | (causal & (zeros + threshold >= 1.0)) | ((kb == 0) & ~ok)
    tl.store(OUT + base + kb, keep.to(tl.int8), mask=kb < kv_blocks)


def select_blocks_triton(mass: Tensor, threshold: Tensor, diag_lo: Tensor, diag_hi: Tensor, row_ok: Tensor, *,
                         plus_one: bool, num_warps: int | None = None) -> Tensor:
    """Bool ``[B, H, QB, KB]`` from masses ``[B, H, QB, KB]``, thresholds ``[H]`` and the rows' geometry
    (``[B', QB]`` each, from :func:`flexsparse.masks.xa_selection.block_rows`). Use
    :func:`flexsparse.masks.xa_selection.select_blocks`, which checks the arguments."""
    batch, heads, q_blocks, kv_blocks = mass.shape
    if kv_blocks > _MAX_SELECT_BLOCKS:
        raise ValueError(f"the Triton selection holds up to {_MAX_SELECT_BLOCKS} key blocks per row, got {kv_blocks}")
    reason = kernel_unavailable(mass.device)
    if reason is not None:
        raise ValueError(f"the Triton selection cannot run on mass's device: {reason}")
    mass = mass.float().contiguous()
    out = torch.empty(batch, heads, q_blocks, kv_blocks, device=mass.device, dtype=torch.int8)
    geometry = [t.to(device=mass.device, dtype=torch.int32).contiguous() for t in (diag_lo, diag_hi, row_ok)]
    block_kb = max(16, triton.next_power_of_2(kv_blocks))
    warps = num_warps or (1 if block_kb <= 1024 else 2 if block_kb <= 2048 else 4 if block_kb <= 4096 else 8)
    _select_kernel[(batch * heads * q_blocks,)](
        mass, threshold.float().contiguous(), *geometry, out,
        mass.stride(0), mass.stride(1), mass.stride(2), q_blocks if geometry[0].shape[0] > 1 else 0,
        heads, q_blocks, kv_blocks, PLUS_ONE=plus_one, BLOCK_KB=block_kb, num_warps=warps,
    )
    return out.view(torch.bool)


def compiled_variants() -> int:
    """Compiled variants of this module's kernels in the process (0 under the interpreter). New inputs of one
    shape and dtype reuse a variant; use this to check that a workload does not recompile."""
    return sum(len(caches[0]) for kernel in (_block_mass_kernel, _select_kernel)
               for caches in getattr(kernel, "device_caches", {}).values())
