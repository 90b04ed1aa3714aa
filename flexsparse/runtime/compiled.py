"""flexsparse's own torch.compile'd flex_attention, which refuses torch's silent unfused O(S^2) fallback."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

MAX_COMPILED_VARIANTS = 256
"""Compiled flex_attention variants (shapes, dtypes, pattern sets, grad modes) allowed per process before
flexsparse raises RecompileLimitError instead of letting torch fall back to the unfused O(S^2) path. Calls run
at bucketed shapes (:mod:`flexsparse.runtime.buckets`, whose docstring gives the bound), so traffic compiles a
bounded set: 20 variants for a one-layer model serving lengths up to 256 at block 16 and batches up to 8, a
few times that per pattern set for lengths up to 128K at block 128 (11 key buckets). Change it here
(``flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS = 512``) when a process needs more."""

_compiled_flex_attention = None


class RecompileLimitError(RuntimeError):
    """Compiled flex_attention would fall back to the unfused O(S^2) path."""


def _flexsparse_flex_attention(q, k, v, block_mask, scale, enable_gqa, kernel_options):
    """flex_attention behind a code object of flexsparse's own.

    torch.compile keeps compiled variants, and the recompile limit, per code object. Compiling torch's
    ``flex_attention`` directly would share both with every other caller in the process, and once any caller hits
    the limit torch marks that code object to run uncompiled (the O(S^2) path) for everyone, silently.
    """
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


def compiled_flex_attention():
    """flexsparse's ``torch.compile``'d flex_attention (one variant per shape/dtype/mask structure/grad mode).

    Call it as ``compiled_flex_attention()(q, k, v, block_mask, scale, enable_gqa, kernel_options)``; prefer
    :func:`run_flex`, which refuses the unfused fallback.
    """
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(_flexsparse_flex_attention, dynamic=False)
    return _compiled_flex_attention


@functools.lru_cache(maxsize=4)
def _refuse_unfused_fallback(limit: int, accumulated: int):
    """A reusable dynamo config patch (building one per call costs more than the call's own Python)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit,
                                      accumulated_recompile_limit=max(limit, accumulated))


def run_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float,
             kernel_options: dict | None = None) -> Tensor:
    """Compiled flex_attention; raises instead of silently running the unfused O(S^2) path after recompiles."""
    enable_gqa = q.shape[1] != k.shape[1]
    options = kernel_options or None
    if torch.compiler.is_compiling():  # inside the user's torch.compile: their graph fuses it
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=options)
    limit = max(torch._dynamo.config.recompile_limit, MAX_COMPILED_VARIANTS)
    try:
        with _refuse_unfused_fallback(limit, torch._dynamo.config.accumulated_recompile_limit):
            return compiled_flex_attention()(q, k, v, block_mask, scale, enable_gqa, options)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            f"flex_attention reached its limit of {limit} compiled variants "
            "(flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS); flexsparse refuses the unfused fallback that "
            "materialises the S x S score matrix. Variants come from length buckets, batch part sizes, "
            "dtypes, head dims, pattern sets and grad modes: share pattern objects across layers, or raise "
            "the limit."
        ) from err
