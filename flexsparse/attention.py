"""HybridAttention: every KV head of a layer in its own pattern, chosen per layer or per input.

The module holds the configuration and the default modes; a forward call is: describe the call (positions from a
padding mask or a cache), plan (group heads by executor, :mod:`flexsparse.runtime.plan`), execute each group once
into one output.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from flexsparse.masks.base import Pattern
from flexsparse.masks.blocks import BlockMaskStack, block_density
from flexsparse.masks.combine import gather_heads
from flexsparse.masks.geometry import Geometry, Positions
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio
from flexsparse.runtime.call import AttentionCall, GroupModes
from flexsparse.runtime.esa_executor import EsaExecutor
from flexsparse.runtime.executors import DenseExecutor, SdpaExecutor
from flexsparse.runtime.flex import FlexExecutor
from flexsparse.runtime.plan import PLAN_KINDS, HeadGroup, PlanKind, Planner
from flexsparse.validation import as_float, as_int

Backend = Literal["auto", "flex", "flex_eager", "dense"]
BACKENDS = ("auto", "flex", "flex_eager", "dense")
CallModes = Tensor | int | str | Sequence[str | int] | None
"""Per-call modes: None (the defaults), an int tensor ``[H_kv]`` / ``[B, H_kv]``, one name or index for every head,
or a list of names or indices, one per KV head."""
CPU_COMPILED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes compiled flex_attention runs on a CPU (inductor refuses float64 there)."""


@dataclass
class AttentionStats:
    """Sparsity of the last call. Tensors (no host sync until read); ``as_dict`` gives floats. Batch rows without
    a real query (padding only) count as nothing; a call without any real query gives NaN."""

    msr: Tensor
    """Model sparsity ratio (Elastic Attention Eq. 4): fraction of (batch, kv head) rows in a sparse mode."""
    esr: Tensor
    """Effective sparsity ratio (Eq. 5): mean over heads of the fraction of causal (q, k) pairs pruned."""
    block_density: Tensor
    """Fraction of causal tiles the kernel computes."""

    def as_dict(self) -> dict[str, float]:
        return {"msr": float(self.msr), "esr": float(self.esr), "block_density": float(self.block_density)}


def _as_pattern_dict(patterns: Mapping[str, Pattern] | Pattern) -> OrderedDict[str, Pattern]:
    if isinstance(patterns, Pattern):
        return OrderedDict(default=patterns)
    if not isinstance(patterns, Mapping) or not patterns:
        raise TypeError("patterns must be a Pattern or a non-empty mapping of name -> Pattern")
    for name, p in patterns.items():
        if not isinstance(name, str) or not isinstance(p, Pattern):
            raise TypeError(f"patterns must map str -> Pattern, got {name!r} -> {type(p).__name__}")
    return OrderedDict(patterns)


def _assemble(results: list[tuple[HeadGroup, Tensor]], num_heads: int) -> Tensor:
    """The groups' results ``[B, h_g, S_q, d]`` written into one ``[B, H, S_q, d]`` output at their query heads.

    The buffer takes the memory layout (dimension order) of the largest result, so that the largest copy is a
    straight copy, not a transpose. The copies go into the buffer itself, not into a permuted view of it: autograd
    rejects an ``index_copy_`` into a view after a slice assignment into it."""
    largest = max((r for _, r in results), key=lambda r: r.shape[1])
    order = sorted(range(4), key=lambda dim: -largest.stride(dim))  # outermost dimension first
    shape = list(largest.shape)
    shape[1] = num_heads
    buffer = largest.new_empty([shape[dim] for dim in order])
    head_dim = order.index(1)
    for group, result in results:
        result = result.permute(order)
        where = group.heads.q_index
        if isinstance(where, slice):
            buffer.narrow(head_dim, where.start, where.stop - where.start).copy_(result)
        else:
            buffer.index_copy_(head_dim, where, result)
    return buffer.permute([order.index(dim) for dim in range(4)])


