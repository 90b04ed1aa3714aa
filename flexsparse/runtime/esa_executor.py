"""The ESA executor: ESA heads through flexsparse's Triton gather kernel (:mod:`flexsparse.kernels.esa`).

FlexAttention is the wrong tool for ESA at long lengths: its dilated keys touch 19-60% of the tiles, every one
partial. The gather kernel reads each query's ``attn_length`` keys directly. It takes any whole KV groups of a layer
(the kernel's ``head_offset`` gives each head its own shifts), so in a mixed layer the ESA heads run here beside full
heads on SDPA and sink+window heads on flex. CPU calls and head dims the kernel does not take (not a power of two in
[16, 256]) keep ESA heads on flex. In a sparse KV cache, ESA heads keep every key and a one-token step gathers the
new token's keys (:meth:`EsaExecutor.decode`: the kernel on CUDA, its PyTorch form elsewhere).

The crossover with flex is measured, not guessed (:mod:`flexsparse.runtime.esa_kernel_table`): where the table has
rates for a call, the kernel is priced at its measured rate, and where flex measured faster the executor declines
the pattern, so its heads run on flex (on the H100: ESA with ``attn_length`` 256 below ~3K tokens, in inference
and training). Everywhere else (CPU, unknown devices, other dtypes, decode steps, chunks) the constant
:data:`SECONDS_PER_QUERY_KEY` prices the kernel and it takes every call it can run.

The executor recognises its patterns by name (``pattern_names``) and reads their ``attn_length``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernels_preferred_on
from flexsparse.kernels.esa_reference import esa_attention_reference, supports_head_dim
from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.cost import HBM_BYTES_PER_S
from flexsparse.runtime.esa_kernel_table import measured_rates
from flexsparse.runtime.executors import Executor

if TYPE_CHECKING:
    from flexsparse.runtime.decode import DecodeCall

SECONDS_PER_QUERY_KEY = 13.5e-3 / (131072 * 32 * 64)
"""The gather kernel's forward time per (query head, attended key) at head dim 128 where the measured table does
not apply: its forward at 128K for 32 query heads of ``attn_length`` 64 on the H100, the same rate at 8K
(docs/notes/esa-kernel.md); it scales with the head dim."""
CONSTANT_HEAD_DIM = 128
"""The head dim :data:`SECONDS_PER_QUERY_KEY` was measured at."""

def _runs(call: AttentionCall, heads: HeadSelection, modes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The selected KV heads as (first position in the selection, count, mode) runs: one mode, consecutive in the
    call's tensors and in the layer (one kernel call each)."""
    runs: list[list[int]] = []
    for i, (local, mode) in enumerate(zip(heads.kv_heads, modes)):
        if runs:
            first, count, run_mode = runs[-1]
            last_local = heads.kv_heads[first + count - 1]
            if (mode == run_mode and local == last_local + 1
                    and call.kv_heads[local] == call.kv_heads[last_local] + 1):
                runs[-1][1] += 1
                continue
        runs.append([i, 1, mode])
    return [tuple(run) for run in runs]


@functools.lru_cache(maxsize=256)
def _consecutive_runs(kv_heads: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Layer KV heads as (first index, count, the layer's first KV head) runs of consecutive heads."""
    runs: list[list[int]] = []
    for index, head in enumerate(kv_heads):
        if runs and head == runs[-1][2] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([index, 1, head])
    return [tuple(run) for run in runs]


class EsaExecutor(Executor):
    """ESA heads on CUDA through the gather kernel (forward, backward, decode, positions)."""

    name = "esa"
    pattern_names = ("esa",)
    """Names of the patterns the gather kernel runs (``Pattern.name``)."""

    def __init__(self, crossover: bool = True) -> None:
        self.crossover = crossover
        """Decline calls the measured table says flex runs faster (False: take every call the kernel can run, as
        benchmarks timing the kernel itself need)."""

    def __repr__(self) -> str:
        return f"EsaExecutor(crossover={self.crossover})"

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        device = call.q.device
        if not (pattern.name in self.pattern_names and kernels_preferred_on(device)
                and supports_head_dim(call.q.shape[-1])):
            return False
        rates = measured_rates(call, pattern.attn_length) if self.crossover else None
        return rates is None or rates.kernel <= rates.flex

    def cost(self, patterns, call):
        """The kernel's seconds per (query head, attended key), measured (the table) or the constant, times the
        pairs: ``min(attn_length, kv_len)`` keys per query."""
        batch, _, q_len, dim = call.q.shape
        seconds_per_query = 0.0
        for pattern in patterns:
            rates = measured_rates(call, pattern.attn_length)
            rate = rates.kernel if rates is not None else SECONDS_PER_QUERY_KEY * dim / CONSTANT_HEAD_DIM
            seconds_per_query += min(pattern.attn_length, call.geometry.kv_len) * rate
        return batch * call.group_size * q_len * seconds_per_query

    def decodes(self, pattern: Pattern) -> bool:
        return pattern.name in self.pattern_names

    def decode_cost(self, call: DecodeCall) -> float:
        """Each query reads its ``attn_length`` keys (at most the filled slots) at the device's bandwidth."""
        (group,) = call.groups
        keys = group.store.keys
        batch, heads, _, dim = keys.shape
        slots = min(group.pattern.attn_length, group.view.filled)
        return 2 * batch * heads * slots * dim * keys.element_size() / HBM_BYTES_PER_S

    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        from flexsparse.kernels.esa import esa_attention

        geo, group = call.geometry, call.group_size
        q_positions = key_slots = None
        if not geo.is_contiguous:
            q_positions = geo.positions.q
            key_slots = geo.positions.key_slots()[:, : geo.span].to(torch.int32)
        outputs = []
        for first, count, mode in _runs(call, heads, modes.host):
            local, layer = heads.kv_heads[first], call.kv_heads[heads.kv_heads[first]]
            kv = slice(local, local + count)
            rule = patterns[mode].index_rule
            outputs.append(esa_attention(
                call.q[:, local * group:(local + count) * group], call.k[:, kv], call.v[:, kv], rule,
                call.scale, q_positions=q_positions, key_slots=key_slots, head_offset=layer * group))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def decode(self, call: DecodeCall) -> Tensor:
        """One new token per sequence of one ESA group, q ``[B, H_g, 1, d]``, against the store's filled slots: the
        new token's ``attn_length`` keys, gathered by the kernel on CUDA, its PyTorch form elsewhere; with padding
        the view's query positions and the slot of each key position. One call per run of consecutive KV heads
        (the kernel takes whole KV groups of the layer's heads)."""
        (group,) = call.groups
        q, view = call.query(), group.view
        keys, values = group.store.keys[:, :, :view.filled], group.store.values[:, :, :view.filled]
        q_positions, key_slots = view.positions() if view.positions is not None else (None, None)
        if supports_head_dim(q.shape[-1]) and kernels_preferred_on(q.device):
            from flexsparse.kernels.esa import esa_attention as attend  # triton: imported where it runs
        else:
            attend = esa_attention_reference
        size, rule = q.shape[1] // keys.shape[1], group.pattern.index_rule
        outputs = [attend(q[:, first * size:(first + count) * size], keys[:, first:first + count],
                          values[:, first:first + count], rule, call.scale, q_positions=q_positions,
                          key_slots=key_slots, head_offset=head * size)
                   for first, count, head in _consecutive_runs(group.layer_kv_heads)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)
