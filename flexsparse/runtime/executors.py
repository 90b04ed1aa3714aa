"""Executors: what runs a group of heads. SDPA for full causal heads (and their decode steps in a sparse KV
cache), masked SDPA on dense masks (small sizes); the flex executors live in flex.py, the ESA kernel's in
esa_executor.py, the registry of the default set in registry.py.

An executor says which patterns it accepts for a call (:meth:`Executor.accepts`), what running some heads would
cost (:meth:`Executor.cost`), computes the output of a head selection (:meth:`Executor.run`) and, for a sparse KV
cache's decode steps, which patterns it decodes (:meth:`Executor.decodes`) and how
(:meth:`Executor.accepts_decode`, :meth:`Executor.decode_cost`, :meth:`Executor.decode`;
:mod:`flexsparse.runtime.decode`). Patterns are data: an executor never asks which class a pattern is, only what
the protocol says (``is_full``, ``decode_reads``, ``dense``, ``block_mask``, ``mask_mod``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexsparse.kernels.availability import kernels_preferred_on
from flexsparse.kernels.decode_reference import MAX_HEAD_DIM, ranged_decode_reference
from flexsparse.masks.base import Pattern
from flexsparse.masks.combine import gather_heads
from flexsparse.masks.geometry import MAX_DENSE_ELEMENTS
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.cost import DENSE_FLOPS_PER_S, attention_flops, causal_pairs
from flexsparse.runtime.dense_kernels import DenseKernel, dense_kernel, sdpa_backend_order

if TYPE_CHECKING:
    from flexsparse.runtime.decode import DecodeCall

_MASKED_DECODE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Executor(ABC):
    """Runs the heads of one group of a layer's plan."""

    name: str
    fuses: bool = False
    """Runs any mix of the patterns it accepts in one launch, with modes chosen per head on the device (a per-call
    mode tensor): what fused plans use."""

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        """Whether this executor can run ``pattern`` for this call (its geometry, device, dtype, grad mode);
        default: any pattern."""
        return True

    @abstractmethod
    def cost(self, patterns: Sequence[Pattern], call: AttentionCall) -> float:
        """Estimated device seconds to run KV heads of these patterns (one entry per KV head, each accepted) in
        this call, without the launch (:mod:`flexsparse.runtime.cost`)."""

    @abstractmethod
    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        """Output ``[B, H_sel, Q, d]`` of the selected heads; ``patterns[m]`` is mode m's pattern for this call
        (resolved if content-dependent; None when no head uses it)."""

    # ----- decode steps over a sparse KV cache (flexsparse.runtime.decode) --------------------------------------

    fuses_decode: bool = False
    """Decodes every group of a layer's step in one call (:func:`~flexsparse.runtime.decode.plan_decode` offers it
    the whole step)."""
    writes_new_token: bool = False
    """Its decode writes the new token's key and value into the stores itself (else they are written first)."""

    def decodes(self, pattern: Pattern) -> bool:
        """Whether this executor decodes heads of ``pattern`` over their store (a capability of the pattern alone:
        a sparse KV cache groups heads by the first executor that does). Default: no."""
        return False

    def accepts_decode(self, call: DecodeCall) -> bool:
        """Whether this executor runs ``call`` (one group unless it ``fuses_decode``). Default: one group whose
        pattern it :meth:`decodes`."""
        return len(call.groups) == 1 and call.groups[0].pattern is not None and self.decodes(call.groups[0].pattern)

    def decode_cost(self, call: DecodeCall) -> float:
        """Estimated device seconds of ``call``. Default: every filled slot read once at the device's bandwidth."""
        return call.read_seconds()

    def decode(self, call: DecodeCall) -> Tensor:
        """The step's output ``[B, H_g, 1, d]`` for the call's groups' query heads, in their order."""
        raise NotImplementedError(f"{self.name} does not decode")

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
    every new shape, far longer than the step's GPU work
    (docs/bench/hf-bench-h100/h100-cudnn-sdpa-growing-length.txt). This call leaves cuDNN out (flash serves it,
    GQA without a K/V copy) and restores the setting; on other devices it is plain SDPA.
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

    Contiguous prefill runs ``is_causal=True`` on the backend the device's measured table picks
    (:mod:`flexsparse.runtime.dense_kernels`; SDPA's own choice on devices it does not know and on the CPU).
    Other calls (padding, decode, chunks) pass an explicit boolean mask from the positions, with the GQA group
    folded into the query rows so no K/V copy is made; on CUDA they run without cuDNN, whose graph build per new
    key length would cost more than the call. That mask is O(B x G x Q x KV), so it is used only up to
    ``max_mask_elements`` (decode and short chunks). Longer calls with positions are not accepted and go to flex.
    """

    name = "sdpa"

    def __init__(self, max_mask_elements: int = 1 << 26) -> None:
        self.max_mask_elements = max_mask_elements

    def cost(self, patterns, call):
        kernel = self._prefill_kernel(call)
        speed = kernel.flops_per_s if kernel is not None and kernel.flops_per_s else DENSE_FLOPS_PER_S
        return attention_flops(call, len(patterns), causal_pairs(call)) / speed

    @staticmethod
    def _prefill_kernel(call: AttentionCall) -> DenseKernel | None:
        """The measured table's backend for a contiguous prefill call (None: other calls, unknown devices)."""
        geo = call.geometry
        if not geo.is_contiguous:
            return None
        return dense_kernel(call.q.device, geo.q_len, geo.kv_len, call.needs_grad, dtype=call.q.dtype,
                            block_size=geo.block_size)

    def decodes(self, pattern: Pattern) -> bool:
        """Heads whose store holds only keys the query attends: every earlier key, or a sink + window ring."""
        return pattern.decode_reads.attends_every_stored_key

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
            kernel = None if torch.compiler.is_compiling() else self._prefill_kernel(call)
            with nullcontext() if kernel is None else sdpa_kernel(sdpa_backend_order(kernel.backend),
                                                                  set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=call.scale,
                                                      enable_gqa=call.group_size > 1)
        batch, n_heads, q_len, dim = q.shape
        group = call.group_size
        allowed = geo.kv_positions()[:, None, :] <= geo.q_positions()[:, :, None]  # [B', Q, KV]
        allowed, empty = _with_dummy_key(allowed)
        folded_mask = allowed[:, None, None].expand(-1, 1, group, -1, -1).reshape(allowed.shape[0], 1, -1,
                                                                                 geo.kv_len)
        folded_q = q.reshape(batch, k.shape[1], group * q_len, dim)
        with sdpa_kernel(_MASKED_DECODE_BACKENDS) if q.is_cuda else nullcontext():  # no graph per key length
            out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask, scale=call.scale)
        return _zero_empty_rows(out.reshape(batch, n_heads, q_len, dim), empty[:, None])

    def decode(self, call: DecodeCall) -> Tensor:
        """Every slot of the view a key the query attends (q ``[B, H_g, 1, d]``, the store ``[B, H_kv, S, d]``):
        a prefix of the slots (no padding) is SDPA without a mask, GQA without a K/V copy (the flash kernel: a
        position mask would send SDPA to a slower one, and cuDNN's would build a graph per step); per-row slot
        ranges (a left-padded prompt) run the ranged decode kernel on CUDA (no host sync), its PyTorch form
        elsewhere; a position mask is SDPA with a boolean mask, the GQA group folded into query rows."""
        (group,) = call.groups
        q, view, store = call.query(), group.view, group.store
        keys, values, filled = store.keys, store.values, view.filled
        if view.visible is not None:
            return _masked_decode(q, keys[:, :, :filled], values[:, :, :filled], view.visible, view.empty,
                                  call.scale)
        if view.prefix:
            return sdpa_without_graph_builds(q, keys[:, :, :filled], values[:, :, :filled], scale=call.scale,
                                             enable_gqa=q.shape[1] > keys.shape[1])
        if q.shape[-1] <= MAX_HEAD_DIM and kernels_preferred_on(q.device):
            from flexsparse.kernels.decode import ranged_decode_attention  # triton: imported where it runs

            return ranged_decode_attention(q[:, :, 0], keys, values, view.lo, view.hi, scale=call.scale)[:, :, None]
        return ranged_decode_reference(q[:, :, 0], keys, values, view.lo, view.hi, scale=call.scale)[:, :, None]


