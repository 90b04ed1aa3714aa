"""Launching the ESA Triton kernels: block sizes and tuned settings, what a call fixes besides q, k, v
(:class:`EsaLaunch`), and the forward (tile or decode kernel) and backward (dQ, then dK/dV) launchers."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from flexsparse.kernels.esa_backward import esa_backward_dq_kernel
from flexsparse.kernels.esa_decode import esa_decode_kernel
from flexsparse.kernels.esa_dkdv import esa_dkdv_kernel, esa_dkdv_work_kernel
from flexsparse.kernels.esa_forward import esa_forward_kernel

BLOCK_QUERIES = 16
"""Queries per forward/dQ program (the tensor-core minimum); also the key tile, so one tile holds a range."""
BLOCK_KEYS = 16
"""Key positions per dK/dV program."""
DECODE_MAX_QUERIES = BLOCK_QUERIES - 1
"""Up to this many queries per sequence, the per-row gather kernel runs instead of the tile kernel."""
KERNEL_CONFIG = {
    "forward_stages": 2,  # cp.async stages of the forward's key tiles (one warp per program)
    "forward_split": False,  # P enters P @ V as two 16-bit parts (False: rounded once, as dense bf16 attention)
    "dq_heads": 1,  # query heads per dQ program, one warp each (at most the KV group, a power of two)
    "dq_split": False,  # dS enters dS @ K as two 16-bit parts (False: rounded once, as dense bf16)
    "dkdv_warps": 1,  # one warp: P and dS stay in its registers between dots (docs/notes/esa-kernel.md)
    "dkdv_queries": 16,  # rows per work entry (BQ)
    "dkdv_stages": 3,  # cp.async stages of the work loop's query and dO rows
    "dkdv_split": False,  # P and dS enter P dO and dS Q as two 16-bit parts (False: rounded once, as dense bf16)
    "dkdv_block_major_waves": 8,  # block-major dK/dV programs below this many waves of 8 per SM, head-major above
    "decode_warps": 4,
}
"""Launch settings, chosen by H100 measurements and the compiler's SASS: docs/notes/esa-kernel.md."""

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class EsaLaunch:
    """Everything the kernels need besides q, k, v: sizes, the index rule's constants and position tensors."""

    num_heads: int  # the pattern's heads (the index rule's H)
    head_offset: int  # the pattern's head of q's head 0
    group: int
    attn_length: int
    layer_den: int
    layer_weight: int
    scale: float
    q_len: int
    kv_len: int
    span: int
    first_pos: int
    sorted_pos: Tensor | None  # int32 [B or 1, S_q], stable sort of q_positions
    order: Tensor | None  # int32 [B or 1, S_q], the rows in that order
    key_slots: Tensor | None  # int32 [B or 1, span]
    step_one: bool  # keys step by <= 1 per position (H even or 1): one tile per slot for consecutive rows
    precision: str  # tl.dot input precision: "ieee" for fp32 inputs
    split: bool  # 16-bit inputs: fp32 left operands of dots enter as two 16-bit parts

    def position_args(self, device: torch.device) -> tuple:
        """(SORTED_POS, ORDER, KEY_SLOTS, stride_pos_b, stride_slots_b); dummies where absent."""
        dummy = torch.empty(1, dtype=torch.int32, device=device)
        sorted_pos = dummy if self.sorted_pos is None else self.sorted_pos
        order = dummy if self.order is None else self.order
        slots = dummy if self.key_slots is None else self.key_slots
        stride_pos = 0 if self.sorted_pos is None or self.sorted_pos.shape[0] == 1 else self.sorted_pos.stride(0)
        stride_slots = 0 if self.key_slots is None or self.key_slots.shape[0] == 1 else self.key_slots.stride(0)
        return sorted_pos, order, slots, stride_pos, stride_slots

    def rule_args(self) -> tuple:
        return (self.q_len, self.kv_len, self.span, self.first_pos, self.layer_weight, self.scale * _LOG2E,
                self.head_offset)

    def heads_per_program(self) -> int:
        """Query heads per dQ or decode program: the whole KV group, at most 8 (one warp per head)."""
        return triton.next_power_of_2(min(self.group, 8))


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _wide_rows(*tensors: Tensor) -> bool:
    """Whether a row's element offset inside one (batch, head) of these [B, H, S, d] tensors may overflow int32."""
    return any((t.shape[2] - 1) * t.stride(2) + t.shape[3] >= 2**31 for t in tensors)


