"""HybridAttention: every head of a layer in its own pattern, in one compiled flex_attention call.

Per (geometry, device) each static pattern's BlockMask is built once; a call's mode tensor picks, for every
(batch element, query head), the rows of its pattern's index tensors (:class:`BlockMaskStack`), and one
dispatching mask_mod that captures the mode tensor resolves partial tiles. New modes are new tensor values in the
same structure, so they never rebuild masks by scanning and never recompile.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexsparse.masks.base import Geometry, MaskMod, Pattern
from flexsparse.masks.blocks import BlockMaskStack, block_density
from flexsparse.masks.combine import _gather_heads, dispatch_mask_mod
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio

Backend = Literal["auto", "flex", "flex_eager", "dense"]
BACKENDS = ("auto", "flex", "flex_eager", "dense")
Plan = Literal["auto", "fused", "split"]
PLANS = ("auto", "fused", "split")

# Cost model for plan="auto" (measured on an H100, torch 2.11, bf16; see README's benchmark table): flex runs the
# blocks of full causal heads at about 0.7x SDPA's throughput, so sending full heads to SDPA saves
# 0.43 x their SDPA time, at the price of one more launch and writing the split outputs into one tensor.
_SDPA_FLOPS_PER_S = 600e12
_FLEX_FULL_SPEED = 0.7
_EXTRA_LAUNCH_S = 50e-6
_HBM_BYTES_PER_S = 3e12
_GEOMETRY_CACHE_SIZE = 8
MAX_COMPILED_VARIANTS = 32
"""Compiled flex_attention variants (shapes, dtypes, pattern sets, grad modes) allowed per process before
flexsparse raises RecompileLimitError instead of letting torch fall back to the unfused O(S^2) path."""
_compiled_flex_attention = None


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
def _refuse_unfused_fallback(limit: int):
    """A reusable dynamo config patch (building one per call costs more than the call's own Python)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit)


def run_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float, kernel_options=None) -> Tensor:
    """Compiled flex_attention; raises instead of silently running the unfused O(S^2) path after recompiles."""
    enable_gqa = q.shape[1] != k.shape[1]
    options = kernel_options or None
    if torch.compiler.is_compiling():  # inside the user's torch.compile: their graph fuses it
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=options)
    limit = max(torch._dynamo.config.recompile_limit, MAX_COMPILED_VARIANTS)
    try:
        with _refuse_unfused_fallback(limit):
            return compiled_flex_attention()(q, k, v, block_mask, scale, enable_gqa, options)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            f"flex_attention reached its limit of {limit} compiled variants "
            "(flexsparse.attention.MAX_COMPILED_VARIANTS); flexsparse refuses the unfused fallback that materialises "
            "the S x S score matrix. Recompiles come from new sequence lengths, dtypes, head dims or pattern sets: "
            "bucket sequence lengths to the block size, share pattern objects across layers, or raise the limit."
        ) from err


class RecompileLimitError(RuntimeError):
    """Compiled flex_attention would fall back to the unfused O(S^2) path."""


@dataclass
class AttentionStats:
    """Sparsity of the last call. Tensors (no host sync until read); ``as_dict`` gives floats."""

    msr: Tensor
    """Model sparsity ratio (Elastic Attention Eq. 4): fraction of (batch, kv head) rows in a sparse mode."""
    esr: Tensor
    """Effective sparsity ratio (Eq. 5): mean over heads of the fraction of causal (q, k) pairs pruned."""
    block_density: Tensor
    """Fraction of causal tiles the kernel computes."""

    def as_dict(self) -> dict[str, float]:
        return {"msr": float(self.msr), "esr": float(self.esr), "block_density": float(self.block_density)}


