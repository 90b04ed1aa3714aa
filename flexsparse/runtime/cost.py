"""The cost model executors price their work in: estimated seconds of device time, from a few throughputs measured
on an H100 (torch 2.11, bf16; the README's benchmark table). Estimates only rank plans; they are not timings.

Every executor prices its own work (:meth:`~flexsparse.runtime.executors.Executor.cost`) with these helpers; the
planner adds :data:`LAUNCH_S` per extra group and :func:`assembly_seconds` for writing several groups into one
output.
"""

from __future__ import annotations

from flexsparse.runtime.call import AttentionCall

DENSE_FLOPS_PER_S = 600e12
"""SDPA's causal attention throughput (cuDNN at 128K on the H100: the README's benchmark table): SDPA's cost where
the device's measured table (:mod:`flexsparse.runtime.dense_kernels`) has no throughput for the call, and the unit
other executors' speeds are relative to."""
FLEX_FULL_SPEED = 0.7
"""flex_attention's speed on full causal tiles as a fraction of SDPA's (H100: the README's benchmarks)."""
FLEX_PARTIAL_TILE_COST = 9.0
"""A partial tile in flex costs up to this many full tiles (ESA's mask_mod at tile density 0.19 against flex
causal at 128K on the H100: the README's benchmark table)."""
LAUNCH_S = 50e-6
"""The cost of one more group in a plan: a launch and its host time."""
HBM_BYTES_PER_S = 3e12


def causal_pairs(call: AttentionCall) -> float:
    """(query, key) pairs of causal attention per query head and batch row, queries the last positions."""
    geo = call.geometry
    return geo.q_len * (geo.kv_len - geo.q_len + (geo.q_len + 1) / 2)


def causal_tile_pairs(call: AttentionCall) -> float:
    """Pairs of the causal tiles (``block_size`` square) per query head and batch row: what a block-sparse kernel
    computes when every causal tile is attended."""
    geo = call.geometry
    block, first = geo.block_size, geo.kv_len - geo.q_len
    tiles = sum(-(-(first + min(stop, geo.q_len)) // block) for stop in range(block, geo.q_len + block, block))
    return tiles * block * block


def attention_flops(call: AttentionCall, kv_heads: int, pairs: float) -> float:
    """FLOPs of ``pairs`` (query, key) pairs per query head for ``kv_heads`` KV heads (two matmuls, 2 FLOPs each)."""
    batch, _, _, dim = call.q.shape
    return 4 * dim * batch * kv_heads * call.group_size * pairs


def assembly_seconds(call: AttentionCall) -> float:
    """Writing the groups' results into one output (read and write of q's size)."""
    return 2 * call.q.numel() * call.q.element_size() / HBM_BYTES_PER_S