def _masked_decode(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, empty: Tensor,
                   scale: float | None) -> Tensor:
    """One query per sequence against the slots marked in ``allowed`` (bool ``[B', S]``; ``empty`` ``[B', 1]``:
    queries that read none, whose row is 0): SDPA with a boolean mask, the GQA group folded into query rows (no
    K/V copy); on CUDA not cuDNN's attention, which would build a graph for every new key length."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    folded = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # one query: the group's rows
    with sdpa_kernel(_MASKED_DECODE_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=allowed[:, None, None, :], scale=scale)
    return out.masked_fill(empty[:, :, None, None], 0.0).reshape(batch, heads, 1, dim)


class DenseExecutor(Executor):
    """Masked SDPA on the patterns' dense references, in chunks of query rows so that one chunk's mask holds at
    most :data:`~flexsparse.masks.geometry.MAX_DENSE_ELEMENTS` booleans. O(Q x KV) time: for small sizes and
    CPU training (it has a backward everywhere; CPU flex has none)."""

    name = "dense"
    fuses = True

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len
        """The longest q_len/kv_len accepted (None: any); a layer's ``max_dense_len``."""

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        return self.max_len is None or max(call.geometry.q_len, call.geometry.kv_len) <= self.max_len

    def cost(self, patterns, call):
        geo = call.geometry
        return attention_flops(call, len(patterns), geo.q_len * geo.kv_len) / DENSE_FLOPS_PER_S

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
            allowed, empty = _with_dummy_key(gather_heads(masks, modes.q_modes))
            out = F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=allowed, scale=call.scale,
                                                 enable_gqa=call.group_size > 1)
            outputs.append(_zero_empty_rows(out, empty))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
