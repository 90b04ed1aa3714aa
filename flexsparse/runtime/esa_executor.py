"""The ESA executor: ESA heads through flexsparse's Triton gather kernel (:mod:`flexsparse.kernels.esa`).

FlexAttention is the wrong tool for ESA: its dilated keys touch 19-60% of the tiles, every one partial. The gather
kernel reads each query's ``attn_length`` keys directly. It computes per-head shifts from the head's index in the
layer, so it runs a layer whose heads are all ESA (the planner gives it only whole layers); mixed layers, CPU
calls and head dims the kernel does not take (not a power of two in [16, 256]) keep ESA heads on flex.
"""

from __future__ import annotations

import torch

from flexsparse.masks.base import Pattern
from flexsparse.masks.esa import ESA
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.executors import Executor


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class EsaExecutor(Executor):
    """ESA heads of a whole layer on CUDA through the gather kernel (forward, backward, decode, positions)."""

    name = "esa"
    needs_all_heads = True

    def __init__(self) -> None:
        self.available = _triton_available()

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        if not (self.available and call.q.device.type == "cuda" and isinstance(pattern, ESA)):
            return False
        from flexsparse.kernels.esa import supports_head_dim

        return supports_head_dim(call.q.shape[-1])

    def run(self, call, patterns, modes, heads):
        from flexsparse.kernels.esa import esa_attention

        pattern = patterns[modes.uniform]
        geo = call.geometry
        q_positions = key_slots = None
        if not geo.is_contiguous:
            q_positions = geo.positions.q
            key_slots = geo.positions.key_slots()[:, : geo.span].to(torch.int32)
        return esa_attention(call.q, call.k, call.v, pattern, call.scale, q_positions=q_positions,
                             key_slots=key_slots)
