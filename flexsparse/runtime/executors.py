"""Executors: what runs a group of heads. SDPA for full causal heads, masked SDPA on dense masks (small sizes);
the flex executors live in flex.py.

An executor says which patterns it accepts for a call and computes the output of a head selection. Patterns are
data: an executor never asks which class a pattern is, only what the protocol says (``is_full``, ``dense``,
``block_mask``, ``mask_mod``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flexsparse.masks.base import Pattern
from flexsparse.masks.combine import gather_heads
from flexsparse.masks.geometry import MAX_DENSE_ELEMENTS
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection


class Executor(ABC):
    """Runs the heads of one group of a layer's plan."""

    name: str

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        """Whether this executor can run ``pattern`` for this call (default: any pattern)."""
        return True

    @abstractmethod
    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        """Output ``[B, H_sel, Q, d]`` of the selected heads; ``patterns[m]`` is mode m's pattern for this call
        (resolved if content-dependent; None when no head uses it)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _zero_empty_rows(out: Tensor, empty: Tensor) -> Tensor:
    """Rows whose mask is empty (padding queries) are 0, as FlexAttention returns them."""
    return out.masked_fill(empty[..., None], 0.0)


def _with_dummy_key(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """SDPA returns NaN for rows with no key: let such rows see key 0, and report them for zeroing."""
    empty = ~allowed.any(-1)
    first_key = torch.arange(allowed.shape[-1], device=allowed.device) == 0
    return allowed | (empty[..., None] & first_key), empty


def sdpa_without_graph_builds(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                              enable_gqa: bool = False) -> Tensor:
    """Unmasked SDPA for calls whose key length changes every time (decode against a growing cache).

    On an H100 with torch 2.11, SDPA prefers cuDNN's attention for bf16, and cuDNN builds an execution graph for
    every new shape: ~60 ms per decode step, against ~0.1 ms of GPU work. This call leaves cuDNN out (flash
    serves it, GQA without a K/V copy) and restores the setting; on other devices it is plain SDPA.
    """
    if q.device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


class SdpaExecutor(Executor):
    """Full causal heads through ``F.scaled_dot_product_attention`` (the fastest dense kernel).

    Contiguous prefill runs ``is_causal=True``. Other calls (padding, decode, chunks) pass an explicit boolean
    mask from the positions, with the GQA group folded into the query rows so no K/V copy is made; that mask is
    O(B x G x Q x KV), so it is used only up to ``max_mask_elements`` (decode and short chunks). Longer calls
    with positions are not accepted and go to flex.
    """

    name = "sdpa"

    def __init__(self, max_mask_elements: int = 1 << 26) -> None:
        self.max_mask_elements = max_mask_elements

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        if not pattern.is_full or pattern.is_dynamic:
            return False
        geo = call.geometry
        if geo.is_contiguous and geo.q_len == geo.kv_len:
            return True
        return geo.batch * call.group_size * geo.q_len * geo.kv_len <= self.max_mask_elements

    def run(self, call, patterns, modes, heads):
        q, k, v = heads.pick(call)
        geo = call.geometry
        if geo.is_contiguous and geo.q_len == geo.kv_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=call.scale,
                                                  enable_gqa=call.group_size > 1)
        batch, n_heads, q_len, dim = q.shape
        group = call.group_size
        allowed = geo.kv_positions()[:, None, :] <= geo.q_positions()[:, :, None]  # [B', Q, KV]
        allowed, empty = _with_dummy_key(allowed)
        folded_mask = allowed[:, None, None].expand(-1, 1, group, -1, -1).reshape(allowed.shape[0], 1, -1,
                                                                                 geo.kv_len)
        folded_q = q.reshape(batch, k.shape[1], group * q_len, dim)
        out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask, scale=call.scale)
        return _zero_empty_rows(out.reshape(batch, n_heads, q_len, dim), empty[:, None])


class DenseExecutor(Executor):
    """Masked SDPA on the patterns' dense references, in chunks of query rows so that one chunk's mask holds at
    most :data:`~flexsparse.masks.geometry.MAX_DENSE_ELEMENTS` booleans. O(Q x KV) time: for small sizes and
    CPU training (it has a backward everywhere; CPU flex has none)."""

    name = "dense"

    def run(self, call, patterns, modes, heads):
        q, k, v = heads.pick(call)
        geo = call.geometry
        batch, n_heads, q_len, _ = q.shape
        rows = max(1, MAX_DENSE_ELEMENTS // max(batch * n_heads * geo.kv_len, 1))
        used = next(p for p in patterns if p is not None)
        outputs = []
        for start in range(0, q_len, rows):
            stop = min(start + rows, q_len)
            sub = geo if (start, stop) == (0, q_len) else geo.query_rows(start, stop)
            masks = []
            for p in patterns:
                mask = (used if p is None else p).dense(sub)
                masks.append(mask[:, heads.q_heads] if mask.shape[1] > 1 else mask)
            allowed, empty = _with_dummy_key(gather_heads(masks, modes.per_head))
            out = F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=allowed, scale=call.scale,
                                                 enable_gqa=call.group_size > 1)
            outputs.append(_zero_empty_rows(out, empty))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
