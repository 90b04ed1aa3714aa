"""Fused router inference: boundary pooling, both MLPs and the decision of one layer in one Triton launch.

:func:`fused_routing` computes what ``Router.route`` computes in eval mode (logits, one-hot weights and the modes)
for both router kinds, whose MLPs have one shape: the task pair ``d -> H1 -> O1`` (two linear layers, SiLU between),
then the router MLP ``O1 -> H2 -> O2 -> 2`` (SiLU between its layers; none between the task output and the router
input). HeadRouter: ``H1 = H2 = 4d``, ``O1 = O2 = d``, one row per (sequence, KV head); LayerRouter: ``H1 = 8d``,
``O1 = 2d``, ``H2 = 4d``, ``O2 = d``, one row per sequence, the mean of its pooled heads (``average_heads``).

Work split. One program per sequence would pull all of the router's weights (1.1 MB for the head router, 2.4 MB
for the layer router at d = 128, float32) and 2P rows of every head through one SM: tens of microseconds at B = 1.
Instead the launch runs four stages, each spread over many programs (41 for the head router with 8 KV heads, 97
for the layer router with 32 query heads, at B = 1 and d = 128):

0. pooling, one program per (sequence, head): the weighted sum of its 2P boundary rows in float32, rounded to the
   states' dtype (what ``boundary_pool`` returns), into a float32 scratch ``[B*H, d]``;
1. the task pair, one program per (block of up to 16 rows, span of hidden units): ``silu(x W1[J]^T + b1[J])
   W2[:, J]^T`` over its hidden units J, a partial sum of the task output (the fused-MLP trick: the hidden
   activations never leave the program); 8 to 32 spans (partial sums per output), as many as the next stage
   can add up at once;
2. the router MLP's first two layers the same way, on the task output (the stage-1 partial sums plus ``b2``);
3. one program: SiLU of the stage-2 sums plus ``b4``, the 2-wide last layer, the decision; writes the logits
   ``[B, G, 2]``, the one-hot weights and the int64 modes ``[B, G]``.

Products. A program holds a weight tile (``[hidden units, in]`` of the first layer, ``[out, hidden units]`` of the
second) in registers and runs its real rows through it one at a time: multiply and sum in float32 on CUDA cores,
no padded rows computed (a layer router at B = 1 has one row). ``tl.dot`` is not used: at the ``ieee`` precision
float32 weights need (tf32 would change decisions) it also runs on CUDA cores, holds whole K-rows of both operands
per thread and spills at d = 128, and needs 16 rows. Tiles hold 4096 float32 elements at 8 warps (ptxas, sm_90:
no spills at d = 128, a few bytes at d = 256).

Synchronisation. A stage waits for every program of the previous one. Programs take their role from a ticket (an
atomic counter taken at start), not from the program id: every program a stage waits on holds a lower ticket, so
it is already running, and the wait ends whatever the grid size and the GPU's occupancy (the interpreter runs
programs one after the other, in ticket order, and never waits). A stage publishes its stores with a CTA barrier
and a release increment of its done-counter; the next reads them after an acquire spin, through L2 (``.cg``
loads). The last program resets the counters, so the workspace (:class:`RouterWorkspace`) serves the next launch
without a memset; one workspace must not serve two launches at once (two streams): each router keeps its own.

Numbers follow the torch path step by step: each head is pooled in float32 and rounded to the states' dtype, the
head mean (layer router) is taken in float32 and rounded, every linear layer's output and every SiLU is rounded to
the weights' dtype (no-ops for float32 weights; bfloat16 rounding by integer arithmetic, as the interpreter
truncates); sums run in float32, partial sums are added in a fixed order (deterministic). Logits match the torch
path to float32 rounding (the summation order differs). The decision is the torch path's (the argmax of the
float32 softmax of the logits, a tie to full): sparse when ``logit_sparse - logit_full > 2^-25``, as closer logits
give equal probabilities.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.launch import CompiledLaunch

MAX_ROWS = 16  # rows (sequences or (sequence, head) pairs) of one MLP program
MAX_HEAD_DIM = 256
_TILE = 4096  # float32 elements of one register tile (a weight tile, gathered rows): no spills at 8 warps
_SUMS = 16384  # float32 elements of the partial sums a program of the next stage reads at once (spans x rows x out)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TIE = 2.0 ** -25  # float32 softmax of two logits closer than this gives equal probabilities


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def _split(hidden: int, in_pad: int, out_pad: int, rows: int) -> tuple[int, int, int]:
    """Hidden units per register tile (``sub``), tiles per program (``per``) and programs per row block
    (``spans``, 8 to 32: as many as the next stage can sum at once for blocks of ``rows``)."""
    sub = max(16, min(64, _TILE // max(in_pad, out_pad), _pow2(hidden)))
    tiles = math.ceil(hidden / sub)
    per = math.ceil(tiles / max(8, min(32, _SUMS // (rows * out_pad))))
    return sub, per, math.ceil(tiles / per)


@dataclass(frozen=True)
class _Launch:
    """What a launch needs besides the tensors, from the sizes alone (see :func:`_launch`)."""

    layers: tuple[tuple[int, ...], ...]  # (weight, bias) shapes of the five layers
    groups: int  # G: decisions per sequence
    grid: tuple[int]
    scratch: int  # float32 elements of workspace
    constants: dict  # the kernel's compile-time arguments


@functools.lru_cache(maxsize=256)
def _launch(batch: int, heads: int, dim: int, two_p: int, hid1: int, out1: int, hid2: int, out2: int,
            average_heads: bool) -> _Launch:
    widths = (dim, hid1, out1, hid2, out2, 2)
    layers = tuple(shape for n_in, n_out in zip(widths[:-1], widths[1:]) for shape in ((n_out, n_in), (n_out,)))
    groups = 1 if average_heads else heads
    rows = batch * groups
    block_rows = min(MAX_ROWS, _pow2(rows))
    row_blocks = math.ceil(rows / block_rows)
    dim_pad, out1_pad, out2_pad = (max(16, _pow2(n)) for n in (dim, out1, out2))
    sub1, per1, spans1 = _split(hid1, dim_pad, out1_pad, block_rows)
    sub2, per2, spans2 = _split(hid2, out1_pad, out2_pad, block_rows)
    constants = dict(
        TWO_P=two_p, BLOCK_P=min(_pow2(two_p), max(16, _TILE // dim_pad)),
        HEAD_CHUNK=min(_pow2(heads), max(1, _TILE // dim_pad)), AVERAGE_HEADS=average_heads, DIM=dim, HID1=hid1,
        OUT1=out1, HID2=hid2, OUT2=out2, DIM_PAD=dim_pad, OUT1_PAD=out1_pad, OUT2_PAD=out2_pad, SUB1=sub1,
        PER1=per1, SPANS1=spans1, SUB2=sub2, PER2=per2, SPANS2=spans2, ROWS=block_rows, TIE=_TIE)
    grid = (batch * heads + row_blocks * (spans1 + spans2) + 1,)
    scratch = batch * heads * dim + rows * (spans1 * out1 + spans2 * out2)
    return _Launch(layers, groups, grid, scratch, constants)


class RouterWorkspace:
    """Scratch (float32) and the stage counters (int32, zero between launches) of one router's launches, per
    device, grown when a launch needs more; and the router's launches (:class:`CompiledLaunch`, per launch sizes,
    states strides and modes). Not for two launches at once (concurrent streams)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.launches: dict[tuple, CompiledLaunch] = {}  # per sizes, scalars, dtypes and device

    def get(self, device: torch.device, numel: int) -> tuple[Tensor, Tensor]:
        found = self._buffers.get(device)
        if found is None or found[0].numel() < numel:
            counters = found[1] if found is not None else torch.zeros(4, dtype=torch.int32, device=device)
            found = (torch.empty(numel, dtype=torch.float32, device=device), counters)
            self._buffers[device] = found
        return found


