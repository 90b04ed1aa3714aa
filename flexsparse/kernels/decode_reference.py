"""The decode kernels' pieces that need no triton: the cache-group type, the argument checks, and
:func:`ranged_decode_reference` / :func:`decode_step_reference`, the functions of
:func:`~flexsparse.kernels.decode.ranged_decode_attention` and
:func:`~flexsparse.kernels.decode.decode_step_attention` in plain PyTorch (for tests, and for the sparse KV cache's
decode where the kernels do not run: a CPU, or no triton installed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.validation import as_float, as_int

MAX_HEAD_DIM = 256
"""The largest head dim the decode kernels take (they pad a smaller one to a power of two >= 16 in registers)."""
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The float dtypes the decode kernels take (the references also take float64)."""
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One cache group of a layer's decode step: the buffers of the layer's consecutive KV heads
    ``kv_start .. kv_start + n - 1`` and, per sequence, where the new token goes and which slots it attends.

    keys/values ``[B, n, C, d]`` (any strides with a contiguous last dim; C = the group's capacity, >= 1).
    lo, hi, slot: int32 or int64 ``[B]`` on the device (any stride): after its key and value are written at
    ``slot[b]``, the new query attends slots ``lo[b] <= s < hi[b]`` (clamped to ``[0, C]``), which must hold
    ``slot[b]``: the new token is always attended (an out-of-range slot is attended but not written).
    """

    keys: Tensor
    values: Tensor
    kv_start: int
    lo: Tensor
    hi: Tensor
    slot: Tensor


def check_tensor(name: str, t: object, dims: int, dtypes: tuple) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {', '.join(str(d)[6:] for d in dtypes)}, got {t.dtype}")


def _check_same(name: str, t: Tensor, q: Tensor) -> None:
    """t has q's dtype and device."""
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q is on {q.device}")


def _check_index(name: str, t: object, q: Tensor) -> None:
    """An int32/int64 ``[B]`` tensor on q's device."""
    check_tensor(name, t, 1, _INDEX_DTYPES)
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if t.shape[0] != q.shape[0]:
        raise ValueError(f"{name} must have shape [{q.shape[0]}] (q's batch), got {list(t.shape)}")


def _check_buffers(prefix: str, keys: object, values: object, q: Tensor, dtypes: tuple, kernel: bool) -> None:
    """keys/values ``[B, n, C, d]`` of q's dtype, batch, head dim and device; for the kernel a contiguous last
    dim and an int32 capacity."""
    check_tensor(f"{prefix}keys", keys, 4, dtypes)
    check_tensor(f"{prefix}values", values, 4, dtypes)
    _check_same(f"{prefix}keys", keys, q)
    _check_same(f"{prefix}values", values, q)
    if keys.shape != values.shape:
        raise ValueError(f"{prefix}keys and {prefix}values must have the same shape, got {list(keys.shape)} and "
                         f"{list(values.shape)}")
    batch, _, dim = q.shape
    if keys.shape[0] != batch or keys.shape[3] != dim:
        raise ValueError(f"{prefix}keys/values [B, Hkv, C, d] must match q's batch {batch} and head dim {dim}, "
                         f"got {list(keys.shape)}")
    if kernel:
        if keys.stride(-1) != 1 or values.stride(-1) != 1:
            raise ValueError(f"{prefix}keys and {prefix}values must have a contiguous last dimension "
                             "(stride(-1) == 1)")
        if keys.shape[2] >= 2**31:
            raise ValueError(f"{prefix}keys' capacity ({keys.shape[2]}) must fit int32")


def check_ranged_args(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor, dtypes: tuple,
                      kernel: bool) -> None:
    """Shapes [B, Hq, d], [B, Hkv, C, d] x 2, [B] x 2; one dtype for q/keys/values; one device for all."""
    check_tensor("q", q, 3, dtypes)
    _check_buffers("", keys, values, q, dtypes, kernel)
    _check_index("lo", lo, q)
    _check_index("hi", hi, q)
    if keys.shape[1] == 0 or q.shape[1] % keys.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of keys' heads ({keys.shape[1]})")


def check_decode_step_args(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup],
                           dtypes: tuple = SUPPORTED_DTYPES, kernel: bool = True) -> list[DecodeGroup]:
    """The shape/dtype/device checks of :func:`~flexsparse.kernels.decode.decode_step_attention` (``kernel``:
    also what its kernel needs of the buffers; ``dtypes``: the accepted float dtypes). Raises a TypeError or ValueError naming the argument;
    returns the groups in KV-head order. Runs when a launch plan is built, not on every call."""
    check_tensor("q", q, 3, dtypes)
    check_tensor("k_new", k_new, 3, dtypes)
    check_tensor("v_new", v_new, 3, dtypes)
    _check_same("k_new", k_new, q)
    _check_same("v_new", v_new, q)
    batch, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    if k_new.shape[0] != batch or k_new.shape[2] != dim or v_new.shape != k_new.shape:
        raise ValueError(f"k_new and v_new must have shape [B, Hkv, d] with q's batch {batch} and head dim {dim}, "
                         f"got {list(k_new.shape)} and {list(v_new.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k_new's heads ({kv_heads})")
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be a list or tuple of DecodeGroup, got {type(groups).__name__}")
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"groups must hold one or two DecodeGroup, got {len(groups)}")
    for i, group in enumerate(groups):
        if not isinstance(group, DecodeGroup):
            raise TypeError(f"groups[{i}] must be a DecodeGroup, got {type(group).__name__}")
        prefix = f"groups[{i}]."
        _check_buffers(prefix, group.keys, group.values, q, dtypes, kernel)
        if group.keys.shape[2] == 0:
            raise ValueError(f"{prefix}keys must have at least one slot (the new token's), got capacity 0")
        as_int(f"{prefix}kv_start", group.kv_start, minimum=0)
        for name in ("lo", "hi", "slot"):
            _check_index(prefix + name, getattr(group, name), q)
    ordered = sorted(groups, key=lambda group: group.kv_start)
    covered = 0
    for group in ordered:
        if group.kv_start != covered:
            break
        covered += group.keys.shape[1]
    if covered != kv_heads or any(group.keys.shape[1] == 0 for group in ordered):
        spans = ", ".join(f"{g.kv_start}..{g.kv_start + g.keys.shape[1] - 1}" for g in groups)
        raise ValueError(f"groups must cover the KV heads 0..{kv_heads - 1} of k_new exactly once, each a "
                         f"non-empty run of consecutive heads; got heads {spans}")
    return ordered


