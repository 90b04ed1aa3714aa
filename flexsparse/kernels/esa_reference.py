"""ESA attention in plain PyTorch (:func:`esa_attention_reference`, a chunked gather) and the argument checks it
shares with the Triton kernels of :mod:`flexsparse.kernels.esa`. Imports no triton: the reference runs on any
device, also where triton is not installed. Its indices come from :meth:`EsaIndexRule.indices
<flexsparse.kernels.esa_index.EsaIndexRule.indices>`."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.kernels.esa_index import EsaIndexRule
from flexsparse.validation import as_float, as_int

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the Triton kernels take (the reference also takes float64)."""


def check_position_tensor(name: str, t: Tensor | None, batch: int, length: int | None, device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 2 or t.shape[0] not in (1, batch) or (length is not None and t.shape[1] != length):
        want = f"[{batch} or 1, {length if length is not None else 'span'}]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must not be empty")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")


def check_esa_inputs(q: Tensor, k: Tensor, v: Tensor, rule: EsaIndexRule, head_offset: object,
                     dtypes: tuple = SUPPORTED_DTYPES) -> int:
    """Raises on bad inputs; returns head_offset checked."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {list(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be one of {', '.join(str(d)[6:] for d in dtypes)}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride(-1) == 1)")
    if not isinstance(rule, EsaIndexRule):
        raise TypeError(f"rule must be a flexsparse.kernels.esa_index.EsaIndexRule, got {type(rule).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    batch, heads, _, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k/v [B, H_kv, S_kv, d] must match q's batch {batch} and head_dim {dim}, "
                         f"got {list(k.shape)}")
    if not supports_head_dim(dim):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {dim}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k/v's heads ({k.shape[1]})")
    if k.shape[2] == 0:
        raise ValueError("k and v must hold at least one key (S_kv >= 1)")
    head_offset = as_int("head_offset", head_offset, minimum=0)
    if head_offset % (heads // k.shape[1]) or head_offset + heads > rule.num_heads:
        raise ValueError(f"q's {heads} heads from head_offset={head_offset} must be whole KV groups of the "
                         f"rule's num_heads={rule.num_heads} heads (head_offset a multiple of "
                         f"{heads // k.shape[1]}, head_offset + {heads} <= {rule.num_heads})")
    return head_offset


def supports_head_dim(dim: int) -> bool:
    """Whether the kernels take this head dim: a power of two in [16, 256]."""
    return 16 <= dim <= 256 and not dim & (dim - 1)



def esa_attention_reference(q: Tensor, k: Tensor, v: Tensor, rule: EsaIndexRule, scale: float | None = None, *,
                            q_positions: Tensor | None = None, key_slots: Tensor | None = None,
                            chunk: int = 1024, head_offset: int = 0) -> Tensor:
    """The same function as :func:`esa_attention` in plain PyTorch (any device, differentiable).

    Gathers each query's w keys, ``chunk`` queries at a time: O(B H S_q w d) time, O(H chunk w d) memory. Computes
    in q's dtype (float64 accepted here: pass float64 inputs for a high-precision reference).
    """
    head_offset = check_esa_inputs(q, k, v, rule, head_offset, dtypes=SUPPORTED_DTYPES + (torch.float64,))
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    chunk = as_int("chunk", chunk, minimum=1)
    check_position_tensor("q_positions", q_positions, batch, q_len, q.device)
    check_position_tensor("key_slots", key_slots, batch, None, q.device)
    span = kv_len if key_slots is None else key_slots.shape[1]
    if q_positions is None:
        q_positions = (torch.arange(q_len, device=q.device) + kv_len - q_len)[None]
    positions = q_positions.long().expand(batch, q_len)
    kv_head = torch.arange(heads, device=q.device) // (heads // kv_heads)
    out = []
    for b in range(batch):
        rows = []
        for first in range(0, q_len, chunk):
            pos = positions[b, first:first + chunk]
            real = (pos >= 0) & (pos < span)
            index = rule.indices(torch.where(real, pos, 0))[head_offset:head_offset + heads]  # [H, n, w]
            ok = real[None, :, None] & (index <= pos[None, :, None])
            if key_slots is None:
                slot = index
            else:
                slot = key_slots[min(b, key_slots.shape[0] - 1)].long()[index.clamp(max=span - 1)]
            ok &= (slot >= 0) & (slot < kv_len)
            slot = torch.where(ok, slot, 0)
            keys = k[b][kv_head[:, None, None], slot]  # [H, n, w, d]
            values = v[b][kv_head[:, None, None], slot]
            scores = torch.einsum("hnd,hnwd->hnw", q[b, :, first:first + chunk], keys) * scale
            weights = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
            rows.append(torch.einsum("hnw,hnwd->hnd", weights, values))
        out.append(torch.cat(rows, dim=1))
    return torch.stack(out)
