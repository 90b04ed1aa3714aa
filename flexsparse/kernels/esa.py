"""ESA (Elastic Sparse Attention, seed 004) through Triton gather kernels: forward, backward and decode in
O(S * w), differentiable (:func:`esa_attention`).

Each query attends exactly ``w = attn_length`` keys per head, chosen by ESA's integer index rule
(:class:`~flexsparse.kernels.esa_index.EsaIndexRule`, recomputed inside the kernels: no index table is read). The
kernels, one idea a module: :mod:`~flexsparse.kernels.esa_forward` (16 or more queries per sequence),
:mod:`~flexsparse.kernels.esa_decode` (fewer), :mod:`~flexsparse.kernels.esa_backward` (dQ),
:mod:`~flexsparse.kernels.esa_dkdv` (dK/dV; no atomics, so every path is deterministic), on the shared pieces of
:mod:`~flexsparse.kernels.esa_shared` and the index rule in Triton (:mod:`~flexsparse.kernels.esa_index_triton`);
:mod:`~flexsparse.kernels.esa_launch` launches them.

The same function in plain PyTorch, :func:`esa_attention_reference`, and the argument checks both share live in
:mod:`flexsparse.kernels.esa_reference` (no triton import).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernel_unavailable
from flexsparse.kernels.esa_index import EsaIndexRule
from flexsparse.kernels.esa_launch import EsaLaunch, launch_backward, launch_forward
from flexsparse.kernels.esa_reference import (  # noqa: F401  (the reference and head dims: also imported from here)
    check_esa_inputs,
    check_position_tensor,
    esa_attention_reference,
    supports_head_dim,
)
from flexsparse.validation import as_float


class _EsaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, launch: EsaLaunch) -> Tensor:
        out, lse = launch_forward(q, k, v, launch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        need_dkdv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dq, dk, dv = launch_backward(grad_out, q, k, v, out, lse, ctx.launch, need_dkdv)
        return dq, dk, dv, None


def esa_launch(q: Tensor, k: Tensor, v: Tensor, rule: EsaIndexRule, scale: float | None = None, *,
               q_positions: Tensor | None = None, key_slots: Tensor | None = None,
               head_offset: int = 0) -> EsaLaunch:
    """The checked arguments of :func:`esa_attention` as the kernels take them (:class:`EsaLaunch`); also for
    benchmarks that launch the forward and backward kernels one by one."""
    head_offset = check_esa_inputs(q, k, v, rule, head_offset)
    batch, heads, q_len, dim = q.shape
    kv_len = k.shape[2]
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    check_position_tensor("q_positions", q_positions, batch, q_len, q.device)
    check_position_tensor("key_slots", key_slots, batch, None, q.device)
    if q_positions is None and q_len > kv_len:
        raise ValueError(f"without q_positions, S_q ({q_len}) must not exceed S_kv ({kv_len})")
    span = kv_len if key_slots is None else key_slots.shape[1]
    w, layers, rule_heads = rule.attn_length, rule.num_layers, rule.num_heads
    if 2 * (max(w, span) + 1) * max(w, rule_heads, layers) >= 2**31:
        raise ValueError(f"key positions ({span}) x max(attn_length, num_heads, num_layers) is too large for "
                         "the kernels' int32 index arithmetic")
    reason = kernel_unavailable(q.device)
    if reason is not None:
        raise ValueError(f"esa_attention needs CUDA tensors or the Triton interpreter (q is on {q.device}: "
                         f"{reason}); elsewhere use esa_attention_reference")
    sorted_pos = order = None
    if q_positions is not None:
        sorted_pos, sort_order = torch.sort(q_positions, dim=1, stable=True)
        order = sort_order.to(torch.int32)
    return EsaLaunch(
        num_heads=rule_heads, head_offset=head_offset, group=heads // k.shape[1], attn_length=w,
        layer_den=rule.layer_den, layer_weight=rule.layer_weight, scale=scale, q_len=q_len, kv_len=kv_len, span=span,
        first_pos=kv_len - q_len, sorted_pos=sorted_pos, order=order,
        key_slots=None if key_slots is None else key_slots.contiguous(),
        step_one=rule_heads % 2 == 0 or rule_heads == 1,
        precision="ieee" if q.dtype == torch.float32 else "tf32", split=q.dtype != torch.float32,
    )


def esa_attention(q: Tensor, k: Tensor, v: Tensor, rule: EsaIndexRule, scale: float | None = None, *,
                  q_positions: Tensor | None = None, key_slots: Tensor | None = None,
                  deterministic: bool = False, head_offset: int = 0) -> Tensor:
    """ESA attention ``[B, H, S_q, d]`` (q's dtype), differentiable in q, k and v.

    q ``[B, H, S_q, d]``, k/v ``[B, H_kv, S_kv, d]`` (H a multiple of H_kv; any strides with a contiguous last
    dim), d a power of two in [16, 256], float32/bfloat16/float16. ``rule``: the layer's ESA index parameters;
    q's heads are its heads ``head_offset .. head_offset + H - 1`` (default: all ``rule.num_heads`` of them);
    whole KV groups, so
    ``head_offset`` is a multiple of ``H / H_kv`` (the other heads of a layer may run elsewhere).
    ``q_positions`` int32 ``[B or 1, S_q]``: token positions of the query rows (default ``S_kv - S_q + i``), -1
    for padding (output row 0, no gradient). ``key_slots`` int32 ``[B or 1, span]``: key position p of batch b is
    ``k[b, :, key_slots[b, p]]`` (default: slot p); slots outside ``[0, S_kv)`` mark absent keys. A query at
    position p attends, per head, the ESA indices of p that are <= p and present. Query positions outside
    ``[0, span)`` count as padding. For gradients, distinct positions must map to distinct slots.
    ``deterministic``: accepted for the executor interface; every path is deterministic (no atomics).
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    launch = esa_launch(q, k, v, rule, scale, q_positions=q_positions, key_slots=key_slots, head_offset=head_offset)
    if q.shape[2] == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _EsaAttention.apply(q, k, v, launch)