class HybridAttention(nn.Module):
    """Attention whose KV heads each run one of several patterns.

    Args:
        num_heads: query heads H.
        num_kv_heads: key/value heads (divides ``num_heads``; GQA groups of ``num_heads // num_kv_heads``).
        head_dim: per-head dimension d.
        patterns: a Pattern, or an ordered mapping name -> Pattern; a mode is an index into it.
        modes: default mode per KV head (names or indices, length ``num_kv_heads``); all the first pattern if None.
        block_size: BlockMask tile in tokens.
        backend: "flex" (compiled flex_attention), "flex_eager" (uncompiled, small sizes, for debugging),
            "dense" (masked SDPA on the dense pattern, small sizes; has a backward on CPU), or "auto":
            flex, except on CPU when gradients are needed (flex has no CPU backward) or q is float64 (compiled
            flex takes float32, float16 and bfloat16 there), where dense is used.
        plan: how the layer's heads are grouped (:mod:`flexsparse.runtime.plan`). "fused": every head in one
            flex launch. "split": full causal heads through SDPA, the others through one flex launch, written into
            one output. "auto": split on CUDA when a cost model says it pays. Per-call mode tensors run fused.
        kernel_options: passed to flex_attention (e.g. block sizes, warps, stages).
        max_dense_len: the longest q_len/kv_len the dense and flex_eager backends accept (they are O(S^2)).
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_finite: raise a ValueError naming q, k or v when it holds NaN or inf (one host sync per call).
            Without it, what NaN/inf give depends on the backend: on dense, a bad key or value makes every row
            of its heads NaN, on flex_eager a bad key the rows that attend it and a bad value every row; compiled
            flex works per tile and may return finite but wrong rows (README, "NaN/inf").

    ``forward(q, k, v, modes=None, *, key_padding_mask=None, positions=None, scale=None)`` takes q
    ``[B, H, S_q, d]`` and k/v ``[B, H_kv, S_kv, d]`` (SDPA layout) and returns ``[B, H, S_q, d]``. Queries are
    the last ``S_q`` positions: ``S_q == S_kv`` is prefill, ``S_q == 1`` decode, anything between a chunk of a
    prefill. ``modes`` overrides the default per call: an int tensor ``[H_kv]`` or ``[B, H_kv]`` on q's device
    (a router's decision; runs fused, no host sync), or one pattern name or index for every head, or a list or
    tuple of names or indices, one per KV head (known on the host, so planned like default modes: all-full runs
    on SDPA).
    ``key_padding_mask`` bool ``[B, S_kv]`` (True = real token; left or right padding): positions count real
    tokens only, so each sequence gets the output it gets alone; rows of padding queries are 0.
    ``positions`` (a :class:`~flexsparse.masks.geometry.Positions`) gives positions directly, e.g. for a cache
    whose slots are not positions; build it once per model forward and pass it to every layer. ``kv_heads``
    (ascending KV head indices) runs only those heads of the layer: k/v hold them and q their query heads (a
    sparse KV cache keeps head groups apart); ``modes`` still describes every KV head of the layer.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        patterns: Mapping[str, Pattern] | Pattern,
        modes: Sequence[str | int] | Tensor | None = None,
        *,
        block_size: int = 128,
        backend: Backend = "auto",
        plan: PlanKind = "auto",
        kernel_options: dict | None = None,
        max_dense_len: int = 8192,
        scale: float | None = None,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = as_int("num_heads", num_heads, minimum=1)
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = as_int("head_dim", head_dim, minimum=1)
        self.block_size = as_int("block_size", block_size, minimum=1)
        self.max_dense_len = as_int("max_dense_len", max_dense_len, minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if plan not in PLAN_KINDS:
            raise ValueError(f"plan must be one of {PLAN_KINDS}, got {plan!r}")
        self.backend, self.plan = backend, plan
        self.scale = self.head_dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
        self.check_finite = bool(check_finite)
        self.patterns = _as_pattern_dict(patterns)
        self.pattern_names = list(self.patterns)
        for name, pattern in self.patterns.items():
            heads = pattern.required_heads
            if heads is not None and heads != self.num_heads:
                raise ValueError(f"pattern {name!r} ({pattern!r}) is defined for {heads} query heads, "
                                 f"the layer has num_heads={self.num_heads}")
        self._pattern_list = list(self.patterns.values())
        self.register_buffer("default_modes", self._modes_from_names(modes), persistent=False)
        self._default_mode_tuple = tuple(self.default_modes.tolist())  # host copy: no device sync per call
        self._default_head_modes: dict[tuple, Tensor] = {}  # (device, host modes) -> per query head modes
        flex = FlexExecutor(self._pattern_list, compiled=True, kernel_options=kernel_options)
        eager = FlexExecutor(self._pattern_list, compiled=False)
        sdpa = [SdpaExecutor(), EsaExecutor()]
        self._planners = {
            "flex": Planner(plan, self._pattern_list, self.num_kv_heads, sdpa, flex),
            "flex_eager": Planner(plan, self._pattern_list, self.num_kv_heads, sdpa, eager),
            "dense": Planner("fused", self._pattern_list, self.num_kv_heads, [], DenseExecutor()),
        }
        self._subset_index: dict[tuple, Tensor] = {}
        self._last: tuple | None = None

    # ----- modes -------------------------------------------------------------------------------------------

    def _modes_from_names(self, modes: Sequence[str | int] | Tensor | None) -> Tensor:
        if modes is None:
            return torch.zeros(self.num_kv_heads, dtype=torch.long)
        if isinstance(modes, Tensor):
            if modes.dim() != 1:
                raise ValueError(f"default modes must be one per KV head, shape [{self.num_kv_heads}], got "
                                 f"{tuple(modes.shape)}; per-input [B, H_kv] modes go to forward(modes=...)")
            return self._check_mode_tensor(modes, batch=None).cpu().long()
        return torch.tensor(self._host_modes(modes), dtype=torch.long)

    def _host_modes(self, modes: Sequence[str | int]) -> tuple[int, ...]:
        """A list or tuple of pattern names or indices, one per KV head, as indices."""
        if isinstance(modes, (str, bytes)) or not isinstance(modes, Sequence):
            raise TypeError(f"modes must be a sequence of pattern names/indices or a tensor, got {type(modes).__name__}")
        if len(modes) != self.num_kv_heads:
            raise ValueError(f"modes must have one entry per KV head ({self.num_kv_heads}), got {len(modes)}")
        indices = []
        for m in modes:
            if isinstance(m, str):
                if m not in self.patterns:
                    raise ValueError(f"modes names unknown pattern {m!r}; known: {self.pattern_names}")
                indices.append(self.pattern_names.index(m))
            else:
                try:
                    indices.append(as_int("modes entry", m, minimum=0, maximum=len(self.patterns) - 1))
                except (TypeError, ValueError):
                    raise ValueError(f"modes entries must be pattern names or indices < {len(self.patterns)}, "
                                     f"got {m!r}") from None
        return tuple(indices)

    def _mode_index(self, mode: str | int) -> int:
        """One mode by pattern name or index."""
        if isinstance(mode, str):
            if mode not in self.patterns:
                raise ValueError(f"modes names unknown pattern {mode!r}; known: {self.pattern_names}")
            return self.pattern_names.index(mode)
        return as_int("modes", mode, minimum=0, maximum=len(self.patterns) - 1)

    def set_modes(self, modes: Sequence[str | int] | Tensor) -> None:
        """Change the default modes (per KV head)."""
        self.default_modes = self._modes_from_names(modes).to(self.default_modes.device)
        self._default_mode_tuple = tuple(self.default_modes.tolist())
        self._default_head_modes.clear()

    def _check_mode_tensor(self, modes: Tensor, batch: int | None) -> Tensor:
        if not isinstance(modes, Tensor):
            raise TypeError(f"modes must be a tensor, got {type(modes).__name__}")
        if modes.dtype.is_floating_point or modes.dtype.is_complex or modes.dtype == torch.bool:
            raise TypeError(f"modes must be an integer tensor (indices into patterns), got {modes.dtype}")
        if modes.dim() not in (1, 2) or modes.shape[-1] != self.num_kv_heads:
            raise ValueError(f"modes must have shape [{self.num_kv_heads}] or [B, {self.num_kv_heads}] "
                             f"(one per KV head), got {tuple(modes.shape)}")
        if modes.dim() == 2 and batch is not None and modes.shape[0] not in (1, batch):
            raise ValueError(f"modes has batch {modes.shape[0]}, inputs have batch {batch}")
        if modes.device.type == "cpu" and modes.numel() and (modes.min() < 0 or modes.max() >= len(self.patterns)):
            raise ValueError(f"modes must index the {len(self.patterns)} patterns, got {modes.unique().tolist()}")
        return modes

    def _head_modes(self, q: Tensor, modes: CallModes) -> tuple[Tensor, tuple[int, ...] | None]:
        """Per query-head modes ``[B or 1, H]`` on q's device, and the per-KV-head modes if the host knows them
        (default modes, one name or index, or a list of them: planned alike; a tensor is not read on the host)."""
        group = self.num_heads // self.num_kv_heads
        if not isinstance(modes, Tensor):
            if modes is None:
                host = self._default_mode_tuple
            elif isinstance(modes, (str, numbers.Integral)):
                host = (self._mode_index(modes),) * self.num_kv_heads
            else:
                host = self._host_modes(modes)
            cached = self._default_head_modes.get((q.device, host))
            if cached is None:
                cached = torch.tensor(host, device=q.device)[None].repeat_interleave(group, dim=1)
                self._default_head_modes[(q.device, host)] = cached
            return cached, host
        kv_modes = self._check_mode_tensor(modes, q.shape[0])
        if kv_modes.device != q.device:
            raise ValueError(f"modes is on {kv_modes.device} but q is on {q.device}")
        if kv_modes.dim() == 1:
            kv_modes = kv_modes[None]
        return kv_modes.long().repeat_interleave(group, dim=1), None

    # ----- inputs ------------------------------------------------------------------------------------------

    def _kv_heads(self, kv_heads: Sequence[int] | None) -> tuple[int, ...]:
        if kv_heads is None:
            return tuple(range(self.num_kv_heads))
        if isinstance(kv_heads, (str, bytes)) or not isinstance(kv_heads, Sequence) or not kv_heads:
            raise TypeError(f"kv_heads must be a non-empty sequence of KV head indices, got {kv_heads!r}")
        heads = tuple(as_int("kv_heads entry", h, minimum=0, maximum=self.num_kv_heads - 1) for h in kv_heads)
        if list(heads) != sorted(set(heads)):
            raise ValueError(f"kv_heads must be distinct and ascending, got {list(heads)}")
        return heads

    def _query_head_index(self, kv_heads: tuple[int, ...], device: torch.device) -> slice | Tensor:
        """The query heads of some KV heads: a slice when contiguous, else an index tensor made once per device
        (indexing with a Python list would copy it to the device, a host sync, on every call)."""
        group = self.num_heads // self.num_kv_heads
        rows = [h * group + i for h in kv_heads for i in range(group)]
        if rows == list(range(rows[0], rows[-1] + 1)):
            return slice(rows[0], rows[-1] + 1)
        key = (kv_heads, device)
        if key not in self._subset_index:
            self._subset_index[key] = torch.tensor(rows, device=device)
        return self._subset_index[key]

    def _check_inputs(self, q: Tensor, k: Tensor, v: Tensor, kv_heads: tuple[int, ...]) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
        subset = "" if len(kv_heads) == self.num_kv_heads else f" for kv_heads={list(kv_heads)}"
        q_heads = len(kv_heads) * (self.num_heads // self.num_kv_heads)
        if q.shape[1] != q_heads:
            raise ValueError(f"q has {q.shape[1]} heads, expected {q_heads}{subset} (num_heads={self.num_heads})")
        for name, t in (("k", k), ("v", v)):
            if t.shape[1] != len(kv_heads):
                raise ValueError(f"{name} has {t.shape[1]} heads, expected {len(kv_heads)}{subset} "
                                 f"(num_kv_heads={self.num_kv_heads})")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
            if t.shape[0] != q.shape[0]:
                raise ValueError(f"{name} has batch {t.shape[0]}, q has batch {q.shape[0]}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"{name} has head_dim {t.shape[-1]}, expected {self.head_dim}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v lengths differ: {k.shape[2]} vs {v.shape[2]}")
        if q.shape[2] > k.shape[2]:
            raise ValueError(f"q_len ({q.shape[2]}) exceeds kv_len ({k.shape[2]}): queries are the last positions")
        if q.shape[2] == 0:
            raise ValueError("q has no queries (q_len 0)")
        if q.shape[0] == 0:
            raise ValueError("q, k and v have batch 0: B must be >= 1")
        if not q.dtype.is_floating_point:
            raise TypeError(f"q must be floating point, got {q.dtype}")
        if self.check_finite:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} contains NaN or inf (check_finite=True)")

    def _geometry(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None,
                  positions: Positions | None) -> Geometry:
        batch, q_len, kv_len = q.shape[0], q.shape[2], k.shape[2]
        if key_padding_mask is not None and positions is not None:
            raise ValueError("give key_padding_mask or positions, not both")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor):
                raise TypeError(f"key_padding_mask must be a bool tensor [B, S_kv], got "
                                f"{type(key_padding_mask).__name__}")
            if tuple(key_padding_mask.shape) != (batch, kv_len):
                raise ValueError(f"key_padding_mask must have shape [B, S_kv] = [{batch}, {kv_len}], got "
                                 f"{tuple(key_padding_mask.shape)}")
            if key_padding_mask.device != q.device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
            positions = Positions.from_padding_mask(key_padding_mask, q_len)
        elif positions is not None:
            if not isinstance(positions, Positions):
                raise TypeError(f"positions must be flexsparse.Positions, got {type(positions).__name__}")
            if positions.batch not in (1, batch):
                raise ValueError(f"positions have batch {positions.batch}, inputs have batch {batch}")
            if positions.device != q.device:
                raise ValueError(f"positions are on {positions.device} but q is on {q.device}")
        elif q_len != kv_len:  # decode or a chunk: positions as tensors, so a new offset is not a recompile
            positions = Positions.contiguous(q_len, kv_len, q.device)
        return Geometry(self.num_heads, q_len, kv_len, self.block_size, q.device, positions)

    def _choose_backend(self, call: AttentionCall) -> str:
        backend, on_cpu, dtype = self.backend, call.q.device.type == "cpu", call.q.dtype
        compiles_on_cpu = dtype in CPU_COMPILED_DTYPES
        hint = "Use backend='flex' (compiled) for long inputs"
        if backend == "auto":
            backend = "dense" if on_cpu and (call.needs_grad or not compiles_on_cpu) else "flex"
            if backend == "dense" and call.needs_grad:
                hint = "backend='auto' runs dense on CPU when gradients are needed (flex has no CPU backward)"
            elif backend == "dense":
                hint = (f"backend='auto' runs dense on CPU for {dtype} (compiled flex takes float32, float16 or "
                        "bfloat16 there)")
        if backend == "flex" and on_cpu and not compiles_on_cpu:
            raise TypeError(f"backend='flex' (compiled flex_attention) takes float32, float16 or bfloat16 on CPU, "
                            f"q/k/v are {dtype}; use backend='dense', 'flex_eager' or 'auto' for {dtype}")
        if backend in ("flex", "flex_eager") and on_cpu and call.needs_grad:
            raise ValueError(f"backend={backend!r} has no backward on CPU (flex_attention is forward-only there); "
                             "use backend='dense' or 'auto' for CPU training")
        longest = max(call.geometry.q_len, call.geometry.kv_len)
        if backend in ("dense", "flex_eager") and longest > self.max_dense_len:
            raise ValueError(f"backend={backend!r} costs O(S^2); sequence length {longest} exceeds "
                             f"max_dense_len={self.max_dense_len}. {hint}")
        return backend

    # ----- forward -----------------------------------------------------------------------------------------

    def _resolved(self, call: AttentionCall, host_modes: tuple[int, ...] | None) -> list[Pattern | None]:
        """Each mode's pattern for this call: content-dependent ones resolved on q/k; None for modes the host
        knows no head uses (their estimators never run)."""
        used = set(range(len(self._pattern_list))) if host_modes is None else set(host_modes)
        return [None if index not in used else p.resolve(call.q, call.k, call.geometry) if p.is_dynamic else p
                for index, p in enumerate(self._pattern_list)]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, modes: CallModes = None, *,
                key_padding_mask: Tensor | None = None, positions: Positions | None = None,
                scale: float | None = None, kv_heads: Sequence[int] | None = None) -> Tensor:
        heads = self._kv_heads(kv_heads)
        self._check_inputs(q, k, v, heads)
        geo = self._geometry(q, k, key_padding_mask, positions)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        call = AttentionCall(q, k, v, self.scale if scale is None else as_float("scale", scale, positive=True),
                             geo, needs_grad, heads)
        backend = self._choose_backend(call)
        head_modes, host_modes = self._head_modes(q, modes)
        if len(heads) < self.num_kv_heads:  # a subset of the layer's heads (e.g. one group of a sparse KV cache)
            head_modes = head_modes[:, self._query_head_index(heads, q.device)]
            host_modes = None if host_modes is None else tuple(host_modes[h] for h in heads)
        patterns = self._resolved(call, host_modes)
        groups = self._planners[backend].groups(call, host_modes)
        self._last = (geo, patterns, head_modes, groups)  # last_stats works from these when read
        if len(groups) == 1:
            group = groups[0]
            return group.executor.run(call, patterns, GroupModes(head_modes, group.host_modes), group.heads)
        results = [(group, group.executor.run(call, patterns, GroupModes(head_modes[:, group.heads.q_index],
                                                                          group.host_modes), group.heads))
                   for group in groups]
        return _assemble(results, q.shape[1])

    def reference_mask(self, q: Tensor, k: Tensor, modes: CallModes = None, *,
                       key_padding_mask: Tensor | None = None, positions: Positions | None = None) -> Tensor:
        """The dense boolean mask ``[B or 1, H, S_q, S_kv]`` this layer applies to q/k (small sizes only)."""
        geo = self._geometry(q, k, key_padding_mask, positions)
        head_modes, _ = self._head_modes(q, modes)
        patterns = [p.resolve(q, k, geo) for p in self._pattern_list]
        return gather_heads([p.dense(geo) for p in patterns], head_modes)

    @property
    def last_stats(self) -> AttentionStats:
        """MSR, ESR and block density of the last call (computed when read, from the patterns it used)."""
        if self._last is None:
            raise RuntimeError("last_stats is available after a forward call")
        geo, patterns, head_modes, groups = self._last
        q_heads = torch.cat([g.heads.q_heads for g in groups]).sort().values
        used = next(p for p in patterns if p is not None)
        patterns = [used if p is None else p for p in patterns]  # unused modes are never selected
        rows = lambda t: t if t.shape[1] == 1 else t[:, q_heads]  # the call's heads of per-head patterns
        masks = [p.block_mask(geo) for p in patterns]
        composed = BlockMaskStack.from_masks(masks, geo.num_heads).select(head_modes, masks[0].mask_mod,
                                                                          heads=q_heads)
        sparse = torch.tensor([not p.is_full for p in patterns], device=head_modes.device)
        attended = gather_heads([rows(p.attended(geo)).sum(-1, keepdim=True) for p in patterns], head_modes)[..., 0]
        causal_pairs = (geo.q_positions() + 1).clamp(min=0).sum(-1, keepdim=True)  # [B', 1]; 0: padding only
        return AttentionStats(
            msr=model_sparsity_ratio(sparse[head_modes], counted=causal_pairs > 0),
            esr=effective_sparsity_ratio(attended, causal_pairs),
            block_density=block_density(composed, geo),
        )

    def extra_repr(self) -> str:
        modes = [self.pattern_names[i] for i in self._default_mode_tuple]
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"patterns={dict(self.patterns)}, modes={modes}, backend={self.backend!r}, plan={self.plan!r}")