def _row_offset_kinds(k: Tensor, v: Tensor) -> dict:
    """WIDE: a key row's element offset inside one (batch, KV head) may not fit int32; SAME_KV_STRIDE: K and V rows
    share offsets."""
    return dict(WIDE=_wide_rows(k, v), SAME_KV_STRIDE=k.stride(2) == v.stride(2))


def launch_forward(q: Tensor, k: Tensor, v: Tensor, launch: EsaLaunch) -> tuple[Tensor, Tensor]:
    """O ``[B, H, S_q, d]`` and LSE ``[B, H, S_q]`` (log2 units): the decode kernel for up to
    ``DECODE_MAX_QUERIES`` queries, else the tile kernel."""
    batch, heads, q_len, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    sorted_pos, order, slots, stride_pos, stride_slots = launch.position_args(q.device)
    args = (q, k, v, out, lse, sorted_pos, order, slots, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            stride_pos, stride_slots, *launch.rule_args())
    common = dict(NUM_HEADS=heads, PATTERN_HEADS=launch.num_heads, GROUP=launch.group, W=launch.attn_length,
                  LAYER_DEN=launch.layer_den, D=dim, HAS_POSITIONS=launch.sorted_pos is not None,
                  HAS_SLOTS=launch.key_slots is not None, **_row_offset_kinds(k, v))
    kv_heads = heads // launch.group
    if q_len <= DECODE_MAX_QUERIES:
        per_program = launch.heads_per_program()
        slots = min(triton.next_power_of_2(launch.attn_length), 64 // per_program)  # [heads, slots, d] tiles
        esa_decode_kernel[(q_len, batch * kv_heads * triton.cdiv(launch.group, per_program))](
            *args, HEADS=per_program, SLOTS=slots, num_warps=KERNEL_CONFIG["decode_warps"], **common)
    else:
        esa_forward_kernel[(triton.cdiv(q_len, BLOCK_QUERIES) * launch.group, batch * kv_heads)](
            *args, BM=BLOCK_QUERIES, STEP_ONE=launch.step_one, PRECISION=launch.precision,
            SPLIT=launch.split and KERNEL_CONFIG["forward_split"], num_warps=1,
            num_stages=KERNEL_CONFIG["forward_stages"], **common)
    return out, lse


def launch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, launch: EsaLaunch,
              need_dkdv: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dQ, dK, dV) from the forward's O and LSE; dK and dV are None unless ``need_dkdv``."""
    batch, heads, q_len, dim = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty_like(lse)
    sorted_pos, order, slots, stride_pos, stride_slots = launch.position_args(q.device)
    per_program = min(KERNEL_CONFIG["dq_heads"], launch.heads_per_program())
    kv_heads = heads // launch.group
    per_group = triton.cdiv(launch.group, per_program)
    common = dict(NUM_HEADS=heads, PATTERN_HEADS=launch.num_heads, GROUP=launch.group, W=launch.attn_length,
                  LAYER_DEN=launch.layer_den, D=dim,
                  HAS_POSITIONS=launch.sorted_pos is not None, HAS_SLOTS=launch.key_slots is not None,
                  PRECISION=launch.precision)
    row_kinds = _row_offset_kinds(k, v)
    dq_args = (q, k, v, out, do, dq, lse, delta, sorted_pos, order, slots, *_strides(q), *_strides(k), *_strides(v),
               *_strides(out), *_strides(do), *_strides(dq), stride_pos, stride_slots, *launch.rule_args(),
               launch.scale)
    dq_grid = (triton.cdiv(q_len, BLOCK_QUERIES) * per_group, batch * kv_heads)
    dq_options = dict(HEADS=per_program, BM=BLOCK_QUERIES, STEP_ONE=launch.step_one,
                      SPLIT=launch.split and KERNEL_CONFIG["dq_split"], num_warps=per_program, **row_kinds,
                      **common)
    esa_backward_dq_kernel[dq_grid](*dq_args, **dq_options)
    if not need_dkdv:
        return dq, None, None
    # without key_slots every slot is some key position's and gets written; with them, unused slots stay 0
    make = torch.empty if launch.key_slots is None else torch.zeros
    dk = make(k.shape, dtype=k.dtype, device=k.device)
    dv = make(v.shape, dtype=v.dtype, device=v.device)
    pairs, blocks = dkdv_programs(launch, batch, heads)
    ranges, work = dkdv_work(launch, batch, heads, q.device)
    esa_dkdv_kernel[(pairs * blocks,)](
        q, k, v, do, dk, dv, lse, delta, sorted_pos, order, slots, ranges, work, *_strides(q), *_strides(k),
        *_strides(v), *_strides(do), *_strides(dk), *_strides(dv), stride_pos, stride_slots, pairs, blocks,
        *launch.rule_args(), launch.scale, HEAD_MAJOR=_head_major(pairs * blocks, q.device), WIDE=_wide_rows(q, do), W_POW2=triton.next_power_of_2(launch.attn_length),
        GROUP_POW2=triton.next_power_of_2(launch.group), BN=BLOCK_KEYS, BQ=KERNEL_CONFIG["dkdv_queries"],
        STAGES=KERNEL_CONFIG["dkdv_stages"], num_warps=KERNEL_CONFIG["dkdv_warps"],
        num_stages=KERNEL_CONFIG["dkdv_stages"],
        SPLIT=launch.split and KERNEL_CONFIG["dkdv_split"], **common)
    return dq, dk, dv


