"""The ESA executor: ESA heads through flexsparse's Triton gather kernel (:mod:`flexsparse.kernels.esa`).

FlexAttention is the wrong tool for ESA: its dilated keys touch 19-60% of the tiles, every one partial. The gather
kernel reads each query's ``attn_length`` keys directly. It takes any whole KV groups of a layer (the kernel's
``head_offset`` gives each head its own shifts), so in a mixed layer the ESA heads run here beside full heads on
SDPA and sink+window heads on flex. CPU calls and head dims the kernel does not take (not a power of two in
[16, 256]) keep ESA heads on flex.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernels_run_on
from flexsparse.masks.base import Pattern
from flexsparse.masks.esa import ESA
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.executors import Executor


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


class EsaExecutor(Executor):
    """ESA heads on CUDA through the gather kernel (forward, backward, decode, positions)."""

    name = "esa"

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        device = call.q.device
        if not (isinstance(pattern, ESA) and device.type == "cuda" and kernels_run_on(device)):
            return False
        from flexsparse.kernels.esa import supports_head_dim

        return supports_head_dim(call.q.shape[-1])

    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        from flexsparse.kernels.esa import esa_attention
        from flexsparse.kernels.esa_index import EsaIndexRule

        geo, group = call.geometry, call.group_size
        q_positions = key_slots = None
        if not geo.is_contiguous:
            q_positions = geo.positions.q
            key_slots = geo.positions.key_slots()[:, : geo.span].to(torch.int32)
        outputs = []
        for first, count, mode in _runs(call, heads, modes.host):
            local, layer = heads.kv_heads[first], call.kv_heads[heads.kv_heads[first]]
            kv = slice(local, local + count)
            pattern = patterns[mode]
            rule = EsaIndexRule(pattern.layer_idx, pattern.num_layers, pattern.attn_length, pattern.num_heads)
            outputs.append(esa_attention(
                call.q[:, local * group:(local + count) * group], call.k[:, kv], call.v[:, kv], rule,
                call.scale, q_positions=q_positions, key_slots=key_slots, head_offset=layer * group))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