@dataclass
class _SplitLayout:
    """Which heads go to SDPA and which to flex, for one set of per-KV-head modes (slices where contiguous)."""

    full_q: slice | Tensor
    sparse_q: slice | Tensor
    full_kv: slice | Tensor
    sparse_kv: slice | Tensor
    sparse_heads: Tensor  # query heads of the flex call, for its mask_mod
    sparse_modes: Tensor  # [1, H_sparse]
    all_modes: Tensor  # [1, H]
    full_first: bool | None  # output order when the two groups are contiguous: cat, else index writes
    block_mask: BlockMask | None = None  # cached when no pattern is content-dependent


@dataclass
class _GeometryPlan:
    """What a geometry needs, built once: per-pattern mask_mods and static BlockMasks, and their stack; the
    composed BlockMask of the default modes and split layouts are cached here on first use."""

    geo: Geometry
    mask_mods: list[MaskMod | None]
    block_masks: list[BlockMask | None]
    stack: BlockMaskStack | None
    default_mask: BlockMask | None = None
    splits: dict = field(default_factory=dict)


def _head_index(heads: list[int], group: int, device: torch.device) -> slice | Tensor:
    """Heads ``h * group + i`` as a slice when they are contiguous (a view, no copy), else an index tensor."""
    index = [h * group + i for h in heads for i in range(group)]
    if index == list(range(index[0], index[-1] + 1)):
        return slice(index[0], index[-1] + 1)
    return torch.tensor(index, device=device)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _as_pattern_dict(patterns: Mapping[str, Pattern] | Pattern) -> OrderedDict[str, Pattern]:
    if isinstance(patterns, Pattern):
        return OrderedDict(default=patterns)
    if not isinstance(patterns, Mapping) or not patterns:
        raise TypeError("patterns must be a Pattern or a non-empty mapping of name -> Pattern")
    for name, p in patterns.items():
        if not isinstance(name, str) or not isinstance(p, Pattern):
            raise TypeError(f"patterns must map str -> Pattern, got {name!r} -> {type(p).__name__}")
    return OrderedDict(patterns)