def fused_support(states: Tensor, layers: Sequence[tuple[Tensor, Tensor | None]]) -> str | None:
    """None when :func:`fused_routing` takes these inputs, else why not. ``layers``: (weight, bias) of the linear
    layers of the task MLP, then of the router MLP."""
    reason = kernel_unavailable(states.device)
    if reason is not None:
        return reason
    if states.dtype not in _DTYPES or states.shape[-1] > MAX_HEAD_DIM:
        return f"states of {states.dtype} and head_dim {states.shape[-1]} (float32/16, bfloat16, <= {MAX_HEAD_DIM})"
    if len(layers) != 5 or any(bias is None for _, bias in layers):
        return f"{len(layers)} linear layers (five with biases expected: task 2, router 3)"
    dtype = layers[0][0].dtype
    if dtype not in _DTYPES or layers[0][0].device != states.device:
        return f"router weights of {dtype} on {layers[0][0].device}, states on {states.device}"
    if not all(t.dtype == dtype and t.is_contiguous() for pair in layers for t in pair):
        return "router weights must be contiguous and of one dtype"
    return None


def fused_routing(states: Tensor, positions: Tensor, pool_weights: Tensor, layers: Sequence[tuple[Tensor, Tensor]],
                  *, average_heads: bool, full_mode: int, sparse_mode: int,
                  workspace: RouterWorkspace | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's routing in one launch (see the module docstring).

    Args:
        states: ``[B, S, H, d]`` float32/float16/bfloat16, any strides.
        positions, pool_weights: a boundary's int64 slots and float32 weights ``[B, 2P]``
            (:func:`flexsparse.routers.boundary_positions`).
        layers: (weight ``[out, in]``, bias ``[out]``) of the five linear layers, task MLP then router MLP, one
            dtype, contiguous (:func:`fused_support`).
        average_heads: one row per sequence from the mean of the pooled heads (layer router, G = 1); else one
            row per (sequence, head) (head router, G = H).
        full_mode, sparse_mode: the modes written for each decision.
        workspace: reused scratch (a fresh one when None).

    Returns:
        logits ``[B, G, 2]`` in the weights' dtype, one-hot weights ``[B, G, 2]`` float32 (channel 1 = sparse),
        modes int64 ``[B, G]``.
    """
    batch, _, heads, dim = states.shape
    (w1, b1), (w2, b2), (w3, b3), (w4, b4), (w5, b5) = layers
    sizes = (batch, heads, dim, positions.shape[1], w1.shape[0], w2.shape[0], w3.shape[0], w4.shape[0], average_heads)
    launch = _launch(*sizes)
    if tuple(t.shape for pair in layers for t in pair) != launch.layers:
        raise ValueError(f"router layers must chain (weight [out, in], bias [out]) as {launch.layers}, got "
                         f"{[tuple(t.shape) for pair in layers for t in pair]}")
    positions, pool_weights = positions.contiguous(), pool_weights.contiguous()  # rows of TWO_P
    device = states.device
    logits = torch.empty(batch, launch.groups, 2, dtype=w1.dtype, device=device)
    choice = torch.empty(batch, launch.groups, 2, dtype=torch.float32, device=device)
    modes = torch.empty(batch, launch.groups, dtype=torch.long, device=device)
    workspace = workspace or RouterWorkspace()
    scratch, counters = workspace.get(device, launch.scratch)
    scalars = (batch, heads, *states.stride(), full_mode, sparse_mode)
    key = (sizes, scalars, states.dtype, w1.dtype, device)
    kernel = workspace.launches.get(key)
    if kernel is None:
        kernel = workspace.launches[key] = CompiledLaunch(_router_kernel, launch.grid, scalars, launch.constants,
                                                          dict(num_warps=8))
    try:
        kernel(states, positions, pool_weights, w1, b1, w2, b2, w3, b3, w4, b4, w5, b5, logits, choice, modes,
               scratch, counters)
    except BaseException:
        counters.zero_()  # a launch stopped part-way (the interpreter) must not leave its tickets to the next one
        raise
    return logits, choice, modes


# ----- the kernel ------------------------------------------------------------------------------------------------

@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` (to nearest, ties to even) and back to float32."""
    if DTYPE == tl.bfloat16:  # by hand: the interpreter truncates float32 -> bfloat16
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _silu(x, DTYPE: tl.constexpr):
    """SiLU of a linear layer's float32 output, both rounded to ``DTYPE`` as torch computes them in it."""
    x = _round(x, DTYPE)
    return _round(x / (1.0 + tl.exp(-x)), DTYPE)


@triton.jit
def _wait(done, target):
    """Spin until ``target`` programs of the previous stage have finished (they hold lower tickets: running)."""
    while tl.atomic_add(done, 0, sem="acquire") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _finish(done):
    """Publish this program's stores (every thread's, through the barrier) and count it done."""
    tl.debug_barrier()
    tl.atomic_add(done, 1, sem="release")


@triton.jit
def _pool_row(item, states, positions, pool_weights, pooled, heads, s_b, s_s, s_h, s_d, TWO_P: tl.constexpr,
              BLOCK_P: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """Stage 0: ``pooled[item] = round(sum_p w_p states[b, pos_p, h])`` for item = b * heads + h, float32 ``[d]``."""
    b = item // heads
    h = item % heads
    k = tl.arange(0, DIM_PAD)
    base = states + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
    acc = tl.zeros([DIM_PAD], tl.float32)
    for start in tl.static_range(0, TWO_P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        pos = tl.load(positions + b * TWO_P + p, mask=p < TWO_P, other=0)
        w = tl.load(pool_weights + b * TWO_P + p, mask=p < TWO_P, other=0.0)
        x = tl.load(base + pos[:, None] * s_s + k[None, :].to(tl.int64) * s_d,
                    mask=(w != 0)[:, None] & (k < DIM)[None, :], other=0.0)  # unused slots are not read
        acc += tl.sum(x.to(tl.float32) * w[:, None], axis=0)
    tl.store(pooled + item * DIM + k, _round(acc, states.dtype.element_ty), mask=k < DIM)


@triton.jit
def _input_rows(block, pooled, rows, heads, W_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
                AVERAGE_HEADS: tl.constexpr, HEAD_CHUNK: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                ROWS: tl.constexpr):
    """The MLP input of rows ``block * ROWS ...``, float32 ``[ROWS, DIM_PAD]`` (zero past the last row)."""
    r = tl.arange(0, ROWS)
    k = tl.arange(0, DIM_PAD)
    if AVERAGE_HEADS:  # row = sequence: the mean of its pooled heads, rounded like torch's mean in the states' dtype
        x = tl.zeros([ROWS, DIM_PAD], tl.float32)
        for i in range(0, tl.minimum(ROWS, rows - block * ROWS)):
            first = (block * ROWS + i) * heads
            total = tl.zeros([DIM_PAD], tl.float32)
            for h0 in range(0, heads, HEAD_CHUNK):
                h = h0 + tl.arange(0, HEAD_CHUNK)
                v = tl.load(pooled + (first + h)[:, None] * DIM + k[None, :],
                            mask=(h < heads)[:, None] & (k < DIM)[None, :], other=0.0, cache_modifier=".cg")
                total += tl.sum(v, axis=0)
            mean = _round(total * (1.0 / heads), S_DTYPE)
            x = tl.where(r[:, None] == i, mean[None, :], x)
    else:  # row = (sequence, head)
        row = block * ROWS + r
        x = tl.load(pooled + row[:, None] * DIM + k[None, :], mask=(row < rows)[:, None] & (k < DIM)[None, :],
                    other=0.0, cache_modifier=".cg")
    return _round(x, W_DTYPE)


@triton.jit
def _summed(partial, bias, block, rows, SPANS: tl.constexpr, WIDTH: tl.constexpr, PAD: tl.constexpr,
            ROWS: tl.constexpr):
    """A linear layer's output for rows ``block * ROWS ...``: its ``SPANS`` partial sums (in order) plus the bias,
    float32 ``[ROWS, PAD]``, not rounded."""
    row = block * ROWS + tl.arange(0, ROWS)
    o = tl.arange(0, PAD)
    mask = (row < rows)[:, None] & (o < WIDTH)[None, :]
    acc = tl.zeros([ROWS, PAD], tl.float32)
    for s in tl.static_range(SPANS):
        acc += tl.load(partial + (s * rows + row)[:, None] * WIDTH + o[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc + tl.load(bias + o, mask=o < WIDTH, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _pair(x, span, block, rows, w_in, b_in, w_out, partial, W_DTYPE: tl.constexpr, IN: tl.constexpr,
          IN_PAD: tl.constexpr, HIDDEN: tl.constexpr, OUT: tl.constexpr, OUT_PAD: tl.constexpr,
          SUB: tl.constexpr, PER: tl.constexpr, ROWS: tl.constexpr):
    """Stages 1 and 2: ``partial[span, rows] = silu(x W_in[J]^T + b_in[J]) W_out[:, J]^T`` over the hidden units
    J of this span (``PER`` tiles of ``SUB``), float32 ``[ROWS, OUT]``; ``x`` float32 ``[ROWS, IN_PAD]``."""
    r = tl.arange(0, ROWS)
    k = tl.arange(0, IN_PAD)
    o = tl.arange(0, OUT_PAD)
    count = tl.minimum(ROWS, rows - block * ROWS)  # real rows of this block
    acc = tl.zeros([ROWS, OUT_PAD], tl.float32)
    for t in tl.static_range(PER):
        j = (span * PER + t) * SUB + tl.arange(0, SUB)
        w = tl.load(w_in + j[:, None] * IN + k[None, :], mask=(j < HIDDEN)[:, None] & (k < IN)[None, :],
                    other=0.0).to(tl.float32)  # W_in[J], [SUB, IN_PAD]
        bias = tl.load(b_in + j, mask=j < HIDDEN, other=0.0).to(tl.float32)
        v = tl.load(w_out + o[:, None] * HIDDEN + j[None, :], mask=(o < OUT)[:, None] & (j < HIDDEN)[None, :],
                    other=0.0).to(tl.float32)  # W_out[:, J], [OUT_PAD, SUB]
        for i in range(0, count):
            x_i = tl.sum(tl.where(r[:, None] == i, x, 0.0), axis=0)  # row i, [IN_PAD]
            hidden = _silu(tl.sum(w * x_i[None, :], axis=1) + bias, W_DTYPE)  # [SUB]; 0 in padded units
            acc = tl.where(r[:, None] == i, acc + tl.sum(v * hidden[None, :], axis=1)[None, :], acc)
    row = block * ROWS + r
    tl.store(partial + (span * rows + row)[:, None] * OUT + o[None, :], acc,
             mask=(row < rows)[:, None] & (o < OUT)[None, :])


@triton.jit
def _router_kernel(states, positions, pool_weights, w1, b1, w2, b2, w3, b3, w4, b4, w5, b5, logits, choice, modes,
                   scratch, counters, batch, heads, s_b, s_s, s_h, s_d, full_mode, sparse_mode,
                   TWO_P: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_CHUNK: tl.constexpr,
                   AVERAGE_HEADS: tl.constexpr, DIM: tl.constexpr, HID1: tl.constexpr, OUT1: tl.constexpr,
                   HID2: tl.constexpr, OUT2: tl.constexpr, DIM_PAD: tl.constexpr, OUT1_PAD: tl.constexpr,
                   OUT2_PAD: tl.constexpr, SUB1: tl.constexpr, PER1: tl.constexpr, SPANS1: tl.constexpr,
                   SUB2: tl.constexpr, PER2: tl.constexpr, SPANS2: tl.constexpr, ROWS: tl.constexpr,
                   TIE: tl.constexpr):
    W_DTYPE: tl.constexpr = w1.dtype.element_ty
    if AVERAGE_HEADS:
        rows = batch
    else:
        rows = batch * heads
    row_blocks = tl.cdiv(rows, ROWS)
    n_pool = batch * heads
    n_task = row_blocks * SPANS1
    n_router = row_blocks * SPANS2
    pooled = scratch  # [B * H, d]
    task = pooled + n_pool * DIM  # [SPANS1, rows, OUT1] partial sums
    router = task + SPANS1 * rows * OUT1  # [SPANS2, rows, OUT2]
    ticket = tl.atomic_add(counters, 1, sem="relaxed")
    if ticket < n_pool:
        _pool_row(ticket, states, positions, pool_weights, pooled, heads, s_b, s_s, s_h, s_d, TWO_P, BLOCK_P, DIM,
                  DIM_PAD)
        _finish(counters + 1)
    elif ticket < n_pool + n_task:
        _wait(counters + 1, n_pool)
        item = ticket - n_pool
        block = item // SPANS1
        x = _input_rows(block, pooled, rows, heads, W_DTYPE, states.dtype.element_ty, AVERAGE_HEADS, HEAD_CHUNK,
                        DIM, DIM_PAD, ROWS)
        _pair(x, item % SPANS1, block, rows, w1, b1, w2, task, W_DTYPE, DIM, DIM_PAD, HID1, OUT1, OUT1_PAD,
              SUB1, PER1, ROWS)
        _finish(counters + 2)
    elif ticket < n_pool + n_task + n_router:
        _wait(counters + 2, n_task)
        item = ticket - n_pool - n_task
        block = item // SPANS2
        x = _round(_summed(task, b2, block, rows, SPANS1, OUT1, OUT1_PAD, ROWS), W_DTYPE)  # no SiLU here
        _pair(x, item % SPANS2, block, rows, w3, b3, w4, router, W_DTYPE, OUT1, OUT1_PAD, HID2, OUT2, OUT2_PAD,
              SUB2, PER2, ROWS)
        _finish(counters + 3)
    else:
        _wait(counters + 3, n_router)
        o = tl.arange(0, OUT2_PAD)
        w_full = tl.load(w5 + o, mask=o < OUT2, other=0.0).to(tl.float32)
        w_sparse = tl.load(w5 + OUT2 + o, mask=o < OUT2, other=0.0).to(tl.float32)
        for block in range(0, row_blocks):
            x = _silu(_summed(router, b4, block, rows, SPANS2, OUT2, OUT2_PAD, ROWS), W_DTYPE)
            full = _round(tl.sum(x * w_full[None, :], axis=1) + tl.load(b5).to(tl.float32), W_DTYPE)
            sparse = _round(tl.sum(x * w_sparse[None, :], axis=1) + tl.load(b5 + 1).to(tl.float32), W_DTYPE)
            row = block * ROWS + tl.arange(0, ROWS)
            ok = row < rows
            is_sparse = (sparse - full) > TIE
            tl.store(logits + row * 2, full.to(logits.dtype.element_ty), mask=ok)
            tl.store(logits + row * 2 + 1, sparse.to(logits.dtype.element_ty), mask=ok)
            tl.store(choice + row * 2, tl.where(is_sparse, 0.0, 1.0), mask=ok)
            tl.store(choice + row * 2 + 1, tl.where(is_sparse, 1.0, 0.0), mask=ok)
            tl.store(modes + row, tl.where(is_sparse, sparse_mode, full_mode).to(tl.int64), mask=ok)
        tl.store(counters + tl.arange(0, 4), tl.zeros([4], tl.int32))  # every other program is done with them