def ranged_decode_reference(q: Tensor, keys: Tensor, values: Tensor, lo: Tensor, hi: Tensor,
                            scale: float | None = None) -> Tensor:
    """The same function as :func:`~flexsparse.kernels.decode.ranged_decode_attention` in plain PyTorch (any
    device, any strides).

    Computes in float64 for float64 inputs (accepted here, for a high-precision reference), else in float32;
    returns ``[B, Hq, d]`` in q's dtype. O(B Hq C d) time, O(B Hq C) memory for the scores.
    """
    check_ranged_args(q, keys, values, lo, hi, SUPPORTED_DTYPES + (torch.float64,), kernel=False)
    batch, heads, dim = q.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    grouped = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,bkcd->bkgc", grouped, keys.to(dtype)) * scale
    slot = torch.arange(capacity, device=q.device)
    inside = (slot >= lo.clamp(0, capacity)[:, None]) & (slot < hi.clamp(0, capacity)[:, None])  # [B, C]
    scores = scores.masked_fill(~inside[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty range: all -inf, a zero row
    out = torch.einsum("bkgc,bkcd->bkgd", weights, values.to(dtype))
    return out.reshape(batch, heads, dim).to(q.dtype)


def decode_step_reference(q: Tensor, k_new: Tensor, v_new: Tensor, groups: Sequence[DecodeGroup],
                          scale: float | None = None) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The same function as :func:`~flexsparse.kernels.decode.decode_step_attention` in plain PyTorch, without
    mutating its inputs.

    Returns (out ``[B, Hq, d]`` in q's dtype, each group's keys after the write, each group's values after the
    write), the lists in the order of ``groups``. Accepts float64 (for a high-precision reference).
    """
    check_decode_step_args(q, k_new, v_new, groups, SUPPORTED_DTYPES + (torch.float64,), kernel=False)
    group_size = q.shape[1] // k_new.shape[1]
    rows = torch.arange(q.shape[0], device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    new_keys, new_values = [], []
    for group in groups:
        kv = slice(group.kv_start, group.kv_start + group.keys.shape[1])
        keys, values = group.keys.clone(), group.values.clone()
        keys[rows, :, group.slot.long()] = k_new[:, kv]
        values[rows, :, group.slot.long()] = v_new[:, kv]
        heads = slice(kv.start * group_size, kv.stop * group_size)
        out[:, heads] = ranged_decode_reference(q[:, heads], keys, values, group.lo, group.hi, scale)
        new_keys.append(keys)
        new_values.append(values)
    return out, new_keys, new_values