def _head_major(programs: int, device: torch.device) -> bool:
    """Whether the dK/dV programs run head-major (see :mod:`flexsparse.kernels.esa_dkdv`): when the grid is many
    waves of 8 programs per multiprocessor, L2 reuse wins over the tail."""
    return programs >= KERNEL_CONFIG["dkdv_block_major_waves"] * 8 * _multiprocessors(device)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """A CUDA device's multiprocessors; 1 elsewhere (the interpreter runs programs one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def dkdv_programs(launch: EsaLaunch, batch: int, heads: int) -> tuple[int, int]:
    """(pairs, key blocks) of the dK/dV kernel: pairs = batch x KV heads, blocks of BLOCK_KEYS key
    positions; its grid is their product."""
    return batch * (heads // launch.group), triton.cdiv(launch.span, BLOCK_KEYS)


def dkdv_work(launch: EsaLaunch, batch: int, heads: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(ranges int64 [programs, 2], work entries) of the dK/dV programs (:mod:`flexsparse.kernels.esa_dkdv`)
    for ``batch`` sequences of ``heads`` query heads.

    The entries' buffer is sized by a bound, not by the count (reading it would sync the host): per (batch, KV
    head, head of the group, slot), the runs of all key blocks hold at most ``q_len`` rows in at most
    ``min(blocks, q_len)`` runs, so at most ``cdiv(q_len, BQ) + min(blocks, q_len)`` chunks."""
    rows_per_chunk = KERNEL_CONFIG["dkdv_queries"]
    group_pow2 = triton.next_power_of_2(launch.group)
    w_pow2 = triton.next_power_of_2(launch.attn_length)
    lanes = group_pow2 * w_pow2
    pairs, blocks = dkdv_programs(launch, batch, heads)
    bound = pairs * launch.group * launch.attn_length * (
        triton.cdiv(launch.q_len, rows_per_chunk) + min(blocks, launch.q_len))
    wide = (launch.q_len + rows_per_chunk) * lanes >= 2**31
    work = torch.empty(max(bound, 1), dtype=torch.int64 if wide else torch.int32, device=device)
    ranges = torch.empty(pairs * blocks, 2, dtype=torch.int64, device=device)
    used = torch.zeros(1, dtype=torch.int64, device=device)
    sorted_pos, _, _, stride_pos, _ = launch.position_args(device)
    args = (sorted_pos, stride_pos, pairs, blocks, launch.q_len, launch.span, launch.first_pos, launch.layer_weight,
            launch.head_offset, max(launch.q_len, 1).bit_length())
    sizes = dict(NUM_HEADS=heads, PATTERN_HEADS=launch.num_heads, GROUP=launch.group, W=launch.attn_length,
                 LAYER_DEN=launch.layer_den, GROUP_POW2=group_pow2, W_POW2=w_pow2, BN=BLOCK_KEYS,
                 BQ=rows_per_chunk, HAS_POSITIONS=launch.sorted_pos is not None,
                 HEAD_MAJOR=_head_major(pairs * blocks, device), num_warps=4)
    esa_dkdv_work_kernel[(pairs * blocks,)](used, ranges, work, *args, **sizes)
    return ranges, work
