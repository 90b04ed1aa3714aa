"""HybridAttention: every KV head of a layer in its own pattern, chosen per layer or per input.

The module holds the configuration and the default modes; a forward call is: describe the call (positions from a
padding mask or a cache), plan (group heads by the executor that runs them at the lowest cost,
:mod:`flexsparse.runtime.plan`), execute each group once into one output (:mod:`flexsparse.runtime.execute`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from flexsparse.masks.base import Pattern
from flexsparse.masks.combine import gather_heads
from flexsparse.masks.geometry import Geometry, Positions
from flexsparse.runtime.backends import BACKENDS, Backend, backend_executors, choose_backend
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.execute import execute
from flexsparse.runtime.executors import Executor
from flexsparse.runtime.flex import as_kernel_options
from flexsparse.runtime.inputs import QueryHeadIndex, call_geometry, check_inputs, kv_head_tuple
from flexsparse.runtime.modes import CallModes, ModeTable, as_pattern_dict
from flexsparse.runtime.plan import PLAN_KINDS, PlanKind, Planner
from flexsparse.runtime.registry import registered_executors
from flexsparse.runtime.stats import AttentionStats, call_stats
from flexsparse.validation import as_float, as_int

__all__ = ["AttentionStats", "Backend", "CallModes", "HybridAttention"]


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
            flex takes float32, float16 and bfloat16 there), where dense is used. The flex backends plan with the
            registered executors (:mod:`flexsparse.runtime.registry`: SDPA, the ESA kernel) before flex.
        plan: how the layer's heads are grouped (:mod:`flexsparse.runtime.plan`). "fused": every head in one
            flex launch. "split": each head to the executor that runs its pattern at the lowest estimated cost
            (full causal heads through SDPA, ESA heads through its kernel on CUDA, the others through one flex
            launch), written into one output. "auto": split on CUDA when the executors' costs say it pays.
            Per-call mode tensors run fused.
        executors: instead of the backend's set, these executors (Executor instances, in preference order: a tie
            in cost goes to the earlier one); fused plans and per-call mode tensors need one with ``fuses`` that
            accepts every pattern. A pattern no executor accepts is a ValueError. Not with ``backend``.
        kernel_options: a dict passed to every compiled flex_attention launch as it is (e.g.
            ``{"BACKEND": "FLASH"}`` for FlashAttention-4's kernels, ``{"BACKEND": "TRITON"}``, block sizes,
            warps, stages): it overrides flexsparse's own choice. None (default): each launch runs torch's
            default Triton kernels, or FLASH where the device's measured table has it faster and the launch
            qualifies (:mod:`flexsparse.runtime.flex`, "Backend of a compiled launch"). Not with ``executors``
            (give a :class:`~flexsparse.runtime.flex.FlexExecutor` its own).
        max_dense_len: the longest q_len/kv_len the dense and flex_eager backends accept (they are O(S^2)).
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_finite: raise a ValueError naming q, k or v when it holds NaN or inf (one host sync per call).
            Without it, what NaN/inf give depends on the backend: on dense, a bad key or value makes every row
            of its heads NaN, on flex_eager a bad key the rows that attend it and a bad value every row; compiled
            flex works per tile and may return finite but wrong rows (docs/guide/hybrid-attention.md, "NaN and
            inf").

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
        executors: Sequence[Executor] | None = None,
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
        if executors is not None and backend != "auto":
            raise ValueError(f"give backend or executors, not both (backend={backend!r} picks an executor set)")
        kernel_options = as_kernel_options("kernel_options", kernel_options)
        if executors is not None and kernel_options:
            raise ValueError("give kernel_options or executors, not both (kernel_options configure the "
                             "backend's FlexExecutor; pass FlexExecutor(..., kernel_options=...) among the "
                             "executors instead)")
        self.backend, self.plan = backend, plan
        self.scale = self.head_dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
        self.check_finite = bool(check_finite)
        self.patterns = as_pattern_dict(patterns)
        self.pattern_names = list(self.patterns)
        for name, pattern in self.patterns.items():
            heads = pattern.required_heads
            if heads is not None and heads != self.num_heads:
                raise ValueError(f"pattern {name!r} ({pattern!r}) is defined for {heads} query heads, "
                                 f"the layer has num_heads={self.num_heads}")
        self._pattern_list = list(self.patterns.values())
        group_size = self.num_heads // self.num_kv_heads
        self._modes = ModeTable(self.pattern_names, self.num_kv_heads, group_size)
        self.register_buffer("default_modes", self._modes.default_tensor(modes), persistent=False)
        self._default_mode_tuple = tuple(self.default_modes.tolist())  # host copy: no device sync per call
        self._query_heads = QueryHeadIndex(group_size)
        planner = lambda kind, executors: Planner(kind, self._pattern_list, self.num_kv_heads, executors,
                                                  self.pattern_names)
        if executors is not None:
            self._planners = {"custom": planner(plan, executors)}
            self.executors = list(executors)
        else:
            specialised = registered_executors()
            sets = backend_executors(specialised, self._pattern_list, kernel_options, self.max_dense_len)
            self._planners = {"flex": planner(plan, sets["flex"]), "flex_eager": planner(plan, sets["flex_eager"]),
                              "dense": planner("fused", sets["dense"])}
            self.executors = [*specialised, *sets["dense"]] if backend == "dense" else sets[
                "flex_eager" if backend == "flex_eager" else "flex"]
        """The executors of the configured backend, in preference order (a sparse KV cache asks them how each
        head decodes)."""
        self._last: tuple | None = None

    # ----- modes -------------------------------------------------------------------------------------------

    def set_modes(self, modes: Sequence[str | int] | Tensor) -> None:
        """Change the default modes (per KV head)."""
        self.default_modes = self._modes.default_tensor(modes).to(self.default_modes.device)
        self._default_mode_tuple = tuple(self.default_modes.tolist())

    def _q_modes(self, q: Tensor, modes: CallModes) -> tuple[Tensor, tuple[int, ...] | None]:
        """Per query-head modes ``[B or 1, H]`` on q's device, and the per-KV-head modes if the host knows them."""
        return self._modes.q_modes(q, modes, self._default_mode_tuple)

    # ----- a call: describe, plan, execute -----------------------------------------------------------------

    def _geometry(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None,
                  positions: Positions | None) -> Geometry:
        return call_geometry(q, k, self.num_heads, self.block_size, key_padding_mask, positions)

    def _planner(self, call: AttentionCall) -> Planner:
        if "custom" in self._planners:
            return self._planners["custom"]
        return self._planners[choose_backend(self.backend, call, self.max_dense_len)]

    def _resolved(self, call: AttentionCall, host_modes: tuple[int, ...] | None) -> list[Pattern | None]:
        """Each mode's pattern for this call: content-dependent ones resolved on q/k; None for modes the host
        knows no head uses (their estimators never run)."""
        used = set(range(len(self._pattern_list))) if host_modes is None else set(host_modes)
        subset = call.subset_query_heads() if any(p.is_dynamic for p in self._pattern_list) else None
        return [None if index not in used else
                p.resolve(call.q, call.k, call.geometry, query_heads=subset) if p.is_dynamic else p
                for index, p in enumerate(self._pattern_list)]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, modes: CallModes = None, *,
                key_padding_mask: Tensor | None = None, positions: Positions | None = None,
                scale: float | None = None, kv_heads: Sequence[int] | None = None) -> Tensor:
        heads = kv_head_tuple(kv_heads, self.num_kv_heads)
        check_inputs(q, k, v, heads, self.num_heads, self.num_kv_heads, self.head_dim, self.check_finite)
        geo = self._geometry(q, k, key_padding_mask, positions)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        call = AttentionCall(q, k, v, self.scale if scale is None else as_float("scale", scale, positive=True),
                             geo, needs_grad, heads)
        planner = self._planner(call)
        q_modes, host_modes = self._q_modes(q, modes)
        if len(heads) < self.num_kv_heads:  # a subset of the layer's heads (e.g. one group of a sparse KV cache)
            q_modes = q_modes[:, self._query_heads(heads, q.device)]
            host_modes = None if host_modes is None else tuple(host_modes[h] for h in heads)
        patterns = self._resolved(call, host_modes)
        groups = planner.groups(call, host_modes)
        self._last = (geo, patterns, q_modes, groups)  # last_stats works from these when read
        return execute(groups, call, patterns, q_modes)

    def reference_mask(self, q: Tensor, k: Tensor, modes: CallModes = None, *,
                       key_padding_mask: Tensor | None = None, positions: Positions | None = None) -> Tensor:
        """The dense boolean mask ``[B or 1, H, S_q, S_kv]`` this layer applies to q/k (small sizes only)."""
        geo = self._geometry(q, k, key_padding_mask, positions)
        q_modes, _ = self._q_modes(q, modes)
        patterns = [p.resolve(q, k, geo) for p in self._pattern_list]
        return gather_heads([p.dense(geo) for p in patterns], q_modes)

    @property
    def last_stats(self) -> AttentionStats:
        """MSR, ESR and block density of the last call (computed when read, from the patterns it used)."""
        if self._last is None:
            raise RuntimeError("last_stats is available after a forward call")
        geo, patterns, q_modes, groups = self._last
        return call_stats(geo, patterns, q_modes, torch.cat([g.heads.q_heads for g in groups]).sort().values)

    def extra_repr(self) -> str:
        modes = [self.pattern_names[i] for i in self._default_mode_tuple]
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"patterns={dict(self.patterns)}, modes={modes}, backend={self.backend!r}, plan={self.plan!r}")
