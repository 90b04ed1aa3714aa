"""Full causal heads through FlashAttention-4 (``flash_attn.cute.flash_attn_func``, the CuTe DSL kernels of the
optional ``fast`` extra), where the device's measured table (:mod:`flexsparse.runtime.dense_kernels`) has it faster
than SDPA's backends.

The executor takes what SDPA's takes on its fast path, a contiguous causal prefill (as many queries as keys, no
padding), on a CUDA device whose table row measured ``fa4``, in 16-bit floats, with the extra installed; it prices
a head at that row's throughput, so the planner gives full heads to it only where it measured faster (and keeps
SDPA elsewhere, and for padding, decode and chunks). Forward and backward: FlashAttention-4's autograd function
(its Hopper and Blackwell kernels). GQA runs without a K/V copy.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.cost import attention_flops, causal_pairs
from flexsparse.runtime.dense_kernels import kernel_rate
from flexsparse.runtime.executors import Executor

KERNEL = "fa4"
"""The dense kernel table's name for FlashAttention-4."""
_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def fa4_attention() -> Callable | None:
    """FlashAttention-4's ``flash_attn_func``, or None where it does not import (the ``fast`` extra missing)."""
    try:
        return importlib.import_module("flash_attn.cute").flash_attn_func
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None


def fa4_runs_on(device: torch.device) -> bool:
    """Whether FlashAttention-4 runs on ``device``: a CUDA device, with the extra installed."""
    return device.type == "cuda" and fa4_attention() is not None


class Fa4Executor(Executor):
    """Full causal heads of a contiguous prefill on FlashAttention-4 (see the module docstring)."""

    name = "fa4"

    def _rate(self, call: AttentionCall) -> float | None:
        geo = call.geometry
        return kernel_rate(KERNEL, call.q.device, geo.q_len, geo.kv_len, call.needs_grad, dtype=call.q.dtype)

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        if not pattern.is_full or pattern.is_dynamic:
            return False
        geo, q = call.geometry, call.q
        if not (geo.is_contiguous and geo.q_len == geo.kv_len) or q.dtype not in _DTYPES:
            return False
        if q.shape[-1] % 8 or q.shape[-1] > 256 or torch.compiler.is_compiling():
            return False
        return self._rate(call) is not None and fa4_runs_on(q.device)

    def cost(self, patterns: Sequence[Pattern], call: AttentionCall) -> float:
        return attention_flops(call, len(patterns), causal_pairs(call)) / self._rate(call)

    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        q, k, v = heads.pick(call)  # [B, H, S, d]: FlashAttention-4 takes [B, S, H, d] (strided views)
        out = fa4_attention()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=call.scale,
                              causal=True)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