class HybridAttention(nn.Module):
    """Attention whose KV heads each run one of several patterns, in one flex_attention call.

    Args:
        num_heads: query heads H.
        num_kv_heads: key/value heads (divides ``num_heads``; GQA groups of ``num_heads // num_kv_heads``).
        head_dim: per-head dimension d.
        patterns: a Pattern, or an ordered mapping name -> Pattern; a mode is an index into it.
        modes: default mode per KV head (names or indices, length ``num_kv_heads``); all the first pattern if None.
        block_size: BlockMask tile in tokens.
        backend: "flex" (compiled flex_attention), "flex_eager" (uncompiled, small sizes, for debugging),
            "dense" (masked SDPA on the dense pattern, small sizes; has a backward on CPU), or "auto":
            flex, except on CPU when gradients are needed, where flex has no backward and dense is used.
        plan: how the flex backends run a layer whose heads mix full (FA) and sparse patterns. "fused": every
            head in one flex_attention launch. "split": full heads through SDPA (the faster kernel for dense
            causal work), sparse heads through one flex launch, written into one output. It needs the modes on
            the host: the default modes, or per-call modes of shape [H_kv] (one host sync), and q_len == kv_len.
            "auto": split on CUDA when a cost model says it pays (long sequences), for the default modes only;
            per-call routing always runs fused (no host sync).
        kernel_options: passed to flex_attention (e.g. block sizes, warps, stages, TMA on Hopper).
        max_dense_len: the longest q_len/kv_len the dense and flex_eager backends accept (they are O(S^2)).
        scale: softmax scale, default ``head_dim ** -0.5``.

    ``forward(q, k, v, modes=None)`` takes q ``[B, H, S_q, d]`` and k/v ``[B, H_kv, S_kv, d]`` (SDPA layout;
    queries are the last ``S_q`` positions) and returns ``[B, H, S_q, d]``. ``modes`` overrides the default per
    call: an int tensor ``[H_kv]`` or ``[B, H_kv]`` on q's device.
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
        plan: Plan = "auto",
        kernel_options: dict | None = None,
        max_dense_len: int = 8192,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("block_size", block_size), ("max_dense_len", max_dense_len)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        self.plan = plan
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.backend, self.max_dense_len = block_size, backend, max_dense_len
        self.kernel_options = dict(kernel_options or {})
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.patterns = _as_pattern_dict(patterns)
        self.pattern_names = list(self.patterns)
        self._pattern_list = list(self.patterns.values())
        self.register_buffer("default_modes", self._modes_from_names(modes), persistent=False)
        self._default_mode_list = self.default_modes.tolist()  # host copy: no device sync per call
        self._uniform_mode = self._single_mode(self.default_modes)
        self._plans: OrderedDict[tuple, _GeometryPlan] = OrderedDict()
        self._any_dynamic = any(p.is_dynamic for p in self._pattern_list)
        self._default_head_modes: dict[torch.device, Tensor] = {}
        self._last: tuple | None = None

    # ----- modes -------------------------------------------------------------------------------------------

    def _modes_from_names(self, modes: Sequence[str | int] | Tensor | None) -> Tensor:
        if modes is None:
            return torch.zeros(self.num_kv_heads, dtype=torch.long)
        if isinstance(modes, Tensor):
            return self._check_mode_tensor(modes, batch=None).cpu()
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
            elif isinstance(m, int) and not isinstance(m, bool) and 0 <= m < len(self.patterns):
                indices.append(m)
            else:
                raise ValueError(f"modes entries must be pattern names or indices < {len(self.patterns)}, got {m!r}")
        return torch.tensor(indices, dtype=torch.long)

    def set_modes(self, modes: Sequence[str | int] | Tensor) -> None:
        """Change the default modes (per KV head)."""
        self.default_modes = self._modes_from_names(modes).to(self.default_modes.device)
        self._default_mode_list = self.default_modes.tolist()  # host copy: no device sync per call
        self._uniform_mode = self._single_mode(self.default_modes)
        self._default_head_modes.clear()
        for plan in self._plans.values():
            plan.default_mask = None

    @staticmethod
    def _single_mode(modes: Tensor) -> int | None:
        """The one mode every head uses, or None (read on the host, once, when default modes are set)."""
        values = modes.unique().tolist()
        return values[0] if len(values) == 1 else None

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
        in_range = (modes >= 0) & (modes < len(self.patterns))
        if modes.device.type == "cpu":
            if not bool(in_range.all()):
                raise ValueError(f"modes must index the {len(self.patterns)} patterns, got {modes.tolist()}")
        else:  # no host sync on the hot path: a device-side assert
            torch._assert_async(in_range.all(), "flexsparse: modes out of range of the patterns")
        return modes.long()

    # ----- inputs ------------------------------------------------------------------------------------------

    def _check_inputs(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads, expected num_heads={self.num_heads}")
        for name, t in (("k", k), ("v", v)):
            if t.shape[1] != self.num_kv_heads:
                raise ValueError(f"{name} has {t.shape[1]} heads, expected num_kv_heads={self.num_kv_heads}")
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
        if not q.dtype.is_floating_point:
            raise TypeError(f"q must be floating point, got {q.dtype}")

    def _choose_backend(self, q: Tensor, k: Tensor, v: Tensor) -> str:
        needs_grad = _needs_grad(q, k, v)
        backend = self.backend
        if backend == "auto":
            backend = "dense" if (q.device.type == "cpu" and needs_grad) else "flex"
        if backend == "flex" and q.device.type == "cpu" and needs_grad:
            raise ValueError("backend='flex' has no backward on CPU (flex_attention is forward-only there); "
                             "use backend='dense' or 'auto' for CPU training")
        if backend in ("dense", "flex_eager") and max(q.shape[2], k.shape[2]) > self.max_dense_len:
            raise ValueError(f"backend={backend!r} materialises S x S scores; sequence length {k.shape[2]} exceeds "
                             f"max_dense_len={self.max_dense_len}. Use backend='flex' (compiled) for long inputs")
        return backend

    # ----- masks -------------------------------------------------------------------------------------------

    def _plan(self, q_len: int, kv_len: int, device: torch.device) -> _GeometryPlan:
        key = (q_len, kv_len, device)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        geo = Geometry(self.num_heads, q_len, kv_len, self.block_size, device)
        static = [not p.is_dynamic for p in self._pattern_list]
        mask_mods = [p.mask_mod(geo) if s else None for p, s in zip(self._pattern_list, static)]
        block_masks = [p.block_mask(geo) if s else None for p, s in zip(self._pattern_list, static)]
        stack = BlockMaskStack.from_masks(block_masks, geo.num_heads) if all(static) else None
        plan = _GeometryPlan(geo, mask_mods, block_masks, stack)
        self._plans[key] = plan
        if len(self._plans) > _GEOMETRY_CACHE_SIZE:
            self._plans.popitem(last=False)
        return plan

    def _resolved(self, plan: _GeometryPlan, q: Tensor, k: Tensor, only: int | None) -> tuple[list, list, list]:
        """Patterns, mask_mods and BlockMasks for this call (content-dependent patterns resolved on q/k).

        With ``only`` set, content-dependent patterns other than that one are not resolved (not used).
        """
        patterns, mods, masks = [], [], []
        for index, (p, mod, mask) in enumerate(zip(self._pattern_list, plan.mask_mods, plan.block_masks)):
            if p.is_dynamic and only is not None and only != index:
                p = None  # never selected in this call
            elif p.is_dynamic:
                p = p.resolve(q, k)
                mod, mask = p.mask_mod(plan.geo), p.block_mask(plan.geo)
            patterns.append(p)
            mods.append(mod)
            masks.append(mask)
        return patterns, mods, masks

    def _head_modes(self, q: Tensor, modes: Tensor | None) -> Tensor:
        """Per query-head modes ``[B or 1, H]`` on q's device, from per-call or default per-KV-head modes."""
        if modes is None:
            cached = self._default_head_modes.get(q.device)
            if cached is None:
                cached = self.default_modes.to(q.device)[None].repeat_interleave(
                    self.num_heads // self.num_kv_heads, dim=1)
                self._default_head_modes[q.device] = cached
            return cached
        kv_modes = self._check_mode_tensor(modes, q.shape[0])
        if kv_modes.device != q.device:
            raise ValueError(f"modes is on {kv_modes.device} but q is on {q.device}")
        if kv_modes.dim() == 1:
            kv_modes = kv_modes[None]
        return kv_modes.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def reference_mask(self, q: Tensor, k: Tensor, modes: Tensor | None = None) -> Tensor:
        """The dense boolean mask ``[B or 1, H, S_q, S_kv]`` this layer applies to q/k (small sizes only)."""
        head_modes = self._head_modes(q, modes)
        geo = Geometry(self.num_heads, q.shape[2], k.shape[2], self.block_size, q.device)
        patterns = [p.resolve(q, k) for p in self._pattern_list]
        return _gather_heads([p.dense(geo) for p in patterns], head_modes)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, modes: Tensor | None = None,
                scale: float | None = None) -> Tensor:
        self._check_inputs(q, k, v)
        backend = self._choose_backend(q, k, v)
        head_modes = self._head_modes(q, modes)
        scale = self.scale if scale is None else float(scale)
        if backend == "dense":
            geo = Geometry(self.num_heads, q.shape[2], k.shape[2], self.block_size, q.device)
            self._last = (geo, [p.resolve(q, k) for p in self._pattern_list], head_modes, None)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.reference_mask(q, k, modes), scale=scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
        plan = self._plan(q.shape[2], k.shape[2], q.device)
        geo = plan.geo
        split_modes = self._split_heads(q, k, modes)
        if split_modes is not None:
            return self._run_split(q, k, v, plan, split_modes, scale, backend)
        if modes is None and not self._any_dynamic and plan.default_mask is not None:
            patterns, block_mask = self._pattern_list, plan.default_mask  # static layer: nothing to build
        else:
            uniform = self._uniform_mode if modes is None else None
            patterns, mods, masks = self._resolved(plan, q, k, only=uniform)
            if uniform is not None:  # one pattern for the whole layer: run it alone, no dispatch
                block_mask = masks[uniform]
            else:
                stack = plan.stack or BlockMaskStack.from_masks(masks, geo.num_heads)
                cached = modes is None and not self._any_dynamic
                block_mask = stack.select(head_modes, dispatch_mask_mod(mods, head_modes),
                                          with_backward=cached or _needs_grad(q, k, v))
            if modes is None and not self._any_dynamic:
                plan.default_mask = block_mask
        self._last = (geo, patterns, head_modes, block_mask)
        if backend == "flex_eager":  # chosen explicitly and bounded by max_dense_len: silence torch's warning
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                return flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                      enable_gqa=self.num_heads != self.num_kv_heads)
        return run_flex(q, k, v, block_mask, scale, self.kernel_options)

    # ----- execution plans ---------------------------------------------------------------------------------

    def _split_heads(self, q: Tensor, k: Tensor, modes: Tensor | None) -> list[int] | None:
        """The per-KV-head modes (host ints) when this call runs the split plan, else None."""
        if self.plan == "fused" or (self.plan == "auto" and (modes is not None or q.device.type != "cuda")):
            return None
        if modes is None:
            kv_modes = self._default_mode_list
        elif modes.dim() == 1 or modes.shape[0] == 1:
            kv_modes = modes.flatten().tolist()  # host sync: plan="split" was asked for with per-call modes
        else:
            raise ValueError("plan='split' needs one set of modes for the whole batch: modes of shape [H_kv]")
        full = [self._pattern_list[m].is_full and not self._pattern_list[m].is_dynamic for m in kv_modes]
        if not any(full) or all(full):
            return None  # nothing to split
        if q.shape[2] != k.shape[2]:
            if self.plan == "split":
                raise ValueError("plan='split' sends full heads to SDPA's causal kernel, which needs q_len == kv_len")
            return None
        if self.plan == "auto" and not self._split_pays(q, sum(full)):
            return None
        return kv_modes

    def _split_pays(self, q: Tensor, full_kv_heads: int) -> bool:
        """Cost model: the full heads' time saved by SDPA against one more launch and the output copy."""
        batch, _, seq, dim = q.shape
        full_q_heads = full_kv_heads * (self.num_heads // self.num_kv_heads)
        causal_flops = 4 * batch * full_q_heads * dim * seq * (seq + 1) / 2
        saved = causal_flops / _SDPA_FLOPS_PER_S * (1 / _FLEX_FULL_SPEED - 1)
        output_bytes = q.numel() * q.element_size()
        return saved > _EXTRA_LAUNCH_S + 2 * output_bytes / _HBM_BYTES_PER_S

    def _split_layout(self, plan: _GeometryPlan, kv_modes: list[int], device: torch.device) -> _SplitLayout:
        layout = plan.splits.get(tuple(kv_modes))
        if layout is not None:
            return layout
        group = self.num_heads // self.num_kv_heads
        full_kv = [h for h, m in enumerate(kv_modes) if self._pattern_list[m].is_full]
        sparse_kv = [h for h, m in enumerate(kv_modes) if not self._pattern_list[m].is_full]
        all_modes = torch.tensor(kv_modes, device=device).repeat_interleave(group)[None]
        sparse_heads = torch.tensor([h * group + i for h in sparse_kv for i in range(group)], device=device)
        contiguous = full_kv == list(range(full_kv[0], full_kv[-1] + 1)) and \
            sparse_kv == list(range(sparse_kv[0], sparse_kv[-1] + 1))
        layout = _SplitLayout(
            full_q=_head_index(full_kv, group, device), sparse_q=_head_index(sparse_kv, group, device),
            full_kv=_head_index(full_kv, 1, device), sparse_kv=_head_index(sparse_kv, 1, device),
            sparse_heads=sparse_heads, sparse_modes=all_modes[:, sparse_heads], all_modes=all_modes,
            full_first=(full_kv[0] == 0) if contiguous else None,
        )
        plan.splits[tuple(kv_modes)] = layout
        return layout

    def _run_split(self, q, k, v, plan: _GeometryPlan, kv_modes: list[int], scale: float, backend: str) -> Tensor:
        """Full KV heads through SDPA, the others through one flex launch, into one output."""
        layout = self._split_layout(plan, kv_modes, q.device)
        group = self.num_heads // self.num_kv_heads
        full_out = F.scaled_dot_product_attention(q[:, layout.full_q], k[:, layout.full_kv], v[:, layout.full_kv],
                                                  is_causal=True, scale=scale, enable_gqa=group > 1)
        sparse_patterns = {self._pattern_list[m] for m in kv_modes if not self._pattern_list[m].is_full}
        single = sparse_patterns.pop() if len(sparse_patterns) == 1 else None
        if layout.block_mask is not None:
            patterns, block_mask = self._pattern_list, layout.block_mask
        elif single is not None and not single.is_dynamic and plan.block_masks[self._pattern_list.index(single)] \
                .kv_num_blocks.shape[1] == 1:
            # one head-agnostic pattern on every sparse head: its own mask and mask_mod, no per-head dispatch
            patterns, block_mask = self._pattern_list, plan.block_masks[self._pattern_list.index(single)]
            layout.block_mask = block_mask
        else:
            patterns, mods, masks = self._resolved(plan, q, k, only=None)
            stack = plan.stack or BlockMaskStack.from_masks(masks, plan.geo.num_heads)
            modes, heads = layout.sparse_modes, layout.sparse_heads
            block_mask = stack.select(modes, dispatch_mask_mod(mods, modes, heads), heads=heads)
            if not self._any_dynamic:
                layout.block_mask = block_mask
        sq, skv = q[:, layout.sparse_q], k[:, layout.sparse_kv]
        if backend == "flex_eager":
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                sparse_out = flex_attention(sq, skv, v[:, layout.sparse_kv], block_mask=block_mask, scale=scale,
                                            enable_gqa=group > 1)
        else:
            sparse_out = run_flex(sq, skv, v[:, layout.sparse_kv], block_mask, scale, self.kernel_options)
        self._last = (plan.geo, patterns, layout.all_modes, None)
        if layout.full_first is not None:
            parts = [full_out, sparse_out] if layout.full_first else [sparse_out, full_out]
            return torch.cat(parts, dim=1)
        out = torch.empty_like(q)
        out[:, layout.full_q] = full_out
        out[:, layout.sparse_q] = sparse_out
        return out

    @property
    def last_stats(self) -> AttentionStats:
        """MSR, ESR and block density of the last call (computed when read)."""
        if self._last is None:
            raise RuntimeError("last_stats is available after a forward call")
        geo, patterns, head_modes, block_mask = self._last
        if block_mask is None:  # the dense backend ran: compose the tiles it would have computed
            masks = [p.block_mask(geo) for p in patterns]
            block_mask = BlockMaskStack.from_masks(masks, geo.num_heads).select(head_modes, masks[0].mask_mod)
        sparse = torch.tensor([p is not None and not p.is_full for p in patterns], device=head_modes.device)
        unused = torch.zeros(1, 1, 1, dtype=torch.long, device=geo.device)
        attended = _gather_heads(
            [unused if p is None else p.attended(geo).sum(-1, keepdim=True) for p in patterns], head_modes
        )
        causal_pairs = (geo.q_positions() + 1).sum()
        return AttentionStats(
            msr=model_sparsity_ratio(sparse[head_modes]),
            esr=effective_sparsity_ratio(attended[..., 0], causal_pairs),
            block_density=block_density(block_mask, geo),
        )

    def extra_repr(self) -> str:
        modes = [self.pattern_names[i] for i in self.default_modes.tolist()]
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"patterns={dict(self.patterns)}, modes={modes}, backend={self.backend!r}, plan={self.plan!r}")
